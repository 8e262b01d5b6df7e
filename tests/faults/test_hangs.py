"""The hang watchdog on the smoke stack: a frozen trainer is dumped and restarted, a frozen server is
restarted, a long start-up phase is waited for, not mistaken for a hang, and a finished run that does
not exit is stopped, never restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PODKIT, alive, free_port, smoke_env, wait_for
from podkit.judge import ending
from stub_pod import STOP, on_runpod, receiver, runpod_api  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
FAST = {"PODKIT_WATCHDOG_INTERVAL_S": "0.5", "PODKIT_WATCHDOG_TRAINER_STALL_S": "10",
        "PODKIT_WATCHDOG_INFERENCE_UNHEALTHY_S": "3"}


def actions(ws) -> list[dict]:
    try:
        return json.loads((ws / ".podkit" / "watchdog.json").read_text())
    except (OSError, ValueError):
        return []


def test_a_hung_trainer_is_dumped_and_restarted_and_resumes(stack_factory):
    """The trainer blocks forever (SIGUSR1 makes the fake trainer hang as on a dead collective) while
    inference is healthy: its Python stacks, naming where it hangs, land in logs/hang-*.txt; then it
    is restarted (SIGKILL after its grace: it ignores SIGTERM) and resumes from its checkpoint."""
    s = stack_factory(**FAST, PODKIT_TRAINER_STOP_GRACE_S="2").start()
    s.wait_step(6)
    trainer = s.pid("trainer")
    os.kill(trainer, signal.SIGUSR1)
    wait_for(lambda: s.pid("trainer") not in (0, trainer), 60, what="trainer restarted by the watchdog")
    # The first restart is the hang's (on a loaded machine a short stall limit may restart a slow start too).
    act = [a for a in actions(s.workspace) if a["program"] == "trainer"][0]
    dump = open(act["dump"]).read()
    assert f"pid {trainer}" in dump and "_injected_hang" in dump and "fake_trainer.py" in dump, dump[:3000]
    assert "/proc/" in dump and act["dump"].startswith(str(s.workspace / "logs" / "hang-"))
    # Named where it waits (podkit's fake trainer has no code of yours), and its end judged a hang by the next start.
    assert "no frame of your code on any stack; waiting at fake_trainer.py:" in act["reason"], act
    assert act["function"] == "_injected_hang" and act["where"].split(":")[0].endswith("fake_trainer.py"), act
    wait_for(lambda: "resumed from checkpoint" in s.log("trainer").split("starting trainer")[-1], 60,
             what="the new trainer to resume")
    ends = json.loads((s.workspace / ".podkit" / "trainer-loop.json").read_text())["ends"]
    assert ends[0]["by"] == "hung" and "no frame of your code" in ends[0]["what"], ends
    assert "the trainer hung" in s.log("trainer") and "killed by a signal" not in s.log("trainer")
    doc = json.loads(subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(s.workspace)], env=s.env,
                                    capture_output=True, text=True, timeout=60).stdout)
    hung = next(f for f in doc["findings"] if f["id"] == "trainer_hung")
    assert "the last: no frame of your code on any stack; waiting at fake_trainer.py:" in hung["title"], hung
    assert "podkit doctor" not in hung["fix"], "the fix is an action, never doctor itself"
    assert s.stop() == 0


def test_a_hung_trainer_is_running_again_within_its_stall_limit_and_ten_seconds(stack_factory):
    """At a 6 s stall limit and the default 10 s interval, a hang took 24 s to a new trainer: up to an
    interval to be seen, then the stop grace (8 s) waited out on a process that cannot use it."""
    s = stack_factory(PODKIT_WATCHDOG_TRAINER_STALL_S="6").start()
    s.wait_step(6)
    trainer = s.pid("trainer")
    os.kill(trainer, signal.SIGUSR1)
    t0 = time.monotonic()
    wait_for(lambda: s.pid("trainer") not in (0, trainer), 40, interval=0.2, what="trainer restarted by the watchdog")
    assert time.monotonic() - t0 <= 6 + 10, f"restarted {time.monotonic() - t0:.1f} s after the hang"
    wait_for(lambda: "resumed from checkpoint" in s.log("trainer").split("starting trainer")[-1], 60,
             what="the new trainer to resume")
    assert s.stop() == 0


def test_a_frozen_inference_server_is_restarted(stack_factory):
    """The stand-in accepts connections but never answers: restarted after inference_unhealthy_s;
    the trainer then pushes its weights to the new server."""
    s = stack_factory(**FAST).start()
    s.wait_step(6)
    sglang, trainer = s.pid("sglang"), s.pid("trainer")
    os.kill(sglang, signal.SIGUSR1)  # the stand-in's freeze
    wait_for(lambda: s.pid("sglang") not in (0, sglang), 60, what="sglang restarted by the watchdog")
    (act,) = [a for a in actions(s.workspace) if a["program"] == "sglang"]
    assert "/health has not answered" in act["reason"]
    assert s.pid("trainer") == trainer
    wait_for(lambda: "inference restarted?" in s.log("trainer"), 60, what="weights re-pushed")
    assert s.stop() == 0


def test_a_long_start_up_phase_is_not_a_hang(stack_factory):
    """A server spending longer than inference_unhealthy_s in its start-up phases is left alone until
    the start-up deadline. (The trainer's stall limit is not under test: generous, since on a busy machine
    a fake trainer importing torch after an 8 s server start took longer than FAST's 10 s to step.)"""
    s = stack_factory(**{**FAST, "PODKIT_WATCHDOG_TRAINER_STALL_S": "120"}, PODKIT_INFERENCE_STARTUP_DELAY_S="8",
                      PODKIT_WATCHDOG_STARTUP_DEADLINE_S="60").start()
    sglang = wait_for(lambda: s.pid("sglang"), 30, what="sglang started")
    s.wait_step(2)
    assert s.pid("sglang") == sglang and not actions(s.workspace)
    assert s.stop() == 0


def test_a_start_up_past_its_deadline_is_restarted(stack_factory):
    """Stuck in a start-up phase beyond startup_deadline_s: restarted, with the phase named."""
    s = stack_factory(**FAST, PODKIT_INFERENCE_STARTUP_DELAY_S="60", PODKIT_WATCHDOG_STARTUP_DEADLINE_S="3").start()
    wait_for(lambda: [a for a in actions(s.workspace) if a["program"] == "sglang"], 60, what="a restart")
    act = actions(s.workspace)[0]
    assert "loading_weights" in act["reason"] or "capturing_cuda_graphs" in act["reason"]
    assert "startup_deadline_s" in act["reason"]
    assert s.stop() == 0


# Trains its 12 steps, then a thread it left running keeps it from exiting (the fake trainer's fault knob).
FINISHED_THEN_HUNG = {"PODKIT_TRAINER_MAX_STEPS": "12", "PODKIT_WATCHDOG_INTERVAL_S": "0.5",
                      "PODKIT_WATCHDOG_TRAINER_STALL_S": "3", "FAKE_TRAINER_HANG_AFTER_DONE": "1"}


def test_a_run_that_trains_to_the_end_then_hangs_is_stopped_once_counted_finished_and_its_pod_stopped(
        stack_factory, runpod_api, receiver):  # noqa: F811 - fixtures
    """The watchdog used to dump and restart such a trainer every minute, for ever (it resumed at its
    last step, finished again and hung again). Now: its stacks dumped once, the trainer stopped (not
    restarted, started once), the run counted finished: notified, and the pod's self-stop sent once."""
    s = stack_factory(**FINISHED_THEN_HUNG, PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    trainer = wait_for(lambda: s.pid("trainer"), 30, what="the trainer")
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the pod stop")
    (act,) = actions(s.workspace)
    assert act["action"] == "stopped" and act["program"] == "trainer", act
    assert "the run finished at step 12 but the trainer did not exit" in act["reason"], act
    dump = open(act["dump"]).read()
    assert f"pid {trainer}" in dump and ("left-running" in dump or "(py-spy)" not in act["reason"]), dump[:3000]
    st = s.status()
    assert st["programs"]["trainer"]["state"] == "STOPPED" and st["programs"]["trainer"]["restarts"] == 0, st
    assert not alive(trainer)
    health = subprocess.run([*PODKIT, "status", "--health", "--workspace", str(s.workspace)], env=s.env,
                            capture_output=True, text=True, timeout=30)
    assert (health.returncode, health.stdout.strip()) == (0, "healthy"), health.stdout + health.stderr
    wait_for(lambda: len(receiver.posts) >= 3, 15, what="the notifications")
    time.sleep(4)  # past another stall limit: nothing more happens
    assert sorted(receiver.events()) == ["finished", "pod-stop", "watchdog"], receiver.events()
    assert "training finished at step 12" in receiver.one("finished")["text"]
    writes = [c for c in runpod_api.calls() if not c.startswith("GET ")]  # the cost meter reads the price
    assert writes == [STOP] and len(actions(s.workspace)) == 1
    assert len(list((s.workspace / "logs").glob("hang-*.txt"))) == 1
    assert s.status()["programs"]["trainer"]["state"] == "STOPPED"
    assert s.stop() == 0


def test_a_script_stopped_for_good_that_does_not_exit_is_stopped_never_restarted_and_its_pod_stops(
        stack_factory, runpod_api, receiver):  # noqa: F811 - fixtures
    """A script that never trains (its end: never-trained, final) and whose non-daemon thread keeps it alive. Before:
    "stopped for good ... the pod stops itself after 5 s unless the trainer is started again", then the watchdog
    restarted it as a hang, 4 starts in 180 s, the pod billing. Now: stopped once, never started again, and the pod
    stops after guard.stop_pod_after_s, as stopped for good."""
    s = stack_factory(**{**FINISHED_THEN_HUNG, "FAKE_TRAINER_HANG_AFTER_DONE": ending.NEVER_TRAINED},
                      PODKIT_GUARD_STOP_POD_AFTER_S="2", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    trainer = wait_for(lambda: s.pid("trainer"), 30, what="the trainer")
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the pod stop")
    (act,) = actions(s.workspace)
    assert act["action"] == "stopped" and "stopped for good (never-trained) but the trainer did not exit" in \
        act["reason"], act
    assert not alive(trainer)
    st = s.status()
    assert st["programs"]["trainer"]["state"] == "STOPPED" and st["programs"]["trainer"]["restarts"] == 0, st
    assert st["standing"]["run"] == "cannot-train", st["standing"]
    assert "the trainer stopped for good (never-trained)" in receiver.one("pod-stop")["text"]
    time.sleep(4)  # past another stall limit: nothing more happens
    assert len(actions(s.workspace)) == 1 and s.log("trainer").count("[podkit:run] starting trainer") == 1
    assert s.stop() == 0


def test_up_whose_run_trains_to_the_end_then_hangs_ends_0_as_finished(procs, tmp_path):
    """`podkit up` (make run) waited for ever on such a run, its trainer restarted every stall limit."""
    ws = tmp_path / "ws"
    procs.workspaces.add(str(ws))
    p = procs.spawn([*PODKIT, "up", "--workspace", str(ws)], env=smoke_env(ws, free_port(), **FINISHED_THEN_HUNG),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    assert "training finished (max_steps) at step 12: stopping everything" in out, out[-3000:]
    assert [a["action"] for a in actions(ws)] == ["stopped"], actions(ws)


def test_a_long_busy_preparation_before_the_first_step_is_not_a_hang(stack_factory):
    """The trainer prepares its data for 14 s (CPU-bound, printing nothing) before its first step, past twice a 6 s
    stall limit: its CPU time moves, so it is busy, not hung, and trains; a hang is still a hang after it."""
    s = stack_factory(**{**FAST, "PODKIT_WATCHDOG_TRAINER_STALL_S": "6"}, FAKE_TRAINER_PREPARE_S="14").start()
    s.wait_step(2, timeout=90)
    assert not [a for a in actions(s.workspace) if a["program"] == "trainer"], actions(s.workspace)
    assert s.stop() == 0


def test_before_the_first_step_a_trainer_that_waits_is_hung_and_one_that_works_is_busy(tmp_path):
    """watchdog.Busy on real processes: a rank that spins (a tokeniser) moves; one that sleeps (a dead collective,
    an await for ever) does not, from the moment the run started."""
    from podkit.programs import watchdog

    log = tmp_path / "trainer.log"
    log.write_text("")
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: sum(range(10000))\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (spin, "import time; time.sleep(30)")]
    try:
        time.sleep(0.5)
        seen = []
        for p in procs:
            busy, t0 = watchdog.Busy(), time.time()
            for _i in range(4):
                moved = busy.seen(p.pid, log, time.time(), t0)
                time.sleep(0.5)
            seen.append((moved, t0))
        (spinning, t_spin), (sleeping, t_sleep) = seen
        assert spinning > t_spin + 1, "CPU time moved: busy until the last look"
        assert t_sleep <= sleeping < t_sleep + 0.1, "nothing moved since the first look"
        busy, t0 = watchdog.Busy(), time.time()
        busy.seen(procs[1].pid, log, t0, t0)
        log.write_text("tokenising 40%\n")
        assert busy.seen(procs[1].pid, log, t0 + 1, t0) == t0 + 1, "its log moved"
    finally:
        for p in procs:
            p.kill()
            p.wait()
