"""PID-1 duties: when podkit is the container's entrypoint, every orphan in the container becomes its
child, and an init that does not wait for them fills the process table with zombies.
Depends on nothing else in podkit."""

from __future__ import annotations

import os


def collect_children() -> None:
    """Wait for every child that has exited, without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


INITS = ("tini", "docker-init", "dumb-init")


def is_entrypoint() -> bool:
    """PID 1, or the direct child of a small init (tini, docker-init, dumb-init) that is PID 1."""
    if os.getpid() == 1:
        return True
    if os.getppid() != 1:
        return False
    try:
        with open("/proc/1/comm") as f:
            return f.read().strip() in INITS
    except OSError:
        return False
