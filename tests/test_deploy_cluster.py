"""`podkit deploy cluster` against a local stand-in for RunPod's API (127.0.0.1; RUNPOD_API_BASE_URL
points podkit at it): the GraphQL endpoint the network volume is looked up through, and the REST API
v2's cluster endpoints. The stand-in checks each create against RunPod's own schema for it: the
fragments of RunPod's OpenAPI spec below (runpod/docs, api-reference-v2/openapi.json, "Runpod REST
API" 2.0.0), descriptions and examples left out, validated with jsonschema as the spec's 2020-12
dialect reads them (`unevaluatedProperties: false`: a field the spec does not define is refused)."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest

from conftest import ROOT
from podkit import deploy
from podkit.errors import PodkitError
from test_deploy import KEY, parse
from test_deploy import podkit_deploy as run_deploy

pytestmark = pytest.mark.timeout(60)
H100 = "NVIDIA H100 80GB HBM3"
VOLUME = {"id": "vol-ckpt1", "name": "checkpoints", "size": 500, "dataCenterId": "US-TX-3"}

# components.schemas of RunPod's OpenAPI spec, as the spec defines them (POST /v2/clusters: createCluster).
SPEC_SCHEMAS = {
    "BaseContainerConfig": {"type": "object", "properties": {
        "args": {"type": "string"}, "disk": {"type": "integer", "minimum": 1},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "image": {"type": "string"}, "ports": {"type": "array", "items": {"type": "string"}}}},
    "ClusterType": {"type": "string", "enum": ["APPLICATION", "TRAINING", "SLURM", "RAY"]},
    "ClusterCompute": {"type": "object", "additionalProperties": False,
                       "required": ["gpuTypeId", "gpuCountPerPod", "podCount"], "properties": {
                           "gpuTypeId": {"type": "string", "minLength": 1},
                           "gpuCountPerPod": {"type": "integer", "minimum": 1},
                           "podCount": {"type": "integer", "minimum": 2, "maximum": 250}}},
    "NetworkMount": {"type": "object", "required": ["volumeId", "path"], "additionalProperties": False,
                     "properties": {"volumeId": {"type": "string"}, "path": {"type": "string"}}},
    "PersistentMount": {"type": "object", "required": ["size", "path"], "additionalProperties": False,
                        "properties": {"size": {"type": "integer", "minimum": 10}, "path": {"type": "string"}}},
    "Mounts": {"type": "object", "additionalProperties": False, "properties": {
        "persistent": {"$ref": "#/components/schemas/PersistentMount"},
        "network": {"type": "array", "maxItems": 1, "items": {"$ref": "#/components/schemas/NetworkMount"}}}},
    "CreateClusterRequest": {"allOf": [
        {"$ref": "#/components/schemas/BaseContainerConfig"},
        {"type": "object", "required": ["name", "type", "compute"], "properties": {
            "compute": {"$ref": "#/components/schemas/ClusterCompute"},
            "name": {"type": "string", "minLength": 1},
            "type": {"$ref": "#/components/schemas/ClusterType"},
            "dataCenterIds": {"type": "array", "items": {"type": "string"}},
            "mounts": {"$ref": "#/components/schemas/Mounts"},
            "startJupyter": {"type": "boolean", "default": False},
            "startSsh": {"type": "boolean", "default": False}}}],
        "unevaluatedProperties": False},
}
CREATE_REQUEST = jsonschema.Draft202012Validator(
    {"$ref": "#/components/schemas/CreateClusterRequest", "components": {"schemas": SPEC_SCHEMAS}})
CLUSTER_REQUIRED = ("id", "name", "type", "compute", "pods", "createdAt")  # the Cluster a 201 answers


class FakeRunPodREST:
    """A stand-in for RunPod's API: it records every request, refuses a create the spec's schema
    refuses (422, problem+json, as RunPod answers), and answers what `answer` is set to otherwise."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, object, str | None]] = []  # (method, path, body, Authorization)
        self.clusters: dict[str, dict] = {}
        self.answer: tuple[int, str, bytes] | None = None  # (status, content type, body) for the next REST call
        self.delay_s = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status: int, body: object = None, ctype: str = "application/json") -> None:
                out = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
                self.send_response(status)
                if out:
                    self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def handle_any(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                fake.requests.append((method, self.path, body, self.headers.get("Authorization")))
                if fake.delay_s:
                    time.sleep(fake.delay_s)
                if self.path == "/graphql":
                    field, _ = parse(body["query"])
                    return self.reply(200, {"data": {"myself": {"networkVolumes": [VOLUME], "podTemplates": []}}}
                                      if field == "myself" else {"errors": [{"message": f"stand-in: {field}?"}]})
                if fake.answer:
                    status, ctype, out = fake.answer
                    return self.reply(status, out, ctype)
                status, out = fake.rest(method, self.path, body)
                self.reply(status, out, "application/json" if status < 400 else "application/problem+json")

            def do_POST(self):
                self.handle_any("POST")

            def do_GET(self):
                self.handle_any("GET")

            def do_DELETE(self):
                self.handle_any("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def rest(self, method: str, path: str, body) -> tuple[int, object]:
        if method == "POST" and path == "/v2/clusters":
            errors = [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}"
                      for e in CREATE_REQUEST.iter_errors(body)]
            if errors:
                return 422, {"title": "Unprocessable Entity", "status": 422, "detail": "Request validation failed.",
                             "errors": errors}
            cid = f"cluster_{len(self.clusters) + 1:03d}"
            self.clusters[cid] = {"id": cid, "name": body["name"], "type": body["type"], "compute": body["compute"],
                                  "pods": {"total": 0, "byStatus": {}}, "createdAt": "2026-08-20T12:00:00Z"}
            return 201, self.clusters[cid]
        m = re.fullmatch(r"/v2/clusters/([^/]+)", path)
        if m and m.group(1) in self.clusters:
            if method == "DELETE":
                del self.clusters[m.group(1)]
                return 204, None
            return 200, self.clusters[m.group(1)]
        return 404, {"title": "Not Found", "status": 404, "detail": "cluster not found"}

    def rest_requests(self) -> list[tuple[str, str, object, str | None]]:
        return [r for r in self.requests if r[1] != "/graphql"]

    def __enter__(self) -> FakeRunPodREST:
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def runpod_api(monkeypatch):
    """The stand-in, podkit pointed at it (test_deploy's key); shut down after the test."""
    with FakeRunPodREST() as fake:
        for name, value in (("RUNPOD_API_BASE_URL", fake.url), ("RUNPOD_API_KEY", KEY)):
            monkeypatch.setenv(name, value)
        yield fake


def podkit_deploy(fake, *args):
    """`podkit deploy ...` as test_deploy runs it; the key never in its output, no traceback."""
    r = run_deploy(fake, *args)
    assert KEY not in r.stdout + r.stderr and "Traceback" not in r.stderr
    return r


CREATE = ("cluster", "--image", "registry.example/podkit:1.0", "--nodes", "2", "--gpus-per-node", "8",
          "--gpu-type", H100, "--network-volume", VOLUME["id"])


def test_a_cluster_create_sends_the_spec_body_and_says_what_next(runpod_api):
    """One GraphQL query for the volume's data center, then POST /v2/clusters with a body the spec's
    schema accepts: 2 x 8 H100s, the image, the cluster config and node count in every node's env, the
    template's secret references, the volume at /workspace in its data center; the id printed."""
    r = podkit_deploy(runpod_api, *CREATE, "--max-runtime", "24h")
    assert r.returncode == 0, r.stderr
    [(method, path, body, auth)] = runpod_api.rest_requests()
    assert (method, path, auth) == ("POST", "/v2/clusters", f"Bearer {KEY}")
    assert list(CREATE_REQUEST.iter_errors(body)) == []
    assert body["type"] == "TRAINING"
    assert body["compute"] == {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}
    assert body["image"] == "registry.example/podkit:1.0"
    env = body["env"]
    assert env["PODKIT_CONFIG"] == "/opt/podkit/configs/cluster-2x8.yaml" and env["PODKIT_CLUSTER_NODES"] == "2"
    assert env["GIT_TOKEN"] == "{{ RUNPOD_SECRET_GIT_TOKEN }}"
    assert 23 * 3600 < float(env["PODKIT_GUARD_STOP_POD_AT"]) - time.time() <= 24 * 3600
    assert body["mounts"] == {"network": [{"volumeId": "vol-ckpt1", "path": "/workspace"}]}
    assert body["dataCenterIds"] == ["US-TX-3"] and body["ports"] == ["22/tcp"] and body["startSsh"] is True
    assert {r[3] for r in runpod_api.requests} == {f"Bearer {KEY}"}
    assert "cluster cluster_001 created" in r.stdout
    assert "podkit deploy cluster-status cluster_001" in r.stdout and "podkit deploy cluster-delete cluster_001" in r.stdout


def test_dry_run_prints_the_body_and_sends_nothing(runpod_api):
    r = podkit_deploy(runpod_api, *CREATE, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert runpod_api.requests == []
    assert f"POST {runpod_api.url}/v2/clusters" in r.stdout and "nothing was sent" in r.stdout
    body = json.loads(r.stdout[r.stdout.index("\n{") + 1:r.stdout.rindex("}\n") + 1])
    assert list(CREATE_REQUEST.iter_errors(body)) == []
    assert body["compute"]["podCount"] == 2 and body["env"]["PODKIT_CLUSTER_NODES"] == "2"


@pytest.mark.parametrize("args, problem", [
    (("cluster", "--gpu-type", H100), "--network-volume: a cluster needs a network volume"),
    (("cluster", "--gpu-type", H100, "--network-volume", "v", "--nodes", "1"), "--nodes: 1: a cluster has 2 nodes"),
    (("cluster", "--gpu-type", H100, "--network-volume", "v", "--nodes", "251"), "--nodes: 251: RunPod's clusters"),
    (("cluster", "--gpu-type", H100, "--network-volume", "v", "--gpus-per-node", "0"), "--gpus-per-node: 0"),
    (("cluster", "--network-volume", "v"), "--gpu-type: required"),
    (("cluster", "--gpu-type", H100, "--network-volume", "v", "--nodes", "4"), "no shipped cluster config for 4"),
    (("cluster", "--gpu-type", H100, "--network-volume", "v", "--max-runtime", "soon"), "'soon' is not a duration"),
    (("cluster-status", "../pods"), "is not a RunPod cluster id"),
])
def test_bad_requests_are_refused_before_anything_is_sent(runpod_api, args, problem):
    r = podkit_deploy(runpod_api, *args)
    assert r.returncode == 2 and problem in r.stderr, r.stderr
    assert runpod_api.requests == []


def test_runpods_4xx_message_is_reported(runpod_api):
    """RunPod's problem+json: its title, detail and errors, with the status; exit 1."""
    problem = {"title": "Bad Request", "status": 400, "detail": "no capacity for 2 x 8 NVIDIA H100 80GB HBM3 in US-TX-3",
               "errors": ["compute: not available"]}
    runpod_api.answer = (400, "application/problem+json", json.dumps(problem).encode())
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1
    assert "HTTP 400: Bad Request: no capacity for 2 x 8 NVIDIA H100 80GB HBM3 in US-TX-3 (compute: not available)" \
        in r.stderr


def test_a_key_in_runpods_answer_is_redacted(runpod_api):
    runpod_api.answer = (401, "application/problem+json",
                         json.dumps({"title": "Unauthorized", "status": 401, "detail": f"bad key {KEY}"}).encode())
    r = podkit_deploy(runpod_api, *CREATE)  # asserts the key is nowhere in the output
    assert r.returncode == 1 and "HTTP 401: Unauthorized: bad key ***" in r.stderr and "API key is invalid" in r.stderr


def test_a_5xx_without_json_is_reported(runpod_api):
    runpod_api.answer = (502, "text/html", b"<html>Bad Gateway</html>")
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1 and "HTTP 502: <html>Bad Gateway</html>" in r.stderr


def test_a_2xx_that_is_not_json_is_reported(runpod_api):
    runpod_api.answer = (201, "text/plain", b"created")
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1 and "HTTP 201 and no JSON object: 'created'" in r.stderr


def test_a_create_the_spec_refuses_shows_runpods_validation_errors(runpod_api):
    """What RunPod's validation answers reaches the person: here a field the spec does not define."""
    d = deploy.Deployer()
    with pytest.raises(PodkitError) as e:
        d.create_cluster({"name": "x", "type": "TRAINING", "cloudType": "SECURE",
                          "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}})
    assert "HTTP 422: Unprocessable Entity: Request validation failed." in e.value.message
    assert "cloudType" in e.value.message


def test_an_api_that_does_not_answer_in_time_is_reported(runpod_api):
    runpod_api.delay_s = 1.0
    with pytest.raises(PodkitError) as e:
        deploy.Deployer().rest("GET", "/v2/clusters/cluster_001", timeout_s=0.2)
    assert "did not answer GET" in e.value.message and "ReadTimeout" in e.value.message


def test_status_and_delete_use_the_clusters_endpoints(runpod_api):
    assert podkit_deploy(runpod_api, *CREATE).returncode == 0
    r = podkit_deploy(runpod_api, "cluster-status", "cluster_001")
    assert r.returncode == 0 and "cluster_001" in r.stdout and f"2 x 8 {H100}" in r.stdout
    assert podkit_deploy(runpod_api, "cluster-delete", "cluster_001").returncode == 0
    assert [r[:2] for r in runpod_api.rest_requests()][1:] == [("GET", "/v2/clusters/cluster_001"),
                                                               ("DELETE", "/v2/clusters/cluster_001")]
    r = podkit_deploy(runpod_api, "cluster-status", "cluster_001")
    assert r.returncode == 1 and "HTTP 404: Not Found: cluster not found" in r.stderr


def test_the_shipped_cluster_config_is_in_the_image():
    assert (ROOT / deploy.SHIPPED_CLUSTER_CONFIG.removeprefix("/opt/podkit/")).is_file()
