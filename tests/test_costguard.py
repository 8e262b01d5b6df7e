"""Cost guards on RunPod: a finished run, and a pod waiting in safe mode past guard.stop_pod_after_s, stop
the pod through REST API v2's `POST /v2/pods/{id}/action` {"action": "stop"}. RunPod is the loopback stub
of tests/runpod_stub.py, which holds every request to RunPod's OpenAPI document; notifications go to
tests/test_notify.py's loopback receiver."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import PODKIT, wait_for
from runpod_stub import RunPodV2Stub
from test_notify import Receiver, dead_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
KEY = "rpa_TESTKEY0123456789"
STOP = "POST /v2/pods/pod-abc123/action"


@pytest.fixture
def runpod_api():
    stub = RunPodV2Stub(key=KEY)
    stub.add_pod(id="pod-abc123", name="podkit-run")
    yield stub
    assert stub.graphql == [] and stub.refused == []
    stub.assert_clean()
    stub.close()


def stop_sent(stub: RunPodV2Stub) -> dict:
    """The stop's body; every request carried the pod's key."""
    [body] = [r.body for r in stub.requests if f"{r.method} {r.path}" == STOP]
    assert {r.headers.get("authorization") for r in stub.requests} == {f"Bearer {KEY}"}
    return body


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def on_runpod(api_url: str, **extra) -> dict[str, str]:
    return {"RUNPOD_POD_ID": "pod-abc123", "RUNPOD_API_KEY": KEY, "RUNPOD_API_BASE_URL": api_url, **extra}


def test_a_finished_run_on_runpod_stops_its_pod_after_its_checkpoint_and_notification(stack_factory, runpod_api,
                                                                                     receiver):
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the stop")
    assert stop_sent(runpod_api) == {"action": "stop"} and runpod_api.calls() == [STOP]
    assert runpod_api.pod("pod-abc123")["status"] == "EXITED"
    assert receiver.events() == ["finished", "pod-stop"], "both notifications are out before the stop"
    assert "training finished at step 12" in receiver.posts[1]["text"]
    assert s.progress()["checkpoint_step"] == 12 and s.status()["programs"]["trainer"]["state"] == "EXITED"
    assert s.stop() == 0
    assert KEY not in s.stdout() and "stopping pod pod-abc123: training finished at step 12" in s.stdout()


def test_a_finished_runs_self_stop_refused_once_is_tried_again(stack_factory, runpod_api, receiver):
    """One transient API error (a 502) at the moment training finished left the pod up, billing. The
    stop is tried again, and announced once."""
    runpod_api.fail("POST", "/v2/pods/pod-abc123/action", 502, times=3, body=b"Bad Gateway")
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    wait_for(lambda: runpod_api.pod("pod-abc123")["status"] == "EXITED", 60, what="the stop, tried again")
    assert runpod_api.calls().count(STOP) == 4, "two sends (one retry) a try, the second try taken"
    assert receiver.events() == ["finished", "pod-stop"], "one notification for the stop, not one per attempt"
    assert "the pod did not stop; trying again in 2 s" in s.stdout()
    assert s.stop() == 0


@pytest.mark.parametrize("where", ["off RunPod", "never"])
def test_off_runpod_or_with_never_a_finished_run_leaves_the_pod_up(stack_factory, runpod_api, where):
    env = on_runpod(runpod_api.url)
    if where == "off RunPod":
        del env["RUNPOD_POD_ID"]
    else:
        env["PODKIT_GUARD_STOP_POD_WHEN_FINISHED"] = "never"
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", **env).start()
    wait_for(lambda: s.status()["programs"]["trainer"]["state"] == "EXITED", 60, what="the run's end")
    time.sleep(3)
    assert runpod_api.requests == [] and s.proc.poll() is None
    assert s.stop() == 0


@pytest.mark.parametrize("runpod", ["answers", "unreachable"])
def test_a_pod_waiting_in_safe_mode_stops_itself_after_stop_pod_after_s(procs, tmp_path, runpod_api, receiver, runpod):
    """A config error (so the setting is read from its env twin alone): after 2 s in safe mode, the
    notification, then podStop. Unreachable RunPod: logged, and safe mode goes on waiting."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    api = runpod_api.url if runpod == "answers" else dead_url().rsplit("/", 1)[0]
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_GUARD_STOP_POD_AFTER_S": "2", "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url, **on_runpod(api)}
    out = tmp_path / "boot.log"
    with open(out, "wb") as f:
        p = procs.spawn([*PODKIT, "boot"], env=env, stdout=f, stderr=subprocess.STDOUT)
    assert "safe mode (config) for" in receiver.one("pod-stop")["text"]
    if runpod == "answers":
        wait_for(lambda: STOP in runpod_api.calls(), 30, what="the stop")
        assert stop_sent(runpod_api) == {"action": "stop"}
    else:
        wait_for(lambda: "RunPod did not stop pod pod-abc123: RunPod's API at" in out.read_text(), 40,
                 what="the failure logged")
    assert receiver.events() == ["safe-mode", "pod-stop"]
    assert p.poll() is None, "safe mode goes on until RunPod's own stop"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0 and KEY not in out.read_text()


def test_the_maximum_run_time_stops_the_trainer_with_its_checkpoint_then_the_pod(stack_factory, runpod_api, receiver):
    """guard.stop_pod_at (what `podkit deploy --max-runtime` sets) passed: supervisord stops the trainer,
    which checkpoints on its SIGTERM, and only then is the pod stopped, with a notification first."""
    # Far enough ahead that the trainer has stepped (and can checkpoint) on a loaded machine.
    at = int(time.time()) + 25
    s = stack_factory(PODKIT_GUARD_STOP_POD_AT=str(at), PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    s.wait_step(1)
    assert time.time() < at, "the trainer took longer than the test allows to make its first step"
    wait_for(lambda: STOP in runpod_api.calls(), 90, what="the stop")
    assert stop_sent(runpod_api) == {"action": "stop"}
    prog = s.progress()
    assert prog["stopped"]["by"] == "SIGTERM" and prog["checkpoint_step"] == prog["step"] > 0
    assert s.status()["programs"]["trainer"]["state"] == "STOPPED"
    assert receiver.events() == ["pod-stop"]
    assert "maximum run time" in receiver.posts[0]["text"] and f"step {prog['step']}" in receiver.posts[0]["text"]
    assert s.stop() == 0
    assert "stopping the trainer with a checkpoint, then the pod" in s.stdout()


def test_a_pod_in_safe_mode_past_its_maximum_run_time_stops_at_once(procs, tmp_path, runpod_api, receiver):
    """A config error and guard.stop_pod_at already passed (its env twin, read alone): the sooner of the
    two guards wins, and the notification names the maximum run time."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_GUARD_STOP_POD_AT": str(int(time.time()) - 5), "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url,
           **on_runpod(runpod_api.url)}
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert "guard.stop_pod_at, the maximum run time" in receiver.one("pod-stop")["text"]
    wait_for(lambda: STOP in runpod_api.calls(), 30, what="the stop")
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0


def test_when_and_how_a_pod_stops_lives_in_the_cost_guard_alone():
    """The boot, safe mode and the log listener tell the cost guard what happened; none of them decides when
    the pod stops, makes a stop, retries one or says so. Safe mode is told in one object (safemode.Why),
    which holds data only: nothing in it calls back into the boot."""
    import inspect
    import re

    from podkit import boot, safemode
    from podkit.programs import logs

    owner = re.compile(r"Stopper\(|WhenIdle\(|stop_pod\(|stop_pod_notified|RETRY_MAX_S|RETRY_FOR_S|FIRST_RETRY_S|sooner|guardfile\.Live\(.*limits"
                       r"|\.check\(time\.monotonic|pod-stop")
    for module in (boot, safemode, logs):
        found = [line.strip() for line in inspect.getsource(module).splitlines() if owner.search(line)]
        assert found == [], f"{module.__name__} holds stop-pod logic: {found}"
    assert list(inspect.signature(safemode.wait).parameters) == ["why"]
    why = boot._why(None, None, "config", "a broken file", "fix it")
    assert why.guards["stop_pod_after_s"] == 3600.0 and not any(
        callable(v) for k, v in vars(why).items() if k != "retry")
