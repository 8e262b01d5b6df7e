"""`podkit deploy watch`: a lost pod is replaced on its network volume, never beside another pod on it.
RunPod is the loopback stub of tests/runpod_stub.py (REST API v2, every request held to RunPod's OpenAPI
document); what RunPod does on its own (a host lost, a migration, an outage) is scripted on the watch's
fake clock, and once end to end as a command with a loopback webhook receiver."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from podkit import runpod as api
from podkit.deploy.bodies import STOP_AT_ENV
from podkit.deploy.deployer import Deployer
from podkit.deploy.pods import created_order
from podkit.deploy.template import load_template
from podkit.deploy.watch import Watch, relauncher
from podkit.errors import PodkitError
from runpod_stub import MISSING, RunPodV2Stub
from webhook import Receiver

pytestmark = pytest.mark.timeout(60)
KEY = "rpa_TESTKEY0123456789"
VOLUME = "vol-ckpt1"  # the stub's volume, in EU-SE-1
A40 = {"id": "NVIDIA A40", "count": 4}


class Clock:
    """The watch's clock and sleep: sleeping moves the clock on, and runs what the test scheduled for
    after that many sleeps (RunPod acting on its own between two questions)."""

    def __init__(self) -> None:
        self.t, self.slept, self.events = 0.0, [], {}

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s
        if fn := self.events.pop(len(self.slept), None):
            fn()


@pytest.fixture
def runpod_api(monkeypatch):
    stub = RunPodV2Stub(key=KEY)
    monkeypatch.setenv("RUNPOD_API_BASE_URL", stub.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.delenv("PODKIT_NOTIFY_WEBHOOK_URL", raising=False)
    yield stub
    assert stub.graphql == [] and stub.refused == []
    stub.assert_clean()
    stub.close()


def old_pod(stub: RunPodV2Stub, gpus: int = 4, env: dict | None = None, **kw) -> str:
    """The watched pod: RUNNING on the run's network volume; replacements get the ids pod-new, pod-r2..."""
    pod = stub.add_pod(volume=VOLUME, id="pod-old", name="podkit-run", image="registry.example/podkit:v2",
                       gpu={"id": "NVIDIA A40", "count": gpus}, env=env or {}, **kw)
    stub.new_pod_ids = ["pod-new", "pod-r2", "pod-r3"]
    return pod["id"]


def watch(stub: RunPodV2Stub, pod_id: str = "pod-old", launch=None, **kw) -> tuple[Watch, Clock]:
    clock = Clock()
    d = Deployer(api.Client(sleep=clock.sleep), sleep=clock.sleep)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    launch = launch or relauncher(d, tpl, d.network_volume(VOLUME), "SECURE", 4, None, capacity_timeout_s=0)
    opts = dict(volume_id=VOLUME, lost_after_s=600, start_grace_s=900, poll_s=30, max_relaunches=3, backoff_s=60) | kw
    return Watch(d, pod_id, launch, clock=clock, **opts), clock


def created(stub: RunPodV2Stub) -> list[dict]:
    return [r.body for r in stub.requests if (r.method, r.path) == ("POST", "/v2/pods")]


def actions(stub: RunPodV2Stub) -> list[tuple[str, str]]:
    return [(r.path.split("/")[3], r.body["action"]) for r in stub.requests if r.path.endswith("/action")]


def test_a_pod_gone_is_replaced_on_its_network_volume_and_followed_to_its_finish(runpod_api):
    """RUNNING, then no such pod (host removed): one replacement on the same network volume, in its data
    center, with the lost pod's GPU count, image and maximum run time; its own stop ends the watch."""
    at = str(int(time.time()) + 3600)
    old_pod(runpod_api, gpus=2, env={STOP_AT_ENV: at, "HF_TOKEN": "x"})
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.vanish("pod-old"), 8: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    [new] = created(runpod_api)
    assert new["mounts"] == {"network": [{"volumeId": VOLUME, "path": "/workspace"}]}
    assert new["dataCenterIds"] == ["EU-SE-1"] and new["gpu"]["count"] == 2 and new["name"] == "podkit-run"
    assert new["image"] == "registry.example/podkit:v2", "the lost pod's image, not the template's default"
    assert new["env"][STOP_AT_ENV] == at and new["env"]["PODKIT_CONFIG"].endswith("a40-2gpu.yaml")
    assert new["env"]["HF_TOKEN"] == "{{ RUNPOD_SECRET_HF_TOKEN }}", "secrets come from the template, never the old pod"
    assert actions(runpod_api) == [], "nothing to stop: the pod is gone"
    assert w.pod_id == "pod-new" and w.relaunches == 1


def test_an_unreachable_pod_is_stopped_before_its_replacement_starts(runpod_api):
    """Not running for lost_after_s (its host went down): stopped first, so that it cannot come back and
    train beside its replacement; the replacement pulling its image for 450 s is not lost too soon."""
    old_pod(runpod_api)
    runpod_api.polls_until_running = 16
    w, clock = watch(runpod_api, lost_after_s=600, poll_s=30)
    clock.events = {1: lambda: runpod_api.hold("pod-old", "STARTING"),
                    60: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert actions(runpod_api) == [("pod-old", "stop")] and len(created(runpod_api)) == 1
    assert w.relaunches == 1 and w.pod_id == "pod-new"


def test_zero_gpus_after_a_restart_is_a_lost_pod_replaced_with_its_gpus(runpod_api):
    old_pod(runpod_api, gpus=2)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.lose_gpus("pod-old"), 4: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert created(runpod_api)[0]["gpu"]["count"] == 2 and actions(runpod_api) == [("pod-old", "stop")]


@pytest.mark.parametrize("status, replaced", [("EXITED", False), ("ERROR", True), ("TERMINATED", True)])
def test_a_stopped_pod_ends_the_watch_and_one_in_error_or_terminated_is_replaced(runpod_api, status, replaced):
    """EXITED is a stop on request (its cost guard, or a person): left stopped; v2 has no interruptible
    pods, so nothing else stops one. ERROR and TERMINATED are lost."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.set_status("pod-old", status),
                    5: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert len(created(runpod_api)) == int(replaced)
    assert actions(runpod_api) == ([("pod-old", "stop")] if status == "ERROR" else [])


def test_a_migrated_pod_is_followed_not_replaced(runpod_api):
    """RunPod migrated the stopped pod's volume to a new pod (new id, new IP): the old id is gone, the new
    pod runs on the run's network volume. The watch follows it; a replacement would be a second pod."""
    receiver = Receiver()
    try:
        old_pod(runpod_api)
        w, clock = watch(runpod_api, state_dir=None)
        w.notify = lambda event, text: receiver.posts.append({"event": event, "text": text})
        moved = {}
        clock.events = {1: lambda: moved.setdefault("id", runpod_api.migrate("pod-old")),
                        6: lambda: runpod_api.set_status(moved["id"], "EXITED")}
        assert w.run() == 0
        assert created(runpod_api) == [] and w.pod_id == moved["id"] and w.relaunches == 0
        assert "RunPod migrated the pod" in receiver.posts[0]["text"]
    finally:
        receiver.close()


def test_a_second_watch_follows_the_first_ones_replacement(runpod_api):
    """Two watches on one run: the first replaced the lost pod; the second, seeing it gone too, finds the
    replacement on the volume and follows it instead of starting a third pod."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)

    def first_watch_replaced():
        runpod_api.vanish("pod-old")
        runpod_api.add_pod(volume=VOLUME, id="pod-other", name="podkit-run", status="PROVISIONING")

    clock.events = {1: first_watch_replaced, 8: lambda: runpod_api.set_status("pod-other", "EXITED")}
    assert w.run() == 0
    assert created(runpod_api) == [] and w.pod_id == "pod-other"


def test_pods_that_cannot_be_listed_hold_the_replacement_back(runpod_api):
    """Lost, but the account's pods cannot be listed (a 503 through every retry): no replacement until
    the watch can see that none is on the volume."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: (runpod_api.vanish("pod-old"), runpod_api.fail("GET", "/v2/pods", 503, times=5)),
                    20: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert len(created(runpod_api)) == 1
    t_unsure = runpod_api.calls().index("GET /v2/pods")
    assert runpod_api.calls()[t_unsure:t_unsure + 5] == ["GET /v2/pods"] * 5


def test_an_api_outage_is_waited_out_not_taken_for_a_lost_pod(runpod_api):
    """RunPod's API answering 502 for longer than lost_after_s, then a page that is not JSON, then once
    "no such pod", says nothing about a pod that then answers RUNNING."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api, lost_after_s=60, start_grace_s=0, poll_s=30)

    def outage():
        runpod_api.fail("GET", "/v2/pods/pod-old", 502, times=15, body=b"Bad Gateway")
        runpod_api.fail("GET", "/v2/pods/pod-old", 200, times=1, body=b"<html>maintenance</html>")
        runpod_api.fail("GET", "/v2/pods/pod-old", 404, times=1)

    clock.events = {1: outage}
    n = {"asks": 0}
    real = w.ask

    def ask():
        n["asks"] += 1
        if n["asks"] == 9:
            runpod_api.set_status("pod-old", "EXITED")
        return real()

    w.ask = ask
    assert w.run() == 0
    assert created(runpod_api) == [] and actions(runpod_api) == [] and clock.t >= 200


def test_replacements_back_off_and_end_at_the_maximum(runpod_api, monkeypatch):
    """Each replacement is gone at once: attempts 2 and 3 wait 60 then 120 s; then the watch gives up
    (exit 1), with a notification for each replacement and one for giving up."""
    receiver = Receiver()
    monkeypatch.setenv("PODKIT_NOTIFY_WEBHOOK_URL", receiver.url)
    try:
        old_pod(runpod_api, env={STOP_AT_ENV: "4102444800"})
        clock = Clock()
        d = Deployer(api.Client(sleep=clock.sleep), sleep=clock.sleep)
        tpl = load_template(ROOT / "runpod" / "template.yaml")
        real = relauncher(d, tpl, d.network_volume(VOLUME), "SECURE", 4, None, capacity_timeout_s=0)

        def launch(carry):
            pod = real(carry)
            runpod_api.vanish(pod["id"])  # its host is lost at once
            return pod

        w = Watch(d, "pod-old", launch, volume_id=VOLUME, clock=clock, max_relaunches=3, backoff_s=60)
        clock.events = {1: lambda: runpod_api.vanish("pod-old")}
        assert w.run() == 1
        assert len(created(runpod_api)) == 3 and w.pod_id == "pod-r3"
        assert [s for s in clock.slept if s >= 60] == [60, 120]
        assert receiver.events() == ["relaunch"] * 3 + ["relaunch-gave-up"]
        assert "replacement 1 of 3 is pod pod-new" in receiver.posts[0]["text"]
        assert "giving up" in receiver.posts[3]["text"]
        for new in created(runpod_api):  # the second and third keep what the first pod had, too
            assert new["name"] == "podkit-run" and new["image"] == "registry.example/podkit:v2"
            assert new["env"][STOP_AT_ENV] == "4102444800"
    finally:
        receiver.close()


def test_a_replacement_refused_for_capacity_is_tried_again_as_the_next_attempt(runpod_api):
    old_pod(runpod_api)
    runpod_api.capacity_failures = 1
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.vanish("pod-old"), 9: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    assert len(created(runpod_api)) == 2 and w.relaunches == 2 and 60 in clock.slept


def podkit_deploy(stub: RunPodV2Stub, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {"RUNPOD_API_BASE_URL": stub.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
           "PODKIT_CACHE_DIR": stub.cache_dir, **env}
    return subprocess.run([sys.executable, "-m", "podkit", "deploy", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_watch_as_a_command_replaces_a_gone_pod_and_notifies(runpod_api):
    """The command end to end: the pod vanishes while watched; the replacement runs, then stops itself."""
    receiver = Receiver()
    old_pod(runpod_api)
    done = threading.Event()

    def runpod_acts():
        while not done.is_set() and runpod_api.calls().count("GET /v2/pods/pod-old") < 2:
            time.sleep(0.02)
        runpod_api.vanish("pod-old")
        while not done.is_set() and runpod_api.calls().count("GET /v2/pods/pod-new") < 3:
            time.sleep(0.02)
        if not done.is_set():
            runpod_api.set_status("pod-new", "EXITED")

    t = threading.Thread(target=runpod_acts, daemon=True)
    t.start()
    try:
        r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, "--poll", "0.1",
                          PODKIT_NOTIFY_WEBHOOK_URL=receiver.url)
        assert r.returncode == 0, r.stderr
        out = r.stdout + r.stderr
        assert "replacement 1 of 3 is pod pod-new" in out and "watch ends" in out
        assert receiver.events() == ["relaunch"] and KEY not in out
    finally:
        done.set()
        t.join(5)
        receiver.close()


def test_watch_without_a_network_volume_or_with_an_unknown_one_is_refused(runpod_api):
    r = podkit_deploy(runpod_api, "watch", "pod-old")
    assert r.returncode == 2 and "--network-volume" in r.stderr and "Traceback" not in r.stderr
    assert runpod_api.requests == []
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", "vol-nope")
    assert r.returncode == 1 and "no network volume 'vol-nope'" in r.stderr and VOLUME in r.stderr
    assert created(runpod_api) == []


def test_a_watch_whose_replacements_would_run_a_local_image_is_refused(runpod_api):
    """--image names the replacements' image: one no RunPod host can pull (a local tag) is refused up front."""
    old_pod(runpod_api)
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, "--image", "podkit:dev")
    assert r.returncode == 2 and "--image: 'podkit:dev' names no registry" in r.stderr and "Traceback" not in r.stderr
    assert runpod_api.requests == []


def test_deploy_on_a_network_volume_with_a_maximum_run_time(runpod_api):
    """--network-volume mounts it at /workspace in its data center; --max-runtime 12h becomes the pod's
    guard.stop_pod_at; a bad duration is refused before anything is sent."""
    before = time.time()
    runpod_api.new_pod_ids = ["pod-abc123"]
    r = podkit_deploy(runpod_api, "--network-volume", VOLUME, "--max-runtime", "12h", "--image", "registry.example/podkit:1.0",
                      "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    [new] = created(runpod_api)
    assert new["mounts"] == {"network": [{"volumeId": VOLUME, "path": "/workspace"}]}
    assert new["dataCenterIds"] == ["EU-SE-1"] and new["env"]["PODKIT_GUARD_NETWORK_VOLUME"] == "refuse"
    at = float(new["env"][STOP_AT_ENV])
    assert before + 12 * 3600 - 1 <= at <= time.time() + 12 * 3600
    assert f"podkit deploy watch pod-abc123 --network-volume {VOLUME}" in r.stdout
    runpod_api.requests.clear()
    r = podkit_deploy(runpod_api, "--max-runtime", "soon")
    assert r.returncode == 2 and "--max-runtime: 'soon' is not a duration" in r.stderr and runpod_api.requests == []


def test_a_running_pod_without_exposed_ports_is_running(runpod_api):
    """A template with no ports: RunPod's runtime is there, its port list empty; never lost for it."""
    old_pod(runpod_api, ports=[])
    w, clock = watch(runpod_api, lost_after_s=600, start_grace_s=0)
    clock.events = {60: lambda: runpod_api.set_status("pod-old", "EXITED")}
    assert w.run() == 0 and created(runpod_api) == [] and actions(runpod_api) == []
    assert clock.t >= 1500


def test_no_replacement_once_the_maximum_run_time_has_passed(runpod_api, monkeypatch):
    receiver = Receiver()
    monkeypatch.setenv("PODKIT_NOTIFY_WEBHOOK_URL", receiver.url)
    try:
        old_pod(runpod_api, env={STOP_AT_ENV: str(int(time.time()) - 60)})
        w, clock = watch(runpod_api)
        clock.events = {1: lambda: runpod_api.vanish("pod-old")}
        assert w.run() == 0 and created(runpod_api) == []
        assert receiver.events() == ["relaunch-gave-up"] and "maximum run time has passed" in receiver.posts[0]["text"]
    finally:
        receiver.close()


def test_a_mistyped_pod_id_is_refused_before_anything_is_replaced(runpod_api):
    r = podkit_deploy(runpod_api, "watch", "pod-typo", "--network-volume", VOLUME, "--poll", "0.1")
    assert r.returncode == 1 and "RunPod knows no pod 'pod-typo'" in r.stderr
    assert created(runpod_api) == [] and actions(runpod_api) == []
    r = podkit_deploy(runpod_api, "watch", 'x" } ) { injected', "--network-volume", VOLUME)
    assert r.returncode == 2 and "is not a RunPod pod id" in r.stderr


def test_a_stop_pod_at_that_reads_as_a_duration_is_a_config_error():
    from podkit import config
    from podkit.errors import ConfigError

    with pytest.raises(ConfigError, match="guard.stop_pod_at: 43200 is a Unix time in 1970-2001"):
        config.load(None, environ={"PODKIT_GUARD_STOP_POD_AT": "43200"})
    assert config.load(None, environ={"PODKIT_GUARD_STOP_POD_AT": "4102444800"}).guard.stop_pod_at == 4102444800


def test_refusals_a_few_times_are_waited_out_and_for_good_end_the_watch(runpod_api):
    """RunPod refusing the question (403) now and then is not a lost pod; refusing it ten times in a row
    ends the watch with the error (exit 1 from the command), nothing replaced."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.fail("GET", "/v2/pods/pod-old", 403, times=2),
                    5: lambda: runpod_api.set_status("pod-old", "EXITED")}
    assert w.run() == 0 and created(runpod_api) == []
    runpod_api.set_status("pod-old", "RUNNING")
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.fail("GET", "/v2/pods/pod-old", 403, times=None)}
    with pytest.raises(PodkitError) as e:
        w.run()
    assert "RunPod refused 10 questions in a row about pod pod-old" in e.value.message and "HTTP 403" in e.value.message
    assert created(runpod_api) == [] and actions(runpod_api) == []


def test_two_watches_that_replace_at_once_keep_the_first_pod_only(runpod_api):
    """Both watches found the run lost and both created a pod: the watch whose pod came second
    terminates it at once (still provisioning: nothing lost) and follows the first."""
    old_pod(runpod_api)
    clock = Clock()
    d = Deployer(api.Client(sleep=clock.sleep), sleep=clock.sleep)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    real = relauncher(d, tpl, d.network_volume(VOLUME), "SECURE", 4, None, capacity_timeout_s=0)

    def launch(carry):  # the other watch's create lands just before this one's
        runpod_api.add_pod(volume=VOLUME, id="pod-zfirst", name="podkit-run", status="PROVISIONING",
                           createdAt="2026-01-01T00:00:00Z")  # created first: the id's order decides nothing
        return real(carry)

    w = Watch(d, "pod-old", launch, volume_id=VOLUME, clock=clock, lost_after_s=600, start_grace_s=900)
    clock.events = {1: lambda: runpod_api.vanish("pod-old"), 8: lambda: runpod_api.set_status("pod-zfirst", "EXITED")}
    assert w.run() == 0
    assert len(created(runpod_api)) == 1 and actions(runpod_api) == [("pod-new", "terminate")]
    assert w.pod_id == "pod-zfirst" and "pod-new" in runpod_api.terminated


def test_a_second_watch_of_the_same_run_on_one_machine_is_refused(runpod_api, tmp_path):
    """One watch per run here: the second `podkit deploy watch` of the same volume exits 1 and says which."""
    old_pod(runpod_api)
    env = {"RUNPOD_API_BASE_URL": runpod_api.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin",
           "HOME": "/nonexistent", "PODKIT_CACHE_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-m", "podkit", "deploy", "watch", "pod-old", "--network-volume", VOLUME,
                              "--poll", "0.2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / f"watch-{VOLUME}.lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, PODKIT_CACHE_DIR=str(tmp_path))
        assert r.returncode == 1 and f"another `podkit deploy watch` (pid {first.pid})" in r.stderr, r.stderr
        assert created(runpod_api) == []
    finally:
        first.terminate()
        first.wait(10)
    runpod_api.set_status("pod-old", "EXITED")
    r = podkit_deploy(runpod_api, "watch", "pod-old", "--network-volume", VOLUME, "--poll", "0.1",
                      PODKIT_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, "the lock goes with its watch"


def test_a_pod_of_something_else_on_the_volume_is_not_followed_and_holds_the_replacement_back(runpod_api):
    """A pod opened on the run's volume to look at its checkpoints is not the run: the watch neither
    follows it nor starts a replacement beside it; once it is stopped, the run's pod is replaced."""
    old_pod(runpod_api, env={"PODKIT_RUN_ID": "run1"})
    w, clock = watch(runpod_api)

    def host_lost():
        runpod_api.vanish("pod-old")
        runpod_api.add_pod(volume=VOLUME, id="pod-browse", name="look-at-ckpts")

    browsed = {}

    def browse_done():
        browsed["at"] = len(runpod_api.requests)
        runpod_api.set_status("pod-browse", "EXITED")

    clock.events = {1: host_lost, 9: browse_done, 16: lambda: runpod_api.set_status("pod-new", "EXITED")}
    assert w.run() == 0
    [new] = created(runpod_api)
    assert w.pod_id == "pod-new" and new["env"]["PODKIT_RUN_ID"] == "run1", "the replacement keeps the run's id"
    assert runpod_api.calls().index("POST /v2/pods") > browsed["at"], "no replacement while the other pod ran"


# -- answers of shapes RunPod does not document (issue 37) --------------------------------------------------

@pytest.mark.parametrize("shown", [MISSING, None, "MIGRATING", "MIGRATED", "running", 7])
def test_a_status_runpod_does_not_document_never_counts_toward_a_loss(runpod_api, shown):
    """For 40 polls (1200 s, twice --lost-after) RunPod shows the running pod with no status, null, a
    migration state or another value it does not document: that says nothing about the pod. Nothing is
    stopped or replaced; the watch ends when the pod stops on request."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api, lost_after_s=600, start_grace_s=0)
    clock.events = {1: lambda: runpod_api.show_status("pod-old", shown),
                    40: lambda: (runpod_api.clear_shown("pod-old"), runpod_api.set_status("pod-old", "EXITED"))}
    assert w.run() == 0
    assert created(runpod_api) == [] and actions(runpod_api) == [] and clock.t >= 1200


@pytest.mark.parametrize("body", [b"null", b""])
def test_a_200_without_a_pod_is_not_a_pod_that_is_gone(runpod_api, body):
    """RunPod answers 200 with a null (or empty) body five times: not "no such pod" (that is a 404), so
    no second pod is created beside the running one."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.fail("GET", "/v2/pods/pod-old", 200, body=body, times=5,
                                               content_type="application/json"),
                    8: lambda: runpod_api.set_status("pod-old", "EXITED")}
    assert w.run() == 0
    assert created(runpod_api) == [] and actions(runpod_api) == []


def test_a_status_documented_as_not_running_counts_only_when_seen_repeatedly(runpod_api):
    """ERROR once, then RUNNING again (a hiccup in what RunPod reports): not a loss. ERROR three times
    in a row is (test_a_stopped_pod_ends_the_watch_and_one_in_error_or_terminated_is_replaced)."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api)
    clock.events = {1: lambda: runpod_api.set_status("pod-old", "ERROR"),
                    2: lambda: runpod_api.set_status("pod-old", "RUNNING"),
                    5: lambda: runpod_api.set_status("pod-old", "EXITED")}
    assert w.run() == 0
    assert created(runpod_api) == [] and actions(runpod_api) == []


def test_an_unknown_status_restarts_the_count_toward_a_loss(runpod_api):
    """STARTING for 300 s, then a migration state for 600 s, then STARTING again: the time in the
    migration state does not count, so the pod is not lost at once when STARTING comes back."""
    old_pod(runpod_api)
    w, clock = watch(runpod_api, lost_after_s=600, start_grace_s=0, poll_s=30)

    def back():
        runpod_api.clear_shown("pod-old")

    clock.events = {1: lambda: runpod_api.hold("pod-old", "STARTING"),
                    11: lambda: runpod_api.show_status("pod-old", "MIGRATING"), 31: back,
                    36: lambda: runpod_api.set_status("pod-old", "EXITED")}
    assert w.run() == 0
    assert created(runpod_api) == [] and actions(runpod_api) == []


def test_a_replacement_created_twice_by_a_late_answer_leaves_one_pod(runpod_api):
    """The run's replacement was made twice (a create whose answer came late, the pod list slow to show
    it): once the earlier pod shows, while the watch's replacement still starts, the later one is
    terminated and the earlier one followed."""
    old_pod(runpod_api, env={"PODKIT_RUN_ID": "run1"})
    runpod_api.polls_until_running = 6
    w, clock = watch(runpod_api)

    def lost_and_made_unseen():
        runpod_api.vanish("pod-old")
        runpod_api.add_pod(volume=VOLUME, id="pod-first", name="podkit-run", status="PROVISIONING",
                           env={"PODKIT_RUN_ID": "run1"}, createdAt="2026-01-01T00:00:00Z")
        runpod_api.unlisted("pod-first")
        runpod_api.list_lag_s = 1e9

    def the_list_catches_up():
        runpod_api.list_lag_s = 0
        runpod_api.unlisted("pod-first", hidden=False)

    clock.events = {1: lost_and_made_unseen, 4: the_list_catches_up,
                    30: lambda: runpod_api.set_status(w.pod_id, "EXITED")}
    assert w.run() == 0
    assert len(created(runpod_api)) == 1 and actions(runpod_api) == [("pod-new", "terminate")]
    assert w.pod_id == "pod-first" and "pod-new" in runpod_api.terminated


def test_a_pod_whose_answer_has_no_creation_time_is_never_taken_for_the_first():
    """Which pod of a run stays goes by createdAt; an answer without one does not make its pod "first"
    (it would have the run's real first pod terminated)."""
    pods = [{"id": "a-late"}, {"id": "z-first", "createdAt": "2026-01-01T00:00:00Z"},
            {"id": "m", "createdAt": "2026-01-02T00:00:00Z"}]
    assert [p["id"] for p in sorted(pods, key=created_order)] == ["z-first", "m", "a-late"]
