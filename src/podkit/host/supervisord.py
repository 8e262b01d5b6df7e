"""What podkit knows of supervisord: its process states as names, and how to ask it over its unix socket.

Every other module compares against these names, never against a string such as "RUNNING" (as
supervisor's own `states.py`). Depends on nothing else in podkit.
"""

from __future__ import annotations

import socket
import threading
import time
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport, UnixStreamHTTPConnection

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


def rpc(socket_path: str | Path, timeout_s: float | None = None):
    """supervisord's XML-RPC interface on its socket. `timeout_s`: how long each read or write on the socket may
    wait (a supervisord alive but not answering: SIGSTOP, a hung host) before it fails with OSError; None, for as
    long as the call takes (a stop that waits for the trainer's checkpoint)."""
    transport = SupervisorTransport(None, None, f"unix://{socket_path}")
    if timeout_s is not None:
        def timed(path=str(socket_path)):
            conn = _TimedUnixConnection("localhost")
            conn.socketfile, conn.timeout_s = path, timeout_s
            return conn
        transport._get_connection = timed
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


class _TimedUnixConnection(UnixStreamHTTPConnection):
    """Each read bounded, and the whole connection too: one answering a byte every few seconds is cut once
    `timeout_s` has passed since it opened (a timer shuts the socket; the call then fails with OSError)."""
    timeout_s: float | None = None
    _cut: threading.Timer | None = None

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout_s)
        if self.timeout_s:
            sock = self.sock
            self._cut = threading.Timer(self.timeout_s, _shut, (sock,))
            self._cut.daemon = True
            self._cut.start()
        self.sock.connect(self.socketfile)

    def close(self):
        if self._cut is not None:
            self._cut.cancel()
        super().close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def stop_requested(socket_path: str | Path, name: str) -> bool:
    """Is supervisord stopping `name` (a pod stop, `supervisorctl stop`), rather than the program having
    been sent a signal by someone else? supervisord marks a program STOPPING before it signals it, and
    answers every call with a SHUTDOWN_STATE fault once it is shutting down. No supervisord to ask (a
    bare `podkit run`) means whoever runs it asked for the stop."""
    try:
        return rpc(socket_path).supervisor.getProcessInfo(name)["statename"] == STOPPING
    except xmlrpc.client.Fault as e:
        return e.faultCode == SHUTDOWN_STATE_FAULT
    except OSError:
        return True


SHUTDOWN_STATE_FAULT = 6  # supervisor.xmlrpc.Faults.SHUTDOWN_STATE


def process_info(socket_path: str | Path, name: str) -> dict | None:
    """supervisord's word on one program; None when there is no supervisord to ask (a bare `podkit run`)
    or it does not know the program."""
    try:
        return rpc(socket_path).supervisor.getProcessInfo(name)
    except (OSError, xmlrpc.client.Error):
        return None


def wait_started(socket_path: str | Path, name: str, timeout_s: float = 30.0) -> None:
    """Return once supervisord counts `name` as started (no longer STARTING). A program that exits while
    STARTING (within its startsecs) is a failed start to supervisord, whatever its exit code: a trainer
    that finishes that soon after its start (resumed at its last step) would be started again and again,
    then FATAL. No supervisord to ask: at once."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        info = process_info(socket_path, name)
        if info is None or info.get("statename") != STARTING:
            return
        time.sleep(0.25)
