"""/workspace full or read-only, staged with a real small tmpfs and a real read-only bind mount
(skipped, saying why, where this machine does not allow mounts)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from conftest import PODKIT, wait_for
from podkit import config
from podkit.views import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def mount(*args) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"cannot mount here ({r.stderr.strip()}): needs root in a machine that allows mounts")


@pytest.fixture
def small_ws(tmp_path):
    """A 6 MB tmpfs as the workspace. Requested before stack_factory, so it is unmounted after the
    stack's processes are gone."""
    ws = tmp_path / "ws"
    ws.mkdir()
    mount("-t", "tmpfs", "-o", "size=6m", "tmpfs", str(ws))
    yield ws
    subprocess.run(["umount", "-l", str(ws)], timeout=30)


@pytest.fixture
def readonly_ws(tmp_path):
    src, ws = tmp_path / "ws-src", tmp_path / "ws"
    src.mkdir()
    ws.mkdir()
    mount("--bind", str(src), str(ws))
    subprocess.run(["mount", "-o", "remount,bind,ro", str(ws)], check=True, timeout=30)
    yield ws
    subprocess.run(["umount", "-l", str(ws)], timeout=30)


def fill(path) -> None:
    with open(path, "wb", buffering=0) as f:  # unbuffered: nothing left to flush (and fail) at close
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_lease_taken_or_renewed_on_a_full_workspace_leaves_no_temp_file(small_ws):
    """A write that fails mid-way (ENOSPC) left its temp file on the volume, for good."""
    from podkit.host import lease

    state = small_ws / ".podkit"
    state.mkdir()
    assert lease.acquire(state, 300, pid=os.getpid()) is None  # ours, taken while there was room
    fill(small_ws / "filler")
    with pytest.raises(OSError) as e:
        lease.renew(state)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:  # ours from before: set aside, and a new one cannot be written
        lease.acquire(state, 300, pid=os.getpid())
    assert e.value.errno == errno.ENOSPC
    assert [p.name for p in state.iterdir() if p.name.startswith(".")] == [], "a temp file was left behind"


def test_a_full_workspace_keeps_the_trainer_alive_and_the_last_checkpoint_good(small_ws, stack_factory):
    """The volume fills up mid-run: the trainer keeps running and says it cannot checkpoint, the last
    checkpoint stays loadable, doctor names the full disk; once space is freed it checkpoints again."""
    s = stack_factory("ws").start()
    s.wait_step(7)
    trainer = s.pid("trainer")
    filler = small_ws / "filler"
    fill(filler)
    latest = (small_ws / "checkpoints" / "latest").read_text()
    wait_for(lambda: "not written (No space left on device)" in s.log("trainer"), 60,
             what="the trainer to report the full disk")
    found = {f.id for f in doctor.examine(config.load(environ={"PODKIT_WORKSPACE": str(small_ws)}), small_ws)}
    assert "workspace_full" in found
    assert s.pid("trainer") == trainer, "a full disk must not crash-loop the trainer"
    assert (small_ws / "checkpoints" / "latest").read_text() == latest
    filler.unlink()
    step = s.progress()["step"]
    wait_for(lambda: (small_ws / "checkpoints" / "latest").read_text() != latest, 60,
             what="checkpoints again after space is freed")
    assert s.progress()["step"] >= step and s.pid("trainer") == trainer
    assert s.stop() == 0


def test_a_read_only_workspace_waits_in_safe_mode_and_doctor_says_why(readonly_ws, stack_factory):
    """Boot on a read-only volume: no exit, a safe-mode banner naming it; doctor names it too."""
    s = stack_factory("ws")
    out = open(s.out_path, "ab")
    s.procs.workspaces.add(str(readonly_ws))
    p = s.procs.spawn([*PODKIT, "boot"], env=s.env, stdout=out, stderr=subprocess.STDOUT)
    s.proc = p
    wait_for(lambda: "SAFE MODE" in s.stdout(), 30, what="safe mode")
    assert p.poll() is None and "preflight" in s.stdout() and "Read-only file system" in s.stdout()
    found = {f.id for f in doctor.examine(config.load(environ={"PODKIT_WORKSPACE": str(readonly_ws)}), readonly_ws)}
    assert found & {"workspace_unwritable", "workspace_missing"}
    assert s.stop() == 0
