"""`podkit deploy cluster`, `cluster-status` and `cluster-delete` against the loopback stub of RunPod's
REST API v2 (tests/runpod_stub.py: a stub, not RunPod), which holds every request and answer to RunPod's
published OpenAPI document: a create body the document refuses (`unevaluatedProperties: false`: a field it
does not define) is a 422 with the validator's messages, as RunPod answers."""

from __future__ import annotations

import json
import time

import pytest
from test_deploy import KEY
from test_deploy import podkit_deploy as run_deploy

from conftest import ROOT
from podkit import config
from podkit.deploy.bodies import SHIPPED_CLUSTER_CONFIG, cluster_body
from podkit.deploy.deployer import Deployer
from podkit.deploy.template import load_template
from podkit.errors import ConfigError, PodkitError
from runpod_stub import RunPodV2Stub, schema_errors

pytestmark = pytest.mark.timeout(60)
H100 = "NVIDIA H100 80GB HBM3"
VOLUME = "vol-h100"
CREATE_REQUEST = {"$ref": "#/components/schemas/CreateClusterRequest"}


@pytest.fixture
def runpod_api(monkeypatch):
    stub = RunPodV2Stub(key=KEY)
    stub.add_volume(VOLUME, "checkpoints", 500, "US-TX-3")
    monkeypatch.setenv("RUNPOD_API_BASE_URL", stub.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    yield stub
    assert stub.graphql == []
    stub.assert_clean()
    stub.close()


def podkit_deploy(stub, *args):
    """`podkit deploy ...` as test_deploy runs it; the key never in its output, no traceback."""
    r = run_deploy(stub, *args)
    assert KEY not in r.stdout + r.stderr and "Traceback" not in r.stderr
    return r


CREATE = ("cluster", "--image", "registry.example/podkit:1.0", "--nodes", "2", "--gpus-per-node", "8",
          "--gpu-type", H100, "--network-volume", VOLUME)


def test_a_cluster_create_sends_the_spec_body_and_says_what_next(runpod_api):
    """The volume's data center from GET /v2/network-volumes, then POST /v2/clusters with a body the
    document accepts: 2 x 8 H100s, the image, the cluster config and node count in every node's env, the
    template's secret references, the volume at /workspace in its data center; the id printed."""
    r = podkit_deploy(runpod_api, *CREATE, "--max-runtime", "24h")
    assert r.returncode == 0, r.stderr
    assert runpod_api.calls() == ["GET /v2/network-volumes", "GET /v2/clusters", "POST /v2/clusters"]
    assert runpod_api.refused == []
    body = runpod_api.requests[-1].body
    assert schema_errors(CREATE_REQUEST, body) == []
    assert body["type"] == "TRAINING" and body["compute"] == {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}
    assert body["image"] == "registry.example/podkit:1.0"
    env = body["env"]
    assert env["PODKIT_CONFIG"] == "/opt/podkit/configs/cluster-2x8.yaml" and env["PODKIT_CLUSTER_NODES"] == "2"
    assert env["GIT_TOKEN"] == "{{ RUNPOD_SECRET_GIT_TOKEN }}"
    assert 23 * 3600 < float(env["PODKIT_GUARD_STOP_POD_AT"]) - time.time() <= 24 * 3600
    assert body["mounts"] == {"network": [{"volumeId": VOLUME, "path": "/workspace"}]}
    assert body["dataCenterIds"] == ["US-TX-3"] and body["ports"] == ["22/tcp", "9401/http"] and body["startSsh"] is True
    assert {q.headers.get("authorization") for q in runpod_api.requests} == {f"Bearer {KEY}"}
    [cid] = runpod_api.clusters
    assert f"cluster {cid} created" in r.stdout
    assert f"podkit deploy cluster-status {cid}" in r.stdout and f"podkit deploy cluster-delete {cid}" in r.stdout


def test_dry_run_prints_the_body_and_sends_nothing(runpod_api):
    r = podkit_deploy(runpod_api, *CREATE, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert runpod_api.requests == []
    assert f"POST {runpod_api.url}/v2/clusters" in r.stdout and "nothing was sent" in r.stdout
    body = json.loads(r.stdout[r.stdout.index("\n{") + 1:r.stdout.rindex("}\n") + 1])
    assert schema_errors(CREATE_REQUEST, body) == []
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
    (("cluster", *CREATE[3:]), "imageName: 'podkit:latest' names no registry"),  # the template's local tag: no host can pull it
])
def test_bad_requests_are_refused_before_anything_is_sent(runpod_api, args, problem):
    r = podkit_deploy(runpod_api, *args)
    assert r.returncode == 2 and problem in r.stderr, r.stderr
    assert runpod_api.requests == []


def test_a_private_image_is_refused_up_front_with_the_fix(runpod_api, tmp_path):
    """v2's clusters have no registry: a template naming a registry credential cannot make one."""
    tpl = tmp_path / "t.yaml"
    tpl.write_text("name: t\nimageName: ghcr.io/me/private:1\nvolumeMountPath: /workspace\nregistry: cred-1\n")
    r = podkit_deploy(runpod_api, *CREATE, "--template", str(tpl))
    assert r.returncode == 2 and "registry: 'cred-1': RunPod's clusters cannot pull from a private registry" \
        in r.stderr and "public registry" in r.stderr
    assert runpod_api.requests == []


def test_runpods_4xx_message_is_reported(runpod_api):
    """RunPod's problem+json: its title, detail and errors, with the status; exit 1."""
    problem = {"title": "Bad Request", "status": 400, "detail": "no capacity for 2 x 8 NVIDIA H100 80GB HBM3 in US-TX-3",
               "errors": ["compute: not available"]}
    runpod_api.fail("POST", "/v2/clusters", 400, body=problem, content_type="application/problem+json")
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1
    assert "HTTP 400: Bad Request: no capacity for 2 x 8 NVIDIA H100 80GB HBM3 in US-TX-3 (compute: not available)" \
        in r.stderr


def test_a_key_in_runpods_answer_is_redacted(runpod_api):
    runpod_api.fail("POST", "/v2/clusters", 401, body={"title": "Unauthorized", "status": 401, "detail": f"bad key {KEY}"})
    r = podkit_deploy(runpod_api, *CREATE)  # asserts the key is nowhere in the output
    assert r.returncode == 1 and "HTTP 401: Unauthorized: bad key ***" in r.stderr and "API key is invalid" in r.stderr


def test_a_create_that_fails_with_5xx_is_not_sent_again(runpod_api):
    """A 502 may come after RunPod made the cluster: the create is sent once, RunPod's clusters are looked
    at, and the error says where to look before making another."""
    runpod_api.fail("POST", "/v2/clusters", 502, times=None, body=b"<html>Bad Gateway</html>")
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1 and "HTTP 502: <html>Bad Gateway</html>" in r.stderr
    assert "lists no new cluster named" in r.stderr and "before creating another" in r.stderr
    assert runpod_api.calls().count("POST /v2/clusters") == 1


def test_a_cluster_made_though_its_answer_was_lost_is_followed(runpod_api):
    """RunPod made the cluster but the answer never came (the client timed out): found by name, one cluster."""
    from podkit import runpod as api

    runpod_api.fail("POST", "/v2/clusters", None, delay_s=1.5)
    d = Deployer(api.Client(timeout_s=0.5, sleep=lambda s: None), sleep=lambda s: time.sleep(2))
    tpl = load_template(ROOT / "runpod" / "template.yaml")
    vol = d.network_volume(VOLUME)
    c = d.create_cluster(cluster_body(tpl, "run-2x8", 2, 8, H100, vol))
    assert list(runpod_api.clusters) == [c["id"]] and runpod_api.calls().count("POST /v2/clusters") == 1


def test_a_2xx_that_is_not_json_is_reported(runpod_api):
    runpod_api.fail("POST", "/v2/clusters", 201, body=b"created")
    r = podkit_deploy(runpod_api, *CREATE)
    assert r.returncode == 1 and "HTTP 201 and no JSON: 'created'" in r.stderr


def test_a_create_the_spec_refuses_shows_runpods_validation_errors(runpod_api):
    """What RunPod's validation answers reaches the person: here a field the document does not define."""
    d = Deployer()
    with pytest.raises(PodkitError) as e:
        d.create_cluster({"name": "x", "type": "TRAINING", "cloudType": "SECURE",
                          "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}})
    assert "HTTP 422" in e.value.message and "cloudType" in e.value.message


def test_status_shows_the_nodes_and_delete_ends_the_cluster(runpod_api):
    assert podkit_deploy(runpod_api, *CREATE).returncode == 0
    [cid] = runpod_api.clusters
    r = podkit_deploy(runpod_api, "cluster-status", cid)
    assert r.returncode == 0 and cid in r.stdout and f"2 x 8 {H100}" in r.stdout and "beyond" not in r.stdout
    assert podkit_deploy(runpod_api, "cluster-delete", cid).returncode == 0
    assert runpod_api.calls()[-1] == f"DELETE /v2/clusters/{cid}"
    r = podkit_deploy(runpod_api, "cluster-status", cid)
    assert r.returncode == 1 and "HTTP 404" in r.stderr


def test_a_cluster_scaled_beyond_the_runs_nodes_is_reported(runpod_api):
    """RunPod's scale-up adds pods with the same template: their NODE_RANK is past cluster.nodes. Status
    names them as outside the run; on the node, the rank is a config error that says why (safe mode)."""
    assert podkit_deploy(runpod_api, *CREATE).returncode == 0
    [cid] = runpod_api.clusters
    [extra] = runpod_api.scale_cluster(cid, 1)
    r = podkit_deploy(runpod_api, "cluster-status", cid)
    assert r.returncode == 0, r.stderr
    assert f"1 node(s) beyond the run's 2 (the cluster was scaled up): rank 2 pod {extra}" in r.stdout
    env = {"PODKIT_CLUSTER_NODES": "2", "NODE_RANK": "2", "PRIMARY_ADDR": "10.65.0.2", "NODE_ADDR": "10.65.0.4"}
    with pytest.raises(ConfigError) as e:
        config.load(None, environ=env)
    assert "rank 2 of a 2-node cluster" in e.value.message and "scaled up" in e.value.hint


def test_the_shipped_cluster_config_is_in_the_image():
    assert (ROOT / SHIPPED_CLUSTER_CONFIG.removeprefix("/opt/podkit/")).is_file()


def test_a_cluster_nodes_self_stop_names_the_cluster_delete_that_ends_its_billing(runpod_api, capfd):
    """RunPod does not stop a cluster's pods one by one (409): the cost guard says which delete ends it."""
    from podkit import runpod as api
    from podkit.money import costguard

    assert podkit_deploy(runpod_api, *CREATE).returncode == 0
    [cid] = runpod_api.clusters
    node = api.Client().cluster_pods(cid)[0]["id"]
    env = {"RUNPOD_POD_ID": node, "RUNPOD_API_KEY": KEY, "RUNPOD_API_BASE_URL": runpod_api.url}
    assert costguard.stop_pod("training finished", env) is False
    assert f"podkit deploy cluster-delete {cid}` ends its billing" in capfd.readouterr().out
