"""`podkit deploy`: the RunPod template from runpod/template.yaml, and a pod on A40s from it.

Uses the official runpod SDK: its transport (`run_graphql_query`), `create_pod`, `get_pod`,
`stop_pod`, `terminate_pod`. The SDK pastes values into its GraphQL text without escaping, so
every string podkit hands it is pre-encoded as the inside of a GraphQL string literal. The SDK has
no template update, so the template is saved with `saveTemplate` (create, or update by id when one
of that name exists) through the SDK's own transport. The API key is never printed.

`podkit deploy cluster`: a RunPod Instant Cluster, which the SDK has no call for, through RunPod's REST
API v2 (`POST /v2/clusters`) with requests, on the host the SDK's GraphQL is on (RUNPOD_API_BASE_URL).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import time
from pathlib import Path

import yaml

from podkit import config, log
from podkit.costguard import POD_ID
from podkit.errors import ConfigError, PodkitError
from podkit.redact import literal_secret

try:
    import requests
    import runpod
    from runpod import error
    from runpod.api.graphql import run_graphql_query
    from runpod.api.mutations.pods import generate_pod_deployment_mutation
except ImportError:  # the [deploy] extra: `podkit deploy` runs where you deploy from, not in the image
    runpod = None

_log = log.get("deploy")
GPU_TYPE = "NVIDIA A40"
CLOUDS = ("SECURE", "COMMUNITY", "ALL")
CAPACITY = re.compile(r"no longer any instances available|not enough (free )?gpus|no (available )?instances|"
                      r"could not find any pods|insufficient capacity", re.I)
TEMPLATE_KEYS = {"name": str, "imageName": str, "containerDiskInGb": int, "volumeInGb": int,
                 "volumeMountPath": str, "ports": str, "dockerArgs": str, "env": dict}


def gql(value) -> str:
    """The inside of a GraphQL string literal: quotes, backslashes, newlines and control characters
    escaped (GraphQL strings take JSON's escapes); `$` and braces need none."""
    return json.dumps(str(value), ensure_ascii=False)[1:-1]


def load_template(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ConfigError(str(path), "", f"cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(str(path), "", f"invalid YAML: {e}") from None
    for key, value in data.items():
        if key not in TEMPLATE_KEYS:
            raise ConfigError(str(path), key, "unknown template field", hint=f"fields: {', '.join(TEMPLATE_KEYS)}")
        want = TEMPLATE_KEYS[key]
        if value is None:
            data[key] = want()
        elif not isinstance(value, want):
            raise ConfigError(str(path), key, f"expected {want.__name__}, got {value!r}")
    missing = [k for k in ("name", "imageName", "volumeMountPath") if not data.get(k)]
    if missing:
        raise ConfigError(str(path), missing[0], "required")
    if data["volumeMountPath"] != "/workspace":
        raise ConfigError(str(path), "volumeMountPath", f"{data['volumeMountPath']!r}: podkit's workspace is "
                          "/workspace", hint="mount the volume at /workspace")
    data["env"] = {str(k): "" if v is None else str(v) for k, v in (data.get("env") or {}).items()}
    for k, v in data["env"].items():
        if why := literal_secret(v, k):
            raise ConfigError(str(path), f"env.{k}", f"looks like a literal secret ({why})",
                              hint=f'reference a RunPod secret: "{{{{ RUNPOD_SECRET_{k} }}}}"')
    return data


def template_mutation(tpl: dict, template_id: str | None = None) -> str:
    """saveTemplate: creates, or updates the template `template_id`."""
    env = ", ".join(f'{{ key: "{gql(k)}", value: "{gql(v)}" }}' for k, v in tpl["env"].items())
    fields = [f'id: "{gql(template_id)}"'] if template_id else []
    fields += [f'name: "{gql(tpl["name"])}"', f'imageName: "{gql(tpl["imageName"])}"',
               f'dockerArgs: "{gql(tpl.get("dockerArgs", ""))}"',
               f'containerDiskInGb: {int(tpl.get("containerDiskInGb", 40))}',
               f'volumeInGb: {int(tpl.get("volumeInGb", 0))}',
               f'volumeMountPath: "{gql(tpl["volumeMountPath"])}"',
               f'ports: "{gql(tpl.get("ports", "").replace(" ", ""))}"', f"env: [{env}]",
               "isServerless: false", "startSsh: true", "isPublic: false", 'readme: ""']
    return ("mutation { saveTemplate(input: { " + ", ".join(fields) + " }) "
            "{ id name imageName dockerArgs volumeMountPath env { key value } } }")


SHIPPED_CONFIG = "/opt/podkit/configs/a40-{}gpu.yaml"
SHIPPED_GPUS = (1, 2, 4)
SHIPPED_CLUSTER_CONFIG = "/opt/podkit/configs/cluster-2x8.yaml"  # the Dockerfile copies configs/ there
SHIPPED_CLUSTER = (2, 8)  # nodes, GPUs per node: what cluster-2x8.yaml's AReaL allocation is for


def own_config(env: dict) -> bool:
    """The template names a config of the user's own in PODKIT_CONFIG (not one podkit ships)."""
    current = env.get("PODKIT_CONFIG", "")
    return bool(current) and current not in {SHIPPED_CONFIG.format(n) for n in SHIPPED_GPUS} | {SHIPPED_CLUSTER_CONFIG}


def config_for(tpl: dict, gpus: int) -> dict:
    """The template's env with PODKIT_CONFIG naming the shipped A40 config for `gpus`; a config of the
    user's own (not a shipped one) is kept as it is."""
    env = dict(tpl["env"])
    if own_config(env):
        return env
    if gpus not in SHIPPED_GPUS:
        raise ConfigError("command line", "--gpus", f"no shipped A40 pod config for {gpus} GPUs",
                          hint=f"use --gpus {' | '.join(map(str, SHIPPED_GPUS))}, or set PODKIT_CONFIG in the "
                          "template's env to a pod config of your own in the image")
    env["PODKIT_CONFIG"] = SHIPPED_CONFIG.format(gpus)
    return env


STOP_AT_ENV = config.env_name("guard", "stop_pod_at")
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    m = DURATION.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError("command line", flag, f"{text!r} is not a duration", hint="e.g. 90m, 12h, 2d or 3600 (s)")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def pod_args(tpl: dict, template_id: str | None, gpus: int, cloud: str, name: str,
             volume: dict | None = None, stop_at: float = 0) -> dict:
    """create_pod's arguments, strings pre-encoded (the SDK pastes them into its query as they are).
    `volume` (a network volume: id, dataCenterId) replaces the pod volume and pins the data center;
    `stop_at` is the maximum run time as the pod's guard.stop_pod_at."""
    env = with_stop_at(config_for(tpl, gpus), stop_at)
    args = dict(name=gql(name), image_name=gql(tpl["imageName"]), gpu_type_id=GPU_TYPE, cloud_type=cloud,
                gpu_count=gpus, volume_in_gb=int(tpl.get("volumeInGb", 0)),
                container_disk_in_gb=int(tpl.get("containerDiskInGb", 40)),
                docker_args=gql(tpl.get("dockerArgs", "")), ports=tpl.get("ports") or None,
                # The SDK's default is /runpod-volume, which would bypass podkit's workspace.
                volume_mount_path=gql(tpl["volumeMountPath"]),
                env={gql(k): gql(v) for k, v in env.items()}, template_id=template_id)
    if volume:
        args.update(network_volume_id=gql(volume["id"]), data_center_id=gql(volume["dataCenterId"]), volume_in_gb=0)
    return args


# -- clusters: RunPod Instant Clusters through the REST API v2 ----------------------------------------------
# RunPod's OpenAPI spec (runpod/docs, api-reference-v2/openapi.json, "Runpod REST API" 2.0.0, server
# https://api.runpod.io, bearerAuth): `POST /v2/clusters` (createCluster) takes a CreateClusterRequest:
# BaseContainerConfig (image, env {str: str}, args, disk, ports ["22/tcp"]) plus name, type (ClusterType:
# TRAINING | APPLICATION | SLURM | RAY), compute (ClusterCompute: gpuTypeId, gpuCountPerPod >= 1,
# podCount 2..250), dataCenterIds, mounts (Mounts: network [{volumeId, path}], at most one), startSsh;
# no other field (unevaluatedProperties: false). 201 answers a Cluster (id, name, type, compute, pods
# {total, byStatus}, createdAt; dataCenterId and primary {podId, status, sshEndpoint} once placed).
# `GET /v2/clusters/{id}` answers the Cluster; `DELETE /v2/clusters/{id}` (204) terminates every member
# pod; there is no stop. Errors are application/problem+json ErrorResponse: title, status, detail, errors.
CLUSTER_TYPE = "TRAINING"  # the generic distributed-training cluster: podkit starts Ray itself
CLUSTER_NODES_ENV = config.env_name("cluster", "nodes")
MAX_CLUSTER_NODES = 250


def api_base() -> str:
    """RunPod's API host: the SDK's GraphQL is at <base>/graphql, the REST API v2 at <base>/v2/..."""
    return os.environ.get("RUNPOD_API_BASE_URL", "https://api.runpod.io").rstrip("/")


def with_stop_at(env: dict, stop_at: float) -> dict:
    """`stop_at` (the maximum run time) as guard.stop_pod_at in the env, when there is one."""
    if stop_at:
        env[STOP_AT_ENV] = str(int(stop_at))
    return env


def check_cluster_shape(nodes: int, gpus_per_node: int, gpu_type: str | None) -> None:
    if nodes < 2:
        raise ConfigError("command line", "--nodes", f"{nodes}: a cluster has 2 nodes or more",
                          hint="one node is a pod: `podkit deploy --gpus N`")
    if nodes > MAX_CLUSTER_NODES:
        raise ConfigError("command line", "--nodes", f"{nodes}: RunPod's clusters have at most {MAX_CLUSTER_NODES}")
    if gpus_per_node < 1:
        raise ConfigError("command line", "--gpus-per-node", f"{gpus_per_node}: at least 1")
    if not (gpu_type or "").strip():
        raise ConfigError("command line", "--gpu-type", "required: Instant Clusters offer no A40s",
                          hint='e.g. --gpu-type "NVIDIA H100 80GB HBM3" (ids: RunPod\'s GET /v2/catalog/gpus)')


def cluster_env(tpl: dict, nodes: int, gpus_per_node: int, stop_at: float = 0) -> dict:
    """The template's env (its secrets as RunPod secret references) for every node: PODKIT_CONFIG naming
    the shipped cluster config, or a config of the user's own kept; the node count; the maximum run time."""
    env = dict(tpl["env"])
    if not own_config(env):
        if (nodes, gpus_per_node) != SHIPPED_CLUSTER:
            raise ConfigError("command line", "--nodes/--gpus-per-node",
                              f"no shipped cluster config for {nodes} nodes x {gpus_per_node} GPUs",
                              hint=f"use --nodes {SHIPPED_CLUSTER[0]} --gpus-per-node {SHIPPED_CLUSTER[1]}, or set "
                              "PODKIT_CONFIG in the template's env to a cluster config of your own in the image")
        env["PODKIT_CONFIG"] = SHIPPED_CLUSTER_CONFIG
    env[CLUSTER_NODES_ENV] = str(nodes)
    return with_stop_at(env, stop_at)


def cluster_body(tpl: dict, name: str, nodes: int, gpus_per_node: int, gpu_type: str, volume: dict,
                 stop_at: float = 0) -> dict:
    """createCluster's body (CreateClusterRequest): every node runs the template's image, env and start
    command, with the network volume at /workspace, in the volume's data center."""
    body = {"name": name, "type": CLUSTER_TYPE,
            "compute": {"gpuTypeId": gpu_type.strip(), "gpuCountPerPod": gpus_per_node, "podCount": nodes},
            "image": tpl["imageName"], "env": cluster_env(tpl, nodes, gpus_per_node, stop_at),
            "disk": int(tpl.get("containerDiskInGb", 40)),
            "ports": [p for p in (tpl.get("ports") or "").replace(" ", "").split(",") if p],
            "dataCenterIds": [volume["dataCenterId"]],
            "mounts": {"network": [{"volumeId": volume["id"], "path": tpl["volumeMountPath"]}]},
            "startSsh": True}
    if tpl.get("dockerArgs"):
        body["args"] = tpl["dockerArgs"]
    return body


def cluster_summary(c: dict) -> str:
    comp = c.get("compute") or {}
    pods = c.get("pods") or {}
    states = ", ".join(f"{n} {s}" for s, n in sorted((pods.get("byStatus") or {}).items())) or "none placed yet"
    line = (f"{c.get('id')} {c.get('name')}: {comp.get('podCount')} x {comp.get('gpuCountPerPod')} "
            f"{comp.get('gpuTypeId')}, nodes: {states}")
    if c.get("dataCenterId"):
        line += f", in {c['dataCenterId']}"
    primary = c.get("primary") or {}
    if primary.get("sshEndpoint"):
        host, _, port = primary["sshEndpoint"].rpartition(":")
        line += f"\n  rank 0 (pod {primary.get('podId')}): ssh root@{host} -p {port}"
    return line


FIND_TEMPLATES = "query { myself { podTemplates { id name imageName } } }"
FIND_VOLUMES = "query { myself { networkVolumes { id name size dataCenterId } } }"


class Deployer:
    def __init__(self, api_key: str | None = None, sleep=time.sleep) -> None:
        self.runpod = runpod
        self.query = run_graphql_query
        key = api_key or os.environ.get("RUNPOD_API_KEY") or runpod.api_key
        if not key:
            raise PodkitError("no RunPod API key", "export RUNPOD_API_KEY=... or run `runpod config`")
        runpod.api_key = key
        self._key = key
        self.sleep = sleep

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***")

    # -- template ---------------------------------------------------------------------------------------
    def save_template(self, tpl: dict) -> dict:
        found = self.query(FIND_TEMPLATES)["data"]["myself"]["podTemplates"] or []
        existing = next((t for t in found if t["name"] == tpl["name"]), None)
        saved = self.query(template_mutation(tpl, existing["id"] if existing else None))["data"]["saveTemplate"]
        _log.info(f"template {saved['name']!r} {'updated' if existing else 'created'} (id {saved['id']})")
        return saved

    def network_volume(self, volume_id: str) -> dict:
        """The network volume (id, dataCenterId): a pod on it runs in its data center."""
        found = self.query(FIND_VOLUMES)["data"]["myself"]["networkVolumes"] or []
        vol = next((v for v in found if v.get("id") == volume_id), None)
        if not vol or not vol.get("dataCenterId"):
            raise PodkitError(f"no network volume {volume_id!r} in this RunPod account",
                              "yours: " + (", ".join(f"{v['id']} ({v.get('name')}, {v.get('dataCenterId')})"
                                                     for v in found) or "none; create one under Storage"))
        return vol

    # -- clusters (REST API v2) ------------------------------------------------------------------------------
    def rest(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30) -> dict | None:
        """One REST API v2 request; its JSON answer (None for 204). Any failure is a PodkitError naming the
        HTTP status and RunPod's own message (its problem+json title, detail and errors), the key redacted."""
        url = f"{api_base()}{path}"
        try:
            r = requests.request(method, url, json=body, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {self._key}", "Accept": "application/json"})
        except requests.RequestException as e:
            raise PodkitError(f"RunPod's API did not answer {method} {url}: {type(e).__name__}",
                              "check the network; a create may still have been made: "
                              "look in the console under Instant Clusters") from None
        if r.status_code == 204:
            return None
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not 200 <= r.status_code < 300:
            if isinstance(answer, dict) and (answer.get("detail") or answer.get("title")):
                msg = ": ".join(str(answer[k]) for k in ("title", "detail") if answer.get(k))
                if isinstance(answer.get("errors"), list) and answer["errors"]:
                    msg += " (" + "; ".join(map(str, answer["errors"])) + ")"
            else:
                msg = " ".join(r.text.split())[:300] or r.reason or "no message"
            raise PodkitError(f"RunPod answered {method} {path} with HTTP {r.status_code}: {self._redact(msg)}",
                              "401: the API key is invalid; 403: the key may not create clusters"
                              if r.status_code in (401, 403) else "") from None
        if not isinstance(answer, dict):
            raise PodkitError(f"RunPod answered {method} {path} with HTTP {r.status_code} and no JSON object: "
                              f"{self._redact(' '.join(r.text.split())[:300])!r}")
        return answer

    def create_cluster(self, body: dict) -> dict:
        c = self.rest("POST", "/v2/clusters", body)
        if not c or not isinstance(c.get("id"), str) or not POD_ID.match(c["id"]):
            raise PodkitError(f"RunPod's answer to the cluster create has no cluster id: {self._redact(str(c))[:300]}",
                              "look in the console under Instant Clusters before creating another")
        comp = body["compute"]
        _log.info(f"cluster {c['id']} created ({comp['podCount']} nodes x {comp['gpuCountPerPod']} {comp['gpuTypeId']})")
        return c

    def cluster(self, cluster_id: str) -> dict:
        return self.rest("GET", f"/v2/clusters/{cluster_id}") or {}

    def delete_cluster(self, cluster_id: str) -> None:
        self.rest("DELETE", f"/v2/clusters/{cluster_id}")

    # -- pods --------------------------------------------------------------------------------------------
    def create_pod(self, args: dict, capacity_timeout_s: float) -> dict:
        """create_pod, retrying capacity errors with back-off for a bounded time."""
        t0, delay, attempt = time.monotonic(), 5.0, 0
        while True:
            attempt += 1
            try:
                pod = self.runpod.create_pod(**args)
                _log.info(f"pod {pod['id']} created ({args['gpu_count']}x {GPU_TYPE}, {args['cloud_type']} cloud)")
                return pod
            except error.QueryError as e:
                msg = self._redact(str(e))
                if not CAPACITY.search(msg):
                    raise PodkitError(f"RunPod refused the pod: {msg}") from None
                waited = time.monotonic() - t0
                if waited + delay > capacity_timeout_s:
                    others = [c for c in CLOUDS if c != args["cloud_type"]]
                    fewer = [n for n in (4, 2, 1) if n < args["gpu_count"]]
                    raise PodkitError(
                        f"no {args['gpu_count']}x {GPU_TYPE} available in {args['cloud_type']} cloud after "
                        f"{attempt} attempt(s) over {waited:.0f}s: {msg}",
                        f"try another cloud (--cloud {' or --cloud '.join(others)})"
                        + (f", or fewer GPUs (--gpus {' or --gpus '.join(map(str, fewer))})" if fewer else "")
                        + ", or later") from None
                _log.warn(f"no capacity yet (attempt {attempt}): {msg}; retrying in {delay:.0f}s")
                self.sleep(delay)
                delay = min(60.0, delay * 2) * random.uniform(0.8, 1.2)

    def wait_running(self, pod_id: str, timeout_s: float, poll_s: float = 5.0) -> dict:
        t0 = time.monotonic()
        last = None
        while True:
            pod = self.runpod.get_pod(pod_id) or {}
            state = pod.get("desiredStatus")
            ready = state == "RUNNING" and (pod.get("runtime") or {}).get("ports")
            if state != last or ready:
                _log.info(f"pod {pod_id}: {state}{', runtime up' if ready else ''} "
                          f"({time.monotonic() - t0:.0f}s)")
                last = state
            if ready:
                return pod
            if time.monotonic() - t0 > timeout_s:
                raise PodkitError(f"pod {pod_id} not running after {timeout_s:.0f}s (state {state})",
                                  f"check it in the console; `podkit deploy status {pod_id}`")
            self.sleep(poll_s)

    def stop(self, pod_id: str) -> dict:
        return self.runpod.stop_pod(pod_id)

    def terminate(self, pod_id: str) -> None:
        self.runpod.terminate_pod(pod_id)

    def status(self, pod_id: str) -> dict:
        pod = self.runpod.get_pod(pod_id)
        if not pod:
            raise PodkitError(f"no pod {pod_id}", "list your pods in the RunPod console")
        return pod


def how_to_reach(pod: dict) -> list[str]:
    lines = []
    for p in (pod.get("runtime") or {}).get("ports") or []:
        if p.get("privatePort") == 22 and p.get("isIpPublic"):
            lines.append(f"ssh root@{p['ip']} -p {p['publicPort']}")
        elif p.get("type") == "http":
            lines.append(f"https://{pod['id']}-{p['privatePort']}.proxy.runpod.net")
    lines.append("logs: the pod's Logs tab (every line prefixed with its program), or over SSH: "
                 "podkit status; tail -f /workspace/logs/trainer.log")
    return lines


# -- watch: relaunch after a lost pod ----------------------------------------------------------------------
class Watch:
    """Follows one pod through RunPod's API. A pod that is gone (terminated, or its host removed), that
    an interruptible rental lost (reclaimed), that runs with zero GPUs (RunPod restarts a pod whose host
    has no free GPU with none), or that has not run for `lost_after_s` (host down; a pod never seen
    running gets `start_grace_s` more, for its image pull) is replaced: the old one is stopped first
    (never terminated) so that two pods never train on one volume, then a new pod starts on the same
    network volume and resumes from its checkpoints.

    An on-demand pod that is EXITED was stopped on request: by its own cost guard (training finished,
    the maximum run time, a long safe mode) or by a person. That ends the watch, as does a maximum run
    time that has passed. A RunPod API that does not answer is waited out: it says nothing about the pod."""

    GONE_AFTER = 3  # answers in a row saying "no such pod": one could be the API's hiccup
    QUERY_ERRORS_MAX = 10  # GraphQL errors in a row: the API answers, and refuses

    def __init__(self, d: Deployer, pod_id: str, launch, *, lost_after_s: float = 900, start_grace_s: float = 900,
                 poll_s: float = 30, max_relaunches: int = 3, backoff_s: float = 60, clock=time.monotonic,
                 wall=time.time, state_dir=None) -> None:
        self.d, self.pod_id, self.launch = d, pod_id, launch
        self.lost_after_s, self.start_grace_s, self.poll_s = lost_after_s, start_grace_s, poll_s
        self.max_relaunches, self.backoff_s = max_relaunches, backoff_s
        self.clock, self.wall, self.state_dir = clock, wall, state_dir
        self.relaunches = 0
        # What a replacement keeps from the first pod: its image, name, GPU count, maximum run time.
        self.carry: dict = {}
        self.seen_running = False
        self.query_errors = 0

    def remember(self, pod: dict) -> None:
        if not self.carry:
            self.carry = {"imageName": pod.get("imageName") or "", "name": pod.get("name") or "",
                          "gpuCount": int(pod.get("gpuCount") or 0), "stop_at": carried_stop_at(pod)}
        elif not self.carry["gpuCount"]:
            self.carry["gpuCount"] = int(pod.get("gpuCount") or 0)

    def verdict(self, pod: dict | None, down_since: float | None, nones: int) -> tuple[str, str]:
        """(state, why): running | waiting | stopped | lost."""
        if pod is None and nones < self.GONE_AFTER:
            return "waiting", "RunPod does not know the pod (asking again)"
        if not pod or pod.get("desiredStatus") == "TERMINATED":
            return "lost", "the pod is gone (terminated, or its host was removed)"
        state = pod.get("desiredStatus")
        if state == "EXITED":
            if "INTERRUPT" in str(pod.get("podType") or "").upper():
                return "lost", "the interruptible pod was stopped (reclaimed, or outbid)"
            return "stopped", ("the pod was stopped on request: by its own cost guard (training finished, its "
                               "maximum run time, a long safe mode) or by a person")
        if state == "RUNNING" and pod.get("gpuCount") == 0:
            return "lost", "the pod runs with zero GPUs (its host had none free when it restarted)"
        if state == "RUNNING" and pod.get("runtime") is not None:
            return "running", "running"
        down = self.clock() - down_since if down_since is not None else 0.0
        limit = self.lost_after_s + (0 if self.seen_running else self.start_grace_s)
        if down >= limit:
            return "lost", f"the pod has not been running for {down:.0f} s (state {state}; host down or unreachable)"
        return "waiting", f"not running yet ({state})"

    def notify(self, event: str, text: str) -> None:
        from podkit import notify

        t = notify.send(event, text, self.state_dir)
        if t:
            t.join(10)

    def ask(self) -> tuple[bool, dict | None]:
        """(answered, the pod or None)."""
        try:
            pod = self.d.runpod.get_pod(self.pod_id)
            self.query_errors = 0
            return True, pod if isinstance(pod, dict) else None
        except error.QueryError as e:
            self.query_errors += 1
            if self.query_errors >= self.QUERY_ERRORS_MAX:
                raise PodkitError(f"RunPod refused {self.QUERY_ERRORS_MAX} questions in a row about pod "
                                  f"{self.pod_id}: {self.d._redact(str(e))}", "check the pod id and the API key; "
                                  f"`podkit deploy status {self.pod_id}`") from None
            why = "refused the question"
        except (requests.RequestException, KeyError, TypeError, ValueError) as e:
            why = f"does not answer ({type(e).__name__})"
        _log.warn(f"RunPod's API {why}; asking again in {self.poll_s:g} s")
        return False, None

    def run(self) -> int:
        down_since, said, nones = None, "", 0
        while True:
            answered, pod = self.ask()
            if not answered:
                self.d.sleep(self.poll_s)
                continue
            nones = 0 if pod else nones + 1
            if pod:
                self.remember(pod)
            running = bool(pod) and pod.get("desiredStatus") == "RUNNING" and pod.get("runtime") is not None
            self.seen_running = self.seen_running or running
            down_since = None if running else (down_since if down_since is not None else self.clock())
            state, why = self.verdict(pod, down_since, nones)
            if why != said:
                _log.info(f"pod {self.pod_id}: {why}")
                said = why
            if state == "stopped":
                _log.info("watch ends: a pod stopped on request is left stopped")
                return 0
            if state == "lost":
                outcome = self.replace(why, pod)
                if outcome != "replaced":
                    return 0 if outcome == "deadline" else 1
                down_since, said, nones, self.seen_running = None, "", 0, False
                continue
            self.d.sleep(self.poll_s)

    def replace(self, why: str, now: dict | None) -> str:
        """Stop the lost pod, then start its replacement, a failed start tried again after a back-off
        that doubles from the second attempt on: replaced | deadline | gave-up."""
        old = self.pod_id
        if now and now.get("desiredStatus") not in ("EXITED", "TERMINATED"):
            try:  # it may come back: it must not then train beside its replacement
                self.d.stop(old)
                _log.info(f"pod {old} stopped (not terminated: `podkit deploy terminate {old}` when done with it)")
            except Exception as e:  # noqa: BLE001 - an unreachable host may refuse; the workspace lease still guards
                _log.warn(f"could not stop pod {old} ({type(e).__name__}); if it comes back, its replacement "
                          "waits for the workspace lease to lapse")
        stop_at = self.carry.get("stop_at") or 0
        if stop_at and self.wall() >= stop_at:
            msg = (f"pod {old} is lost ({why}), and the run's maximum run time has passed: no replacement; the "
                   "network volume keeps the checkpoints")
            _log.info(msg)
            self.notify("relaunch-gave-up", msg)
            return "deadline"
        while True:
            if self.relaunches >= self.max_relaunches:
                msg = (f"pod {old} is lost ({why}); {self.relaunches} replacement attempt(s) spent "
                       f"(--max-relaunches {self.max_relaunches}): giving up; the network volume keeps the checkpoints")
                _log.error(msg)
                self.notify("relaunch-gave-up", msg)
                return "gave-up"
            self.relaunches += 1
            n = self.relaunches
            if n > 1:
                delay = min(BACKOFF_MAX_S, self.backoff_s * 2 ** (n - 2))
                _log.info(f"waiting {delay:.0f} s before replacement attempt {n} of {self.max_relaunches}")
                self.d.sleep(delay)
            try:
                pod = self.launch(self.carry)
                new_id = pod["id"]
            except Exception as e:  # noqa: BLE001 - any failure to start one is a failed attempt, not the watch's end
                what = e.message if isinstance(e, PodkitError) else f"{type(e).__name__}: {self.d._redact(str(e))}"
                _log.error(f"replacement attempt {n} of {self.max_relaunches} for pod {old} failed: {what}")
                self.notify("relaunch", f"pod {old} is lost ({why}); replacement attempt {n} of "
                            f"{self.max_relaunches} failed: {what}")
                continue
            self.pod_id = new_id
            msg = (f"pod {old} is lost ({why}); replacement {n} of {self.max_relaunches} is pod {new_id} on "
                   "the same network volume, resuming from its checkpoints")
            _log.info(msg)
            self.notify("relaunch", msg)
            return "replaced"


BACKOFF_MAX_S = 900.0


def carried_stop_at(pod: dict) -> float:
    """The pod's maximum run time (its guard.stop_pod_at, from its env: RunPod lists it as K=V)."""
    env = pod.get("env") or []
    pairs = (e.split("=", 1) for e in env if isinstance(e, str) and "=" in e) if isinstance(env, list) else ()
    raw = dict(pairs).get(STOP_AT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    return value if config.is_stop_time(value) else 0.0


def relauncher(d: Deployer, tpl: dict, vol: dict, cloud: str, gpus: int, name: str | None,
               capacity_timeout_s: float, image: str | None = None):
    """Watch's `launch`: a replacement like the first pod watched (its image unless --image names one,
    its GPU count while it had GPUs, its name and maximum run time), with the template's env and secrets,
    on the network volume. Replacements are on-demand pods."""
    def launch(carry: dict) -> dict:
        n = carry.get("gpuCount") or gpus
        t = dict(tpl, imageName=image or carry.get("imageName") or tpl["imageName"])
        saved = d.save_template(t)
        return d.create_pod(pod_args(t, saved["id"], n, cloud, name or carry.get("name") or f"{t['name']}-{n}xa40",
                                     vol, carry.get("stop_at") or 0), capacity_timeout_s)
    return launch


def default_template() -> Path:
    return config.packaged("runpod/template.yaml")


def main(args) -> int:
    if runpod is None:
        raise PodkitError("podkit deploy needs the RunPod SDK, which is not installed",
                          "pip install 'podkit[deploy]' where you deploy from (make test installs it)")
    try:
        return _main(args)
    except requests.RequestException as e:
        raise PodkitError(f"cannot reach the RunPod API at {api_base()}: {type(e).__name__}",
                          "check the network; nothing may have been created, `podkit deploy status` tells") from None
    except (error.QueryError, error.AuthenticationError) as e:
        key = os.environ.get("RUNPOD_API_KEY") or ""
        msg = str(e).replace(key, "***") if key else str(e)
        raise PodkitError(f"RunPod answered: {msg}", "an invalid API key shows as Unauthorized") from None


def _main(args) -> int:
    action = args.action or "create"
    if action.startswith("cluster"):
        return _cluster(args, action)
    if action in ("stop", "terminate", "status"):
        if not args.pod:
            raise ConfigError("command line", "POD", f"`podkit deploy {action}` needs a pod id")
        check_pod_id(args.pod)
        d = Deployer()
        if action == "stop":
            d.stop(args.pod)
            _log.info(f"pod {args.pod} stopped (its volume is kept; resume it in the console)")
        elif action == "terminate":
            d.terminate(args.pod)
            _log.info(f"pod {args.pod} terminated")
        else:
            pod = d.status(args.pod)
            print(json.dumps(pod, indent=2) if args.json else
                  f"{pod['id']} {pod.get('name')}: {pod.get('desiredStatus')}, {pod.get('gpuCount')} GPU(s), "
                  f"uptime {pod.get('uptimeSeconds') or 0}s")
            for line in how_to_reach(pod):
                print("  " + line)
        return 0
    if action == "watch":
        return _watch(args)
    if action != "create":
        raise ConfigError("command line", "ACTION", f"unknown action {action!r}",
                          "create | stop | terminate | status | watch | cluster | cluster-status | cluster-delete")
    tpl = load_template(Path(args.template) if args.template else default_template())
    if args.image:
        tpl["imageName"] = args.image
    check_cloud(args)
    if args.gpus < 1:
        raise ConfigError("command line", "--gpus", f"{args.gpus}: at least 1")
    config_for(tpl, args.gpus)  # refuse a GPU count without a pod config before anything is sent
    stop_at = max_runtime_until(args)
    name = args.name or f"{tpl['name']}-{args.gpus}xa40"
    if args.dry_run:
        print("# 1. query (finds an existing template of this name):")
        print(FIND_TEMPLATES)
        print(f"# 2. mutation (create; with id: \"<existing id>\" when one named {tpl['name']!r} exists):")
        print(template_mutation(tpl))
        print("# 3. mutation (the SDK's create_pod, after its GPU type check):")
        vol = {"id": args.network_volume, "dataCenterId": "<its data center>"} if args.network_volume else None
        a = pod_args(tpl, "<template id>", args.gpus, args.cloud, name, vol, stop_at)
        # create_pod's own defaults for what podkit does not set, so this is exactly what it sends.
        a.update(support_public_ip=True, start_ssh=True, min_vcpu_count=1, min_memory_in_gb=1)
        print(generate_pod_deployment_mutation(**a).strip())
        print("# nothing was sent (--dry-run)")
        return 0
    d = Deployer()
    vol = d.network_volume(args.network_volume) if args.network_volume else None
    saved = d.save_template(tpl)
    pod = d.create_pod(pod_args(tpl, saved["id"], args.gpus, args.cloud, name, vol, stop_at), args.capacity_timeout)
    if stop_at:
        _log.info(f"pod {pod['id']} stops itself at {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(stop_at))} "
                  "(--max-runtime), the trainer first with its checkpoint")
    pod = d.wait_running(pod["id"], args.wait_timeout)
    print(f"pod {pod['id']} is running. Reach it with:")
    for line in how_to_reach(pod):
        print("  " + line)
    print(f"stop it: podkit deploy stop {pod['id']}   terminate: podkit deploy terminate {pod['id']}")
    if vol:
        same = "".join(f" {flag} {shlex.quote(str(v))}" for flag, v in (("--template", args.template),
                       ("--cloud", args.cloud if args.cloud != "SECURE" else None)) if v)
        print(f"relaunch it when it is lost: podkit deploy watch {pod['id']} --network-volume {vol['id']}{same}")
    return 0


def check_cloud(args) -> None:
    if args.cloud not in CLOUDS:
        raise ConfigError("command line", "--cloud", f"{args.cloud!r} is not one of {', '.join(CLOUDS)}")
    if args.network_volume and args.cloud == "COMMUNITY":
        raise ConfigError("command line", "--cloud", "network volumes are in Secure Cloud only",
                          hint="--cloud SECURE (the default)")


def check_pod_id(pod: str, what: str = "pod") -> None:
    if not POD_ID.match(pod):  # the SDK pastes it into its GraphQL as it is; a cluster's goes into a URL
        raise ConfigError("command line", what.upper(), f"{pod!r} is not a RunPod {what} id")


def max_runtime_until(args) -> float:
    """--max-runtime as the Unix time to stop at; 0 without one."""
    return time.time() + parse_duration(args.max_runtime, "--max-runtime") if args.max_runtime else 0


def _cluster(args, action: str) -> int:
    """cluster: create an Instant Cluster; cluster-status | cluster-delete CLUSTER."""
    if action in ("cluster-status", "cluster-delete"):
        if not args.pod:
            raise ConfigError("command line", "CLUSTER", f"`podkit deploy {action}` needs a cluster id")
        check_pod_id(args.pod, "cluster")
        d = Deployer()
        if action == "cluster-delete":
            d.delete_cluster(args.pod)
            _log.info(f"cluster {args.pod} deleted: every node terminated (the network volume is kept)")
            return 0
        c = d.cluster(args.pod)
        print(json.dumps(c, indent=2) if args.json else cluster_summary(c))
        return 0
    if args.pod:
        raise ConfigError("command line", "CLUSTER", f"`podkit deploy cluster` creates one and takes no id ({args.pod!r})",
                          hint="podkit deploy cluster-status CLUSTER | cluster-delete CLUSTER")
    if not args.network_volume:
        raise ConfigError("command line", "--network-volume", "a cluster needs a network volume: every node "
                          "mounts it at /workspace, where the run's checkpoints, logs and records are shared",
                          hint="create one under Storage in the cluster's data center; --network-volume ID")
    check_cluster_shape(args.nodes, args.gpus_per_node, args.gpu_type)
    tpl = load_template(Path(args.template) if args.template else default_template())
    if args.image:
        tpl["imageName"] = args.image
    cluster_env(tpl, args.nodes, args.gpus_per_node)  # refuse a shape without a cluster config before anything is sent
    stop_at = max_runtime_until(args)
    name = args.name or f"{tpl['name']}-{args.nodes}x{args.gpus_per_node}"
    if args.dry_run:
        vol = {"id": args.network_volume, "dataCenterId": "<the network volume's data center>"}
        body = cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at)
        print("# 1. query (finds the network volume's data center):")
        print(FIND_VOLUMES)
        print(f"# 2. POST {api_base()}/v2/clusters  (Authorization: Bearer $RUNPOD_API_KEY)")
        print(json.dumps(body, indent=2, ensure_ascii=False))
        print("# nothing was sent (--dry-run)")
        return 0
    d = Deployer()
    vol = d.network_volume(args.network_volume)
    c = d.create_cluster(cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at))
    cid = c["id"]
    print(f"cluster {cid} created: {args.nodes} nodes x {args.gpus_per_node} {args.gpu_type.strip()}, network "
          f"volume {vol['id']} at /workspace ({vol['dataCenterId']})")
    print(f"  watch it:  podkit deploy cluster-status {cid}   (rank 0's SSH once it runs; logs: "
          "/workspace/logs/trainer.log, other nodes' under /workspace/logs/node-<rank>)")
    print(f"  end it:    podkit deploy cluster-delete {cid}   (terminates every node; RunPod has no cluster stop; "
          "the network volume keeps the checkpoints)")
    if stop_at:
        print(f"  --max-runtime: the trainer stops with its checkpoint at "
              f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(stop_at))}; delete the cluster to end its billing")
    return 0


def _watch(args) -> int:
    if not args.pod:
        raise ConfigError("command line", "POD", "`podkit deploy watch` needs a pod id")
    if not args.network_volume:
        raise ConfigError("command line", "--network-volume", "a replacement pod resumes from the run's network "
                          "volume, and none was named: on a new pod volume it would start from nothing",
                          hint="deploy with `podkit deploy --network-volume ID` and watch with the same ID")
    for flag, value in (("--lost-after", args.lost_after), ("--poll", args.poll), ("--backoff", args.backoff)):
        if not 0 < value < float("inf"):
            raise ConfigError("command line", flag, f"{value}: a positive number of seconds")
    if args.max_relaunches < 0:
        raise ConfigError("command line", "--max-relaunches", f"{args.max_relaunches}: 0 or more")
    check_cloud(args)
    tpl = load_template(Path(args.template) if args.template else default_template())
    check_pod_id(args.pod)
    d = Deployer()
    vol = d.network_volume(args.network_volume)
    if not d.runpod.get_pod(args.pod):
        raise PodkitError(f"RunPod knows no pod {args.pod!r}", "check the id: `podkit deploy status <pod-id>`; "
                          "the watch replaces pods it has seen, never one it could not find")
    launch = relauncher(d, tpl, vol, args.cloud, args.gpus, args.name, args.capacity_timeout, args.image)
    _log.info(f"watching pod {args.pod} every {args.poll:g} s; lost after {args.lost_after:g} s not running; up to "
              f"{args.max_relaunches} replacement(s) on network volume {vol['id']} ({vol['dataCenterId']})")
    w = Watch(d, args.pod, launch, lost_after_s=args.lost_after, start_grace_s=args.wait_timeout, poll_s=args.poll,
              max_relaunches=args.max_relaunches, backoff_s=args.backoff)
    try:
        return w.run()
    except KeyboardInterrupt:
        _log.info(f"watch interrupted; the pod now followed is {w.pod_id}")
        return 130
