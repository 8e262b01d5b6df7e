"""`podkit deploy` against the loopback stub of RunPod's REST API v2 (tests/runpod_stub.py: a stub, not
RunPod), which holds every request and every answer to RunPod's published OpenAPI document: a body the
document refuses is a 422 here, as there. RUNPOD_API_BASE_URL points podkit at it; the key is a test key."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import tomllib
from test_deploy_watch import Clock

from conftest import ROOT, raw_server
from podkit import config
from podkit import runpod as api
from podkit.deploy import template as deploy_template
from podkit.deploy.bodies import SHIPPED_CONFIG, SHIPPED_GPUS, new_run, pod_body
from podkit.deploy.deployer import Deployer
from podkit.deploy.template import default_template, load_template
from podkit.errors import ConfigError, PodkitError
from runpod_stub import RunPodV2Stub

pytestmark = pytest.mark.timeout(60)
KEY = "rpa_TESTKEY0123456789"
VOLUME = "vol-ckpt1"
SRC = ROOT / "src" / "podkit"
IMAGE = ("--image", "registry.example/podkit:1.0")  # the template's podkit:latest is refused on a real deploy


@pytest.fixture
def runpod_api(monkeypatch):
    stub = RunPodV2Stub(key=KEY)
    monkeypatch.setenv("RUNPOD_API_BASE_URL", stub.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.setenv("PODKIT_CACHE_DIR", stub.cache_dir)  # in-process verbs: this test's notes and locks
    yield stub
    assert stub.graphql == [], "nothing of podkit's speaks GraphQL"
    stub.assert_clean()
    stub.close()


def podkit_deploy(stub, *args, env: dict | None = None):
    env = {"RUNPOD_API_BASE_URL": stub.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
           "PODKIT_CACHE_DIR": stub.cache_dir, **(env or {})}
    return subprocess.run([sys.executable, "-m", "podkit", "deploy", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def sent(stub, call: str) -> list:
    """The bodies of every "METHOD /path" request, in order."""
    return [r.body for r in stub.requests if f"{r.method} {r.path}" == call]


def tpl_file(tmp_path, **fields) -> str:
    path = tmp_path / "template.yaml"
    path.write_text(json.dumps({"name": "t", "imageName": "registry.example/img", "volumeMountPath": "/workspace",
                                **fields}))
    return str(path)


def test_deploy_saves_the_template_then_a_4xa40_pod_and_says_how_to_reach_it(runpod_api):
    """The price per hour said before anything is made (RunPod's GPU catalogue), template created, pod created
    on 4 A40s (v2's nested body: gpu with the image's CUDA floor, the pod volume at /workspace) and its own
    price said, waited for, and the SSH command printed; the key only in the header."""
    r = podkit_deploy(runpod_api, "--image", "registry.example/podkit:1.0", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert runpod_api.calls()[:5] == ["GET /v2/catalog/gpus", "GET /v2/templates", "POST /v2/templates",
                                      "GET /v2/pods", "POST /v2/pods"]
    said = r.stdout.splitlines()
    price = said.index("price: $1.60/h for 4x NVIDIA A40 in SECURE cloud (RunPod's list price; the pod's own is "
                       "shown once it is made)")
    made = next(i for i, line in enumerate(said) if line.startswith("pod stubpod") and " created: " in line)
    assert price < made and re.fullmatch(r"pod stubpod\d+ created: RunPod bills it \$1\.60/h \(its cost\)",
                                         said[made]), r.stdout
    assert runpod_api.refused == []
    [tpl] = sent(runpod_api, "POST /v2/templates")
    assert tpl["image"] == "registry.example/podkit:1.0" and tpl["startJupyter"] is False and tpl["args"] == ""
    assert tpl["mounts"] == {"persistent": {"size": 100, "path": "/workspace"}}
    [pod] = sent(runpod_api, "POST /v2/pods")
    assert pod["gpu"] == {"id": "NVIDIA A40", "count": 4, "minCudaVersion": "12.9"} and pod["cloud"] == "SECURE"
    assert pod["mounts"] == {"persistent": {"size": 100, "path": "/workspace"}}
    assert "templateId" not in pod and pod["args"] == "" and pod["registry"] is None, "every field explicit"
    assert re.fullmatch(r"[0-9a-f]{16}", pod["env"]["PODKIT_RUN_ID"]), "the run's id, for its watch and guards"
    assert pod["env"]["GIT_TOKEN"] == "{{ RUNPOD_SECRET_GIT_TOKEN }}"
    assert pod["env"]["PODKIT_CONFIG"] == "/opt/podkit/configs/a40-4gpu.yaml"
    assert re.search(r"ssh root@203\.0\.113\.\d+ -p 22022", r.stdout), r.stdout
    assert {q.headers.get("authorization") for q in runpod_api.requests} == {f"Bearer {KEY}"}
    assert KEY not in r.stdout + r.stderr


@pytest.mark.parametrize("args, where", [
    ((), "runpod/template.yaml: imageName: 'podkit:latest' names no registry"),
    (("--image", "localhost:5000/podkit:1"), "--image: 'localhost:5000/podkit:1' is in a registry on this machine"),
    (("--image", "Me/Podkit:1"), "--image: 'Me/Podkit:1' is not an image reference"),
])
def test_an_image_no_runpod_host_can_pull_is_refused_before_anything_is_sent(runpod_api, args, where):
    """The template's podkit:latest is the tag `docker build` gave here; Docker would look for it among Docker
    Hub's official images (library/podkit), where there is none, and the pod would wait on its pull for ever:
    refused (exit 2), naming the setting and --image, with nothing sent. A dry run still shows the requests,
    saying so."""
    r = podkit_deploy(runpod_api, *args, "--wait-timeout", "30")
    assert r.returncode == 2 and where in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "--image ghcr.io/<you>/podkit:<tag>" in r.stderr and runpod_api.requests == []
    r = podkit_deploy(runpod_api, *args, "--dry-run")
    assert r.returncode == 0 and "a real deploy refuses it" in r.stderr
    assert runpod_api.calls() == ["GET /v2/catalog/gpus"], "a dry run with a key reads the price, and only that"


@pytest.mark.parametrize("image, pullable", [
    ("podkit:latest", False), ("podkit", False), ("podkit@sha256:" + "a" * 64, False),
    ("localhost/podkit:1", False), ("127.0.0.1:5000/podkit:1", False), ("[::1]:5000/podkit", False),
    ("ghcr.io/Me/podkit:1", False), ("registry.example/podkit:bad tag", False),
    ("me/podkit:1.0", True), ("ghcr.io/me/podkit:1.0", True), ("registry.example:5000/a/b/podkit:v1-rc.2", True),
    ("docker.io/library/ubuntu:24.04", True), ("ghcr.io/me/podkit@sha256:" + "0" * 64, True),
])
def test_which_images_a_runpod_host_can_pull_follows_dockers_reference_grammar(image, pullable):
    """Docker's grammar and its rule for the registry: the part before the first "/" is a registry host only
    with a "." or ":" or as "localhost"; else the name is Docker Hub's (user/name), library/ when one part."""
    assert (deploy_template.unpullable(image) == "") is pullable


def test_a_one_a40_pod_in_community_cloud(runpod_api):
    r = podkit_deploy(runpod_api, *IMAGE, "--gpus", "1", "--cloud", "COMMUNITY", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    [pod] = sent(runpod_api, "POST /v2/pods")
    assert (pod["gpu"]["count"], pod["cloud"]) == (1, "COMMUNITY")
    assert pod["env"]["PODKIT_CONFIG"] == "/opt/podkit/configs/a40-1gpu.yaml"  # SGLang and trainer share the GPU


@pytest.mark.parametrize("args, problem", [
    (("--gpus", "3"), "--gpus: no shipped A40 pod config for 3 GPUs"),
    (("--cloud", "ALL"), "--cloud: 'ALL' is not one of SECURE, COMMUNITY"),
])
def test_a_request_podkit_cannot_place_is_refused_before_anything_is_sent(runpod_api, args, problem):
    r = podkit_deploy(runpod_api, *args, "--wait-timeout", "30")
    assert r.returncode == 2 and problem in r.stderr and "Traceback" not in r.stderr
    assert runpod_api.requests == []


def test_a_pod_config_of_your_own_is_kept_for_any_gpu_count(runpod_api, tmp_path):
    t = tpl_file(tmp_path, env={"PODKIT_CONFIG": "/workspace/my-pod.yaml"})
    r = podkit_deploy(runpod_api, "--template", t, "--gpus", "3", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert sent(runpod_api, "POST /v2/pods")[0]["env"]["PODKIT_CONFIG"] == "/workspace/my-pod.yaml"


def test_every_shipped_config_deploy_can_name_is_in_the_image():
    for n in SHIPPED_GPUS:
        assert (ROOT / SHIPPED_CONFIG.format(n).removeprefix("/opt/podkit/")).is_file()


def test_a_second_deploy_updates_the_template_of_the_same_name(runpod_api):
    """Idempotent: the template of that name is PATCHed, not duplicated, and the pod names it."""
    assert podkit_deploy(runpod_api, *IMAGE, "--wait-timeout", "30").returncode == 0
    r = podkit_deploy(runpod_api, "--image", "registry.example/podkit:2.0", "--name", "second", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    [tid] = runpod_api.templates
    assert [c for c in runpod_api.calls() if "templates" in c].count("POST /v2/templates") == 1
    assert sent(runpod_api, f"PATCH /v2/templates/{tid}")[0]["image"] == "registry.example/podkit:2.0"
    runs = [p["env"]["PODKIT_RUN_ID"] for p in sent(runpod_api, "POST /v2/pods")]
    assert len(set(runs)) == 2, "each deploy is a run of its own"


def test_a_start_command_removed_from_the_template_is_gone_from_the_next_pod(runpod_api, tmp_path):
    """A PATCH leaves what it omits as it was: the start command and registry are always sent, and pods
    carry every field themselves, so nothing stale of the template reaches a pod."""
    assert podkit_deploy(runpod_api, "--template", tpl_file(tmp_path, dockerArgs="python old.py", registry="cred-1",
                                                            volumeInGb=50), "--wait-timeout", "30").returncode == 0
    r = podkit_deploy(runpod_api, "--template", tpl_file(tmp_path), "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    [tid] = runpod_api.templates
    [patch] = sent(runpod_api, f"PATCH /v2/templates/{tid}")
    assert patch["args"] == "" and patch["registry"] is None
    pod = sent(runpod_api, "POST /v2/pods")[-1]
    assert pod["args"] == "" and pod["registry"] is None and "mounts" not in pod


HOSTILE = {"QUOTE": 'say "hi"', "NEWLINE": "line1\nline2", "DOLLAR": "$HOME ${PATH} $(id)",
           "BACKSLASH": "C:\\path\\n", "BRACES": "} ] { injected: true", "UNICODE": "température ✓"}


def test_hostile_values_in_env_and_start_command_arrive_intact(runpod_api, tmp_path):
    """Quotes, newlines, `$`, backslashes and braces in env values and the start command reach RunPod
    byte for byte, in the template and in the pod: JSON bodies, nothing pasted into a query text."""
    cmd = 'bash -c "echo \\"$PODKIT_REPO_URL\\"; exec /entrypoint"\n'
    t = tpl_file(tmp_path, dockerArgs=cmd, env=HOSTILE)
    r = podkit_deploy(runpod_api, "--template", t, "--name", 'pod "x"\n', "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    [tpl], [pod] = sent(runpod_api, "POST /v2/templates"), sent(runpod_api, "POST /v2/pods")
    assert tpl["env"] == HOSTILE and tpl["args"] == cmd == pod["args"]
    assert pod["env"] == {**HOSTILE, "PODKIT_CONFIG": "/opt/podkit/configs/a40-4gpu.yaml",
                          "PODKIT_RUN_ID": pod["env"]["PODKIT_RUN_ID"]}
    assert pod["name"] == 'pod "x"\n'


def tiny_client(**kw) -> api.Client:
    return api.Client(sleep=lambda s: None, **kw)


def test_capacity_refusals_are_retried_with_back_off_then_succeed(runpod_api):
    """'No longer any instances available' (RunPod's 400) twice, then a pod: retried with growing delays."""
    runpod_api.capacity_failures = 2
    slept: list[float] = []
    d = Deployer(tiny_client(), sleep=slept.append)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    pod = d.create_pod(pod_body(tpl, 4, "SECURE", "p"), capacity_timeout_s=600)
    assert runpod_api.pod(pod["id"])["name"] == "p"
    assert runpod_api.calls().count("POST /v2/pods") == 3
    assert len(slept) == 2 and slept[1] > slept[0]


def test_capacity_that_never_comes_is_reported_with_alternatives(runpod_api):
    runpod_api.capacity_failures = 1000
    d = Deployer(tiny_client(), sleep=lambda s: None)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    with pytest.raises(PodkitError) as e:
        d.create_pod(pod_body(tpl, 4, "SECURE", "p"), capacity_timeout_s=0)
    assert "no 4x NVIDIA A40 available in SECURE cloud" in e.value.message
    assert "--cloud COMMUNITY" in e.value.hint and "--gpus 2" in e.value.hint


def test_a_create_whose_answer_is_lost_is_found_not_made_twice(runpod_api):
    """RunPod makes the pod, but its answer never arrives (the client times out): podkit finds the pod by
    name among the pods made since, follows it, and bills for one pod, not two."""
    runpod_api.fail("POST", "/v2/pods", None, delay_s=2.5)
    slept: list[float] = []
    d = Deployer(tiny_client(timeout_s=1), sleep=lambda s: slept.append(s) or time.sleep(2))
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    runpod_api.add_pod(name="p")  # an older pod of the same name is not the one just made
    pod = d.create_pod(pod_body(tpl, 4, "SECURE", "p"), capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 1 and len(slept) == 1
    assert sorted(p["name"] for p in runpod_api.pods.values()) == ["p", "p"]
    assert pod["gpu"]["id"] == "NVIDIA A40"


def test_dry_run_prints_the_v2_requests_and_sends_nothing(runpod_api):
    """--dry-run shows each request with its JSON body; it needs no key and sends nothing."""
    r = podkit_deploy(runpod_api, "--dry-run", "--gpus", "2", "--network-volume", VOLUME, env={"RUNPOD_API_KEY": ""})
    assert r.returncode == 0, r.stderr
    assert runpod_api.requests == []
    assert f"POST {runpod_api.url}/v2/templates" in r.stdout and f"POST {runpod_api.url}/v2/pods" in r.stdout
    pod = json.loads(r.stdout.split("/v2/pods\n")[-1].split("# nothing")[0])
    assert pod["mounts"] == {"network": [{"volumeId": VOLUME, "path": "/workspace"}]}
    assert pod["gpu"]["count"] == 2 and "graphql" not in r.stdout.lower()
    assert "price" not in r.stdout + r.stderr and r.stdout.endswith("# nothing was sent (--dry-run)\n")


def test_a_dry_run_with_a_key_reads_the_price_and_says_so_and_writes_nothing(runpod_api):
    """With a key, the dry run reads RunPod's GPU catalogue, the one request it sends, says so beside the price
    (list price x GPUs, in the cloud asked for), and still writes nothing; a catalogue that does not answer is
    a price not known, never a failed dry run."""
    r = podkit_deploy(runpod_api, "--dry-run", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert runpod_api.calls() == ["GET /v2/catalog/gpus"]
    assert r.stdout.startswith(f"# price: $0.80/h for 2x NVIDIA A40 in SECURE cloud (RunPod's list price; the pod's "
                               f"own is shown once it is made); read from GET {runpod_api.url}/v2/catalog/gpus, this "
                               "dry run's one request\n"), r.stdout
    assert r.stdout.endswith("# nothing was written (--dry-run)\n")
    assert json.loads(r.stdout.split("/v2/pods\n")[-1].split("# nothing")[0])["gpu"]["count"] == 2
    runpod_api.fail("GET", "/v2/catalog/gpus", 403)
    r = podkit_deploy(runpod_api, "--dry-run", "--cloud", "COMMUNITY")
    assert r.returncode == 0 and r.stdout.startswith(
        "# price: unknown for 4x NVIDIA A40 in COMMUNITY cloud (RunPod's GPU catalogue did not answer: RunPod answered "
        "GET /v2/catalog/gpus (the GPU catalogue) with HTTP 403"), r.stdout
    r = podkit_deploy(runpod_api, "--dry-run", "--cloud", "COMMUNITY")
    assert r.stdout.startswith("# price: unknown: RunPod's GPU catalogue lists no price for 4x NVIDIA A40 in "
                               "COMMUNITY cloud;"), "the stub's A40s are in Secure Cloud only"
    assert all(c == "GET /v2/catalog/gpus" for c in runpod_api.calls())


def test_stop_start_terminate_and_status_are_v2_actions(runpod_api):
    pod = runpod_api.add_pod(name="run")
    pid = pod["id"]
    assert podkit_deploy(runpod_api, "stop", pid).returncode == 0
    assert runpod_api.pod(pid)["status"] == "EXITED"
    r = podkit_deploy(runpod_api, "stop", pid)  # stopped already: done, not an error
    assert r.returncode == 0, r.stderr
    assert podkit_deploy(runpod_api, "start", pid).returncode == 0
    r = podkit_deploy(runpod_api, "status", pid)
    assert r.returncode == 0 and pid in r.stdout and "ssh root@" in r.stdout, r.stdout
    r = podkit_deploy(runpod_api, "status")
    assert r.returncode == 0 and f"{pid} run: RUNNING" in r.stdout
    assert podkit_deploy(runpod_api, "terminate", pid).returncode == 0
    assert pid in runpod_api.terminated
    assert sent(runpod_api, f"POST /v2/pods/{pid}/action") == [{"action": a} for a in
                                                                ("stop", "stop", "start", "terminate")]
    r = podkit_deploy(runpod_api, "status", pid)
    assert r.returncode == 1 and "RunPod has no pod" in r.stderr and "migrated" in r.stderr


def test_a_locked_pod_is_not_stopped_and_says_why(runpod_api):
    pid = runpod_api.add_pod(locked=True)["id"]
    r = podkit_deploy(runpod_api, "stop", pid)
    assert r.returncode == 1 and f"pod {pid} is locked" in r.stderr and "unlock it" in r.stderr
    assert runpod_api.pod(pid)["status"] == "RUNNING"


def test_waiting_for_the_pod_polls_until_its_runtime_is_up(runpod_api):
    runpod_api.polls_until_running = 3
    pid = runpod_api.add_pod(status="PROVISIONING")["id"]
    slept: list[float] = []
    pod = Deployer(tiny_client(), sleep=slept.append).wait_running(pid, timeout_s=60, poll_s=5)
    assert pod["status"] == "RUNNING" and pod["runtime"]["ports"] and slept == [5, 5]


def test_a_pod_in_error_while_starting_points_at_its_system_log(runpod_api):
    pid = runpod_api.add_pod(status="ERROR")["id"]
    with pytest.raises(PodkitError) as e:
        Deployer(tiny_client()).wait_running(pid, timeout_s=60)
    assert "is in ERROR" in e.value.message and f"podkit deploy logs {pid} --system" in e.value.hint


@pytest.mark.parametrize("fault, retried", [
    (dict(status=429, retry_after=1, times=2), True),
    (dict(status=503, times=2), True),
    (dict(status=502, times=2, body=b"<html>Bad Gateway</html>"), True),
])
def test_rate_limits_and_server_errors_are_retried(runpod_api, fault, retried):
    slept: list[float] = []
    runpod_api.fail("GET", "/v2/pods", **fault)
    c = api.Client(sleep=slept.append)
    assert c.pods() == [] and runpod_api.calls().count("GET /v2/pods") == 3
    if fault["status"] == 429:
        assert slept == [1, 1], "RunPod's Retry-After is what is waited"


@pytest.mark.parametrize("fault, says", [
    (dict(status=401), "HTTP 401: Unauthorized"),
    (dict(status=200, body=b"<html>maintenance</html>"), "HTTP 200 and no JSON: '<html>maintenance</html>'"),
    (dict(status=200, body={"pod": []}), "has no 'pods' list"),
    (dict(status=503, times=None), "HTTP 503"),
    (dict(status=429, retry_after=3600), "HTTP 429"),
    (dict(status=302, body=b""), "redirected GET /v2/pods (HTTP 302): not followed"),
])
def test_an_answer_podkit_cannot_use_is_one_clear_line_without_the_key(runpod_api, fault, says):
    runpod_api.fail("GET", "/v2/pods", **fault)
    r = podkit_deploy(runpod_api, "status")
    assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert KEY not in r.stderr
    if fault["status"] == 401:
        assert "API key" in r.stderr


def test_a_slow_api_times_out_with_a_clear_error(runpod_api):
    runpod_api.fail("GET", "/v2/pods", None, times=None, delay_s=1.5)
    with pytest.raises(api.ApiError) as e:
        api.Client(timeout_s=0.5, retries=1, sleep=lambda s: None).pods()
    assert "did not answer GET /v2/pods" in e.value.message and e.value.status == 0


def test_a_key_echoed_in_runpods_answer_is_redacted(runpod_api):
    runpod_api.fail("GET", "/v2/pods", 400, body={"title": "Bad Request", "status": 400, "detail": f"key {KEY} bad"})
    r = podkit_deploy(runpod_api, "status")
    assert r.returncode == 1 and "key *** bad" in r.stderr and KEY not in r.stderr


@pytest.mark.parametrize("base", ["http://api.runpod.io", "https://user:pw@api.runpod.io", "ftp://x", "https://"])
def test_an_api_base_url_the_key_must_not_go_to_is_refused(runpod_api, base):
    r = podkit_deploy(runpod_api, "status", env={"RUNPOD_API_BASE_URL": base})
    assert r.returncode == 1 and "is not an https URL of an API host" in r.stderr, r.stderr
    assert runpod_api.requests == [] and "pw" not in r.stderr


def test_an_api_base_url_with_a_path_is_refused(runpod_api):
    r = podkit_deploy(runpod_api, "status", env={"RUNPOD_API_BASE_URL": "https://api.runpod.io/v2"})
    assert r.returncode == 1 and "has a path: it is the host alone" in r.stderr


def test_missing_api_key_is_a_clear_error(runpod_api):
    r = podkit_deploy(runpod_api, "stop", "pod-1", env={"RUNPOD_API_KEY": ""})
    assert r.returncode == 1 and "no RunPod API key" in r.stderr and runpod_api.requests == []


def test_a_network_volume_another_pod_uses_is_refused(runpod_api):
    runpod_api.add_volume(VOLUME, "checkpoints", 200, "EU-SE-1")
    other = runpod_api.add_pod(volume=VOLUME, name="older-run")["id"]
    r = podkit_deploy(runpod_api, *IMAGE, "--network-volume", VOLUME, "--wait-timeout", "30")
    assert r.returncode == 1 and f"in use by pod {other}" in r.stderr and f"podkit deploy stop {other}" in r.stderr
    assert "POST /v2/pods" not in runpod_api.calls()


def test_template_with_a_literal_secret_another_mount_or_spot_is_refused(tmp_path):
    tpl = tmp_path / "t.yaml"
    tpl.write_text("name: t\nimageName: i\nvolumeMountPath: /workspace\nenv:\n  GIT_TOKEN: ghp_abcdefghijklmnop\n")
    with pytest.raises(ConfigError, match="looks like a literal secret"):
        load_template(tpl)
    tpl.write_text("name: t\nimageName: i\nvolumeMountPath: /runpod-volume\n")
    with pytest.raises(ConfigError, match="podkit's workspace is /workspace"):
        load_template(tpl)
    tpl.write_text("name: t\nimageName: i\nvolumeMountPath: /workspace\nbidPerGpu: 0.2\n")
    with pytest.raises(ConfigError) as e:
        load_template(tpl)
    assert "no interruptible (spot) pods" in e.value.hint


def test_the_shipped_template_is_the_one_deploy_sends():
    assert default_template().read_text() == (ROOT / "runpod" / "template.yaml").read_text()
    tpl = load_template(config.packaged("runpod/template.yaml"))
    assert tpl["volumeMountPath"] == "/workspace" and tpl["dockerArgs"] == "" and tpl["minCudaVersion"]


def test_no_code_path_reaches_graphql():
    """GraphQL is retired: no URL, query or SDK of it is left in podkit's source."""
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        assert "/graphql" not in text and not re.search(r"^\s*(import runpod|from runpod)", text, re.M), path
        assert not re.search(r"\bmutation\s*\{|\bquery\s*\{", text), path
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wants = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    assert not [d for d in wants if re.match(r"(runpod|graphql)", d, re.I)], "no GraphQL SDK or client"

def test_logs_resume_after_a_dropped_connection_without_a_line_lost_or_twice(runpod_api):
    """RunPod's SSE stream drops after 3 events: `podkit deploy logs` reconnects with Last-Event-ID and
    prints every line once, in order; a secret a line carries is redacted."""
    pid = runpod_api.add_pod()["id"]
    lines = [f"[trainer] step {i}" for i in range(8)] + ["[sync] cloning https://x:ghp_abcdefghijklmnop1234@github.com/a"]
    runpod_api.logs[pid] = [("container", line) for line in lines] + [("system", "pulling image")]
    runpod_api.drop_logs_after = 3
    r = podkit_deploy(runpod_api, "logs", pid)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[:8] == lines[:8] and len(out) == 9 and "ghp_abcdefghijklmnop1234" not in r.stdout
    streams = [q for q in runpod_api.requests if q.path.endswith("/logs")]
    # The drop, the resume, and a last resume that brings nothing new: the stream was whole.
    assert len(streams) == 3 and "last-event-id" not in streams[0].headers
    events = runpod_api.log_events(pid)
    assert [q.headers["last-event-id"] for q in streams[1:]] == [events[2][0], events[8][0]]
    assert {q.query.get("source") for q in streams} == {"container"}
    r = podkit_deploy(runpod_api, "logs", pid, "--system")
    assert r.returncode == 0 and r.stdout.splitlines() == ["pulling image"]


def test_logs_of_a_pod_that_is_gone_or_a_bad_tail_say_so(runpod_api):
    r = podkit_deploy(runpod_api, "logs", "nopod")
    assert r.returncode == 1 and "HTTP 404" in r.stderr and "Traceback" not in r.stderr
    r = podkit_deploy(runpod_api, "logs", "nopod", "--tail", "9000")
    assert r.returncode == 2 and "--tail: 9000: 0..5000" in r.stderr


def test_a_pod_create_answered_with_a_cut_2xx_is_found_not_made_twice(runpod_api):
    """RunPod made the pod; its 201 arrived cut short (not JSON): looked for by name, not sent again."""
    runpod_api.fail("POST", "/v2/pods", 201, body=b'{"id": "stubpod', times=1)
    d = Deployer(tiny_client(), sleep=lambda s: None)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    # The cut answer replaces the stub's own, so the stub makes no pod for it: make the one RunPod made.
    made = {}
    orig = d.api.create_pod

    def create(body):
        made["pod"] = runpod_api.add_pod(name=body["name"], status="PROVISIONING")
        return orig(body)

    d.api.create_pod = create
    pod = d.create_pod(pod_body(tpl, 4, "SECURE", "p"), capacity_timeout_s=0)
    assert pod["id"] == made["pod"]["id"] and runpod_api.calls().count("POST /v2/pods") == 1


def test_a_start_whose_answer_was_lost_is_done_when_sent_again(runpod_api):
    """The first start was taken, its answer lost: the retry's 409 on a pod now starting is success."""
    pid = runpod_api.add_pod(status="EXITED")["id"]
    runpod_api.fail("POST", f"/v2/pods/{pid}/action", None, delay_s=1.5)
    d = Deployer(api.Client(timeout_s=0.5, sleep=lambda s: time.sleep(1.5)))
    d.act(pid, "start")
    assert runpod_api.pod(pid)["status"] in ("STARTING", "RUNNING")
    assert sent(runpod_api, f"POST /v2/pods/{pid}/action") == [{"action": "start"}] * 2


def garbled_server(answer: bytes):
    """Answers every request with `answer` as it is (a broken proxy)."""
    def reply(c):
        c.recv(65536)
        c.sendall(answer)

    srv = raw_server(reply)
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("answer", [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n"])
def test_a_garbled_answer_is_a_clear_error_and_the_self_stop_never_raises(answer):
    from podkit.money import costguard

    srv, url = garbled_server(answer)
    try:
        with pytest.raises(api.ApiError) as e:
            api.Client(KEY, environ={"RUNPOD_API_BASE_URL": url}, retries=1, sleep=lambda s: None).pods()
        assert "did not answer GET /v2/pods" in e.value.message
        env = {"RUNPOD_POD_ID": "pod-abc123", "RUNPOD_API_KEY": KEY, "RUNPOD_API_BASE_URL": url}
        assert costguard.stop_pod("test", env) is False
    finally:
        srv.close()


def test_logs_without_follow_end_when_runpod_holds_the_stream_open(runpod_api):
    """RunPod keeps the stream open after the backlog: without --follow the command ends once nothing
    more comes for a few seconds, with every line once."""
    pid = runpod_api.add_pod()["id"]
    runpod_api.logs[pid] = [("container", f"line {i}") for i in range(3)]
    runpod_api.follow_s = 30
    t0 = time.monotonic()
    lines = [e["line"] for e in api.Client(sleep=lambda s: None).logs(pid, follow=False, settle_s=1)]
    assert lines == ["line 0", "line 1", "line 2"] and time.monotonic() - t0 < 10


def test_logs_wait_out_a_rate_limit_or_a_5xx_at_a_connect(runpod_api):
    pid = runpod_api.add_pod()["id"]
    runpod_api.logs[pid] = [("container", "hello")]
    runpod_api.fail("GET", f"/v2/pods/{pid}/logs", 429, retry_after=1)
    runpod_api.fail("GET", f"/v2/pods/{pid}/logs", 503)
    slept = []
    lines = [e["line"] for e in api.Client(sleep=slept.append).logs(pid, follow=False, settle_s=1)]
    assert lines == ["hello"] and slept[0] == 1


# -- whole-request deadline, redaction before the cut, ids, log lines (issue 34) ---------------------------

def test_an_answer_that_drips_ends_at_the_clients_timeout(runpod_api):
    """RunPod's answer arrives a byte every 50 ms (each read gets something, so a per-read timeout never
    fires): Client(timeout_s=1) gives up after about 1 s, not when the last byte comes (about 8 s)."""
    runpod_api.fail("GET", "/v2/pods", 200, body={"pods": [], "pad": "x" * 60}, drip_s=0.05, times=None)
    t0 = time.monotonic()
    with pytest.raises(api.ApiError) as e:
        api.Client(timeout_s=1, retries=0, sleep=lambda s: None).pods()
    assert time.monotonic() - t0 < 2.5 and "did not answer GET /v2/pods" in e.value.message


def test_the_self_stop_on_a_dripping_api_is_bounded_and_retried(runpod_api, monkeypatch):
    """The cost guard's stop meets an API that drips its answers: each attempt ends at the client's
    timeout, the Stopper tries again, and the stop RunPod finally answers is taken."""
    from podkit.money import costguard

    pid = runpod_api.add_pod()["id"]
    monkeypatch.setenv("RUNPOD_POD_ID", pid)
    monkeypatch.delenv("PODKIT_NOTIFY_WEBHOOK_URL", raising=False)
    monkeypatch.setattr(costguard, "FIRST_RETRY_S", 0.1)
    real = api.Client
    monkeypatch.setattr(api, "Client", lambda **kw: real(**{**kw, "timeout_s": 1, "sleep": lambda s: None}))
    runpod_api.fail("POST", f"/v2/pods/{pid}/action", 200, body={"pad": "x" * 200}, drip_s=0.2, times=2)
    stopper = costguard.Stopper("test", None)
    t0 = time.monotonic()
    stopper.start().thread.join(20)
    assert stopper.done and time.monotonic() - t0 < 10, "bounded by the client's timeout, then tried again"
    assert runpod_api.pod(pid)["status"] == "EXITED"
    assert runpod_api.calls().count(f"POST /v2/pods/{pid}/action") == 3


def test_logs_without_follow_end_though_keep_alives_and_new_lines_keep_coming(runpod_api):
    """After the backlog RunPod holds the stream open with a keep-alive comment every 0.2 s, and the pod
    writes a line every 0.3 s: without --follow the backlog is printed and the command ends within
    seconds (a comment is not an event; a line stamped after the stream began is not backlog)."""
    pid = runpod_api.add_pod()["id"]
    runpod_api.logs[pid] = [("container", f"line {i}") for i in range(3)]
    runpod_api.follow_s, runpod_api.keepalive_s = 30, 0.2
    t0 = time.monotonic()
    lines = [e["line"] for e in api.Client(sleep=lambda s: None).logs(pid, follow=False, settle_s=1)]
    assert lines == ["line 0", "line 1", "line 2"] and time.monotonic() - t0 < 5
    stop = threading.Event()

    def chatty():
        i = 0
        while not stop.wait(0.3):
            runpod_api.logs[pid] = [*runpod_api.logs[pid], ("container", f"new {i}")]
            i += 1

    threading.Thread(target=chatty, daemon=True).start()
    try:
        t0 = time.monotonic()
        lines = [e["line"] for e in api.Client(sleep=lambda s: None).logs(pid, follow=False, settle_s=1)]
        assert lines[:3] == ["line 0", "line 1", "line 2"] and time.monotonic() - t0 < 6, lines
    finally:
        stop.set()


def test_logs_without_follow_print_the_backlog_when_the_log_clock_runs_ahead(runpod_api):
    """The log lines' ts run an hour ahead of the API's Date: every line would look written after the
    stream began. The first line already does, so the clocks are taken to differ and the backlog is
    printed whole, ending when nothing more comes."""
    pid = runpod_api.add_pod()["id"]
    runpod_api.log_clock_s = 3600
    runpod_api.logs[pid] = [("container", f"line {i}") for i in range(3)]
    runpod_api.follow_s, runpod_api.keepalive_s = 30, 0.2
    t0 = time.monotonic()
    lines = [e["line"] for e in api.Client(sleep=lambda s: None).logs(pid, follow=False, settle_s=1)]
    assert lines == ["line 0", "line 1", "line 2"] and time.monotonic() - t0 < 5


def test_a_key_echoed_near_the_cut_of_an_error_is_never_shown_in_part(runpod_api):
    """An error answer echoes `Authorization: Bearer <key>` where the message is cut (400 characters of
    a problem, 200 of an answer that is not JSON): the key is taken out first, so no part of it shows."""
    filler = "x" * (400 - len("Bad Request: ") - len("Authorization: Bearer ") - 5)
    runpod_api.fail("GET", "/v2/pods", 400, body={"title": "Bad Request", "status": 400,
                                                   "detail": f"{filler}Authorization: Bearer {KEY} rejected"})
    r = podkit_deploy(runpod_api, "status")
    assert r.returncode == 1 and "HTTP 400" in r.stderr and KEY[:4] not in r.stderr, r.stderr
    runpod_api.fail("GET", "/v2/pods", 200, body=("y" * 190 + f" Authorization: Bearer {KEY}").encode())
    r = podkit_deploy(runpod_api, "status")
    assert r.returncode == 1 and "no JSON" in r.stderr and KEY[:4] not in r.stderr, r.stderr


HOSTILE_ID = "victim/action?x="


def test_ids_of_another_shape_never_go_into_a_url_path(runpod_api):
    """An id from RunPod's answer is checked before it goes into a path: a create answered with id
    'victim/action?x=' is not a pod podkit follows or terminates; a listed pod with such an id is
    dropped; the client refuses to put one in a path at all."""
    runpod_api.fail("POST", "/v2/pods", 201, body=dict(runpod_api.add_pod(name="other") | {"id": HOSTILE_ID}))
    c = tiny_client()
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    with pytest.raises(api.ApiError, match="no pod id of RunPod's shape"):
        c.create_pod(pod_body(tpl, 4, "SECURE", "p", run=new_run()))
    runpod_api.fail("GET", "/v2/pods", 200, body={"pods": [dict(runpod_api.pod(next(iter(runpod_api.pods))),
                                                                id=HOSTILE_ID)]})
    assert [p["id"] for p in c.pods()] == []
    for call in (lambda: c.action(HOSTILE_ID, "terminate"), lambda: c.pod(HOSTILE_ID),
                 lambda: list(c.logs(HOSTILE_ID, follow=False))):
        with pytest.raises(api.ApiError, match="is not a RunPod pod id"):
            call()
    assert not [q for q in runpod_api.requests if "victim" in q.path or "victim" in str(q.query)]
    runpod_api.fail("POST", "/v2/pods", 201, body={"id": f"Bearer {KEY}"})
    with pytest.raises(api.ApiError) as e:
        c.create_pod(pod_body(tpl, 4, "SECURE", "p"))
    assert KEY[:4] not in e.value.message, "an id that echoes the key is shown redacted"


def test_a_log_line_of_many_mib_costs_a_bounded_amount_of_memory():
    """One 20 MiB SSE line is read through in pieces and given as skipped: memory stays under 2 MiB,
    the next event comes whole."""
    import io
    import tracemalloc

    stream = io.BytesIO(b"id: 1\ndata: " + b"x" * (20 << 20) + b"\n\nid: 2\ndata: {\"line\": \"after\"}\n\n")
    tracemalloc.start()
    try:
        events = list(api.sse_events(stream))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert events == [("1", None), ("2", '{"line": "after"}')] and peak < 2 << 20, peak


def test_deploy_logs_says_a_line_over_the_limit_was_skipped(runpod_api):
    pid = runpod_api.add_pod()["id"]
    runpod_api.logs[pid] = [("container", "a" * (300 << 10)), ("container", "after")]
    lines = [e["line"] for e in api.Client(sleep=lambda s: None).logs(pid, follow=False, settle_s=1)]
    assert lines == ["[podkit] a log event over 256 KiB was skipped", "after"]


# -- a create answered late (issue 37) -----------------------------------------------------------------

def late_create(stub: RunPodV2Stub, list_lag_s: float, create_answer_s: float, lag_allowed_s: float = 0):
    """A Deployer whose create RunPod makes at once and answers after 3 s (the client gives up after
    1 s), and whose pod list shows a new pod only `list_lag_s` after it was made; the Deployer looks for
    `create_answer_s` + `lag_allowed_s` before it sends the create again."""
    stub.answer_late("POST", "/v2/pods", 3.0)
    stub.list_lag_s = list_lag_s
    d = Deployer(api.Client(timeout_s=1, sleep=lambda s: None), sleep=time.sleep,
                        create_answer_s=create_answer_s, look_every_s=0.25, list_lag_s=lag_allowed_s)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    return d, pod_body(tpl, 4, "SECURE", "p", run=new_run())


def test_a_create_answered_late_is_looked_for_before_it_is_sent_again(runpod_api):
    """The create's answer is lost and RunPod lists the pod only 7.5 s later (past podkit's old look, 5 s
    after the timeout): podkit looks for it for as long as the create could still be made, finds it, and
    sends no second create."""
    d, body = late_create(runpod_api, list_lag_s=7.5, create_answer_s=10)
    pod = d.create_pod(body, capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 1 and list(runpod_api.pods) == [pod["id"]]


def test_after_a_create_sent_twice_exactly_one_pod_of_the_run_is_left(runpod_api):
    """The pod list lags past even the lag podkit allows for (7 s against 1 + 2 s): the create is sent
    again and RunPod makes a second pod. Once the first shows, the second (still starting) is terminated
    and the first, created first, is the one waited for: one pod bills, not two."""
    runpod_api.polls_until_running = 40
    d, body = late_create(runpod_api, list_lag_s=7, create_answer_s=1, lag_allowed_s=2)
    second = d.create_pod(body, capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 2
    first = next(pid for pid in runpod_api.pods if pid != second["id"])
    pod = d.wait_running(second["id"], timeout_s=40, poll_s=0.25)
    assert pod["id"] == first and runpod_api.terminated == {second["id"]} and list(runpod_api.pods) == [first]


# -- never two pods for one create (issue 48) -------------------------------------------------------------

def lost_create(stub: RunPodV2Stub, clock: Clock):
    """A Deployer on a fake clock (the stub's pod list lags on it too) with its defaults, whose create
    RunPod makes and answers with a connection dropped mid-body; the body, of a new run."""
    stub.garble("POST", "/v2/pods", "drop")
    stub.clock = clock
    d = Deployer(api.Client(sleep=clock.sleep), sleep=clock.sleep)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    return d, pod_body(tpl, 4, "SECURE", "p", run=new_run())


def test_a_pod_list_lagging_past_the_old_look_gets_no_second_create(runpod_api):
    """The create's answer is lost and RunPod's pod list leaves the pod out for 200 s, past the 120 s in
    which RunPod may still make it (all podkit used to look): podkit looks for as long as the list may
    lag besides (LIST_LAG_S), finds the pod, and sends no second create."""
    clock = Clock()
    d, body = lost_create(runpod_api, clock)
    runpod_api.list_lag_s = 200
    pod = d.create_pod(body, capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 1 and list(runpod_api.pods) == [pod["id"]]
    assert d.look_s() == d.CREATE_ANSWER_S + d.LIST_LAG_S and 200 <= clock.t < d.look_s()
    assert d.wait_running(pod["id"], timeout_s=20, poll_s=1)["id"] == pod["id"]


@pytest.mark.parametrize("status, ended", [("RUNNING", "stopped"), ("PROVISIONING", "terminated")])
def test_a_second_pod_of_the_run_is_named_with_its_price_and_ended(runpod_api, capsys, status, ended):
    """The create's answer is lost, and when the run's pods show there are two: the one made by this
    create and a later one (a create re-sent by an older podkit, or a race). podkit follows the one made
    first and names the other with its price, then ends it: terminated while it starts (nothing is on it
    yet), stopped once it runs (its GPUs stop billing; its disk stays for a person to look at)."""
    clock = Clock()
    d, body = lost_create(runpod_api, clock)
    runpod_api.list_lag_s, runpod_api.polls_until_running = 30, 10
    create, extra = d.api.create_pod, {}
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def create_and_another(b):
        try:
            return create(b)
        finally:
            extra.update(runpod_api.add_pod(name=b["name"], env=dict(b["env"]), status=status, createdAt=later,
                                            gpu={"id": "NVIDIA A40", "count": 4}))
            runpod_api.unlisted(extra["id"])  # the list lags for it too

    d.api.create_pod = create_and_another
    pod = d.create_pod(body, capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 1 and pod["id"] != extra["id"]
    run = body["env"]["PODKIT_RUN_ID"]
    assert f"pod {extra['id']} (p, {status}, $1.60/h) is a second pod of run {run} beside pod {pod['id']}" \
        in capsys.readouterr().out
    if ended == "stopped":
        assert runpod_api.pods[extra["id"]]["status"] == "EXITED" and runpod_api.terminated == set()
    else:
        assert runpod_api.terminated == {extra["id"]}
    assert d.wait_running(pod["id"], timeout_s=20, poll_s=1)["id"] == pod["id"]


def test_a_pod_of_another_run_with_the_same_name_is_never_touched(runpod_api, capsys):
    """While podkit looks for its lost create's pod (the list lagging 200 s), another run's pod of the same
    name, created earlier and running (a deploy from another terminal), shows up: it is neither followed
    as this run's pod nor ended as a second one; podkit finds its own and sends no second create."""
    clock = Clock()
    d, body = lost_create(runpod_api, clock)
    runpod_api.list_lag_s = 200
    clock.events = {3: lambda: runpod_api.add_pod(id="pod-other", name="p", status="RUNNING",
                                                  env={"PODKIT_RUN_ID": new_run()},
                                                  createdAt="2026-01-01T00:00:00Z")}
    pod = d.create_pod(body, capacity_timeout_s=0)
    assert pod["id"] != "pod-other" and runpod_api.calls().count("POST /v2/pods") == 1
    assert d.wait_running(pod["id"], timeout_s=20, poll_s=1)["id"] == pod["id"]
    assert runpod_api.pods["pod-other"]["status"] == "RUNNING" and "pod-other" not in capsys.readouterr().out
    assert not [q for q in runpod_api.requests if q.method == "POST" and "/action" in q.path]


# -- never pay twice (issue 43) ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["bad-id", "cut", "drop"])
def test_a_create_made_but_answered_unreadably_is_followed_never_sent_again(runpod_api, how):
    """RunPod made the pod, and its answer cannot be read: an id not of RunPod's shape, a body cut short, a
    connection closed mid-body. Before any second create, podkit looks for the run's pods (by the run id it put
    in the pod's env), finds the one RunPod made, and follows it until it runs: one create sent, one pod billing."""
    runpod_api.garble("POST", "/v2/pods", how)
    runpod_api.add_pod(name="p")  # an older pod of the same name, of no run: not the one made
    d = Deployer(tiny_client(), sleep=time.sleep, create_answer_s=2, look_every_s=0.2)
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    body = pod_body(tpl, 4, "SECURE", "p", run=new_run())
    pod = d.create_pod(body, capacity_timeout_s=0)
    assert runpod_api.calls().count("POST /v2/pods") == 1, "never sent again"
    [made] = [p for p in runpod_api.pods.values() if p["env"].get("PODKIT_RUN_ID") == body["env"]["PODKIT_RUN_ID"]]
    assert pod["id"] == made["id"] and len(runpod_api.pods) == 2 and runpod_api.terminated == set()
    assert d.wait_running(pod["id"], timeout_s=20, poll_s=0.2)["id"] == made["id"]
    assert not [q for q in runpod_api.requests if "victim" in q.path], "the unreadable id went nowhere"
