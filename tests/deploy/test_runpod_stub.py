"""The RunPod REST API v2 stub (tests/runpod_stub.py) against RunPod's own document: what it accepts, what
it refuses and how, and the behaviour the document describes in words (pod lifecycle, actions, log resume)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request

import jsonschema
import pytest

from runpod_stub import CAPACITY_DETAIL, SPEC, RunPodV2Stub

pytestmark = pytest.mark.timeout(60)
KEY = "rpa_TESTKEY0123456789"
H100 = "NVIDIA H100 80GB HBM3"
CREATE = {"name": "podkit-train", "image": "registry.example/podkit:1.0", "gpu": {"id": H100, "count": 2},
          "dataCenterIds": ["EU-SE-1"], "ports": ["22/tcp", "8888/http"], "env": {"PODKIT_CONFIG": "x.yaml"},
          "mounts": {"network": [{"volumeId": "vol-ckpt1", "path": "/workspace"}]}, "startSsh": True}


@pytest.fixture
def stub():
    with RunPodV2Stub(key=KEY) as s:
        yield s


def call(stub, method, path, body=None, headers=None, key=KEY, timeout=10):
    """(status, headers, parsed JSON body or raw bytes) of one request through urllib."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(stub.url + path, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, e.headers, e.read()
    try:
        return status, hdrs, json.loads(raw) if raw else None
    except ValueError:
        return status, hdrs, raw


def events(stub, pod_id, query="", headers=None):
    """The SSE events of one logs connection, and whether it broke before its end."""
    req = urllib.request.Request(f"{stub.url}/v2/pods/{pod_id}/logs{query}",
                                 headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    broke = False
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"] == "text/event-stream" and r.headers["Cache-Control"] == "no-cache"
        try:
            raw = r.read()
        except http.client.IncompleteRead as e:  # the chunked stream ended without its last chunk
            raw, broke = e.partial, True
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            out.append((fields["id"], json.loads(fields["data"])))
    return out, broke


def test_the_documents_schemas_are_valid_2020_12_schemas():
    """Every schema of the vendored document is one the stub's validator can read."""
    bad = {}
    for name, schema in SPEC["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            bad[name] = e.message
    assert bad == {}


def test_a_valid_create_is_201_provisioning_and_running_after_one_poll(stub):
    """201 with a complete Pod in PROVISIONING (no runtime, no direct SSH); the next GET shows it RUNNING
    with its public SSH port, in the volume's data center; every answer passed the document."""
    status, _, pod = call(stub, "POST", "/v2/pods", CREATE)
    assert status == 201, pod
    assert (pod["status"], pod["actions"], pod["runtime"], pod["ssh"]["direct"]) == \
        ("PROVISIONING", ["stop", "terminate"], None, None)
    assert pod["dataCenterId"] == "EU-SE-1" and pod["gpu"] == {"id": H100, "count": 2}
    status, _, pod = call(stub, "GET", f"/v2/pods/{pod['id']}")
    assert status == 200 and pod["status"] == "RUNNING" and pod["actions"] == ["stop", "restart", "terminate"]
    assert {"private": 22, "public": 22022, "type": "tcp", "ip": "203.0.113.7"} in pod["runtime"]["ports"]
    assert pod["ssh"]["direct"]["command"] == "ssh root@203.0.113.7 -p 22022" and len(pod["runtime"]["gpus"]) == 2
    status, _, listed = call(stub, "GET", "/v2/pods?includeClusterPods=false")
    assert status == 200 and [p["id"] for p in listed["pods"]] == [pod["id"]]
    assert stub.calls() == ["POST /v2/pods", f"GET /v2/pods/{pod['id']}", "GET /v2/pods"]
    assert stub.requests[-1].query == {"includeClusterPods": "false"}
    assert stub.requests[0].headers["authorization"] == f"Bearer {KEY}" and stub.requests[0].body == CREATE
    stub.assert_clean()


def test_a_create_the_document_refuses_is_422_with_its_errors(stub):
    """A field the document does not define and a count under its minimum: 422 problem+json listing both,
    kept in stub.refused; no pod made. A body that is not JSON is 400."""
    status, hdrs, problem = call(stub, "POST", "/v2/pods", {**CREATE, "cloudType": "SECURE",
                                                            "gpu": {"id": H100, "count": 0}})
    assert status == 422 and hdrs["Content-Type"] == "application/problem+json"
    assert problem["title"] == "Unprocessable Entity" and problem["detail"] == "Request validation failed."
    assert any("cloudType" in e for e in problem["errors"]), problem
    assert any(e.startswith("$.gpu.count: 0 is less than the minimum of 1") for e in problem["errors"]), problem
    assert [r.status for r in stub.refused] == [422] and stub.pods == {}
    assert call(stub, "POST", "/v2/pods", b"{name: x")[0] == 400
    assert call(stub, "POST", "/v2/pods", {**CREATE, "gpu": None})[0] == 422
    stub.assert_clean()


def test_the_capacity_failure_and_scripted_faults(stub):
    """capacity_failures: createPod's 400 with RunPod's words, then a 201; fail(): a 429 with Retry-After,
    a body that is not JSON, and a delay past the client's timeout."""
    stub.capacity_failures = 1
    status, _, problem = call(stub, "POST", "/v2/pods", CREATE)
    assert (status, problem["detail"]) == (400, CAPACITY_DETAIL)
    assert call(stub, "POST", "/v2/pods", CREATE)[0] == 201
    stub.fail("GET", r"/v2/pods/[^/]+", 429, retry_after=3)
    stub.fail("GET", r"/v2/pods", 502, body=b"<html>Bad Gateway</html>", content_type="text/html")
    status, hdrs, problem = call(stub, "GET", "/v2/pods/stubpod001")
    assert (status, hdrs["Retry-After"], problem["status"]) == (429, "3", 429)
    assert call(stub, "GET", "/v2/pods")[::2] == (502, b"<html>Bad Gateway</html>")
    stub.fail("*", r"/v2/pods/stubpod001", None, delay_s=1.0)
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        call(stub, "GET", "/v2/pods/stubpod001", timeout=0.2)
    assert call(stub, "GET", "/v2/pods/stubpod001")[0] == 200
    stub.assert_clean()


def test_actions_follow_the_status_and_a_bad_one_is_409(stub):
    """RUNNING allows stop, not start (409); a locked pod cannot stop (409); stop -> EXITED, start ->
    STARTING -> RUNNING on the next GET; terminate is 204 and the pod is gone."""
    pid = stub.add_pod(volume="vol-ckpt1")["id"]
    status, _, problem = call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "start"})
    assert status == 409 and "RUNNING" in problem["detail"]
    assert call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "pause"})[0] == 422
    assert call(stub, "PATCH", f"/v2/pods/{pid}", {"locked": True})[2]["locked"] is True
    assert call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "stop"})[0] == 409
    call(stub, "PATCH", f"/v2/pods/{pid}", {"locked": False})
    status, _, pod = call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "stop"})
    assert (status, pod["status"], pod["runtime"], pod["actions"], pod["cost"]) == \
        (200, "EXITED", None, ["start", "terminate"], 0.0)
    assert call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "start"})[2]["status"] == "STARTING"
    assert call(stub, "GET", f"/v2/pods/{pid}")[2]["status"] == "RUNNING"
    assert call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "terminate"})[:3:2] == (204, None)
    assert call(stub, "GET", f"/v2/pods/{pid}")[0] == 404 and stub.terminated == {pid}
    stub.assert_clean()


def test_migrate_and_vanish(stub):
    """migrate: the old id 404s, a new pod with a new IP and the same name, env and mounts runs; vanish:
    404 without anyone terminating it."""
    old = stub.add_pod(volume="vol-ckpt1", env={"A": "1"})
    new_id = stub.migrate(old["id"])
    assert call(stub, "GET", f"/v2/pods/{old['id']}")[0] == 404
    new = call(stub, "GET", f"/v2/pods/{new_id}")[2]
    assert new["status"] == "RUNNING" and new["ssh"]["direct"]["host"] != old["ssh"]["direct"]["host"]
    assert (new["name"], new["env"], new["mounts"]) == (old["name"], old["env"], old["mounts"])
    stub.vanish(new_id)
    assert call(stub, "GET", "/v2/pods")[2] == {"pods": []} and stub.terminated == set()
    stub.assert_clean()


def test_logs_resume_after_a_drop_with_last_event_id(stub):
    """The first connection breaks after 2 events; with Last-Event-ID the next one sends the rest, strictly
    after it; ts strictly increase and are the ones the stub stored; source and tail are honoured."""
    pid = stub.add_pod()["id"]
    stub.logs[pid] = [("system", "pulling image"), *[("container", f"step {i}") for i in range(4)]]
    stub.drop_logs_after = 2
    first, broke = events(stub, pid)
    assert broke and [e["line"] for _, e in first] == ["pulling image", "step 0"]
    rest, broke = events(stub, pid, headers={"Last-Event-ID": first[-1][0]})
    assert not broke and [e["line"] for _, e in rest] == ["step 1", "step 2", "step 3"]
    stamps = [i for i, _ in first + rest]
    assert stamps == sorted(set(stamps)) == [ts for ts, _, _ in stub.log_events(pid)]
    assert all(i == e["ts"] for i, e in first + rest)
    assert [e["line"] for _, e in events(stub, pid, "?source=container&tail=2")[0]] == ["step 2", "step 3"]
    assert events(stub, pid, "?tail=0")[0] == []
    assert [e["line"] for _, e in events(stub, pid, f"?since={stamps[3]}&tail=0")[0]] == ["step 2", "step 3"]
    for bad in ("?source=stdout", "?tail=5001", "?tail=x", "?follow=true"):
        assert call(stub, "GET", f"/v2/pods/{pid}/logs{bad}")[0] == 422, bad
    stub.assert_clean()


def test_logs_follow_sends_lines_appended_while_open(stub):
    """With follow_s, a line appended while the stream is open is sent on it."""
    pid = stub.add_pod()["id"]
    stub.logs[pid] = [("container", "a")]
    stub.follow_s = 1.0
    threading.Timer(0.3, lambda: stub.logs[pid].append(("container", "b"))).start()
    assert [e["line"] for _, e in events(stub, pid)[0]] == ["a", "b"]


def test_a_cluster_lives_through_its_endpoints(stub):
    """Create (201 Cluster), its members hidden from GET /v2/pods unless includeClusterPods, listed by
    /v2/clusters/{id}/pods, not stoppable as pods (409); scale_cluster adds a rank; DELETE 204, then 404."""
    body = {"name": "grpo", "type": "TRAINING", "image": "registry.example/podkit:1.0", "ports": ["22/tcp"],
            "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}, "dataCenterIds": ["EU-SE-1"],
            "mounts": {"network": [{"volumeId": "vol-ckpt1", "path": "/workspace"}]}, "startSsh": True}
    status, _, cluster = call(stub, "POST", "/v2/clusters", body)
    assert status == 201 and cluster["pods"] == {"total": 2, "byStatus": {"PROVISIONING": 2}}
    cid = cluster["id"]
    assert call(stub, "POST", "/v2/clusters", {**body, "cloudType": "SECURE"})[0] == 422
    assert call(stub, "GET", "/v2/pods")[2] == {"pods": []}
    members = call(stub, "GET", f"/v2/clusters/{cid}/pods")[2]["pods"]
    assert [(p["cluster"]["rank"], p["status"]) for p in members] == [(0, "RUNNING"), (1, "RUNNING")]
    assert len(call(stub, "GET", "/v2/pods?includeClusterPods=true")[2]["pods"]) == 2
    assert call(stub, "POST", f"/v2/pods/{members[0]['id']}/action", {"action": "stop"})[0] == 409
    assert call(stub, "DELETE", f"/v2/pods/{members[0]['id']}")[0] == 409
    stub.scale_cluster(cid, 1)
    cluster = call(stub, "GET", f"/v2/clusters/{cid}")[2]
    assert cluster["compute"]["podCount"] == 3 and cluster["pods"]["total"] == 3
    assert cluster["primary"]["sshEndpoint"].endswith(":22022")
    assert call(stub, "DELETE", f"/v2/clusters/{cid}")[0] == 204
    status, _, problem = call(stub, "GET", f"/v2/clusters/{cid}")
    assert (status, problem["detail"]) == (404, "cluster not found") and stub.pods == {}
    stub.assert_clean()


def test_graphql_unknown_paths_and_a_missing_key_are_recorded(stub):
    """GraphQL: 410 and in stub.graphql; a path the document lacks: 404 and in stub.unknown; no key: 401."""
    assert call(stub, "POST", "/graphql", {"query": "{ myself { id } }"})[0] == 410
    assert [r.path for r in stub.graphql] == ["/graphql"]
    assert call(stub, "GET", "/v2/podz")[0] == 404 and [r.path for r in stub.unknown] == ["/v2/podz"]
    status, _, problem = call(stub, "GET", "/v2/pods", key=None)
    assert (status, problem["detail"]) == (401, "missing bearer token")
    assert call(stub, "GET", "/v2/pods", key="rpa_WRONG")[0] == 401
    assert call(stub, "GET", "/v2/catalog/gpus?include=AVAILABILITY&product=POD")[2]["gpus"][0]["availability"]
    stub.assert_clean()


def test_answers_of_other_shapes_and_timings_are_scripted_and_not_held_to_the_document(stub):
    """What the watch and the client are tested against: a pod shown with no status or one the document
    lacks, an answer sent late for a request done at once, a pod list that lags, an answer dripped a byte
    at a time, keep-alive comments in a followed log stream. None of it is counted as the stub's bug."""
    import time

    from runpod_stub import KEEPALIVE, MISSING

    pid = stub.add_pod()["id"]
    stub.show_status(pid, MISSING)
    assert "status" not in call(stub, "GET", f"/v2/pods/{pid}")[2]
    stub.show_status(pid, "MIGRATING")
    assert [p["status"] for p in call(stub, "GET", "/v2/pods")[2]["pods"]] == ["MIGRATING"]
    stub.clear_shown(pid)
    assert call(stub, "GET", f"/v2/pods/{pid}")[2]["status"] == "RUNNING"

    stub.answer_late("POST", "/v2/pods", 1.0)
    stub.list_lag_s = 1.5
    with pytest.raises(OSError):  # the client's timeout: the answer comes after it
        call(stub, "POST", "/v2/pods", CREATE, timeout=0.3)
    assert len(stub.pods) == 2, "made at once"
    assert [p["id"] for p in call(stub, "GET", "/v2/pods")[2]["pods"]] == [pid], "not listed yet"
    time.sleep(1.6)
    assert len(call(stub, "GET", "/v2/pods")[2]["pods"]) == 2

    stub.fail("GET", "/v2/templates", 200, body={"templates": []}, drip_s=0.01)
    t0 = time.monotonic()
    assert call(stub, "GET", "/v2/templates")[2] == {"templates": []} and time.monotonic() - t0 > 0.8

    stub.logs[pid] = [("container", "hello")]
    stub.follow_s, stub.keepalive_s = 0.5, 0.1
    req = urllib.request.Request(f"{stub.url}/v2/pods/{pid}/logs", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        raw = r.read()
    assert raw.count(KEEPALIVE) >= 2 and b'"line":"hello"' in raw
    stub.assert_clean()


def test_a_pod_shows_its_cost_and_its_bill_grows_in_the_documents_buckets(stub):
    """`cost` is the pod's USD/h while it bills and 0.0 once it is EXITED; GET /v2/billing/pods answers its
    bill (what it ran plus charges) in buckets of the window, narrowed by podId; lastN with startTime is refused
    (400) and a bucketSize the document lacks is a 422. Every answer passed the document's schema."""
    import time

    pid = stub.add_pod(id="pod-bill1")["id"]
    other = stub.add_pod(gpu={"id": "NVIDIA A40", "count": 4})["id"]
    assert call(stub, "GET", f"/v2/pods/{pid}")[2]["cost"] == 2.69
    assert call(stub, "GET", f"/v2/pods/{other}")[2]["cost"] == 1.6, "the GPUs' list price x their count"
    stub.charge(pid, 12.5)
    time.sleep(0.2)
    status, _, bill = call(stub, "GET", f"/v2/billing/pods?podId={pid}&bucketSize=hour&lastN=2")
    assert status == 200 and {r["podId"] for r in bill["records"]} == {pid}
    total = sum(r["totalAmount"] for r in bill["records"])  # one bucket, or two across an hour's turn
    assert 12.5 < total < 12.6 and total == pytest.approx(bill["metadata"]["totals"]["totalAmount"])
    assert all(r["startTime"].endswith(":00:00Z") for r in bill["records"])
    assert bill["metadata"]["query"]["podId"] == pid and bill["metadata"]["query"]["bucketSize"] == "hour"
    assert bill["metadata"]["recordCount"] == len(bill["records"]) >= 1
    everyone = call(stub, "GET", "/v2/billing/pods?bucketSize=month")[2]
    assert everyone["metadata"]["uniquePodCount"] == 2 and everyone["metadata"]["query"]["podId"] is None

    status, _, pod = call(stub, "POST", f"/v2/pods/{pid}/action", {"action": "stop"})
    assert (status, pod["cost"]) == (200, 0.0)
    stopped_at = call(stub, "GET", f"/v2/billing/pods?podId={pid}")[2]["metadata"]["totals"]["totalAmount"]
    time.sleep(0.3)
    assert call(stub, "GET", f"/v2/billing/pods?podId={pid}")[2]["metadata"]["totals"]["totalAmount"] == stopped_at, \
        "a stopped pod's bill stands still"
    assert call(stub, "GET", "/v2/billing/pods?lastN=3&startTime=2026-01-01T00:00:00Z")[0] == 400
    assert call(stub, "GET", "/v2/billing/pods?bucketSize=minute")[0] == 422
    assert call(stub, "GET", "/v2/billing/pods?startTime=yesterday")[0] == 422
    stub.assert_clean()


def test_the_gpu_catalogue_answers_a_type_by_its_id(stub):
    """getGpuType: the id is a name, so it travels percent-encoded; an unknown one is 404."""
    status, _, gpu = call(stub, "GET", "/v2/catalog/gpus/NVIDIA%20A40")
    assert status == 200 and gpu["id"] == "NVIDIA A40" and gpu["price"]["secure"] == 0.40
    assert gpu == next(g for g in call(stub, "GET", "/v2/catalog/gpus")[2]["gpus"] if g["id"] == "NVIDIA A40")
    assert call(stub, "GET", "/v2/catalog/gpus/NVIDIA%20Z9")[0] == 404
    stub.assert_clean()


@pytest.mark.parametrize("how", ["bad-id", "cut", "drop"])
def test_a_garbled_answer_comes_after_the_request_was_done(stub, how):
    """garble(): the create makes its pod, and its answer cannot be read: an id of another shape, a body cut
    short, or a connection closed halfway through the body it announced."""
    from runpod_stub import HOSTILE_ID

    stub.garble("POST", "/v2/pods", how)
    if how == "drop":
        with pytest.raises(http.client.IncompleteRead):
            call(stub, "POST", "/v2/pods", CREATE)
    else:
        status, _, answer = call(stub, "POST", "/v2/pods", CREATE)
        assert status == 201
        assert answer["id"] == HOSTILE_ID if how == "bad-id" else isinstance(answer, bytes)
    assert len(stub.pods) == 1, "the pod was made"
    assert call(stub, "POST", "/v2/pods", CREATE)[0] == 201, "once: the next answer is whole"
    stub.assert_clean()
