"""Ends that are not the script's, on the smoke stack (real supervisord, the fake trainer, `podkit boot`): the
user's own restarts and stops count nothing and never stop the pod; podkit's own back-off is not a hang; a
wait for inference that never comes is named as inference; a run that fails after every new step is named
once; and `podkit resume` on a live pod takes a pushed fix to the trainer. The real trainer's own cases:
tests/trainer/test_your_code.py; the judge and the counts themselves: tests/judge/test_ending.py."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from conftest import PODKIT, free_port, wait_for
from gitserver import Remote
from stub_pod import KEY, STOP, on_runpod, receiver, runpod_api  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def podkit(s, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PODKIT, *args[:1], "--workspace", str(s.workspace), *args[1:]], capture_output=True,
                          text=True, env=s.env, timeout=timeout)


def ctl(s, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PODKIT, "ctl", "--workspace", str(s.workspace), *args], capture_output=True, text=True,
                          env=s.env, timeout=90)


def loop(s) -> dict:
    try:
        return json.loads((s.workspace / ".podkit" / "trainer-loop.json").read_text())
    except (OSError, ValueError):
        return {}


def counted(s) -> dict:
    rec = loop(s)
    return {k: rec.get(k) or 0 for k in ("failures", "hangs", "ooms", "outside")}


def new_trainer(s, old: int, timeout: float = 60) -> int:
    return wait_for(lambda: s.pid("trainer") not in (0, old) and s.pid("trainer"), timeout, interval=0.2,
                    what="a new trainer process")


def test_your_restarts_in_a_long_step_and_while_inference_is_stopped_count_nothing_and_never_stop_the_pod(
        stack_factory, runpod_api):  # noqa: F811
    """`podkit ctl restart trainer` three times while each step is longer than trainer.stop_grace_s (supervisord
    kills the trainer at the end of the grace: its next start reads the SIGTERM it noted), then `podkit ctl stop
    sglang` mid-run and two more restarts while the trainer waits for it: the loop bound counts nothing, every
    end says who asked, and on RunPod the pod is never stopped, though stop_pod_after_s passes many times."""
    s = stack_factory(PODKIT_TRAINER_STEP_INTERVAL_S="6", PODKIT_TRAINER_CHECKPOINT_EVERY="1",
                      PODKIT_TRAINER_STOP_GRACE_S="1", PODKIT_GUARD_STOP_POD_AFTER_S="2",
                      **on_runpod(runpod_api.url)).start()
    s.wait_step(1, timeout=60)
    pid = s.pid("trainer")
    for _n in range(3):
        # Inside the step's 6 s: the new program has resumed (its record) and trains, however slow its start was.
        wait_for(lambda p=pid: s.progress().get("pid") == p, 60, interval=0.2, what="the trainer's run under way")
        time.sleep(1)
        r = ctl(s, "restart", "trainer")
        assert r.returncode == 0, r.stdout + r.stderr
        pid = new_trainer(s, pid)
    wait_for(lambda: len(loop(s).get("ends") or []) >= 3, 30, what="the three restarts judged")
    ends = loop(s)["ends"]
    assert {e["by"] for e in ends} == {"SIGTERM"}, ends
    assert counted(s) == {"failures": 0, "hangs": 0, "ooms": 0, "outside": 0}, loop(s)
    stopped = s.progress()["stopped"]  # the last end stays on record while the next run trains
    assert stopped["by"] == "SIGTERM" and stopped["asked"] == "you (podkit ctl restart trainer)", stopped
    assert "killed after the stop's grace" in stopped["evidence"][0], stopped

    # Inference stopped on purpose: the trainer waits for it, through restarts, and nothing stops the pod.
    step = s.progress()["step"]
    assert ctl(s, "stop", "sglang").returncode == 0
    time.sleep(3)
    r = ctl(s, "restart", "trainer")
    assert r.returncode == 0, r.stdout + r.stderr
    pid = new_trainer(s, pid)
    wait_for(lambda: "inference was stopped on request by you (podkit ctl stop sglang)" in s.log("trainer"), 30,
             what="the trainer to wait for the inference you stopped")
    r = ctl(s, "restart", "trainer")
    pid = new_trainer(s, pid)
    time.sleep(5)  # stop_pod_after_s (2 s) over twice: no pod stop, no loop
    assert counted(s) == {"failures": 0, "hangs": 0, "ooms": 0, "outside": 0}, loop(s)
    assert STOP not in runpod_api.calls(), runpod_api.calls()
    assert s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "RUNNING"
    health = podkit(s, "status", "--health")
    assert health.returncode == 1 and "sglang is STOPPED" in health.stdout, health.stdout
    doc = json.loads(podkit(s, "doctor", "--json").stdout)
    assert not [f for f in doc["findings"] if f["id"].startswith("trainer_") and f["severity"] == "problem"], doc
    assert ctl(s, "start", "sglang").returncode == 0
    wait_for(lambda: (s.progress().get("step") or 0) > step and s.progress()["pid"] == pid, 60,
             what="training to go on once inference is back")
    assert s.stop() == 0 and KEY not in s.stdout()


@pytest.mark.timeout(300)
def test_podkits_own_back_off_is_never_killed_as_a_hang(stack_factory):
    """A trainer that fails before its first step waits trainer.restart_delay_s (20 s here) inside its program
    before the next start, which supervisord shows RUNNING after its startsecs (3 s): the watchdog, whose stall
    limit (8 s) is shorter than the back-off, measures a stall from the run's own start, not the program's, and
    restarts nothing. (It used to kill the back-off as a hang, dump it and count it as a kill.)"""
    s = stack_factory(FAKE_TRAINER_FAIL_AT_STEP="1", PODKIT_TRAINER_RESTART_DELAY_S="20",
                      PODKIT_TRAINER_MAX_FAILURES="2", PODKIT_WATCHDOG_TRAINER_STALL_S="8",
                      PODKIT_WATCHDOG_INTERVAL_S="0.5").start()
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "crash-loop" and st, 120,
                       interval=0.5, what="the loop bound's stop")
    assert "failed 2 times in a row before its first step" in stopped["message"], stopped
    watchdog = s.workspace / ".podkit" / "watchdog.json"
    actions = json.loads(watchdog.read_text()) if watchdog.exists() else []
    assert not [a for a in actions if a["program"] == "trainer"], actions
    waits = [int(w) for w in re.findall(r"back-off: waiting (\d+)s", s.log("trainer"))]
    assert len(waits) == 1 and waits[0] >= 12, s.log("trainer")[-3000:]  # past startsecs and the stall limit
    assert counted(s) == {"failures": 2, "hangs": 0, "ooms": 0, "outside": 0}, loop(s)
    assert s.stop() == 0


def test_a_wait_for_inference_that_never_comes_is_named_as_inference_not_as_a_kill(stack_factory):
    """The fake trainer gives inference inference.ready_timeout_s: past it, its end is inference's, in those
    words, counted apart from the script's failures."""
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="60", PODKIT_INFERENCE_READY_TIMEOUT_S="1",
                      PODKIT_TRAINER_RESTART_DELAY_S="1").start()
    wait_for(lambda: counted(s)["outside"] >= 2, 60, interval=0.5, what="two ends for inference")
    log = s.log("trainer")
    assert "the trainer ended while inference was restarted or down before its first step without a new step (1 " \
           "of 9 in a row): inference at 127.0.0.1" in log and "not ready after 1s" in log, log[-3000:]
    assert "killed" not in log, log[-3000:]
    assert counted(s)["failures"] == 0
    assert s.stop() == 0


@pytest.mark.timeout(300)
def test_a_run_that_fails_after_every_new_step_goes_on_and_is_named_once(stack_factory, receiver):  # noqa: F811
    """Each start resumes, trains a step and fails: the loop bound never stops it (each start is progress), but
    after five such starts in an hour a notification says so, once, and status and doctor name what each costs."""
    s = stack_factory(FAKE_TRAINER_FAIL_AT_STEP="new", PODKIT_TRAINER_CHECKPOINT_EVERY="1",
                      PODKIT_NOTIFY_WEBHOOK_URL=receiver.url).start()
    # Each start lasts supervisord's startsecs (3 s) at least: the loop bound, not supervisord, bounds the trainer.
    wait_for(lambda: "trainer-restarting" in receiver.events(), 150, interval=0.5,
             what="the restarts' notification")
    assert "failed 5 times in the last hour, each time after a new step" in receiver.one("trainer-restarting")["text"]
    assert (s.progress().get("step") or 0) >= 5 and "trainer-stopped" not in receiver.events()
    assert s.rpc().supervisor.getProcessInfo("trainer")["statename"] != "FATAL"
    human = podkit(s, "status").stdout
    assert "start(s) in the last hour" in human and "after a failure that followed a new step" in human, human
    doc = json.loads(podkit(s, "doctor", "--json").stdout)
    f = next(f for f in doc["findings"] if f["id"] == "trainer_failing_after_progress")
    assert f["severity"] == "problem" and "injected failure" in f["evidence"][0], f
    assert counted(s)["failures"] <= 1, loop(s)
    # The notification's fix names `podkit resume`: on this trainer, running and failing, it does what it says.
    assert "`podkit resume` (it syncs the fix and starts the trainer)" in receiver.one("trainer-restarting")["text"]
    pid = s.pid("trainer")
    r = podkit(s, "resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "but failing (" in r.stdout and "after new steps in the last hour" in r.stdout, r.stdout
    assert "started trainer" in r.stdout and "nothing to resume" not in r.stdout, r.stdout
    new_trainer(s, pid)
    wait_for(lambda: "started again by `podkit resume` (the repo synced): counting from zero" in s.log("trainer"),
             30, what="the trainer's start by resume")
    assert s.stop() == 0


def test_resume_on_a_live_pod_syncs_the_pushed_fix_and_starts_the_trainer_stopped_for_good(stack_factory, tmp_path):
    """The loop bound stopped the trainer; the user pushes a fix: `podkit resume`, one verb, syncs it, and starts
    the trainer, which counts from zero. (The fake trainer fails on by its own fault injection: this is about
    what the verb does.)"""
    remote = Remote(tmp_path / "remote")
    remote.commit("train.py", "print('v1')\n")
    s = stack_factory(FAKE_TRAINER_FAIL_AT_STEP="1", PODKIT_TRAINER_RESTART_DELAY_S="0.5",
                      PODKIT_TRAINER_MAX_FAILURES="2", PODKIT_REPO_URL=remote.url).start()
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "crash-loop" and st, 90,
                       interval=0.5, what="the loop bound's stop")
    assert "push, then `podkit resume` (it syncs the fix and starts the trainer)" in stopped["hint"], stopped
    wait_for(lambda: s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 30,
             what="the trainer to stay stopped")
    fixed = remote.commit("train.py", "print('v2: fixed')\n")
    r = podkit(s, "resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the trainer's last run: the trainer stopped for good by the loop bound" in r.stdout, r.stdout
    assert f"-> {fixed[:12]}" in r.stdout and "started trainer" in r.stdout, r.stdout
    assert (s.workspace / "repo" / "train.py").read_text() == "print('v2: fixed')\n"
    wait_for(lambda: "started again after the loop bound stopped it" in s.log("trainer"), 30,
             what="the trainer's new start")
    r = podkit(s, "resume")
    assert "nothing to resume" in r.stdout or "synced" in r.stdout, r.stdout
    assert s.stop() == 0


@contextmanager
def mirror(port: int):
    """A data mirror, answering on 127.0.0.1."""
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_one_off_network_error_before_training_is_retried_named_and_the_next_start_trains(stack_factory):
    """The trainer's data mirror is down at its first start: a refused connection, named by what it could not
    reach, counted apart from the script's failures (it may pass), and retried after the back-off; the mirror is
    back, and the next start trains. (It used to stop the trainer for good as the script's config error.)"""
    port = free_port()
    s = stack_factory(FAKE_TRAINER_FETCH=f"http://127.0.0.1:{port}/data.jsonl", PODKIT_TRAINER_RESTART_DELAY_S="2").start()
    wait_for(lambda: counted(s)["outside"] == 1, 60, interval=0.5, what="the network error's end")
    assert f"could not reach a service it needs (a network error) before its first step without a new step (1 of 9 " \
           f"in a row): could not reach 127.0.0.1:{port}: URLError" in s.log("trainer"), s.log("trainer")[-3000:]
    assert s.progress()["stopped"]["by"] == "network-error" and counted(s)["failures"] == 0
    with mirror(port):
        p = s.wait_step(2, timeout=60)
    assert p["stopped"]["by"] == "network-error", "the last end stays on record while the next run trains"
    assert s.stop() == 0
