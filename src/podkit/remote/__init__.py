"""Checkpoints whole on the volume and off the pod: the run's generations and record on the checkpoint remote, its
lease there, the uploader, and rclone (the mover) with its secrets."""
