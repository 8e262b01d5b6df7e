"""A volume that fills, on the smoke stack with a real small tmpfs as the workspace (skipped, saying why, where this
machine does not allow mounts), on RunPod (the loopback stub of tests/runpod_stub.py): the loop bound never forgets a
failure (its count kept in the run dir while the volume cannot take it), no end becomes a stranger's kill, and the pod
stops within guard.stop_pod_after_s of the moment the trainer can no longer train, with its words (issue 55)."""

from __future__ import annotations

import errno
import os
import time

import pytest
from test_workspace import fill, small_ws  # noqa: F401 - fixture

from conftest import wait_for
from podkit import records
from podkit.judge import ending
from stub_pod import KEY, STOP, on_runpod, receiver, runpod_api  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def starts(s) -> int:
    return s.stdout().count("[podkit:run] starting trainer")


def test_a_script_failing_on_a_full_volume_is_bounded_and_the_pod_stops_with_its_words(
        small_ws, stack_factory, runpod_api, receiver):  # noqa: F811
    """The volume fills at step 3; the script fails at step 5 on every start (trainer.max_failures 2). Before: 20
    starts in 151 s and on, "the loop bound forgets them", each end after the first "killed by a signal podkit did not
    send", the pod billing. Now: two failures in a row, the trainer stops for good, and the pod stops after
    guard.stop_pod_after_s, its notification naming why."""
    s = stack_factory("ws", FAKE_TRAINER_FAIL_AT_STEP="5", PODKIT_TRAINER_CHECKPOINT_EVERY="1",
                      PODKIT_TRAINER_MAX_FAILURES="2", PODKIT_TRAINER_RESTART_DELAY_S="1",
                      PODKIT_GUARD_STOP_POD_AFTER_S="3", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    s.wait_step(3, timeout=90)
    fill(small_ws / "filler")
    wait_for(lambda: "The trainer stays stopped" in s.stdout() and "stopped for good" in s.stdout() and
             s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 150, interval=0.5,
             what="the trainer to be stopped for good")
    exited = time.time()
    log = s.stdout()  # the logs on the volume stop with its room: the container's output does not
    assert "the loop bound forgets them" not in log, log[-3000:]
    assert "killed by a signal podkit did not send" not in log, log[-3000:]
    assert starts(s) <= 4, log[-3000:]
    assert "stopped for good" in log and "failed 2 times in a row" in log, log[-3000:]
    # The pod's stop: after guard.stop_pod_after_s (3 s) and the stop's own moments, not never.
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the pod's stop")
    assert time.time() - exited < 3 + 30
    text = receiver.one("pod-stop")["text"]
    assert "for good (crash-loop)" in text or "exited without recording a final end" in text, text
    assert "guard.stop_pod_after_s" in text, text
    assert KEY not in s.stdout()
    assert s.stop() == 0


def test_a_run_that_reaches_max_steps_on_a_full_volume_is_finished_and_its_pod_stops_as_finished(
        small_ws, stack_factory, runpod_api, receiver):  # noqa: F811
    """Before: no "training finished", the pod billing on. Now the trainer's finish, kept in the run dir, is read by
    the listener: notified, and the pod stopped as finished (guard.stop_pod_when_finished: auto)."""
    s = stack_factory("ws", PODKIT_TRAINER_MAX_STEPS="8", PODKIT_TRAINER_CHECKPOINT_EVERY="1",
                      PODKIT_NOTIFY_WEBHOOK_URL=receiver.url, **on_runpod(runpod_api.url)).start()
    s.wait_step(3, timeout=90)
    fill(small_ws / "filler")
    wait_for(lambda: STOP in runpod_api.calls(), 90, what="the pod's stop")
    assert "training finished at step 8" in receiver.one("finished")["text"]
    assert "training finished at step 8 (guard.stop_pod_when_finished: auto)" in receiver.one("pod-stop")["text"]
    assert s.progress()["step"] < 8, "the volume took none of the last steps"
    assert s.stop() == 0


def test_a_record_podkit_cannot_write_for_want_of_room_takes_the_reserve_which_comes_back_with_room(tmp_path):
    """records.write_json on a full volume gives up podkit's reserve and writes; keep_reserve makes it again only once
    the volume has room for it and as much again; a reserve that is not a file (planted) is never replaced."""
    from test_workspace import mount

    ws = tmp_path / "ws"
    ws.mkdir()
    mount("-t", "tmpfs", "-o", "size=12m", "tmpfs", str(ws))
    try:
        state = ws / ".podkit"
        state.mkdir()
        assert records.keep_reserve(state)
        fill(ws / "filler")
        with pytest.raises(OSError) as e:
            (ws / "more").write_bytes(b"x" * 8192)
        assert e.value.errno == errno.ENOSPC
        ending.store(state, ending.record(ending.CRASH_LOOP, "failed 2 times in a row"))
        assert records.PROGRESS.read(state)["stopped"]["by"] == ending.CRASH_LOOP
        assert not (state / records.RESERVE).exists()
        assert not records.keep_reserve(state)  # no room for it yet
        os.unlink(ws / "filler")
        assert records.keep_reserve(state) and (state / records.RESERVE).stat().st_size == records.RESERVE_BYTES
        os.unlink(state / records.RESERVE)
        os.mkdir(state / records.RESERVE)
        assert not records.keep_reserve(state) and (state / records.RESERVE).is_dir()
        os.rmdir(state / records.RESERVE)
        mine = ws / "my-notes.txt"
        mine.write_text("the user's")
        os.symlink(mine, state / records.RESERVE)  # planted: never written through, never replaced
        assert not records.keep_reserve(state) and mine.read_text() == "the user's"
        assert (state / records.RESERVE).is_symlink()
    finally:
        import subprocess

        subprocess.run(["umount", "-l", str(ws)], timeout=30)


def test_an_end_the_volume_cannot_take_is_kept_in_the_run_dir_read_by_every_reader_and_put_back_with_room(
        tmp_path, monkeypatch):
    """The trainer's end written while the volume refuses it (no room, no reserve): kept in the run dir, read there
    by the judge's readers (ending.read, standing.gather), then put on the volume by the listener once it has room."""
    from podkit.judge import standing

    state, run = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    records.PROGRESS.write(state, {"step": 4, "stopped": ending.record(ending.FAILED, "older", step=3)})
    monkeypatch.setenv(ending.KEEP_ENV, str(run))
    real = records.Record.write

    def full(self, directory, data, mode=0o644):
        if directory == state:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, directory, data, mode)
    monkeypatch.setattr(records.Record, "write", full)
    ending.write(state, ending.CRASH_LOOP, "failed 2 times in a row")
    assert records.PROGRESS.read(state)["stopped"]["message"] == "older"
    assert ending.read(state, run_dir=run).kind.name == ending.CRASH_LOOP
    assert ending.read(state).kind.name == ending.FAILED  # without the run dir: the volume's, the older
    ev = standing.gather(state, {}, run_dir=run)
    assert ev.end["by"] == ending.CRASH_LOOP
    assert not ending.flush_kept(state, run)  # still full
    monkeypatch.setattr(records.Record, "write", real)
    assert ending.flush_kept(state, run)
    assert records.PROGRESS.read(state)["stopped"]["by"] == ending.CRASH_LOOP
    assert records.PROGRESS.read(state)["step"] == 4 and not ending.KEPT.path(run).exists()
    # an older kept end never overwrites a newer one on the volume
    ending.KEPT.write(run, ending.record(ending.FAILED, "stale", step=1) | {"time": 5.0}, mode=0o600)
    assert ending.flush_kept(state, run) and records.PROGRESS.read(state)["stopped"]["by"] == ending.CRASH_LOOP
