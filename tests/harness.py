"""What the tests and the benchmarks both drive a pod with: free ports, a pid's liveness, polling, and the
pod itself under `podkit boot`. Plain Python (no pytest, podkit imported lazily): conftest.py imports it as
a test module, and bench/*.py put tests/ on their path for it. It lives here, not in bench/, because
bench/ holds one benchmark per file (tests/house/test_bench.py runs each) and tests/ already is the home of test
helpers; nor in src/podkit, which ships in the image and holds nothing test-only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import xmlrpc.client
from pathlib import Path


def wait_for(cond, timeout: float, interval: float = 0.1, what: str = "condition", error=AssertionError):
    """Poll `cond` until it returns a truthy value; raise `error` naming `what` after `timeout` seconds.
    A look that costs (a `podkit status` process: 0.1 CPU-s) is taken at most a fifth of the time: the
    pause is `interval`, or four times the look's own time up to a second, whichever is longer."""
    until = time.monotonic() + timeout
    while True:
        t0 = time.monotonic()
        value = cond()
        if value:
            return value
        now = time.monotonic()
        if now > until:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(max(interval, min(4 * (now - t0), 1.0)))


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, never one this process handed out before, and on an xdist worker only ports of
    its own lane. Two calls in a row may otherwise get the same port back (the kernel reuses a
    port just closed), and a smoke env's inference and metrics ports then collide: a config error."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    lanes = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1), 1)
    lane = int(worker[2:]) % lanes if worker[2:].isdigit() else 0
    held = []  # kept bound while looking, so the kernel offers another port each time
    try:
        for _ in range(1000):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port // 2 % lanes == lane and port not in _HANDED_OUT:  # Linux gives bind() even ports
                _HANDED_OUT.add(port)
                return port
    finally:
        for s in held:
            s.close()
    raise RuntimeError("no free port found in 1000 tries")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def pids_of_workspaces(workspaces) -> set[int]:
    """Processes whose environment names one of these workspaces (PODKIT_WORKSPACE=<workspace>): what
    a pod's supervisord started, found without touching anything else."""
    marks = {f"PODKIT_WORKSPACE={ws}".encode() for ws in workspaces}
    found = set()
    if not marks:
        return found
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if marks & set(env):
                found.add(int(name))
    return found


class Pod:
    """`podkit boot` on one workspace, as the container's entrypoint runs it, with `env` as its
    environment. Every process it starts carries PODKIT_WORKSPACE=<workspace> (pids_of_workspaces)."""

    boot_timeout = 30.0
    error = AssertionError  # what a wait that timed out raises

    def __init__(self, workspace: Path, port: int, env: dict[str, str], python: str = sys.executable) -> None:
        self.workspace, self.port, self.env, self.python = workspace, port, env, python
        self.proc: subprocess.Popen | None = None

    def launch(self, stdout, spawn=subprocess.Popen) -> subprocess.Popen:
        """Starts `podkit boot` and returns once its supervisord answers."""
        self.proc = spawn([self.python, "-m", "podkit", "boot"], env=self.env, stdout=stdout,
                          stderr=subprocess.STDOUT)
        wait_for(lambda: self.current().get("supervisord_pid") == self.proc.pid and self._rpc_ok(),
                 self.boot_timeout, what="supervisord to accept commands", error=self.error)
        return self.proc

    @property
    def state(self) -> Path:
        return self.workspace / ".podkit"

    def current(self) -> dict:
        return read_json(self.state / "current.json")

    def progress(self) -> dict:
        return read_json(self.state / "progress.json")

    def rpc(self):
        from podkit.host.supervisord import rpc

        return rpc(self.current()["socket"])

    def _rpc_ok(self) -> bool:
        try:
            self.rpc().supervisor.getState()
            return True
        except (OSError, xmlrpc.client.Error, KeyError):
            return False

    def served(self) -> str | None:
        """The weight version inference serves; None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/model_info", timeout=5) as r:
                return json.loads(r.read())["weight_version"]
        except (OSError, ValueError, KeyError):
            return None
