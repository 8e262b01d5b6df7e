"""The log listener: prefixes each program line, joins lines split across events, survives
non-ASCII output (the protocol is read in bytes), and counts starts for `podkit status`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from podkit.programs.logs import Pump

pytestmark = pytest.mark.timeout(60)


def log_event(proc: str, data: str) -> bytes:
    """The bytes supervisord writes to a listener for one chunk of a program's stdout, built by
    supervisor's own code: its `len` counts characters, and it writes UTF-8."""
    from supervisor import events
    from supervisor.process import EventListenerPool

    process = SimpleNamespace(config=SimpleNamespace(name=proc), group=SimpleNamespace(config=SimpleNamespace(name=proc)))
    payload = events.ProcessLogStdoutEvent(process, 7, data.encode()).payload()
    pool = SimpleNamespace(config=SimpleNamespace(options=SimpleNamespace(identifier="supervisor"), name="logs"))
    return EventListenerPool._eventEnvelope(pool, events.EventTypes.PROCESS_LOG_STDOUT, 1, 1, payload).encode()


def test_lines_split_across_events_are_joined_and_prefixed(tmp_path):
    """A line that arrives in two chunks is printed once, whole, with the program's name."""
    out = io.StringIO()
    pump = Pump(out, tmp_path)
    pump.handle({"eventname": "PROCESS_LOG_STDOUT"}, b"processname:trainer groupname:trainer pid:7 channel:stdout\nstep 1 lo")
    pump.handle({"eventname": "PROCESS_LOG_STDOUT"}, b"processname:trainer groupname:trainer pid:7 channel:stdout\nss 0.5\nstep 2\n")
    assert out.getvalue() == "trainer  | step 1 loss 0.5\ntrainer  | step 2\n"


def test_listener_speaks_the_protocol_in_bytes_with_non_ascii_output(tmp_path):
    """`podkit run logs` as supervisord drives it: READY, event, RESULT; a multi-byte character in one
    event must not desynchronise the next."""
    table = "│ ppo_actor/task_reward/avg │  5.0000e-01 │\n"  # AReaL's stats table
    feed = log_event("sglang", "température ✓ 温度\n") + log_event("trainer", table) + log_event("trainer", "next line\n")
    env = {"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin"}
    (tmp_path / "run").mkdir()
    r = subprocess.run([sys.executable, "-m", "podkit", "run", "logs"], input=feed, capture_output=True,
                       env=env, timeout=30)
    assert r.returncode == 0
    assert r.stdout == b"READY\nRESULT 2\nOK" * 3 + b"READY\n", r.stderr.decode()
    assert r.stderr.decode() == f"sglang   | température ✓ 温度\ntrainer  | {table}trainer  | next line\n"


def test_state_events_count_starts_and_record_fatal(tmp_path):
    """STARTING events count starts (restarts = starts - 1); FATAL is recorded."""
    pump = Pump(io.StringIO(), tmp_path)
    for to in ("STARTING", "RUNNING", "BACKOFF", "STARTING", "FATAL"):
        pump.state(f"PROCESS_STATE_{to}", {"processname": "sglang", "pid": "9"})
    rec = json.loads((tmp_path / "programs.json").read_text())["sglang"]
    assert rec["starts"] == 2 and rec["state"] == "FATAL" and "fatal_at" in rec


def test_a_trainer_that_exits_0_without_training_is_not_announced_finished(tmp_path, monkeypatch):
    """An earlier run's "done" is on the volume; this trainer exited 0 without a record of its own (a
    cluster whose volume was not shared): no "finished", no self-stop. Its own fresh record is finished."""
    import time as _time

    from podkit import notify

    sent = []
    monkeypatch.setattr(notify, "send", lambda event, text, state_dir, environ=None: sent.append(event))
    state = tmp_path / ".podkit"
    state.mkdir()
    (state / "progress.json").write_text(json.dumps({"step": 40, "stopped": {"by": "done", "step": 40,
                                                                             "time": _time.time() - 3600}}))
    pump = Pump(io.StringIO(), tmp_path, state_dir=state)
    for to in ("STARTING", "RUNNING"):
        pump.state(f"PROCESS_STATE_{to}", {"processname": "trainer", "pid": "9"})
    pump.state("PROCESS_STATE_EXITED", {"processname": "trainer", "pid": "9", "expected": "1"})
    assert sent == []
    (state / "progress.json").write_text(json.dumps({"step": 50, "stopped": {"by": "done", "step": 50,
                                                                             "time": _time.time()}}))
    pump.state("PROCESS_STATE_EXITED", {"processname": "trainer", "pid": "9", "expected": "1"})
    assert sent == ["finished"]


def test_a_finished_pods_self_stop_is_called_off_when_the_guard_is_set_to_never_meanwhile(tmp_path, monkeypatch):
    """RunPod refuses the finished pod's stop, and while podkit tries again the person runs
    `podkit guard set stop_pod_when_finished=never`: the next try is not made, and it says so."""
    from podkit.money import costguard

    tries = []
    guards = {"stop_pod_at": 0.0, "stop_pod_when_finished": "auto", "stop_pod_after_s": 0.0}

    def refused(reason, state_dir, notify=True):
        tries.append(reason)
        if len(tries) == 2:
            guards["stop_pod_when_finished"] = "never"
        return False

    monkeypatch.setattr(costguard, "stop_pod_notified", refused)
    monkeypatch.setattr(costguard, "FIRST_RETRY_S", 0.01)
    out = io.StringIO()
    pump = Pump(out, tmp_path, state_dir=tmp_path, on_runpod=True, guards=SimpleNamespace(values=lambda: guards))
    stop = costguard.when_finished(12, pump.guard, tmp_path, pump.say)
    stop.thread.join(10)
    assert not stop.done and len(tries) == 2 and "self-stop is called off" in out.getvalue()


def test_a_maximum_run_time_moved_later_after_its_stop_says_the_trainer_stays_stopped(tmp_path, monkeypatch):
    """stop_pod_at came (trainer stopped, the pod's stop refused), then `podkit guard set stop_pod_at=+6h`:
    the pod is left up, and the listener says once, and notifies, that the trainer stays stopped."""
    import threading
    import time as _time

    from podkit import notify

    sent = []
    monkeypatch.setattr(notify, "send", lambda event, text, state_dir, environ=None: sent.append((event, text)))
    guards = {"stop_pod_at": _time.time() - 5, "stop_pod_when_finished": "auto", "stop_pod_after_s": 0.0,
              "max_spend": 0.0}
    out = io.StringIO()
    pump = Pump(out, tmp_path, state_dir=tmp_path, on_runpod=True, guards=SimpleNamespace(values=lambda: guards))
    pump.deadline.thread = threading.Thread(target=lambda: None)  # the deadline's stop ran; the pod's was refused
    pump.deadline.key = "stop_pod_at"  # ...for this guard
    guards["stop_pod_at"] = _time.time() + 6 * 3600
    pump.deadline.check(_time.time())
    pump.deadline.check(_time.time())
    assert out.getvalue().count("the trainer stays stopped until `podkit ctl start trainer watchdog`") == 1
    assert [e for e, _ in sent] == ["guard"]
