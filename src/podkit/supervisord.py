"""What podkit knows of supervisord: its process states as names, and how to ask it over its unix socket.

Every other module compares against these names, never against a string such as "RUNNING" (as
supervisor's own `states.py`). Depends on nothing else in podkit.
"""

from __future__ import annotations

import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

STOPPED = "STOPPED"
STARTING = "STARTING"
RUNNING = "RUNNING"
BACKOFF = "BACKOFF"
STOPPING = "STOPPING"
EXITED = "EXITED"
FATAL = "FATAL"
UNKNOWN = "UNKNOWN"

UP = (STARTING, RUNNING)                 # started, or being started
STOPPED_STATES = (STOPPED, EXITED, FATAL)  # supervisord will not start it again by itself
GONE = (EXITED, STOPPED, BACKOFF, FATAL)  # the process is not running


def rpc(socket_path: str | Path):
    transport = SupervisorTransport(None, None, f"unix://{socket_path}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


def process_info(socket_path: str | Path, name: str) -> dict | None:
    """supervisord's word on one program; None when there is no supervisord to ask (a bare `podkit run`)
    or it does not know the program."""
    try:
        return rpc(socket_path).supervisor.getProcessInfo(name)
    except (OSError, xmlrpc.client.Error):
        return None
