"""Checkpoints a kill -9 cannot corrupt: `latest` only ever names a complete file, and a reader that
finds a damaged one falls back to the newest that loads, deleting nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import wait_for
from podkit.remote.checkpoint import NPZ, CheckpointDir

pytestmark = pytest.mark.timeout(120)

WRITER = """
import sys, numpy as np
from podkit.remote.checkpoint import NPZ, CheckpointDir
d = CheckpointDir(sys.argv[1])
print("writing", flush=True)
d.save(NPZ, 2, {"step": 2, "model": {"w": np.ones(64 << 20, np.float32)}})  # 256 MB: slow enough to interrupt
print("done", flush=True)
"""


def test_kill_9_mid_checkpoint_leaves_latest_pointing_at_the_previous_good_one(tmp_path):
    """SIGKILL while step 2 is being written: latest still loads step 1; the dead writer's temp file
    is cleared on the next load."""
    d = CheckpointDir(tmp_path)
    d.save(NPZ, 1, {"step": 1, "model": {"w": np.zeros(4, np.float32)}})
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        wait_for(lambda: any(f.name.startswith(".step-00000002") and f.stat().st_size > 0
                             for f in tmp_path.iterdir()), 30, interval=0.005, what="the write to begin")
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(10)
    assert not (tmp_path / "step-00000002.pt").exists(), "the kill came too late to test anything"
    path, state = d.load_latest(NPZ)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name]


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_and_is_kept(tmp_path):
    """A truncated newest file (disk trouble): load the previous one; the damaged file stays for a person."""
    d = CheckpointDir(tmp_path)
    d.save(NPZ, 1, {"step": 1})
    d.save(NPZ, 2, {"step": 2})
    newest = tmp_path / "step-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:20])
    path, state = d.load_latest(NPZ)
    assert state["step"] == 1 and newest.exists()


def test_retention_keeps_the_newest_n(tmp_path):
    """keep=2 leaves the two newest checkpoints, latest pointing at the newest."""
    d = CheckpointDir(tmp_path, keep=2)
    for step in (1, 2, 3):
        d.save(NPZ, step, {"step": step})
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000002.pt", "step-00000003.pt"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003.pt"
