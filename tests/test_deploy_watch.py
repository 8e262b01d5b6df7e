"""`podkit deploy watch`: a lost pod is replaced on its network volume, against the local endpoint of
test_deploy.py that answers as RunPod does (the real runpod SDK sends every request; each is parsed with
graphql-core). The pod's answers are scripted per poll; the watch runs in-process on a fake clock, and
once end to end as a command with a loopback webhook receiver."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT
from podkit import deploy
from test_deploy import KEY, FakeRunPod
from test_notify import Receiver

pytestmark = pytest.mark.timeout(60)
VOLUME = "vol-ckpt1"
PORTS = {"ports": [{"ip": "203.0.113.7", "isIpPublic": True, "privatePort": 22, "publicPort": 22022, "type": "tcp"}]}


def pod(pod_id: str, status: str = "RUNNING", gpus: int = 4, up: bool = True, pod_type: str = "RESERVED",
        env: tuple[str, ...] = (), image: str = "registry.example/podkit:v2") -> dict:
    return {"id": pod_id, "name": "podkit-run", "desiredStatus": status, "gpuCount": gpus, "podType": pod_type,
            "env": list(env), "imageName": image, "runtime": PORTS if up else None}


class Clock:
    """The watch's clock and sleep: sleeping moves the clock on."""

    def __init__(self) -> None:
        self.t, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


@pytest.fixture
def runpod_api(monkeypatch):
    fake = FakeRunPod()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", fake.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.delenv("PODKIT_NOTIFY_WEBHOOK_URL", raising=False)
    yield fake
    fake.close()


def watch(api: FakeRunPod, pod_id: str = "pod-old", **kw) -> tuple[deploy.Watch, Clock]:
    clock = Clock()
    d = deploy.Deployer(sleep=clock.sleep)
    tpl = deploy.load_template(ROOT / "runpod" / "template.yaml")
    launch = deploy.relauncher(d, tpl, d.network_volume(VOLUME), "SECURE", 4, None, capacity_timeout_s=0)
    opts = dict(lost_after_s=600, start_grace_s=900, poll_s=30, max_relaunches=3, backoff_s=60) | kw
    return deploy.Watch(d, pod_id, launch, clock=clock, **opts), clock


def created(api: FakeRunPod) -> list[dict]:
    return [r[1]["input"] for r in api.requests if r[0] == "podFindAndDeployOnDemand"]


def test_a_pod_gone_is_replaced_on_its_network_volume_and_followed_to_its_finish(runpod_api):
    """RUNNING, then no such pod (host removed): one replacement on the same network volume, in its data
    center, with the lost pod's GPU count and maximum run time; the replacement's own stop ends the watch."""
    stop_at = f"{deploy.STOP_AT_ENV}={int(time.time()) + 3600}"
    runpod_api.script["pod-old"] = [pod("pod-old", gpus=2, env=(stop_at, "HF_TOKEN=x")), None]
    runpod_api.new_pod_ids = ["pod-new"]
    runpod_api.script["pod-new"] = [pod("pod-new", "RUNNING", up=False), pod("pod-new", gpus=2), pod("pod-new", "EXITED")]
    w, _ = watch(runpod_api)
    assert w.run() == 0
    [new] = created(runpod_api)
    assert (new["networkVolumeId"], new["dataCenterId"], new["volumeInGb"]) == (VOLUME, "EU-SE-1", 0)
    assert new["gpuCount"] == 2 and new["volumeMountPath"] == "/workspace" and new["name"] == "podkit-run"
    assert new["imageName"] == "registry.example/podkit:v2", "the lost pod's image, not the template's default"
    env = {e["key"]: e["value"] for e in new["env"]}
    assert env[deploy.STOP_AT_ENV] == stop_at.split("=")[1] and env["PODKIT_CONFIG"].endswith("a40-2gpu.yaml")
    assert env["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}", "secrets come from the template, never the old pod"
    assert "podStop" not in runpod_api.fields(), "nothing to stop: the pod is gone"
    assert w.pod_id == "pod-new" and w.relaunches == 1


def test_an_unreachable_pod_is_stopped_before_its_replacement_starts(runpod_api):
    """RUNNING without a runtime for lost_after_s (its host went down): podStop first, so that it cannot
    come back and train beside its replacement; the replacement pulling its image is not lost too soon."""
    runpod_api.script["pod-old"] = [pod("pod-old"), pod("pod-old", up=False)]
    runpod_api.new_pod_ids = ["pod-new"]
    runpod_api.script["pod-new"] = [pod("pod-new", up=False)] * 15 + [pod("pod-new"), pod("pod-new", "EXITED")]
    w, clock = watch(runpod_api, lost_after_s=600, poll_s=30)
    assert w.run() == 0
    fields = [f for f in runpod_api.fields() if f in ("podStop", "podFindAndDeployOnDemand")]
    assert fields == ["podStop", "podFindAndDeployOnDemand"]
    assert runpod_api.sent("podStop")["input"]["podId"] == "pod-old"
    assert w.relaunches == 1, "15 polls (450 s) without a runtime is a replacement starting, not lost"


def test_zero_gpus_after_a_restart_is_a_lost_pod_replaced_with_its_gpus(runpod_api):
    runpod_api.script["pod-old"] = [pod("pod-old", gpus=2), pod("pod-old", gpus=0)]
    runpod_api.new_pod_ids = ["pod-new"]
    runpod_api.script["pod-new"] = [pod("pod-new", "EXITED")]
    w, _ = watch(runpod_api)
    assert w.run() == 0
    assert created(runpod_api)[0]["gpuCount"] == 2
    assert runpod_api.sent("podStop")["input"]["podId"] == "pod-old"


@pytest.mark.parametrize("pod_type", ["RESERVED", "INTERRUPTABLE"])
def test_an_exited_pod_is_replaced_only_when_an_interruptible_rental_lost_it(runpod_api, pod_type):
    """An on-demand pod is EXITED only on request (its cost guard when training finished, or a person):
    left stopped. An interruptible one is also EXITED when it is reclaimed: replaced."""
    runpod_api.script["pod-old"] = [pod("pod-old", pod_type=pod_type), pod("pod-old", "EXITED", pod_type=pod_type)]
    runpod_api.script["pod-abc123"] = [pod("pod-abc123", "EXITED")]
    w, _ = watch(runpod_api)
    assert w.run() == 0
    assert len(created(runpod_api)) == (1 if pod_type == "INTERRUPTABLE" else 0)
    assert "podStop" not in runpod_api.fields()


def test_an_api_outage_is_waited_out_not_taken_for_a_lost_pod(runpod_api):
    """RunPod's API answering 502 (then JSON without data) for longer than lost_after_s, and once "no
    such pod", say nothing about a pod that then answers RUNNING."""
    runpod_api.script["pod-old"] = [pod("pod-old"), None, pod("pod-old"), pod("pod-old", "EXITED")]
    w, clock = watch(runpod_api, lost_after_s=60, start_grace_s=0, poll_s=30)
    real, calls = w.d.runpod.get_pod, []

    def get_pod(pod_id):
        calls.append(pod_id)
        if len(calls) == 2:
            runpod_api.outage = 6  # from the second question on, six 502s
        if len(calls) == 9:
            raise KeyError("data")  # then an answer without data (a rate limit's JSON)
        return real(pod_id)

    w.d.runpod = type("SDK", (), {"get_pod": staticmethod(get_pod), "stop_pod": staticmethod(w.d.runpod.stop_pod)})
    assert w.run() == 0
    assert runpod_api.fields().count("(outage)") == 6 and created(runpod_api) == []
    assert "podStop" not in runpod_api.fields() and clock.t >= 200


def test_replacements_back_off_and_end_at_the_maximum(runpod_api, monkeypatch):
    """Each replacement is gone at once: attempts 2 and 3 wait 60 then 120 s; then the watch gives up
    (exit 1), with a notification for each replacement and one for giving up."""
    receiver = Receiver()
    monkeypatch.setenv("PODKIT_NOTIFY_WEBHOOK_URL", receiver.url)
    try:
        runpod_api.script["pod-old"] = [pod("pod-old", env=(f"{deploy.STOP_AT_ENV}=4102444800",)), None]
        runpod_api.new_pod_ids = ["pod-r1", "pod-r2", "pod-r3"]
        for r in runpod_api.new_pod_ids:
            runpod_api.script[r] = [None]
        w, clock = watch(runpod_api, max_relaunches=3, backoff_s=60)
        assert w.run() == 1
        assert len(created(runpod_api)) == 3 and w.pod_id == "pod-r3"
        assert [s for s in clock.slept if s >= 60] == [60, 120]
        assert receiver.events() == ["relaunch"] * 3 + ["relaunch-gave-up"]
        assert "replacement 1 of 3 is pod pod-r1" in receiver.posts[0]["text"]
        assert "giving up" in receiver.posts[3]["text"]
        for new in created(runpod_api):  # the second and third keep what the first pod had, too
            env = {e["key"]: e["value"] for e in new["env"]}
            assert new["name"] == "podkit-run" and new["imageName"] == "registry.example/podkit:v2"
            assert env[deploy.STOP_AT_ENV] == "4102444800"
    finally:
        receiver.close()


def test_a_replacement_refused_for_capacity_is_tried_again_as_the_next_attempt(runpod_api):
    runpod_api.script["pod-old"] = [None]
    runpod_api.capacity_failures = 1
    runpod_api.new_pod_ids = ["pod-new"]
    runpod_api.script["pod-new"] = [pod("pod-new", "EXITED")]
    w, clock = watch(runpod_api)
    assert w.run() == 0
    assert runpod_api.fields().count("podFindAndDeployOnDemand") == 2 and w.relaunches == 2
    assert 60 in clock.slept


def podkit_deploy(fake: FakeRunPod, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
           **env}
    return subprocess.run([sys.executable, "-m", "podkit", "deploy", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_watch_as_a_command_replaces_a_gone_pod_and_notifies(runpod_api):
    receiver = Receiver()
    try:
        runpod_api.script["pod-old"] = [pod("pod-old"), None]
        runpod_api.new_pod_ids = ["pod-new"]
        runpod_api.script["pod-new"] = [pod("pod-new"), pod("pod-new", "EXITED")]
        r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, "--poll", "0.1",
                          PODKIT_NOTIFY_WEBHOOK_URL=receiver.url)
        assert r.returncode == 0, r.stderr
        out = r.stdout + r.stderr
        assert "replacement 1 of 3 is pod pod-new" in out and "watch ends" in out
        assert receiver.events() == ["relaunch"] and KEY not in r.stdout + r.stderr
    finally:
        receiver.close()


def test_watch_without_a_network_volume_or_with_an_unknown_one_is_refused(runpod_api):
    r = podkit_deploy(runpod_api, "watch", "pod-old")
    assert r.returncode == 2 and "--network-volume" in r.stderr and "Traceback" not in r.stderr
    assert runpod_api.requests == []
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", "vol-nope")
    assert r.returncode == 1 and "no network volume 'vol-nope'" in r.stderr and VOLUME in r.stderr
    assert "podFindAndDeployOnDemand" not in runpod_api.fields()


def test_deploy_on_a_network_volume_with_a_maximum_run_time(runpod_api):
    """--network-volume mounts it at /workspace in its data center; --max-runtime 12h becomes the pod's
    guard.stop_pod_at; a bad duration is refused before anything is sent."""
    before = time.time()
    r = podkit_deploy(runpod_api, "--network-volume", VOLUME, "--max-runtime", "12h", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    new = runpod_api.sent("podFindAndDeployOnDemand")["input"]
    assert (new["networkVolumeId"], new["dataCenterId"], new["volumeMountPath"]) == (VOLUME, "EU-SE-1", "/workspace")
    at = float({e["key"]: e["value"] for e in new["env"]}[deploy.STOP_AT_ENV])
    assert before + 12 * 3600 - 1 <= at <= time.time() + 12 * 3600
    assert f"podkit deploy watch pod-abc123 --network-volume {VOLUME}" in r.stdout
    runpod_api.requests.clear()
    r = podkit_deploy(runpod_api, "--max-runtime", "soon")
    assert r.returncode == 2 and "--max-runtime: 'soon' is not a duration" in r.stderr and runpod_api.requests == []


def test_a_pod_lost_while_not_running_is_stopped_too(runpod_api):
    """Lost while RunPod still restarts it: it is stopped before its replacement starts."""
    runpod_api.script["pod-old"] = [pod("pod-old"), pod("pod-old", "RESTARTING", up=False)]
    runpod_api.new_pod_ids = ["pod-new"]
    runpod_api.script["pod-new"] = [pod("pod-new", "EXITED")]
    w, _ = watch(runpod_api)
    assert w.run() == 0
    assert runpod_api.sent("podStop")["input"]["podId"] == "pod-old" and len(created(runpod_api)) == 1


def test_a_running_pod_without_exposed_ports_is_running(runpod_api):
    """A template with no ports: RunPod's runtime is there, its port list empty; never lost for it."""
    idle = dict(pod("pod-old"), runtime={"ports": []})
    runpod_api.script["pod-old"] = [idle] * 60 + [pod("pod-old", "EXITED")]
    w, clock = watch(runpod_api, lost_after_s=600, start_grace_s=0)
    assert w.run() == 0 and created(runpod_api) == [] and "podStop" not in runpod_api.fields()
    assert clock.t >= 1500


def test_no_replacement_once_the_maximum_run_time_has_passed(runpod_api, monkeypatch):
    receiver = Receiver()
    monkeypatch.setenv("PODKIT_NOTIFY_WEBHOOK_URL", receiver.url)
    try:
        past = f"{deploy.STOP_AT_ENV}={int(time.time()) - 60}"
        runpod_api.script["pod-old"] = [pod("pod-old", env=(past,)), None]
        w, _ = watch(runpod_api)
        assert w.run() == 0 and created(runpod_api) == []
        assert receiver.events() == ["relaunch-gave-up"] and "maximum run time has passed" in receiver.posts[0]["text"]
    finally:
        receiver.close()


def test_a_mistyped_pod_id_is_refused_before_anything_is_replaced(runpod_api):
    runpod_api.script["pod-typo"] = [None]
    r = podkit_deploy(runpod_api, "watch", "pod-typo", "--network-volume", VOLUME, "--poll", "0.1")
    assert r.returncode == 1 and "RunPod knows no pod 'pod-typo'" in r.stderr
    assert "podFindAndDeployOnDemand" not in runpod_api.fields() and "podStop" not in runpod_api.fields()
    r = podkit_deploy(runpod_api, "watch", 'x" } ) { injected', "--network-volume", VOLUME)
    assert r.returncode == 2 and "is not a RunPod pod id" in r.stderr


def test_a_stop_pod_at_that_reads_as_a_duration_is_a_config_error():
    from podkit import config
    from podkit.errors import ConfigError

    with pytest.raises(ConfigError, match="guard.stop_pod_at: 43200 is a Unix time in 1970-2001"):
        config.load(None, environ={"PODKIT_GUARD_STOP_POD_AT": "43200"})
    assert config.load(None, environ={"PODKIT_GUARD_STOP_POD_AT": "4102444800"}).guard.stop_pod_at == 4102444800


def test_graphql_errors_a_few_times_are_waited_out_and_for_good_end_the_watch(runpod_api):
    """RunPod refusing the question now and then is not a lost pod; refusing it ten times in a row
    ends the watch with the error (exit 1 from the command), nothing replaced."""
    runpod_api.script["pod-old"] = [pod("pod-old"), "Something went wrong", "Something went wrong",
                                    pod("pod-old"), pod("pod-old", "EXITED")]
    w, _ = watch(runpod_api)
    assert w.run() == 0 and created(runpod_api) == []
    runpod_api.script["pod-old"] = [pod("pod-old"), "Something went wrong"]
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, "--poll", "0.05")
    assert r.returncode == 1 and "RunPod refused 10 questions in a row about pod pod-old" in r.stderr
    assert "Traceback" not in r.stderr and "podFindAndDeployOnDemand" not in runpod_api.fields()
