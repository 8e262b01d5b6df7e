"""A worker node outside its cluster: node rank 1 of configs/cpu-cluster.yaml booted alone (`podkit boot`, the
real supervisord), its Ray head at 127.0.0.2 on a closed port. No Ray head is started (Ray's ports are fixed) and no
trainer runs (rank 1's is idle): `ray` is a stand-in on PATH that records how it was started and blocks as
`ray start --block` does, so the test needs neither Ray nor AReaL. The head that appears later is a loopback
listener on the head's port. On RunPod (the loopback stub of tests/runpod_stub.py) the cost guard stops the pod."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import xmlrpc.client
from pathlib import Path

import pytest

from conftest import PODKIT, ROOT, free_port, wait_for
from harness import Pod
from stub_pod import STOP, on_runpod, receiver, runpod_api  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
HEAD = "127.0.0.2"
STANDIN_RAY = """#!/bin/sh
echo "$@" >> "$RAY_STANDIN_ARGV"
[ -n "$RAY_STANDIN_EXIT" ] && { echo "standin ray: cannot register with the head"; exit "$RAY_STANDIN_EXIT"; }
# Ray starts its raylet once it has reached the head's GCS; without one (RAY_STANDIN_NO_RAYLET) it keeps trying.
[ -z "$RAY_STANDIN_NO_RAYLET" ] && "$(dirname "$0")/raylet" &
trap 'exit 0' TERM
while :; do sleep 0.2; done
"""
STANDIN_RAYLET = """#!/bin/sh
while :; do sleep 0.2; done
"""


class Worker(Pod):
    """Node rank 1, booted as its container's entrypoint does; its records are the node's own (node-1)."""

    boot_timeout = 60.0

    def __init__(self, procs, root: Path, **env: str) -> None:
        self.procs, self.root = procs, root
        ws = root / "ws"
        (ws / "rehearsal" / "model").mkdir(parents=True)
        (ws / "rehearsal" / "model" / "config.json").write_text("{}")  # preflight's check of the stand-in's model
        procs.workspaces.add(str(ws))
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for name, script in (("ray", STANDIN_RAY), ("raylet", STANDIN_RAYLET)):
            (bin_dir / name).write_text(script)
            (bin_dir / name).chmod(0o755)
        self.argv = root / "ray-argv.txt"
        port = free_port()  # nothing listens there: the head is gone
        base = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        super().__init__(ws, port, {
            **base, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-cluster.yaml"), "PODKIT_WORKSPACE": str(ws),
            "PODKIT_CLUSTER_RANK": "1", "PODKIT_CLUSTER_NODE_ADDR": "127.0.0.3",
            "PODKIT_CLUSTER_HEAD": HEAD, "PODKIT_CLUSTER_RAY_PORT": str(port),
            "PODKIT_RUN_DIR": str(root / "run1"), "PODKIT_CLUSTER_JOIN_TIMEOUT_S": "6",
            "PODKIT_TRAINER_RESTART_DELAY_S": "4", "PODKIT_TRAINER_MAX_FAILURES": "3",
            "RAY_STANDIN_ARGV": str(self.argv), "PYTHONUNBUFFERED": "1",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **env})
        self.ws = ws

    @property
    def state(self) -> Path:
        return self.workspace / ".podkit" / "node-1"

    def start(self) -> Worker:
        self.out_path = self.root / "node1-stdout.log"
        self.launch(open(self.out_path, "ab"), spawn=self.procs.spawn)  # noqa: SIM115 - closed with the tmp dir
        return self

    def info(self, name: str) -> dict:
        try:
            return self.rpc().supervisor.getProcessInfo(name)
        except (OSError, xmlrpc.client.Error, KeyError):
            return {}

    def record(self) -> dict:
        try:
            return json.loads((self.state / "ray-loop.json").read_text())
        except (OSError, ValueError):
            return {}

    def log(self) -> str:
        try:
            return (self.ws / "logs" / "node-1" / "ray.log").read_text()
        except OSError:
            return ""

    def starts(self) -> int:
        return self.log().count("[podkit:run] starting ray")

    def podkit(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*PODKIT, *args], env=self.env, capture_output=True, text=True, timeout=60)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def test_a_worker_whose_head_is_gone_is_unhealthy_stops_restarting_and_joins_a_head_that_appears_later(
        procs, tmp_path, runpod_api, receiver):  # noqa: F811
    """Each start waits cluster.join_timeout_s (6 s: past supervisord's startsecs, so it never
    counted these restarts) for the head and fails: unhealthy from the first, naming the
    head; the starts back off and after trainer.max_failures (3) `ray` stays stopped, recorded, and the pod stops
    itself after guard.stop_pod_after_s. `podkit ctl start ray` counts from zero and joins a head that is up."""
    w = Worker(procs, tmp_path, PODKIT_GUARD_STOP_POD_AFTER_S="2", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
               **on_runpod(runpod_api.url)).start()
    head = f"{HEAD}:{w.port}"
    t0 = time.time()
    wait_for(lambda: "did not answer for" in w.log(), 60, interval=0.5, what="the first start that did not join")
    health = w.podkit("status", "--health")
    assert health.returncode == 1 and f"cannot join its cluster: the Ray head at {head}" in health.stdout, health.stdout
    wait_for(lambda: w.record().get("gave_up") and w.info("ray").get("statename") == "EXITED", 90, interval=0.5,
             what="the bound to stop ray")
    took = time.time() - t0
    rec = w.record()
    assert rec["failures"] == 3 and rec["head"] == head and f"the Ray head at {head} did not answer" in rec["why"], rec
    time.sleep(6)  # supervisord's restarts, were they not bounded, come within 1-3 s
    assert w.info("ray")["statename"] == "EXITED" and w.starts() == 3, w.info("ray")
    assert not w.argv.exists(), "`ray start` ran without a head"
    log = w.log()
    assert "restarting in 4s" in log and "restarting in 8s" in log and "back-off: waiting" in log, log
    assert "ray stays stopped (trainer.max_failures 3)" in log
    # Named everywhere: --health, status, doctor, a notification; the cost guard stops the pod.
    health = w.podkit("status", "--health")
    assert health.returncode == 1 and head in health.stdout and "stays stopped" in health.stdout, health.stdout
    assert f"ray: this node cannot join its cluster: the Ray head at {head}" in w.podkit("status").stdout
    doc = w.podkit("doctor", "--json")
    finding = next(f for f in json.loads(doc.stdout)["findings"] if f["id"] == "cluster_join")
    assert doc.returncode == 1 and head in finding["title"] and "podkit ctl start ray" in finding["fix"], finding
    wait_for(lambda: runpod_api.pod("pod-abc123")["status"] == "EXITED", 60, what="the pod's stop")
    assert STOP in runpod_api.calls() and receiver.events().count("cluster") == 1, receiver.events()
    assert "this node cannot join its cluster (the Ray head at" in receiver.one("pod-stop")["text"]
    # The head appears; `podkit ctl start ray` counts from zero and joins it.
    listener = socket.create_server((HEAD, w.port))
    try:
        assert w.podkit("ctl", "start", "ray").returncode == 0
        wait_for(lambda: w.argv.exists() and w.argv.read_text(), 30, what="`ray start` against the head")
        assert f"--address {head}" in w.argv.read_text() and "--block" in w.argv.read_text()
        assert "counting from zero" in w.log()
        health = w.podkit("status", "--health")
        assert health.returncode == 0 and health.stdout.strip() == "healthy", health.stdout
        rec = wait_for(lambda: (r := w.record()).get("joined") and r, 45, interval=1, what="the join's record")
        assert rec["failures"] == 0 and not rec["gave_up"] and w.info("ray")["statename"] == "RUNNING", rec
    finally:
        listener.close()
    print(f"worker outside its cluster: 3 starts, stopped {took:.0f}s after its boot")
    assert w.stop() == 0


@pytest.mark.parametrize("standin", ["ends at once", "hangs without a raylet"])
def test_a_worker_whose_ray_start_does_not_join_a_head_that_answers_is_bounded_too(procs, tmp_path, standin):
    """The head's port answers but `ray start` ends at once (a head that will not take the node): each such start
    is a failed join, counted by this bound rather than supervisord's own retries (it ends within startsecs), and
    after three `ray` stays stopped, EXITED, not FATAL. Or what answers there is not the head's GCS (another
    service, a hung head): real Ray's `ray start` then retries for many minutes without starting its raylet
    (measured: 40 s a try, 20 tries); it was counted as joined after 30 s up, its failures reset, healthy, and
    restarted for ever. Without a raylet within cluster.join_timeout_s the start is a failed join too."""
    exits = standin == "ends at once"
    w = Worker(procs, tmp_path, PODKIT_CLUSTER_JOIN_TIMEOUT_S="2", PODKIT_TRAINER_RESTART_DELAY_S="1",
               **({"RAY_STANDIN_EXIT": "1"} if exits else {"RAY_STANDIN_NO_RAYLET": "1"}))
    listener = socket.create_server((HEAD, w.port))
    try:
        w.start()
        wait_for(lambda: w.record().get("gave_up") and w.info("ray").get("statename") == "EXITED", 120, interval=0.5,
                 what="the bound to stop ray")
        time.sleep(4)
        assert w.info("ray")["statename"] == "EXITED" and w.starts() == 3 and len(w.argv.read_text().splitlines()) == 3
        rec = w.record()
        assert rec["failures"] == 3 and not rec.get("joined"), rec
        if exits:
            assert "`ray start` ended (exit 1)" in rec["why"] and "before it joined the Ray head" in rec["why"], rec
            assert "standin ray: cannot register with the head" in w.log()
        else:
            assert f"reached {HEAD}:{w.port} but did not join it" in rec["why"] and "cluster.ray_port" in rec["why"]
        health = w.podkit("status", "--health")
        assert health.returncode == 1 and f"the Ray head at {HEAD}:{w.port}" in health.stdout, health.stdout
    finally:
        listener.close()
    assert w.stop() == 0
