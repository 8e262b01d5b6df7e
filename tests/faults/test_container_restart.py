"""The container "restarted" with the previous run's processes still holding the GPUs (docs/failures.md):
the next boot frees them, clears the stale socket, and the run resumes from its checkpoint."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import alive, wait_for
from podkit.host import gpu

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_boot_after_a_dirty_restart_frees_the_gpus_and_resumes(stack_factory, tmp_path):
    """supervisord dies with SIGKILL: its programs live on, holding the stand-in devices and the
    inference port, and its socket stays behind. The next boot reaps exactly those holders,
    removes the stale socket, and the new programs start and resume."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_bytes(b"\0" * 4096)
    env = {"PODKIT_DEVICES": f"{dev}/nvidia*", "PODKIT_REAP_ENABLED": "always", "PODKIT_REAP_GRACE_S": "2"}
    s = stack_factory(**env).start()
    s.wait_step(7)
    old = {name: s.pid(name) for name in ("sglang", "trainer")}
    held = {h.pid for h in gpu.holders(gpu.match_devices(f"{dev}/nvidia*"))[0]}
    assert set(old.values()) <= held
    sock = s.current()["socket"]
    # The new boot takes the workspace's lease before it reaps: a running old trainer sees that at its next step and
    # leaves by itself (lease.lost), sometimes before the reap (suite run 81). Hung (the fake trainer's SIGUSR1:
    # blocked, SIGTERM ignored), it is the holder that does not leave, which the reap is for. Its stack says when.
    os.kill(old["trainer"], signal.SIGUSR1)
    stacks = s.workspace / "logs" / f"stacks-{old['trainer']}.txt"
    wait_for(lambda: os.kill(old["trainer"], signal.SIGUSR2) or "_injected_hang" in stacks.read_text(), 20,
             interval=0.2, what="the old trainer to hang")
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    assert os.path.exists(sock) and all(alive(p) for p in old.values()), "the leftovers this test needs"

    again = stack_factory(**env).start()  # same workspace: the container's restart
    out = again.stdout()
    for pid in old.values():
        # Stopped as the previous run's process group it recorded, before the device scan would find it.
        assert f"stopped {pid} (" in out and "left running by the previous run" in out
        assert not alive(pid)
    assert "removed stale socket" in out
    new = wait_for(lambda: again.pid("sglang"), 30, what="new sglang")
    assert new not in old.values()
    wait_for(lambda: again.status()["inference"]["phase"] == "ready", 30, what="new inference ready")
    wait_for(lambda: "resumed from checkpoint" in again.log("trainer").split("starting trainer")[-1], 60,
             what="the new trainer to resume")
    assert again.stop() == 0
    assert gpu.holders(gpu.match_devices(f"{dev}/nvidia*"))[0] == [], "a device file is still held after the stop"
