"""The trainer's end and the pod's standing, judged from gathered evidence: how a run ended and whose end it was, the
loop bound on fast ends, inference health and the start-up timeline."""
