"""`podkit deploy` against a local GraphQL endpoint that answers as RunPod would and records what the
real runpod SDK sends (RUNPOD_API_BASE_URL points the SDK at it). Every request is parsed with
graphql-core, so the values asserted are the ones RunPod would read."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import graphql
import pytest

from conftest import ROOT
from podkit import config, deploy
from podkit.errors import ConfigError, PodkitError

pytestmark = pytest.mark.timeout(60)
KEY = "rpa_TESTKEY0123456789"
NO_CAPACITY = ("There are no longer any instances available with the requested specifications. "
               "Please refresh and try again.")


def parse(query: str) -> tuple[str, dict]:
    """(top-level field, its arguments as Python values) of a GraphQL document."""
    doc = graphql.parse(query)
    field = doc.definitions[0].selection_set.selections[0]
    args = {a.name.value: graphql.value_from_ast_untyped(a.value) for a in field.arguments or ()}
    return field.name.value, args


class FakeRunPod:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, str]] = []  # (field, args, Authorization)
        self.templates: list[dict] = []
        self.capacity_failures = 0
        self.pod_polls = 0
        self.polls_until_running = 1
        self.volumes = [{"id": "vol-ckpt1", "name": "checkpoints", "size": 200, "dataCenterId": "EU-SE-1"}]
        # A pod's answers in turn (the last one repeats), for pod ids listed here; None: no such pod;
        # a string: a GraphQL error with that message.
        self.script: dict[str, list[dict | None]] = {}
        self.new_pod_ids: list[str] = []  # ids for the pods created, in turn
        self.outage = 0  # answer this many requests with a bare 502, as a proxy in front of an API that is down
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                field, args = parse(body["query"])
                if fake.outage:
                    fake.outage -= 1
                    fake.requests.append(("(outage)", args, self.headers.get("Authorization")))
                    self.send_response(502)
                    self.send_header("Content-Length", "11")
                    self.end_headers()
                    self.wfile.write(b"Bad Gateway")
                    return
                fake.requests.append((field, args, self.headers.get("Authorization")))
                out = json.dumps(fake.answer(field, args)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, field: str, args: dict) -> dict:
        if field == "myself":
            return {"data": {"myself": {"podTemplates": self.templates, "networkVolumes": self.volumes}}}
        if field == "saveTemplate":
            tpl = dict(args["input"])
            if "id" not in tpl:
                tpl["id"] = f"tpl-{len(self.templates) + 1}"
                self.templates.append({"id": tpl["id"], "name": tpl["name"], "imageName": tpl["imageName"]})
            return {"data": {"saveTemplate": tpl}}
        if field == "gpuTypes":
            return {"data": {"gpuTypes": [{"id": "NVIDIA A40", "displayName": "A40", "memoryInGb": 48}]}}
        if field == "podFindAndDeployOnDemand":
            if self.capacity_failures:
                self.capacity_failures -= 1
                return {"errors": [{"message": NO_CAPACITY}]}
            pod_id = self.new_pod_ids.pop(0) if self.new_pod_ids else "pod-abc123"
            return {"data": {"podFindAndDeployOnDemand": {"id": pod_id, "imageName": args["input"]["imageName"],
                                                          "env": [], "machineId": "m1", "machine": {"podHostId": "h"}}}}
        if field == "pod" and args["input"]["podId"] in self.script:
            answers = self.script[args["input"]["podId"]]
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, str):  # a GraphQL error RunPod answers with
                return {"errors": [{"message": answer}]}
            return {"data": {"pod": answer}}
        if field == "pod":
            self.pod_polls += 1
            running = self.pod_polls >= self.polls_until_running
            return {"data": {"pod": {
                "id": args["input"]["podId"], "name": "podkit", "desiredStatus": "RUNNING", "gpuCount": 4,
                "uptimeSeconds": 12, "runtime": {"ports": [
                    {"ip": "203.0.113.7", "isIpPublic": True, "privatePort": 22, "publicPort": 22022, "type": "tcp"}]}
                if running else None}}}
        if field == "podStop":
            return {"data": {"podStop": {"id": args["input"]["podId"], "desiredStatus": "EXITED"}}}
        if field == "podTerminate":
            return {"data": {"podTerminate": None}}
        return {"errors": [{"message": f"fake endpoint does not know {field}"}]}

    def fields(self) -> list[str]:
        return [r[0] for r in self.requests]

    def sent(self, field: str) -> dict:
        return next(r[1] for r in self.requests if r[0] == field)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def runpod_api(monkeypatch):
    fake = FakeRunPod()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", fake.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    yield fake
    fake.close()


def podkit_deploy(fake, *args):
    env = {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, "-m", "podkit", "deploy", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_deploy_creates_the_template_then_a_4xa40_pod_and_says_how_to_reach_it(runpod_api):
    """Template saved, GPU type checked, pod created on 4 A40s with the volume at /workspace, waited
    for, and the SSH command printed; the API key only in the Authorization header."""
    r = podkit_deploy(runpod_api, "--image", "registry.example/podkit:1.0", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert runpod_api.fields()[:4] == ["myself", "saveTemplate", "gpuTypes", "podFindAndDeployOnDemand"]
    tpl = runpod_api.sent("saveTemplate")["input"]
    assert "id" not in tpl and tpl["imageName"] == "registry.example/podkit:1.0"
    assert tpl["volumeMountPath"] == "/workspace" and tpl["dockerArgs"] == ""
    pod = runpod_api.sent("podFindAndDeployOnDemand")["input"]
    assert (pod["gpuTypeId"], pod["gpuCount"], pod["cloudType"]) == ("NVIDIA A40", 4, "SECURE")
    assert pod["volumeMountPath"] == "/workspace" and pod["templateId"] == "tpl-1"
    assert {e["key"]: e["value"] for e in pod["env"]}["GIT_TOKEN"] == "{{ RUNPOD_SECRET_GIT_TOKEN }}"
    assert "ssh root@203.0.113.7 -p 22022" in r.stdout
    assert {auth for *_, auth in runpod_api.requests} == {f"Bearer {KEY}"}
    assert KEY not in r.stdout + r.stderr


def test_a_one_a40_pod(runpod_api):
    """--gpus 1 asks for one A40."""
    r = podkit_deploy(runpod_api, "--gpus", "1", "--cloud", "COMMUNITY", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    pod = runpod_api.sent("podFindAndDeployOnDemand")["input"]
    assert (pod["gpuCount"], pod["cloudType"]) == (1, "COMMUNITY")
    env = {e["key"]: e["value"] for e in pod["env"]}
    assert env["PODKIT_CONFIG"] == "/opt/podkit/configs/a40-1gpu.yaml"  # SGLang and trainer share the GPU


def test_a_gpu_count_without_a_shipped_config_is_refused_before_anything_is_sent(runpod_api):
    r = podkit_deploy(runpod_api, "--gpus", "3", "--wait-timeout", "30")
    assert r.returncode == 2 and "--gpus: no shipped A40 pod config for 3 GPUs" in r.stderr
    assert "Traceback" not in r.stderr
    assert runpod_api.fields() == []


def test_a_pod_config_of_your_own_is_kept_for_any_gpu_count(runpod_api, tmp_path):
    tpl = tmp_path / "template.yaml"
    tpl.write_text(json.dumps({"name": "t", "imageName": "img", "volumeMountPath": "/workspace",
                               "env": {"PODKIT_CONFIG": "/workspace/my-pod.yaml"}}))
    r = podkit_deploy(runpod_api, "--template", str(tpl), "--gpus", "3", "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    env = {e["key"]: e["value"] for e in runpod_api.sent("podFindAndDeployOnDemand")["input"]["env"]}
    assert env["PODKIT_CONFIG"] == "/workspace/my-pod.yaml"


def test_every_shipped_config_deploy_can_name_is_in_the_image():
    from podkit import deploy

    for n in deploy.SHIPPED_GPUS:
        assert (ROOT / deploy.SHIPPED_CONFIG.format(n).removeprefix("/opt/podkit/")).is_file()


def test_a_second_deploy_updates_the_template_of_the_same_name(runpod_api):
    """Idempotent: a template with the same name is updated by id, not duplicated."""
    runpod_api.templates.append({"id": "tpl-existing", "name": "podkit-areal-grpo", "imageName": "old"})
    r = podkit_deploy(runpod_api, "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    assert runpod_api.sent("saveTemplate")["input"]["id"] == "tpl-existing"
    assert runpod_api.sent("podFindAndDeployOnDemand")["input"]["templateId"] == "tpl-existing"
    assert len(runpod_api.templates) == 1


HOSTILE = {"QUOTE": 'say "hi"', "NEWLINE": "line1\nline2", "DOLLAR": "$HOME ${PATH} $(id)",
           "BACKSLASH": "C:\\path\\n", "BRACES": "} ] { injected: true", "UNICODE": "température ✓"}


def test_hostile_values_in_env_and_start_command_arrive_intact(runpod_api, tmp_path):
    """Quotes, newlines, `$`, backslashes and braces in env values and the start command reach
    RunPod byte for byte, in the template and in the pod (the SDK does not escape them)."""
    tpl = tmp_path / "template.yaml"
    cmd = 'bash -c "echo \\"$PODKIT_REPO_URL\\"; exec /entrypoint"\n'
    tpl.write_text(json.dumps({"name": "t", "imageName": "img", "volumeMountPath": "/workspace",
                               "dockerArgs": cmd, "env": HOSTILE}))
    r = podkit_deploy(runpod_api, "--template", str(tpl), "--name", 'pod "x"\n', "--wait-timeout", "30")
    assert r.returncode == 0, r.stderr
    for field in ("saveTemplate", "podFindAndDeployOnDemand"):
        sent = runpod_api.sent(field)["input"]
        # The pod also gets the shipped pod config for its GPU count (4 by default).
        extra = {"PODKIT_CONFIG": "/opt/podkit/configs/a40-4gpu.yaml"} if field.startswith("pod") else {}
        assert {e["key"]: e["value"] for e in sent["env"]} == {**HOSTILE, **extra}
        assert sent["dockerArgs"] == cmd
    assert runpod_api.sent("podFindAndDeployOnDemand")["input"]["name"] == 'pod "x"\n'


def test_capacity_errors_are_retried_with_back_off_then_succeed(runpod_api):
    """'No longer any instances available' twice, then a pod: retried with growing delays."""
    runpod_api.capacity_failures = 2
    slept: list[float] = []
    d = deploy.Deployer(sleep=slept.append)
    tpl = deploy.load_template(ROOT / "runpod" / "template.yaml")
    pod = d.create_pod(deploy.pod_args(tpl, "tpl-1", 4, "SECURE", "p"), capacity_timeout_s=600)
    assert pod["id"] == "pod-abc123"
    assert runpod_api.fields().count("podFindAndDeployOnDemand") == 3
    assert len(slept) == 2 and slept[1] > slept[0]


def test_capacity_that_never_comes_is_reported_with_alternatives(runpod_api):
    """After the bounded time: an error naming other clouds and fewer GPUs."""
    runpod_api.capacity_failures = 1000
    d = deploy.Deployer(sleep=lambda s: None)
    tpl = deploy.load_template(ROOT / "runpod" / "template.yaml")
    with pytest.raises(PodkitError) as e:
        d.create_pod(deploy.pod_args(tpl, "tpl-1", 4, "SECURE", "p"), capacity_timeout_s=0)
    assert "no 4x NVIDIA A40 available in SECURE cloud" in e.value.message
    assert "--cloud COMMUNITY" in e.value.hint and "--gpus 2" in e.value.hint


def test_dry_run_prints_the_mutations_and_sends_nothing(runpod_api):
    """--dry-run shows the template and pod mutations and makes no request."""
    r = podkit_deploy(runpod_api, "--dry-run", "--gpus", "4")
    assert r.returncode == 0, r.stderr
    assert runpod_api.requests == []
    assert "saveTemplate" in r.stdout and "podFindAndDeployOnDemand" in r.stdout
    assert 'volumeMountPath: "/workspace"' in r.stdout and "gpuCount: 4" in r.stdout


def test_stop_terminate_and_status_send_their_operations(runpod_api):
    """stop -> podStop, terminate -> podTerminate, status -> pod query and how to reach it."""
    assert podkit_deploy(runpod_api, "stop", "pod-abc123").returncode == 0
    assert runpod_api.sent("podStop")["input"]["podId"] == "pod-abc123"
    assert podkit_deploy(runpod_api, "terminate", "pod-abc123").returncode == 0
    assert runpod_api.sent("podTerminate")["input"]["podId"] == "pod-abc123"
    r = podkit_deploy(runpod_api, "status", "pod-abc123")
    assert r.returncode == 0 and "RUNNING" in r.stdout and "ssh root@203.0.113.7 -p 22022" in r.stdout


def test_waiting_for_the_pod_polls_until_its_runtime_is_up(runpod_api):
    """A pod is running once RunPod reports its runtime ports; until then podkit polls."""
    runpod_api.polls_until_running = 3
    slept: list[float] = []
    pod = deploy.Deployer(sleep=slept.append).wait_running("pod-abc123", timeout_s=60, poll_s=5)
    assert pod["runtime"]["ports"] and runpod_api.pod_polls == 3 and slept == [5, 5]


def test_missing_api_key_is_a_clear_error(runpod_api):
    """No key anywhere: exit 1 with a hint, nothing sent."""
    r = subprocess.run([sys.executable, "-m", "podkit", "deploy", "stop", "pod-1"], capture_output=True, text=True,
                       env={"RUNPOD_API_BASE_URL": runpod_api.url, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
                       timeout=60)
    assert r.returncode == 1 and "no RunPod API key" in r.stderr and runpod_api.requests == []


def test_template_with_a_literal_secret_or_another_mount_is_refused(tmp_path):
    """Secrets are RunPod secret references; the volume is podkit's /workspace."""
    tpl = tmp_path / "t.yaml"
    tpl.write_text("name: t\nimageName: i\nvolumeMountPath: /workspace\nenv:\n  GIT_TOKEN: ghp_abcdefghijklmnop\n")
    with pytest.raises(ConfigError, match="looks like a literal secret"):
        deploy.load_template(tpl)
    tpl.write_text("name: t\nimageName: i\nvolumeMountPath: /runpod-volume\n")
    with pytest.raises(ConfigError, match="podkit's workspace is /workspace"):
        deploy.load_template(tpl)


def test_the_shipped_template_is_the_one_deploy_sends():
    """runpod/template.yaml is what `podkit deploy` loads by default, and it is valid."""
    assert deploy.default_template().read_text() == (ROOT / "runpod" / "template.yaml").read_text()
    tpl = deploy.load_template(config.packaged("runpod/template.yaml"))
    assert tpl["volumeMountPath"] == "/workspace" and tpl["dockerArgs"] == ""
