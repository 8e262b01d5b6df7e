"""The machine under the run: its processes and PID 1's duties, the PID-stamped locks and the workspace's lease, the
GPUs and who holds them, and supervisord as podkit asks it."""
