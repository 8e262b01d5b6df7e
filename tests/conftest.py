"""Shared test helpers. Tests kill only processes they started, by pid, and bind only 127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness import Pod, alive, free_port, pids_of_workspaces, wait_for

pytest_plugins = ["timing"]  # where the suite's time went (tests/timing.py)
# Helpers taken out of test modules (tests/stub_pod.py's fixture, ...): their asserts keep pytest's messages.
pytest.register_assert_rewrite("chromium", "lease_pods", "scrape", "stub_pod", "webhook")

ROOT = Path(__file__).resolve().parent.parent
PODKIT = [sys.executable, "-m", "podkit"]


def raw_server(answer) -> socket.socket:
    """A TCP server on 127.0.0.1 that is not an HTTP server (a broken proxy, a tarpit, another protocol):
    `answer(conn)` speaks to each connection, which is closed after; close the returned socket to end it."""
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            try:
                answer(c)
            except OSError:
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


class Procs:
    """Every process a test starts; whatever is left at the end is killed by pid."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.extra_pids: set[int] = set()
        self.workspaces: set[str] = set()

    def spawn(self, argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        self.started.append(p)
        return p

    def track(self, pid: int) -> None:
        if pid:
            self.extra_pids.add(pid)

    def cleanup(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.started:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for pid in self.extra_pids | self._programs_of_our_workspaces():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _programs_of_our_workspaces(self) -> set[int]:
        """Programs a test's supervisord started and did not stop (it was killed mid-test): found by
        the test's own temp workspace in their environment, so nothing else is ever touched."""
        return pids_of_workspaces(self.workspaces)


@pytest.fixture
def procs():
    tracker = Procs()
    yield tracker
    tracker.cleanup()


HOLDER = str(Path(__file__).with_name("holder.py"))  # holds stand-in device files


@pytest.fixture
def devices(tmp_path):
    d = tmp_path / "dev"
    d.mkdir()
    for i in range(3):
        (d / f"nvidia{i}").write_bytes(b"\0" * 4096)
    (d / "nvidiactl").write_bytes(b"\0" * 4096)
    return d


def hold(procs, mode, *files, flags=()):
    """Start a holder; returns (pid, child pids) once it prints its ready line."""
    p = procs.spawn([sys.executable, HOLDER, mode, *map(str, files), *flags], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("ready (pid: "), line
    pid = int(line.split("pid: ")[1].split(")")[0])
    kids = [int(k) for k in line.split("children", 1)[1].split()]
    procs.track(pid)
    for k in kids:
        procs.track(k)
    return pid, kids


def smoke_env(workspace: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    env.update({
        "PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"),
        "PODKIT_WORKSPACE": str(workspace),
        "PODKIT_INFERENCE_PORT": str(port),
        "PODKIT_METRICS_PORT": str(free_port()),  # stacks side by side: not all on the default 9400
        "PODKIT_PAGE_PORT": str(free_port()),  # nor on the page's 9401
        "PODKIT_INFERENCE_STARTUP_DELAY_S": "0.5",
        "PODKIT_TRAINER_STEP_INTERVAL_S": "0.1",
        "PODKIT_TRAINER_CHECKPOINT_EVERY": "5",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


class Stack(Pod):
    """The smoke stack booted through `podkit boot`, as the container's entrypoint runs it."""

    def __init__(self, procs: Procs, workspace: Path, **env: str) -> None:
        port = free_port()
        super().__init__(workspace, port, smoke_env(workspace, port, **env))
        self.procs = procs
        self.out_path = workspace.parent / f"{workspace.name}-stdout.log"

    def start(self) -> Stack:
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.procs.workspaces.add(str(self.workspace))
        self.out = open(self.out_path, "ab")
        self.launch(self.out, self.procs.spawn)
        return self

    def pid(self, name: str) -> int:
        info = self.rpc().supervisor.getProcessInfo(name)
        if info["statename"] in ("STARTING", "RUNNING") and info["pid"]:
            self.procs.track(info["pid"])
            return info["pid"]
        return 0

    def wait_step(self, step: int, timeout: float = 120) -> dict:
        return wait_for(lambda: (p := self.progress()).get("step", 0) >= step and p, timeout,
                        what=f"trainer step {step}")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def log(self, program: str) -> str:
        return (self.workspace / "logs" / f"{program}.log").read_text(errors="replace")

    def status(self) -> dict:
        out = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(self.workspace)],
                             capture_output=True, text=True, env=self.env, timeout=30)
        return json.loads(out.stdout)

    def stop(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def stack_factory(procs, tmp_path):
    made: list[Stack] = []

    def make(name: str = "ws", **env: str) -> Stack:
        s = Stack(procs, tmp_path / name, **env)
        made.append(s)
        return s

    yield make


# --- the real trainer (tests/areal_stack.py) --------------------------------------------------------


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny model and data of rehearse/assets.py, built once per test run; tests copy them."""
    from areal_stack import build_assets

    return build_assets(tmp_path_factory)


@pytest.fixture
def rehearsal(procs, tmp_path, assets, tmp_path_factory):
    """Makes real-trainer stacks (areal_stack.Rehearsal) that share one compile cache per run."""
    from areal_stack import Rehearsal, compile_cache, compile_env

    made = []
    shared = compile_env(compile_cache(tmp_path_factory))

    def make(name: str = "ws", **env: str):
        s = Rehearsal(procs, tmp_path / name, assets, **{**shared, **env})
        made.append(s)
        return s

    yield make
    for s in made:
        if s.proc and s.proc.poll() is None:
            s.stop()


def wheel(path: Path, name: str = "podkit_demo_dep", version: str = "1.0") -> Path:
    """A pure-Python wheel, written by hand (no build backend, no index)."""
    whl = path / f"{name}-{version}-py3-none-any.whl"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for n, t in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    path.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
    return whl
