"""`podkit deploy` and `deploy watch` beyond one data center: a run whose template's env names a checkpoint.remote
needs no network volume, and its replacement pod lands wherever RunPod has the GPUs free, to restore from the
remote at boot. RunPod is the loopback stub of tests/runpod_stub.py (every request held to RunPod's OpenAPI
document), whose data centers fill up on the test's word (`stub.full`); no credential is real, and none is ever
written literally: the template's env carries RunPod secret references only."""

from __future__ import annotations

import json
import threading

import pytest
from test_deploy_watch import Clock, actions, created, podkit_deploy

from podkit import runpod as api
from podkit.deploy import bodies
from podkit.deploy.deployer import Deployer
from podkit.deploy.template import load_template
from podkit.deploy.watch import Watch, one_watch, relauncher
from podkit.errors import PodkitError
from podkit.money import ledger
from runpod_stub import RunPodV2Stub

pytestmark = pytest.mark.timeout(60)
KEY = "rpa_TESTKEY0123456789"
IMAGE = ("--image", "registry.example/podkit:1.0")
REMOTE = "s3://ckpts/runs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "{{ RUNPOD_SECRET_AWS_ACCESS_KEY_ID }}",
               "AWS_SECRET_ACCESS_KEY": "{{ RUNPOD_SECRET_AWS_SECRET_ACCESS_KEY }}",
               "AWS_ENDPOINT_URL": "https://0123abcd.r2.cloudflarestorage.com"}
RUN = "0123456789abcdef"


@pytest.fixture
def runpod_api(monkeypatch, tmp_path):
    stub = RunPodV2Stub(key=KEY)
    monkeypatch.setenv("RUNPOD_API_BASE_URL", stub.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.setenv("PODKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PODKIT_NOTIFY_WEBHOOK_URL", raising=False)
    yield stub
    assert stub.graphql == [] and stub.refused == []
    stub.assert_clean()
    stub.close()


def template(tmp_path, remote: str | None = REMOTE, **env: str) -> str:
    """A template whose env names `remote` and its credentials (references to RunPod secrets), plus `env`."""
    path = tmp_path / "template.yaml"
    extra = {bodies.REMOTE_ENV: remote, **CREDENTIALS} if remote else {}
    path.write_text(json.dumps({"name": "t", "imageName": "registry.example/img", "volumeMountPath": "/workspace",
                                "volumeInGb": 50, "env": {**extra, **env}}))
    return str(path)


def lost_pod(stub: RunPodV2Stub, **kw) -> None:
    """The watched pod: RUNNING in EU-SE-1 on its own pod volume (no network volume), of run RUN."""
    stub.add_pod(id="pod-old", name="podkit-run", image="registry.example/podkit:v2",
                 gpu={"id": "NVIDIA A40", "count": 2}, env={ledger.RUN_ENV: RUN}, **kw)
    stub.new_pod_ids = ["pod-new", "pod-r2", "pod-r3"]


def watch(stub: RunPodV2Stub, tmp_path, cloud: str = "SECURE") -> tuple[Watch, Clock]:
    clock = Clock()
    d = Deployer(api.Client(sleep=clock.sleep), sleep=clock.sleep)
    tpl = load_template(template(tmp_path))
    launch = relauncher(d, tpl, None, cloud, 4, None, capacity_timeout_s=0)
    return Watch(d, "pod-old", launch, remote=REMOTE, clock=clock, lost_after_s=600, start_grace_s=900,
                        poll_s=30, max_relaunches=3, backoff_s=60), clock


def script(stub: RunPodV2Stub, done: threading.Event, steps) -> None:
    """RunPod acting on its own while a command runs: each (call, n, act) acts once `call` was made n times."""
    for call, n, act in steps:
        while stub.calls().count(call) < n:
            if done.wait(0.02):
                return
        act()


def test_deploy_with_a_remote_asks_for_no_volume_and_lands_where_the_gpus_are(runpod_api, tmp_path):
    """EU-SE-1 has no A40 free: the pod body names no data center and no network volume, RunPod's scheduler puts
    it in US-TX-3; its env carries the remote and its credentials as secret references; the output says where
    the checkpoints go and the watch command, which needs no --network-volume."""
    runpod_api.full = {"EU-SE-1"}
    tpl = template(tmp_path)
    r = podkit_deploy(runpod_api, *IMAGE, "--template", tpl, "--gpus", "2", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert "GET /v2/network-volumes" not in runpod_api.calls(), "nothing asks for a volume"
    [body] = [q.body for q in runpod_api.requests if (q.method, q.path) == ("POST", "/v2/pods")]
    assert "dataCenterIds" not in body and body["mounts"] == {"persistent": {"size": 50, "path": "/workspace"}}
    assert body["env"][bodies.REMOTE_ENV] == REMOTE and body["env"]["AWS_SECRET_ACCESS_KEY"] == \
        "{{ RUNPOD_SECRET_AWS_SECRET_ACCESS_KEY }}"
    assert bodies.NETWORK_VOLUME_ENV not in body["env"], "the pod's preflight counts the remote as durable"
    [pod] = [p for p in runpod_api.pods.values()]
    assert pod["dataCenterId"] == "US-TX-3"
    assert f"its checkpoints go to checkpoint.remote {REMOTE} as they are saved (no network volume)" in r.stdout
    assert f"relaunch it when it is lost: podkit deploy watch {pod['id']} --template {tpl}\n" in r.stdout, r.stdout
    assert KEY not in r.stdout + r.stderr


def test_a_dry_run_with_a_remote_says_runpod_places_the_pod_and_shows_only_secret_references(runpod_api, tmp_path):
    r = podkit_deploy(runpod_api, "--dry-run", "--template", template(tmp_path), "--cloud", "COMMUNITY",
                      RUNPOD_API_KEY="")
    assert r.returncode == 0 and runpod_api.requests == [], r.stderr
    assert ("# no network volume: RunPod places the pod in any data center of COMMUNITY cloud with the GPUs; its "
            f"checkpoints go to checkpoint.remote {REMOTE}") in r.stdout
    body = json.loads(r.stdout.split("POST")[-1].split("\n", 1)[1].rsplit("\n#", 1)[0])
    assert "dataCenterIds" not in body and body["cloud"] == "COMMUNITY"
    assert body["env"]["AWS_ACCESS_KEY_ID"] == "{{ RUNPOD_SECRET_AWS_ACCESS_KEY_ID }}"


def test_deploy_without_a_remote_or_a_volume_says_the_checkpoints_die_with_the_pod(runpod_api, tmp_path):
    """Today's deploy on a pod volume: it runs (the pod's preflight warns, or refuses per guard.network_volume),
    and the output names both ways to keep the checkpoints apart from the pod; no watch command is offered."""
    r = podkit_deploy(runpod_api, *IMAGE, "--template", template(tmp_path, remote=None), "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert "its checkpoints live on the pod's own volume" in r.stdout and "--network-volume, or " \
        "PODKIT_CHECKPOINT_REMOTE in the template's env (checkpoint.remote)" in r.stdout
    assert "deploy watch" not in r.stdout


def test_watch_with_a_remote_replaces_a_lost_pod_in_another_data_center(runpod_api, tmp_path):
    """The command end to end, in Community Cloud: the pod's host is removed and its data center has no A40 left;
    the replacement names no data center and no volume, lands in US-TX-3 with the run's id and the remote, and
    the watch says the pod restores from the remote; it ends when that pod stops itself."""
    lost_pod(runpod_api, cloud="COMMUNITY")

    def host_lost():
        runpod_api.full = {"EU-SE-1"}
        runpod_api.vanish("pod-old")

    done = threading.Event()
    t = threading.Thread(target=script, args=(runpod_api, done, [("GET /v2/pods/pod-old", 2, host_lost),
                         ("GET /v2/pods/pod-new", 3, lambda: runpod_api.set_status("pod-new", "EXITED"))]), daemon=True)
    t.start()
    try:
        r = podkit_deploy(runpod_api, "watch", "pod-old", "--template", template(tmp_path), "--cloud", "COMMUNITY",
                          "--poll", "0.1", PODKIT_CACHE_DIR=str(tmp_path / "cache"))
    finally:
        done.set()
        t.join(5)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"in any data center of COMMUNITY cloud with the GPUs, each restoring from checkpoint.remote {REMOTE}" in out
    assert ("replacement 1 of 3 is pod pod-new in data center US-TX-3, restoring the newest whole checkpoint from "
            f"checkpoint.remote {REMOTE} at its boot") in out and "watch ends" in out
    assert "GET /v2/network-volumes" not in runpod_api.calls()
    [new] = created(runpod_api)
    assert "dataCenterIds" not in new and "network" not in new["mounts"] and new["cloud"] == "COMMUNITY"
    assert new["env"][ledger.RUN_ENV] == RUN and new["env"][bodies.REMOTE_ENV] == REMOTE
    assert new["gpu"]["count"] == 2 and new["image"] == "registry.example/podkit:v2"
    assert runpod_api.pod("pod-new")["dataCenterId"] == "US-TX-3" and KEY not in out


def test_without_a_volume_a_live_pod_of_the_run_elsewhere_is_followed_not_doubled(runpod_api, tmp_path):
    """Another watch already replaced the lost pod in CA-MTL-1: the run is told by its run id, so that pod is
    followed and nothing is created; a pod of the same name but another run is neither followed nor touched."""
    lost_pod(runpod_api)
    runpod_api.add_pod(id="pod-alien", name="podkit-run", env={ledger.RUN_ENV: "fedcba9876543210"})
    w, clock = watch(runpod_api, tmp_path)
    clock.events = {1: lambda: (runpod_api.vanish("pod-old"),
                                runpod_api.add_pod(id="pod-other", name="podkit-run", env={ledger.RUN_ENV: RUN},
                                                   dataCenterId="CA-MTL-1")),
                    6: lambda: runpod_api.set_status("pod-other", "EXITED")}
    assert w.run() == 0
    assert w.pod_id == "pod-other" and created(runpod_api) == [] and w.relaunches == 0
    assert actions(runpod_api) == [] and runpod_api.pod("pod-alien")["status"] == "RUNNING"


def test_without_a_volume_a_second_replacement_of_the_run_is_ended(runpod_api, tmp_path):
    """Two watches that found the run lost at once each start a pod, in different data centers: the one started
    later is terminated while it is still starting, and its watch follows the first."""
    lost_pod(runpod_api)
    w, clock = watch(runpod_api, tmp_path)
    real = w.launch

    def launch(carry):
        runpod_api.add_pod(id="pod-rival", name="podkit-run", status="PROVISIONING", dataCenterId="CA-MTL-1",
                           env={ledger.RUN_ENV: RUN}, createdAt="2020-01-01T00:00:00Z")
        return real(carry)

    w.launch = launch
    clock.events = {1: lambda: runpod_api.vanish("pod-old"), 6: lambda: runpod_api.set_status("pod-rival", "EXITED")}
    assert w.run() == 0
    assert w.pod_id == "pod-rival" and ("pod-new", "terminate") in actions(runpod_api)


def test_without_a_volume_a_lost_pod_that_could_not_be_stopped_is_stopped_when_it_runs_again(runpod_api, tmp_path):
    """Its host went down, so the stop before the replacement fails; no workspace lease stands between two pods
    that do not share a volume, so when the host comes back and the old pod runs again, the watch stops it."""
    lost_pod(runpod_api)
    runpod_api.fail("POST", "/v2/pods/pod-old/action", 502, times=None)
    w, clock = watch(runpod_api, tmp_path)

    def host_back():
        runpod_api.faults.clear()
        runpod_api.set_status("pod-old", "RUNNING")

    clock.events = {1: lambda: runpod_api.hold("pod-old", "STARTING"), 45: host_back,
                    60: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert w.pod_id == "pod-new" and len(created(runpod_api)) == 1
    assert set(actions(runpod_api)) == {("pod-old", "stop")} and runpod_api.pod("pod-old")["status"] == "EXITED"
    assert w.unstopped == set()


def test_watch_without_a_volume_or_a_remote_is_refused_naming_both(runpod_api, tmp_path):
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--template", template(tmp_path, remote=None))
    assert r.returncode == 2 and "Traceback" not in r.stderr and runpod_api.requests == []
    assert "--network-volume: a replacement pod resumes from the run's network volume or its checkpoint.remote, " \
        "and neither was named" in r.stderr and "PODKIT_CHECKPOINT_REMOTE (s3://bucket/prefix)" in r.stderr


def test_watch_without_a_volume_refuses_a_pod_without_a_run_id(runpod_api, tmp_path):
    """A pod podkit deploy did not make has no PODKIT_RUN_ID: with no volume, nothing would tell its replacements
    from a stranger's pods, so the watch refuses it (exit 1) before it follows anything."""
    runpod_api.add_pod(id="pod-old", name="podkit-run")
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--template", template(tmp_path))
    assert r.returncode == 1 and "pod pod-old has no run id (PODKIT_RUN_ID in its env)" in r.stderr, r.stderr
    assert "--network-volume" in r.stderr and created(runpod_api) == [] and "Traceback" not in r.stderr


@pytest.mark.parametrize("remote, env, says", [
    (REMOTE, {"AWS_SECRET_ACCESS_KEY": ""}, "env.AWS_SECRET_ACCESS_KEY: missing: PODKIT_CHECKPOINT_REMOTE "
     f"'{REMOTE}' needs it on the pod"),
    ("r2:ckpts/runs", {}, "env.RCLONE_CONFIG_R2_TYPE: missing"),
    ("https://bucket.example/x", {}, "env.PODKIT_CHECKPOINT_REMOTE: 'https://bucket.example/x' is neither "
     "s3://bucket/prefix nor an rclone remote name:path"),
    (REMOTE, {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCY0EXAMPLEKEY"},
     "env.AWS_SECRET_ACCESS_KEY: looks like a literal secret"),
])
@pytest.mark.parametrize("verb", [(), ("watch", "pod-old")])
def test_a_remote_the_pod_could_not_use_is_refused_before_anything_is_sent(runpod_api, tmp_path, remote, env, says,
                                                                           verb):
    """A remote without its credentials, or not a remote at all, would leave a pod without a volume nowhere
    durable to put its checkpoints: exit 2 naming the template's setting, with a hint, and no request sent; a
    literal secret is refused as ever, and never shown."""
    r = podkit_deploy(runpod_api, *verb, *IMAGE, "--template", template(tmp_path, remote, **env))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert runpod_api.requests == [] and "wJalrXUtnFEMI" not in r.stderr


def test_an_rclone_remote_configured_in_the_template_env_is_accepted(tmp_path):
    tpl = load_template(template(tmp_path, "r2:ckpts/runs", RCLONE_CONFIG_R2_TYPE="s3"))
    assert bodies.checkpoint_remote(tpl, "t.yaml") == "r2:ckpts/runs"


def test_one_watch_per_run_without_a_volume_goes_by_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("PODKIT_CACHE_DIR", str(tmp_path))
    with one_watch(f"run-{RUN}", f"{RUN} (no network volume)"):
        with pytest.raises(PodkitError) as e, one_watch(f"run-{RUN}", f"{RUN} (no network volume)"):
            pass
        with one_watch("run-fedcba9876543210"):
            pass  # another run's watch is its own
    assert f"follows the run {RUN} (no network volume): one watch per run" in e.value.message
