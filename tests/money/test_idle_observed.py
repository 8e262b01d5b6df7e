"""Idle observed, not recorded (issue 55 item 1), in the log listener with the cost guard's real rule (WhenIdle,
Stopper): the pod stops when supervisord will not start a trainer for guard.stop_pod_after_s, whatever the records
say (a lost end, a lost finish, a lost lease), and never for a trainer that runs, starts or backs off, nor one you
stopped on purpose (`podkit ctl stop trainer`: said once, with the guard's time). The stop's words say which."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest

from podkit import notify, records
from podkit.judge import ending
from podkit.money import costguard
from podkit.programs.logs import Pump

pytestmark = pytest.mark.timeout(60)
AFTER_S = 1.0


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """A listener on a RunPod pod whose stop is recorded, not sent; notifications recorded too."""
    stops, sent = [], []
    monkeypatch.setattr(costguard, "on_runpod", lambda environ=None: True)
    monkeypatch.setattr(costguard, "stop_pod_notified", lambda reason, state_dir, notify=True: stops.append(reason)
                        or True)
    monkeypatch.setattr(notify, "send", lambda event, text, state_dir, environ=None: sent.append((event, text)))
    state, run = tmp_path / ".podkit", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    records.CURRENT.write(state, {"started": time.time() - 60})
    guards = {"stop_pod_at": 0.0, "stop_pod_when_finished": "auto", "stop_pod_after_s": AFTER_S, "max_spend": 0.0}
    out = io.StringIO()
    pump = Pump(out, run, state_dir=state, on_runpod=True, guards=SimpleNamespace(values=lambda: guards))
    return SimpleNamespace(pump=pump, state=state, run=run, stops=stops, sent=sent, out=out, guards=guards)


def events(pump: Pump, *states: str, pid: str = "9", expected: str = "1") -> None:
    for to in states:
        pump.state(f"PROCESS_STATE_{to}", {"processname": "trainer", "pid": pid, "expected": expected})


def stopped_within(p, seconds: float) -> str:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if p.stops:
            return p.stops[0]
        time.sleep(0.05)
    return ""


@pytest.mark.parametrize("what,record", [
    ("no record at all (the volume was full)", None),
    ("an end the trainer could not write, a lease lost to another host", {"by": ending.LEASE_LOST}),
    ("an earlier run's finish on the volume", {"by": ending.DONE, "time_ago": 3600}),
])
def test_a_trainer_that_exited_with_no_end_of_its_own_stops_the_pod_after_stop_pod_after_s(pod, what, record):
    if record is not None:
        rec = ending.record(record["by"], "another host took the workspace", step=12)
        rec["time"] -= record.get("time_ago", 0)
        if record["by"] == ending.LEASE_LOST:
            rec["time"] += 1  # made after the start below
        records.PROGRESS.write(pod.state, {"step": 12, "stopped": rec})
    events(pod.pump, "STARTING", "RUNNING")
    time.sleep(1.1 if record and record["by"] == ending.LEASE_LOST else 0)
    events(pod.pump, "EXITED")
    t0 = time.monotonic()
    reason = stopped_within(pod, AFTER_S + 5)
    assert reason, (what, pod.out.getvalue())
    assert time.monotonic() - t0 >= AFTER_S - 0.2
    assert "guard.stop_pod_after_s" in reason, reason
    if record and record["by"] == ending.LEASE_LOST:
        assert "the trainer exited (stopped: another pod holds the workspace now) and nothing will start it" in reason
    else:
        assert "the trainer exited without recording a final end" in reason, reason
    assert not any(e == "finished" for e, _ in pod.sent), "never a finish it cannot show"


def test_a_finish_kept_in_the_run_dir_while_the_volume_was_full_is_a_finish(pod, monkeypatch):
    """The trainer reached max_steps on a full volume: its `done` kept in the run dir is read, the run is finished,
    and the pod stops as finished (stop_pod_when_finished auto), not as idle."""
    monkeypatch.setenv(ending.KEEP_ENV, str(pod.run))
    events(pod.pump, "STARTING", "RUNNING")
    ending.keep(ending.record(ending.DONE, step=40, program=9))
    events(pod.pump, "EXITED")
    reason = stopped_within(pod, AFTER_S + 5)
    assert "training finished at step" in reason and "stop_pod_when_finished" in reason, reason
    assert [e for e, _ in pod.sent] == ["finished"]


def test_a_trainer_you_stopped_keeps_the_pod_up_said_once_and_one_nobody_asked_for_does_not(pod):
    events(pod.pump, "STARTING", "RUNNING", "STOPPING")
    ending.ask(pod.run, ["trainer"], "you (podkit ctl stop trainer)")
    events(pod.pump, "STOPPED")
    assert not stopped_within(pod, AFTER_S * 3)
    pod.pump.idle_rule()  # the listener's TICK: said once, not each minute
    said = pod.out.getvalue()
    assert said.count("the trainer is stopped by you (podkit ctl stop trainer)") == 1, said
    assert "guard.stop_pod_after_s, 1 s, counts only a trainer nothing will start" in said, said
    # Started again and stopped by something that did not say so (supervisorctl): your ask was long before.
    ending.ASKED.write(pod.run, [{"program": "trainer", "by": "you (podkit ctl stop trainer)",
                                  "time": time.time() - ending.ASKED_FRESH_S - 60}], mode=0o600)
    events(pod.pump, "STARTING", "RUNNING", "STOPPING", "STOPPED", pid="10")
    reason = stopped_within(pod, AFTER_S + 5)
    assert "the trainer is stopped (not by podkit ctl) and nothing will start it" in reason, reason


@pytest.mark.parametrize("states", [("STARTING",), ("STARTING", "RUNNING"), ("STARTING", "RUNNING", "BACKOFF")])
def test_a_trainer_that_runs_starts_or_backs_off_never_stops_the_pod(pod, states):
    events(pod.pump, *states)
    pod.pump.idle_rule()
    assert not stopped_within(pod, AFTER_S * 2.5)


def test_a_trainer_started_again_within_the_wait_calls_the_stop_off(pod):
    events(pod.pump, "STARTING", "RUNNING", "EXITED")
    time.sleep(AFTER_S / 3)
    events(pod.pump, "STARTING", "RUNNING", pid="11")
    assert not stopped_within(pod, AFTER_S * 2.5)


def test_the_listeners_tick_puts_a_kept_end_on_the_volume_and_makes_the_reserve_again(pod, monkeypatch):
    """Once the volume has room (the listener's TICK: room()), the end kept in the run dir goes onto it and podkit's
    reserve is made again; an end kept over another than the volume holds now (a newer one reached it) is dropped."""
    monkeypatch.setenv(ending.KEEP_ENV, str(pod.run))
    ending.keep(ending.record(ending.CRASH_LOOP, "failed 2 times in a row"), pod.state)
    assert not (pod.state / records.RESERVE).exists()
    pod.pump.room()
    assert records.PROGRESS.read(pod.state)["stopped"]["by"] == ending.CRASH_LOOP
    assert not ending.KEPT.path(pod.run).exists() and (pod.state / records.RESERVE).is_file()
    ending.keep(ending.record(ending.FAILED, "kept while full"), pod.state)
    records.PROGRESS.write(pod.state, {"stopped": ending.record(ending.DONE, step=9)})  # a newer end, by another
    assert ending.read(pod.state, run_dir=pod.run).kind.name == ending.DONE
    pod.pump.room()
    assert records.PROGRESS.read(pod.state)["stopped"]["by"] == ending.DONE and not ending.KEPT.path(pod.run).exists()


def test_a_stop_you_asked_for_that_takes_its_whole_grace_keeps_the_pod_up(pod):
    """`podkit ctl stop trainer` whose stop took 141 s (trainer.stop_grace_s 140): the pod was stopped as "not by
    podkit ctl" (the ask had to be within 120 s of the stop)."""
    events(pod.pump, "STARTING", "RUNNING")
    pod.pump.states["trainer"]["started_at"] = time.time() - 600  # it had trained ten minutes
    ending.ASKED.write(pod.run, [{"program": "trainer", "by": "you (podkit ctl stop trainer)",
                                  "time": time.time() - 141}], mode=0o600)
    events(pod.pump, "STOPPING", "STOPPED")
    assert not stopped_within(pod, AFTER_S * 2.5)


def test_a_programs_record_the_run_dir_cannot_take_never_ends_the_listener(pod, monkeypatch):
    def full(*_a, **_k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(records.PROGRAMS, "write", full)
    events(pod.pump, "STARTING", "RUNNING", "EXITED")
    assert pod.out.getvalue().count("cannot record the programs' states") == 1
    assert stopped_within(pod, AFTER_S + 5), "the idle rule holds from the listener's own events"
