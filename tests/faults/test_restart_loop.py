"""Never a restart loop: boots that come too fast wait in safe mode, `podkit resume` leaves it, and
each boot records why the run before it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PODKIT, alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def boots(ws) -> list[dict]:
    return json.loads((ws / ".podkit" / "boots.json").read_text())


def test_a_boot_storm_enters_safe_mode_and_resume_boots_again_in_place(stack_factory):
    """With max_boots=2, the third boot inside the window waits in safe mode and explains why;
    `podkit resume` makes that same process (PID 1 in a container) boot again to supervisord."""
    for _ in range(2):
        s = stack_factory(PODKIT_GUARD_MAX_BOOTS="2").start()
        assert s.stop() == 0
    third = stack_factory(PODKIT_GUARD_MAX_BOOTS="2")
    third.workspace.mkdir(exist_ok=True)
    out = open(third.out_path, "ab")
    p = third.procs.spawn([*PODKIT, "boot"], env=third.env, stdout=out, stderr=subprocess.STDOUT)
    third.proc = p
    wait_for(lambda: "SAFE MODE" in third.stdout(), 30, what="safe mode")
    assert "crash-loop guard: 3 boots" in third.stdout() and p.poll() is None
    st = third.status()
    assert st["safe_mode"]["stage"] == "guard" and boots(third.workspace)[-1]["outcome"] == "safe-mode"
    r = subprocess.run([*PODKIT, "resume", "--workspace", str(third.workspace)], capture_output=True, text=True,
                       env=third.env, timeout=30)
    assert f"(pid {p.pid})" in r.stdout
    wait_for(lambda: third.current().get("supervisord_pid") == p.pid and third._rpc_ok(), 30,
             what="the resumed boot to exec supervisord in the same process")
    assert boots(third.workspace)[-1]["outcome"] == "supervisord"
    assert third.status()["safe_mode"] is None
    assert third.stop() == 0


def test_each_boot_records_why_the_run_before_it_stopped(stack_factory, procs):
    """A clean SIGTERM is told apart from a kill -9 of the whole stack."""
    s = stack_factory().start()
    s.wait_step(3)
    assert s.stop() == 0
    s = stack_factory().start()
    assert boots(s.workspace)[-1]["last_stop"].startswith("SIGTERM: the trainer stopped by the pod's stop (docker "
                                                          "stop, a RunPod stop or migration) at step")
    s.wait_step(s.progress()["step"] + 2)
    pids = [s.proc.pid, s.pid("sglang"), s.pid("trainer"), s.pid("logs")]
    for pid in pids:  # what a container kill does to every process in it
        os.kill(pid, signal.SIGKILL)
    s.proc.wait(10)
    wait_for(lambda: not any(alive(p) for p in pids), 10, what="the stack gone")
    s = stack_factory().start()
    assert boots(s.workspace)[-1]["last_stop"].startswith("unknown: no end recorded")
    assert s.stop() == 0


def test_health_is_healthy_while_training_and_names_what_is_not(stack_factory):
    """`podkit status --health` (the image's HEALTHCHECK): 0 while both programs run and the trainer
    progresses; 1 naming the stopped program otherwise."""
    s = stack_factory().start()
    s.wait_step(3)

    def health():
        return subprocess.run([*PODKIT, "status", "--health", "--workspace", str(s.workspace)],
                              capture_output=True, text=True, env=s.env, timeout=30)

    r = wait_for(lambda: (r := health()).returncode == 0 and r, 30, what="healthy")
    assert r.stdout.strip() == "healthy"
    ctl = [os.path.join(os.path.dirname(sys.executable), "supervisorctl"),
           "-c", os.path.join(s.current()["run_dir"], "supervisorctl.conf")]
    subprocess.run([*ctl, "stop", "trainer"], check=True, timeout=60, capture_output=True)
    r = health()
    assert r.returncode == 1 and r.stdout.strip() == "unhealthy: trainer is STOPPED"
    subprocess.run([*ctl, "start", "trainer"], check=True, timeout=60, capture_output=True)
    wait_for(lambda: health().returncode == 0, 30, what="healthy again once the restarted trainer steps")
    assert s.stop() == 0


def test_health_of_a_restarted_trainer_that_does_not_step_fails_before_the_progress_timeout():
    """A trainer that keeps restarting is STARTING or RUNNING most of the time: it was reported healthy
    until health.progress_timeout_s (30 min), or for ever if it never stepped. Once restarted, ten
    minutes without a step is a failure; a restart that recovers in time is not."""
    from podkit import programs
    from podkit.views import status

    now = time.time()

    def st(last, restarts: int = 3, up: float = 900) -> dict:
        progs = {n: {"state": "RUNNING", "uptime_s": up, "restarts": 0} for n in programs.NAMES}
        progs["trainer"] = {"state": "RUNNING", "uptime_s": 20, "restarts": restarts}
        return {"safe_mode": None, "supervisord": {"reachable": True}, "trainer": {"last_progress": last},
                "inference": {"phase": "ready"}, "programs": progs}

    assert "has not stepped for 700s" in status.health_problem(st(now - 700), 1800)
    assert "has not stepped for 900s" in status.health_problem(st(None), 1800)  # never stepped
    assert status.health_problem(st(now - 120), 1800) is None  # a restart that is recovering
    assert status.health_problem(st(now - 700, restarts=0), 1800) is None  # not restarted: the 30 min limit


def test_a_person_running_podkit_up_again_and_again_is_not_a_boot_storm(tmp_path):
    """`podkit up` records its boots too (the start-up timeline), but a person starts those and they exit:
    six of them in a minute are not the container's restart loop, and the next `podkit boot` trains."""
    from podkit.boot import guard

    state = tmp_path / ".podkit"
    state.mkdir()
    now = time.time()
    ups = [{"time": now - 60 + i, "pid": 100 + i, "stages": {}, "outcome": "supervisord", "last_stop": "",
            "via": "up"} for i in range(6)]
    (state / "boots.json").write_text(json.dumps(ups))
    assert guard.storm(state, max_boots=5, window_s=600) is None
    b = guard.Boot(state)
    assert "via" not in b.rec and [r["pid"] for r in guard.recent(state, 600)] == [b.rec["pid"]]
