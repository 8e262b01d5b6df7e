"""The trainer's loop bound on the smoke stack (real supervisord, the fake trainer with an injected failure,
`podkit boot`): a trainer that fails again and again without a new step stops once, named everywhere, and
on RunPod (the loopback stub of tests/runpod_stub.py) the pod stops itself after guard.stop_pod_after_s.
A failure after new steps restarts at once and resumes. The real trainer's cases: tests/trainer/test_your_code.py."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import PODKIT, ROOT, free_port, smoke_env, wait_for
from scrape import scrape
from stub_pod import KEY, STOP, on_runpod, receiver, runpod_api  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def starts(s) -> int:
    return s.log("trainer").count("[podkit:run] starting trainer")


def test_a_trainer_failing_at_step_2_on_every_run_stops_after_four_starts_and_the_pod_stops_itself(
        stack_factory, runpod_api, receiver):  # noqa: F811
    """Step 1 trains (new evidence), then every run fails at step 2 after resuming at step 1: three failures
    in a row without a new step, with a growing wait between them, and the trainer stays stopped. After
    guard.stop_pod_after_s the pod stops; RunPod's first answer is a 502, so the stop is tried again, and
    announced once."""
    runpod_api.fail("POST", "/v2/pods/pod-abc123/action", 502, times=2, body=b"Bad Gateway")
    t0, port = time.time(), free_port()
    s = stack_factory(FAKE_TRAINER_FAIL_AT_STEP="2", PODKIT_METRICS_PORT=str(port), PODKIT_TRAINER_CHECKPOINT_EVERY="1",
                      PODKIT_TRAINER_RESTART_DELAY_S="4", PODKIT_GUARD_STOP_POD_AFTER_S="3",
                      PODKIT_NOTIFY_WEBHOOK_URL=receiver.url, **on_runpod(runpod_api.url)).start()
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "crash-loop" and st, 120,
                       interval=0.5, what="the loop bound to stop the trainer")
    took = time.time() - t0
    assert "failed 3 times in a row after step 1 without a new step" in stopped["message"], stopped
    assert "RuntimeError: injected failure at step 2" in stopped["message"] and "fake_trainer.py:" in stopped["message"]
    wait_for(lambda: s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 30,
             what="the trainer to stay stopped")
    assert starts(s) == 4, s.log("trainer")
    log = s.log("trainer")
    # Each failing start outlives supervisord's startsecs (3 s) before its exit: what is left of the growing
    # back-off is waited at the next start.
    assert "restarting in 4s" in log and "restarting in 8s" in log and "back-off: waiting" in log
    # Named everywhere: --health, status, doctor, metrics, a notification.
    health = subprocess.run([*PODKIT, "status", "--health", "--workspace", str(s.workspace)], capture_output=True,
                            text=True, env=s.env, timeout=30)
    assert health.returncode == 1 and "stopped for good, crash-loop" in health.stdout, health.stdout
    human = subprocess.run([*PODKIT, "status", "--workspace", str(s.workspace)], capture_output=True, text=True,
                           env=s.env, timeout=30).stdout
    assert "stopped for good by the loop bound" in human and "injected failure at step 2" in human, human
    doc = json.loads(subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(s.workspace)],
                                    capture_output=True, text=True, env=s.env, timeout=60).stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "trainer_crash_loop")
    assert any(e.startswith("RuntimeError: injected failure at step 2 (") and "fake_trainer.py:" in e
               for e in finding["evidence"]), finding
    assert not any(f["id"] == "trainer_restarts" for f in doc["findings"]), "one finding for one cause"
    assert "trainer-stopped" in receiver.events()
    m = scrape(port)
    assert m[("podkit_trainer_stopped_for_good", (("by", "crash-loop"),))] == 1.0
    assert m[("podkit_trainer_stopped_for_good", (("by", "config-error"),))] == 0.0
    assert m[("podkit_trainer_failures_in_a_row", ())] == 3.0
    # The cost guard: after stop_pod_after_s, the stop; a 502 first, tried again; one notification.
    wait_for(lambda: runpod_api.pod("pod-abc123")["status"] == "EXITED", 60, what="the pod's stop")
    assert runpod_api.calls().count(STOP) >= 3
    assert receiver.events().count("pod-stop") == 1 and receiver.events().count("trainer-stopped") == 1
    assert "the trainer stopped for good (crash-loop) for" in receiver.one("pod-stop")["text"]
    assert "the pod did not stop; trying again in 2 s" in s.stdout()
    print(f"loop bound: {starts(s)} starts, stopped {took:.0f}s after the boot")
    assert s.stop() == 0 and KEY not in s.stdout()


def test_a_failure_after_new_steps_restarts_at_once_and_the_run_goes_on(stack_factory):
    """The step that fails once, after steps 1-4, is new evidence: no back-off, no count toward the bound;
    the next start resumes and trains to the end."""
    s = stack_factory(FAKE_TRAINER_FAIL_AT_STEP="5:once", PODKIT_TRAINER_CHECKPOINT_EVERY="2",
                      PODKIT_TRAINER_MAX_STEPS="8", PODKIT_TRAINER_RESTART_DELAY_S="30").start()
    wait_for(lambda: (s.progress().get("stopped") or {}).get("by") == "max_steps", 90, what="the run's end")
    assert starts(s) == 2 and "back-off" not in s.log("trainer")
    assert "resumed from checkpoint" in s.log("trainer")
    assert s.stop() == 0


def test_up_whose_trainer_fails_before_its_first_step_every_time_ends_by_itself_with_exit_1(tmp_path):
    """`podkit up` (make run, make rehearse) is never left waiting: the loop bound stops the trainer after
    three failures, and up ends with 1 and doctor's finding, the user's exception in it."""
    ws = tmp_path / "ws"
    e = smoke_env(ws, free_port(), FAKE_TRAINER_FAIL_AT_STEP="1", PODKIT_TRAINER_RESTART_DELAY_S="1")
    e.pop("PODKIT_CONFIG")
    t0 = time.time()
    r = subprocess.run([*PODKIT, "up", "--smoke", "--workspace", str(ws)], env=e, capture_output=True, text=True,
                       timeout=150, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the trainer stopped for good (crash-loop)" in r.stdout, r.stdout[-3000:]
    assert "PROBLEM: your script failed again and again without a new step" in r.stdout
    assert "RuntimeError: injected failure at step 1 (FAKE_TRAINER_FAIL_AT_STEP) at " in r.stdout
    assert "failed 3 times in a row before its first step" in r.stdout
    assert (ws / "logs" / "trainer.log").read_text().count("[podkit:run] starting trainer") == 3
    print(f"up: exit 1 after {time.time() - t0:.0f}s")


def bound_cfg(tmp_path, **trainer):
    from types import SimpleNamespace

    (tmp_path / "run").mkdir(exist_ok=True)
    return SimpleNamespace(state_dir=tmp_path, run_path=tmp_path / "run", socket_path=str(tmp_path / "no.sock"),
                           workspace_path=tmp_path,
                           trainer=SimpleNamespace(**{"max_failures": 3, "restart_delay_s": 0.0, **trainer}))


def test_a_planted_loop_record_neither_crashes_the_start_nor_makes_it_wait(tmp_path, monkeypatch):
    """A count no run makes and a last failure a day ahead: the start goes on, without a day's sleep."""
    from podkit import records
    from podkit.judge import loopbound

    records.TRAINER_LOOP.write(tmp_path, {"failures": 10**7, "outside": 5000, "last_failure": time.time() + 80000})
    slept = []
    monkeypatch.setattr(loopbound.time, "sleep", slept.append)
    assert loopbound.Bound(bound_cfg(tmp_path, restart_delay_s=10.0)).hold_off()
    assert all(s <= loopbound.MAX_DELAY_S for s in slept), slept


def test_a_trainer_killed_on_every_run_by_nobody_podkit_knows_stops_too_only_later(tmp_path):
    """A program killed with no word from it, and no evidence of why (no watchdog restart, no stop asked for, no
    OOM kill): not the script's failure, so counted apart, against three times trainer.max_failures, and the
    stop names it as what it is, with where to look."""
    from podkit import records
    from podkit.judge import loopbound

    cfg = bound_cfg(tmp_path)
    for start in range(1, 11):  # the first start has no run before it; each next one finds the last killed
        went_on = loopbound.Bound(cfg).hold_off()
        assert went_on == (start < 10), start
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == "outside-loop", stopped
    assert "could not run 9 times in a row before its first step" in stopped["message"], stopped
    assert "no watchdog restart, no stop asked for, no OOM kill" in stopped["message"], stopped
    assert "dmesg" in stopped["hint"] and stopped["last"] == "killed-by-signal", stopped
    assert loopbound.Bound(cfg).hold_off(), "`podkit ctl start trainer` after the stop counts from zero"


def test_a_final_end_then_a_kill_before_the_exit_stays_final_and_only_your_start_trains_again(tmp_path):
    """The script recorded its own final end (never-trained), then its program was killed before it exited 0 (an OOM
    kill, supervisord's SIGKILL): supervisord starts it again (a non-zero exit), and the loop bound trained it again.
    Now the next start judges the kill, finds the final end and stays stopped, the end named for this start; a
    start after that one (`podkit ctl start trainer`: the program exited as it should) trains."""
    import os

    from podkit import records
    from podkit.judge import ending, loopbound

    cfg = bound_cfg(tmp_path)
    first = loopbound.Bound(cfg)
    assert first.hold_off()
    killed = 4242  # another process than this test's: the end is carried to the next start's
    first.rec["program"] = killed
    first.save()
    ending.store(tmp_path, ending.record(ending.NEVER_TRAINED, "the script ended without training", program=killed))
    # killed here: no finish(), its `running` stays on record
    assert not loopbound.Bound(cfg).hold_off(), "a final end stays final"
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == ending.NEVER_TRAINED and stopped["program"] == os.getpid(), stopped
    assert "running" not in records.TRAINER_LOOP.read(tmp_path)
    assert loopbound.Bound(cfg).hold_off(), "your start after the stop trains"


def test_the_loop_bounds_count_kept_in_the_run_dir_while_the_volume_is_full_goes_back_onto_it(tmp_path, monkeypatch):
    """Loop.save: a volume that refuses the record puts it in the run dir, and the next start reads that copy (its
    write count is higher); the next save the volume takes removes the copy. The count goes on across a reset."""
    import errno

    from podkit import records
    from podkit.judge import ending, loopbound

    cfg = bound_cfg(tmp_path)
    b = loopbound.Bound(cfg)
    b.rec["failures"] = 1
    b.save()
    real = records.Record.write

    def full(self, directory, data, mode=0o644):
        if directory == tmp_path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, directory, data, mode)
    monkeypatch.setattr(records.Record, "write", full)
    b.rec["failures"] = 2
    b.save()
    assert records.TRAINER_LOOP.read(tmp_path)["failures"] == 1
    assert loopbound.Bound(cfg).rec["failures"] == 2, "the run dir's newer copy"
    monkeypatch.setattr(records.Record, "write", real)
    again = loopbound.Bound(cfg)
    seq = again.seq
    again.save()
    assert again.seq == seq + 1 and records.TRAINER_LOOP.read(tmp_path)["seq"] == seq + 1
    assert not records.TRAINER_LOOP.path(cfg.run_path).exists(), "back on the volume: the copy goes"
    assert ending  # the module the bound judges with


def test_a_resume_is_not_a_new_step_but_a_step_trained_after_it_is(tmp_path):
    from podkit import records
    from podkit.judge import ending, loopbound

    cfg = bound_cfg(tmp_path)
    b = loopbound.Bound(cfg)
    started = time.time() - 1
    failed = ending.End(ending.record(ending.FAILED, "ValueError: bad row"))
    records.PROGRESS.write(tmp_path, {"step": 50, "resumed_at": 50, "time": time.time()})
    assert b.finish(failed, 1, started) == 1 and b.rec["failures"] == 1, "resumed at 50, failed before 51"
    records.PROGRESS.write(tmp_path, {"step": 51, "resumed_at": 50, "time": time.time()})
    assert b.finish(failed, 1, started) == 1 and b.rec["failures"] == 0 and b.rec["best_step"] == 51


def test_a_stray_sigterm_at_every_start_is_bounded_with_a_back_off_and_one_after_a_new_step_is_not_counted(tmp_path):
    """A script (or a neighbour) that sends its ranks SIGTERM at every start: a stop nobody asked podkit for,
    restarted to resume, was never counted, so it restarted for ever with no back-off. It counts now, as a cause
    outside the script (three times trainer.max_failures), when it comes again with no new step."""
    from podkit import records
    from podkit.judge import ending, loopbound

    cfg = bound_cfg(tmp_path)
    b = loopbound.Bound(cfg)
    started = time.time() - 1
    stray = ending.End(ending.record(ending.STRAY, step=7, asked="a SIGTERM sent to rank 0, not by podkit"))
    records.PROGRESS.write(tmp_path, {"step": 7, "resumed_at": 6, "time": time.time()})
    assert b.finish(stray, 0, started) == ending.EXIT_RESTART and b.rec.get("outside", 0) == 0, "after a new step"
    records.PROGRESS.write(tmp_path, {"step": 7, "resumed_at": 7, "time": time.time()})
    codes = [b.finish(stray, 0, started) for _ in range(3 * cfg.trainer.max_failures)]
    assert codes[:-1] == [ending.EXIT_RESTART] * (len(codes) - 1) and codes[-1] == 0, codes
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == ending.OUTSIDE_LOOP and stopped["last"] == ending.STRAY, stopped
