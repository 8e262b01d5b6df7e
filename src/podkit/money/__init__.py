"""What the run costs across its pods, and the cost guards that stop a pod billing for nothing: the spend's integral
and how sure it is, the run's meter, and the guards, their table and their file."""
