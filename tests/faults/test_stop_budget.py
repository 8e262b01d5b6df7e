"""The stop budget: docker and RunPod give a container 10 s (stop_timeout_s) from SIGTERM to SIGKILL.
PID 1 must exit by itself inside it, with a trainer that spends its whole grace and a webhook that never
answers; supervisord's loop (patched by pid1.py) wakes on signals and keeps one deadline. Real
supervisord, the smoke stack, a loopback webhook that accepts and never answers."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, raw_server, wait_for
from podkit import config, notify
from podkit.boot import render
from podkit.host import pid1

pytestmark = pytest.mark.timeout(300)

STOP_TIMEOUT_S = 10.0  # docker's and RunPod's


def never_answers():
    """A webhook that accepts every connection and never answers (the listen backlog holds the rest)."""
    gone = threading.Event()
    srv = raw_server(lambda c: gone.wait(60))
    return srv, gone, f"http://127.0.0.1:{srv.getsockname()[1]}/hooks/not-a-real-secret"


@pytest.mark.e2e
def test_a_trainer_using_its_grace_and_a_webhook_that_never_answers_stop_inside_the_timeout(stack_factory):
    """A trainer whose step takes 6.5 s (SIGTERM just after a step: it finishes the next, about 6.5 s,
    then checkpoints) and a webhook that never answers the "stopping" notification: PID 1 exits by itself
    before the container's 10 s, every time (it was killed in 4 of 6 such stops)."""
    srv, gone, url = never_answers()
    took = []
    try:
        for i in range(4):
            s = stack_factory(PODKIT_TRAINER_STEP_INTERVAL_S="6.5", PODKIT_NOTIFY_WEBHOOK_URL=url).start()
            first = s.wait_step(1, timeout=60)["step"]
            wait_for(lambda s=s, first=first: s.progress().get("step", 0) > first, 30, 0.01, what="a fresh step")
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            try:
                code = s.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                s.proc.kill()  # what docker does at 10 s: exit 137
                s.proc.wait(10)
                pytest.fail(f"stop {i + 1}: PID 1 still running {STOP_TIMEOUT_S:g} s after SIGTERM; took so far {took}")
            took.append(round(time.monotonic() - t0, 2))
            assert code == 0, (i, code)
            assert took[-1] < STOP_TIMEOUT_S - 1, took  # render.MARGIN_S before the timeout, give or take a turn
            assert "Traceback" not in s.stdout(), s.stdout()[-3000:]
    finally:
        gone.set()
        srv.close()
    print(f"[stop budget] SIGTERM -> PID 1 exited: {took} s")


def pid1_supervisord(procs, tmp_path, programs: str, **env: str):
    """supervisord as boot execs it (python -m podkit.host.pid1), on a config of its own with these programs."""
    conf = tmp_path / "supervisord.conf"
    conf.write_text(f"""[supervisord]
nodaemon=true
logfile={tmp_path}/supervisord.log
pidfile={tmp_path}/supervisord.pid
[unix_http_server]
file={tmp_path}/s.sock
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
{programs}""")
    sup = str(ROOT / ".venv" / "bin" / "supervisord")
    p = procs.spawn([sys.executable, "-m", "podkit.host.pid1", sup, "-n", "-c", str(conf)],
                    env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), **env},
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "supervisord.log"
    return p, lambda: log.read_text() if log.exists() else ""


# A program that ignores SIGTERM, with a stopwaitsecs of 60
STUBBORN = f"""[program:stubborn]
command={sys.executable} -c "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
stopwaitsecs=60
startsecs=1
stdout_logfile=NONE
"""


def sigterm_took(p) -> float:
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(20)
    return time.monotonic() - t0


def test_pid1_kills_what_outlives_the_deadline_and_exits_by_itself(procs, tmp_path):
    """A program that ignores SIGTERM, with a stopwaitsecs of 60: supervisord run by pid1 kills it at
    PODKIT_STOP_DEADLINE_S after the SIGTERM and exits, instead of waiting out the 60 s."""
    p, log = pid1_supervisord(procs, tmp_path, STUBBORN, **{pid1.STOP_DEADLINE_ENV: "1.5"})
    wait_for(lambda: "stubborn entered RUNNING" in log(), 30, what="the program to start")
    took = sigterm_took(p)
    # the deadline sits 1.5 s inside the container's stop timeout (render.stop_budget): that is the margin
    assert took < 1.5 + 1.5, took
    assert "the stop's deadline (1.5 s, PODKIT_STOP_DEADLINE_S) has passed" in log()


def test_supervisord_notices_sigterm_and_each_exit_at_once(procs, tmp_path):
    """Three programs that exit at once on SIGTERM: the whole stop takes well under supervisord's 1-s turn
    for each (it saw the SIGTERM, then each exit, only at its next turn: 3 s on this test before)."""
    p, log = pid1_supervisord(procs, tmp_path, "".join(f"""[program:p{i}]
command=sleep 600
startsecs=0
stdout_logfile=NONE
""" for i in range(3)))
    wait_for(lambda: log().count("entered RUNNING") == 3, 30, what="three programs")
    time.sleep(0.3)  # into supervisord's 1-s poll
    took = sigterm_took(p)
    assert took < 1.0, took


def test_supervisors_loop_has_the_shape_pid1s_patch_expects():
    """pid1.patch_supervisord wraps PollPoller.poll and Supervisor.tick and kills through Process.kill
    (supervisor 4.3): a supervisor that renames or reshapes them must fail here, not at a pod's stop."""
    from supervisor import poller, process, supervisord
    from supervisor.states import SupervisorStates

    assert poller.Poller is poller.PollPoller, "on Linux supervisord polls with PollPoller"
    assert list(inspect.signature(poller.PollPoller.poll).parameters) == ["self", "timeout"]
    assert "self._poller = select.poll()" in inspect.getsource(poller.PollPoller.initialize)
    assert list(inspect.signature(supervisord.Supervisor.tick).parameters) == ["self", "now"]
    assert "self.tick()" in inspect.getsource(supervisord.Supervisor.runforever)
    assert list(inspect.signature(process.Subprocess.kill).parameters) == ["self", "sig"]
    assert SupervisorStates.SHUTDOWN < SupervisorStates.RUNNING


@pytest.mark.parametrize(("env", "deadline", "trainer", "inference"), [
    ({}, "8.5", "7", "8"),                                                    # the defaults: 7 s of docker's 10
    ({"PODKIT_TRAINER_STOP_GRACE_S": "8"}, "8.5", "7", "8"),                 # 8 does not fit: cut to 7
    ({"PODKIT_STOP_TIMEOUT_S": "200", "PODKIT_TRAINER_STOP_GRACE_S": "180"}, "198.5", "180", "20"),
    ({"PODKIT_STOP_TIMEOUT_S": "4", "PODKIT_INFERENCE_STOP_GRACE_S": "30"}, "2.5", "1", "2"),
])
def test_the_stop_budget_gives_the_trainer_what_podkits_own_work_leaves(tmp_path, env, deadline, trainer, inference):
    """One deadline, 1.5 s inside the stop timeout; the trainer's grace is what is left after 1 s of
    podkit's own work; inference is cut to the deadline; supervisord's stopwaitsecs follow, the log listener's
    the whole deadline (its upload of the last checkpoint)."""
    cfg = config.load(ROOT / "configs" / "default.yaml",
                      environ={"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run"), **env})
    budget = render.stop_budget(cfg)
    assert budget[pid1.STOP_DEADLINE_ENV] == deadline
    assert budget["PODKIT_TRAINER_STOP_GRACE_S"] == trainer
    assert budget["PODKIT_INFERENCE_STOP_GRACE_S"] == inference
    (tmp_path / "logs").mkdir()
    (tmp_path / "run").mkdir()
    opts = render.check_supervisord_conf(ROOT / "supervisord.conf", render.environment(cfg, base={}))
    waits = {g.name: g.process_configs[0].stopwaitsecs for g in opts.process_group_configs}
    assert waits["trainer"] == int(trainer) and waits["sglang"] == int(inference)
    assert waits["ray"] <= float(deadline)
    # the listener uploads the last checkpoint (checkpoint.remote) after the trainer: only PID 1's deadline cuts it
    assert float(deadline) <= waits["logs"] < float(deadline) + 1


def test_a_notification_during_a_stop_ends_by_its_deadline(tmp_path):
    """A webhook that never answers: once the container is stopping, the attempt is cut at the stop's
    deadline (less the listener's own exit) and no other starts; draining waits no longer."""
    srv, gone, url = never_answers()
    try:
        notify._until.clear()
        notify.stopping(2.0)
        t0 = time.monotonic()
        t = notify.send("stopping", "the pod is stopping", tmp_path, environ={notify.ENV: url})
        notify.drain(30)
        took = time.monotonic() - t0
        assert took < 2.0 - notify.EXIT_S + 0.2, took
        t.join(1.0)  # its attempt was cut at the same moment
        assert not t.is_alive()
    finally:
        notify._until.clear()
        notify._failing_logged.clear()
        gone.set()
        srv.close()
