"""Graceful stop with checkpoints constantly in flight: SIGTERM lands mid-checkpoint sooner or
later; every stop must leave a loadable latest checkpoint at the final step, and every boot must
resume from it. A trainer killed with SIGKILL is restarted alone and doctor counts it."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import wait_for
from podkit import config
from podkit.programs.fake_trainer import Codec
from podkit.remote.checkpoint import CheckpointDir
from podkit.views import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_sigterm_mid_checkpoint_never_leaves_a_bad_latest(stack_factory):
    """A checkpoint every step (always writing), stopped three times at different moments."""
    env = {"PODKIT_TRAINER_CHECKPOINT_EVERY": "1", "PODKIT_TRAINER_STEP_INTERVAL_S": "0.02",
           "PODKIT_TRAINER_KEEP_CHECKPOINTS": "2"}
    last = 0
    for i in range(3):
        s = stack_factory(**env).start()
        if i:
            wait_for(lambda s=s, last=last: f"(step {last})" in s.log("trainer").split("starting trainer")[-1], 60,
                     what=f"boot {i + 1} to resume from step {last}")
        s.wait_step(last + 5 + 3 * i)
        assert s.stop() == 0
        final = s.progress()
        path, state = CheckpointDir(s.workspace / "checkpoints").load_latest(Codec)
        assert state["step"] == final["step"] == final["checkpoint_step"], (path, final)
        last = final["step"]


def test_a_killed_trainer_is_restarted_alone_and_doctor_counts_it(stack_factory):
    """SIGKILL the trainer: supervisord restarts it (not inference); doctor reports the restart."""
    s = stack_factory().start()
    s.wait_step(3)
    trainer, sglang = s.pid("trainer"), s.pid("sglang")
    os.kill(trainer, signal.SIGKILL)
    wait_for(lambda: s.pid("trainer") not in (0, trainer), 30, what="trainer restart")
    assert s.pid("sglang") == sglang
    cfg = config.load(environ={"PODKIT_WORKSPACE": str(s.workspace)})

    def findings():
        return {f.id: f for f in doctor.examine(cfg, s.workspace, min_free_bytes=0, min_mb_s=0)}
    # supervisord delivers state events to the listener asynchronously: the new pid can show before the count.
    wait_for(lambda: "trainer_restarts" in findings(), 15, 0.5, what="the restart recorded by the event listener")
    assert findings()["trainer_restarts"].title.startswith("trainer restarted 1 time(s)")
    assert s.stop() == 0
