"""`podkit deploy`: the RunPod template from runpod/template.yaml, and a pod on A40s from it; `status`,
`stop`, `start`, `terminate`, `logs` and `watch` of a pod; `cluster` for an Instant Cluster.

Everything goes through RunPod's REST API v2 (podkit.runpod, the one client): templates are created or
updated (PATCH) by name, pods are created with v2's nested body (gpu {id, count, minCudaVersion}, mounts),
and every lifecycle change is one `POST /v2/pods/{id}/action`. The API key is never printed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import re
import secrets
import shlex
import sys
import time
from pathlib import Path

import yaml

from podkit import config, guardfile, log
from podkit import runpod as api
from podkit.costguard import POD_ID
from podkit.errors import ConfigError, PodkitError
from podkit.redact import Redactor, literal_secret, secret_name

_log = log.get("deploy")
GPU_TYPE = "NVIDIA A40"
CLOUDS = ("SECURE", "COMMUNITY")  # v2's Cloud; there is no "ALL"
# How RunPod words "no machine for this now" (v1, GraphQL and v2 alike): retried, not a refusal.
CAPACITY = re.compile(r"no longer any instances available|not enough (free )?gpus|no (available )?instances|"
                      r"could not find any pods|insufficient capacity|no (gpu )?capacity", re.I)
TEMPLATE_KEYS = {"name": str, "imageName": str, "containerDiskInGb": int, "volumeInGb": int,
                 "volumeMountPath": str, "ports": str, "dockerArgs": str, "env": dict, "minCudaVersion": str,
                 "registry": str}
CUDA_VERSION = re.compile(r"^\d+\.\d+$")
PERSISTENT_MIN_GB = 10  # v2's PersistentMount.size minimum


def load_template(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ConfigError(str(path), "", f"cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(str(path), "", f"invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", "not a mapping of template fields")
    for key, value in data.items():
        if key not in TEMPLATE_KEYS:
            hint = f"fields: {', '.join(TEMPLATE_KEYS)}"
            if key in ("bidPerGpu", "interruptible", "spot"):
                hint = "RunPod's REST API v2 has no interruptible (spot) pods; podkit deploys on-demand pods"
            raise ConfigError(str(path), key, "unknown template field", hint=hint)
        want = TEMPLATE_KEYS[key]
        if value is None:
            data[key] = want()
        elif not isinstance(value, want) or isinstance(value, bool):
            raise ConfigError(str(path), key, f"expected {want.__name__}, got {value!r}")
    missing = [k for k in ("name", "imageName", "volumeMountPath") if not data.get(k)]
    if missing:
        raise ConfigError(str(path), missing[0], "required")
    if data["volumeMountPath"] != "/workspace":
        raise ConfigError(str(path), "volumeMountPath", f"{data['volumeMountPath']!r}: podkit's workspace is "
                          "/workspace", hint="mount the volume at /workspace")
    gb = data.get("volumeInGb", 0)
    if gb and not PERSISTENT_MIN_GB <= gb <= 4096:
        raise ConfigError(str(path), "volumeInGb", f"{gb}: a pod volume is {PERSISTENT_MIN_GB}..4096 GB "
                          "(0: none; a network volume from --network-volume replaces it)")
    if data.get("minCudaVersion") and not CUDA_VERSION.match(data["minCudaVersion"]):
        raise ConfigError(str(path), "minCudaVersion", f"{data['minCudaVersion']!r} is not major.minor",
                          hint='e.g. "12.9": the CUDA of the image, which the host\'s driver must run')
    data["env"] = {str(k): "" if v is None else str(v) for k, v in (data.get("env") or {}).items()}
    for k, v in data["env"].items():
        if why := literal_secret(v, k):
            raise ConfigError(str(path), f"env.{k}", f"looks like a literal secret ({why})",
                              hint=f'reference a RunPod secret: "{{{{ RUNPOD_SECRET_{k} }}}}"')
    return data


def ports(tpl: dict) -> list[str]:
    return [p for p in (tpl.get("ports") or "").replace(" ", "").split(",") if p]


def template_body(tpl: dict) -> dict:
    """createTemplate's body (CreateTemplateRequest); PATCH takes the same fields. A pod template, SSH on,
    JupyterLab off (v2 starts it by default), private."""
    body = {"name": tpl["name"], "image": tpl["imageName"], "disk": int(tpl.get("containerDiskInGb") or 40),
            "env": dict(tpl["env"]), "ports": ports(tpl), "startSsh": True, "startJupyter": False,
            "public": False, "serverless": False}
    # Always sent: a PATCH leaves what it omits as it was, and a start command or registry removed from
    # template.yaml must go from the template too.
    body["args"] = tpl.get("dockerArgs") or ""
    body["registry"] = tpl.get("registry") or None
    if tpl.get("volumeInGb"):
        body["mounts"] = {"persistent": {"size": int(tpl["volumeInGb"]), "path": tpl["volumeMountPath"]}}
    if tpl.get("minCudaVersion"):
        body["allowedCudaVersions"] = []  # no exact set: the pod's gpu.minCudaVersion is the floor
    return body


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
NETWORK_VOLUME_ENV = config.env_name("guard", "network_volume")
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    m = DURATION.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError("command line", flag, f"{text!r} is not a duration", hint="e.g. 90m, 12h, 2d or 3600 (s)")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def with_stop_at(env: dict, stop_at: float) -> dict:
    """`stop_at` (the maximum run time) as guard.stop_pod_at in the env, when there is one."""
    if stop_at:
        env[STOP_AT_ENV] = str(int(stop_at))
    return env


def pod_body(tpl: dict, gpus: int, cloud: str, name: str, volume: dict | None = None, stop_at: float = 0,
             run: str = "") -> dict:
    """createPod's body (CreatePodRequest): the template's container with the GPUs, on the network
    volume (in its data center) when there is one, else on a pod volume; `stop_at` is the maximum run
    time as the pod's guard.stop_pod_at; `run` the run's id. Every field is explicit and no templateId
    is sent: a template's fields that template.yaml no longer has (a PATCH cannot clear a mount) would
    be applied to the pod."""
    env = with_stop_at(config_for(tpl, gpus), stop_at)
    if run:
        env[guardfile.RUN_ENV] = run
    gpu = {"id": GPU_TYPE, "count": gpus}
    if tpl.get("minCudaVersion"):
        gpu["minCudaVersion"] = tpl["minCudaVersion"]  # the host's driver must run the image's CUDA
    body = {"name": name, "image": tpl["imageName"], "disk": int(tpl.get("containerDiskInGb") or 40), "env": env,
            "ports": ports(tpl), "cloud": cloud, "gpu": gpu, "startSsh": True}
    body["args"] = tpl.get("dockerArgs") or ""
    body["registry"] = tpl.get("registry") or None
    if volume:  # network and persistent mounts are exclusive; the network volume is what outlives the pod
        env[NETWORK_VOLUME_ENV] = "refuse"  # a pod that came up without it must not train onto a throwaway disk
        body["mounts"] = {"network": [{"volumeId": volume["id"], "path": tpl["volumeMountPath"]}]}
        body["dataCenterIds"] = [volume["dataCenter"]]
    elif tpl.get("volumeInGb"):
        body["mounts"] = {"persistent": {"size": int(tpl["volumeInGb"]), "path": tpl["volumeMountPath"]}}
    return body


# -- clusters: RunPod Instant Clusters ---------------------------------------------------------------------
# `POST /v2/clusters` (createCluster) takes a CreateClusterRequest: BaseContainerConfig (image, env, args,
# disk, ports) plus name, type, compute {gpuTypeId, gpuCountPerPod, podCount 2..250}, dataCenterIds, mounts
# (one network volume), startSsh; no registry: "private registries are not yet supported for clusters".
# `DELETE /v2/clusters/{id}` terminates every member pod; there is no stop.
CLUSTER_TYPE = "TRAINING"  # the generic distributed-training cluster: podkit starts Ray itself
CLUSTER_NODES_ENV = config.env_name("cluster", "nodes")
MAX_CLUSTER_NODES = 250


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


def check_cluster_image(tpl: dict, source: str) -> None:
    """Clusters pull public images only (v2's CreateClusterRequest has no registry)."""
    if tpl.get("registry"):
        raise ConfigError(source, "registry", f"{tpl['registry']!r}: RunPod's clusters cannot pull from a private "
                          "registry (\"private registries are not yet supported for clusters\")",
                          hint="push the image to a public registry and remove `registry`, or deploy single pods "
                          "(`podkit deploy --gpus N`), which can")


def cluster_env(tpl: dict, nodes: int, gpus_per_node: int, stop_at: float = 0, run: str = "") -> dict:
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
    env[NETWORK_VOLUME_ENV] = "refuse"  # every node shares the run's network volume
    if run:
        env[guardfile.RUN_ENV] = run
    return with_stop_at(env, stop_at)


def cluster_body(tpl: dict, name: str, nodes: int, gpus_per_node: int, gpu_type: str, volume: dict,
                 stop_at: float = 0, run: str = "") -> dict:
    """createCluster's body (CreateClusterRequest): every node runs the template's image, env and start
    command, with the network volume at /workspace, in the volume's data center."""
    body = {"name": name, "type": CLUSTER_TYPE,
            "compute": {"gpuTypeId": gpu_type.strip(), "gpuCountPerPod": gpus_per_node, "podCount": nodes},
            "image": tpl["imageName"], "env": cluster_env(tpl, nodes, gpus_per_node, stop_at, run),
            "disk": int(tpl.get("containerDiskInGb") or 40), "ports": ports(tpl),
            "dataCenterIds": [volume["dataCenter"]],
            "mounts": {"network": [{"volumeId": volume["id"], "path": tpl["volumeMountPath"]}]},
            "startSsh": True}
    if tpl.get("dockerArgs"):
        body["args"] = tpl["dockerArgs"]
    return body


def run_nodes(members: list[dict]) -> int | None:
    """The node count the run was made for: cluster.nodes in its pods' env (set at create)."""
    counts = {str((p.get("env") or {}).get(CLUSTER_NODES_ENV, "")) for p in members if isinstance(p.get("env"), dict)}
    counts = {int(n) for n in counts if n.isdigit()}
    return min(counts) if counts else None


def cluster_summary(c: dict, members: list[dict] | None = None) -> list[str]:
    comp = c.get("compute") or {}
    pods = c.get("pods") or {}
    states = ", ".join(f"{n} {s}" for s, n in sorted((pods.get("byStatus") or {}).items())) or "none placed yet"
    line = (f"{c.get('id')} {c.get('name')}: {comp.get('podCount')} x {comp.get('gpuCountPerPod')} "
            f"{comp.get('gpuTypeId')}, nodes: {states}")
    if c.get("dataCenterId"):
        line += f", in {c['dataCenterId']}"
    lines = [line]
    primary = c.get("primary") or {}
    if primary.get("sshEndpoint"):
        host, _, port = primary["sshEndpoint"].rpartition(":")
        lines.append(f"  rank 0 (pod {primary.get('podId')}): ssh root@{host} -p {port}")
    made_for = run_nodes(members or [])
    extra = sorted((p for p in members or [] if _rank(p) is not None and made_for is not None
                    and _rank(p) >= made_for), key=_rank)
    if extra:
        lines.append(f"  {len(extra)} node(s) beyond the run's {made_for} (the cluster was scaled up): "
                     + ", ".join(f"rank {_rank(p)} pod {p.get('id')}" for p in extra)
                     + f". They take no part in the run (a node with NODE_RANK >= {made_for} waits in safe mode, "
                     "saying so) and bill until the cluster is deleted; a run on more nodes is a new cluster made "
                     "for them (--nodes and a config for that shape)")
    return lines


def _rank(pod: dict) -> int | None:
    rank = (pod.get("cluster") or {}).get("rank") if isinstance(pod.get("cluster"), dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


class Deployer:
    """podkit's RunPod operations, each a few REST API v2 calls."""

    # How long a create podkit gave up waiting for may still be made and answered by RunPod: its edge holds
    # a request up to 100 s (Cloudflare's proxy read timeout), and its pod list may show the pod later still.
    CREATE_ANSWER_S = 120.0
    LOOK_EVERY_S = 5.0

    def __init__(self, client: api.Client | None = None, sleep=time.sleep, create_answer_s: float | None = None,
                 look_every_s: float | None = None) -> None:
        self.api = client or api.Client(sleep=sleep)
        self.sleep = sleep
        self.create_answer_s = self.CREATE_ANSWER_S if create_answer_s is None else create_answer_s
        self.look_every_s = self.LOOK_EVERY_S if look_every_s is None else look_every_s

    def _redact(self, text: str) -> str:
        return self.api.redact(text)

    # -- template ---------------------------------------------------------------------------------------
    def save_template(self, tpl: dict) -> dict:
        """Create the template, or update the one of this name (PATCH); its id."""
        existing = next((t for t in self.api.templates() if t.get("name") == tpl["name"]), None)
        saved = self.api.save_template(template_body(tpl), existing["id"] if existing else None)
        if not isinstance(saved.get("id"), str):
            raise PodkitError(f"RunPod's answer to the template save has no id: {self._redact(str(saved))[:200]}")
        _log.info(f"template {tpl['name']!r} {'updated' if existing else 'created'} (id {saved['id']})")
        return saved

    def network_volume(self, volume_id: str) -> dict:
        """The network volume (id, dataCenter, type): a pod on it runs in its data center."""
        found = self.api.network_volumes()
        vol = next((v for v in found if v.get("id") == volume_id), None)
        if not vol or not vol.get("dataCenter"):
            raise PodkitError(f"no network volume {volume_id!r} in this RunPod account",
                              "yours: " + (", ".join(f"{v.get('id')} ({v.get('name')}, {v.get('dataCenter')})"
                                                     for v in found) or "none; create one under Storage"))
        return vol

    def pods_on(self, volume_id: str, but=()) -> list[dict]:
        """The account's pods that mount this network volume and may be live (ids in `but` aside): all but
        those RunPod documents as stopped, in error or gone; one in a status it does not document (a
        migration) may hold the volume."""
        but = {but} if isinstance(but, str) else set(but)
        return [p for p in self.api.pods() if p.get("id") not in but and maybe_live(p)
                and volume_id in mounted_volumes(p)]

    # -- clusters ----------------------------------------------------------------------------------------
    def create_cluster(self, body: dict) -> dict:
        """createCluster, sent once. A create whose answer is lost is looked for by name: a second cluster
        would bill beside the first."""
        before = {c.get("id") for c in self.api.clusters() if c.get("name") == body["name"]}
        try:
            c = self.api.create_cluster(body)
        except api.ApiError as e:
            if not lost_answer(e):
                raise
            self.sleep(5.0)
            made = [c for c in self.api.clusters() if c.get("name") == body["name"] and c.get("id") not in before]
            if not made:
                raise PodkitError(f"{e.message}; RunPod lists no new cluster named {body['name']!r} yet",
                                  "look under Instant Clusters in the console (or `podkit deploy cluster-status`) "
                                  "before creating another: it may still appear") from None
            _log.warn(f"RunPod made cluster {made[0].get('id')} although its answer was lost ({e.message})")
            c = made[0]
        if not c or not isinstance(c.get("id"), str) or not POD_ID.match(c["id"]):
            raise PodkitError(f"RunPod's answer to the cluster create has no cluster id: {self._redact(str(c))[:300]}",
                              "look in the console under Instant Clusters before creating another")
        comp = body["compute"]
        _log.info(f"cluster {c['id']} created ({comp['podCount']} nodes x {comp['gpuCountPerPod']} {comp['gpuTypeId']})")
        return c

    def cluster(self, cluster_id: str) -> dict:
        return self.api.cluster(cluster_id) or {}

    def delete_cluster(self, cluster_id: str) -> None:
        self.api.delete_cluster(cluster_id)

    # -- pods --------------------------------------------------------------------------------------------
    def create_pod(self, body: dict, capacity_timeout_s: float, mine=None, before=()) -> dict:
        """createPod, capacity refusals retried with back-off for a bounded time. A create RunPod may have
        made (no answer, 5xx, an answer cut short) is looked for among the run's pods for as long as RunPod
        could still make it (`create_answer_s`) before it is sent again, and after any create exactly one
        pod of the run is left (only_one): a second pod would bill too. `mine` tells the run's pods (its
        run id, else its name); `before`, pods of it that were there already."""
        name, run = body["name"], body["env"].get(guardfile.RUN_ENV, "")
        mine = mine or (lambda p: run_of(p) == run if run else p.get("name") == name)
        before = set(before) | {p.get("id") for p in self.api.pods() if mine(p)}
        t0, delay, attempt, unsure = time.monotonic(), 5.0, 0, 0
        while True:
            attempt += 1
            try:
                pod = self.api.create_pod(body)
                _log.info(f"pod {pod['id']} created ({body['gpu']['count']}x {GPU_TYPE}, {body['cloud']} cloud)")
                return self.only_one(pod, mine, before)
            except api.ApiError as e:
                if lost_answer(e):
                    made = self.look_for(mine, before)
                    if made:
                        _log.warn(f"RunPod made pod {made[0]['id']} although its answer was lost ({e.message}); "
                                  "following it, not creating another")
                        return self.only_one(made[0], mine, before)
                    unsure += 1
                    if unsure > 3:
                        raise
                    _log.warn(f"the pod create failed and RunPod lists no pod of the run after "
                              f"{self.create_answer_s:.0f} s: sending it again ({e.message})")
                    continue
                if not CAPACITY.search(f"{e.detail} {e.message}"):
                    raise PodkitError(f"RunPod refused the pod: {e.message}", e.hint) from None
                waited = time.monotonic() - t0
                if waited + delay > capacity_timeout_s:
                    other = [c for c in CLOUDS if c != body["cloud"]]
                    fewer = [n for n in (4, 2, 1) if n < body["gpu"]["count"]]
                    raise PodkitError(
                        f"no {body['gpu']['count']}x {GPU_TYPE} available in {body['cloud']} cloud after "
                        f"{attempt} attempt(s) over {waited:.0f}s: {e.detail or e.message}",
                        f"try another cloud (--cloud {' or --cloud '.join(other)})"
                        + (f", or fewer GPUs (--gpus {' or --gpus '.join(map(str, fewer))})" if fewer else "")
                        + ", or later") from None
                _log.warn(f"no capacity yet (attempt {attempt}): {e.detail or e.message}; retrying in {delay:.0f}s")
                self.sleep(delay)
                delay = min(60.0, delay * 2) * random.uniform(0.8, 1.2)

    def look_for(self, mine, before) -> list[dict]:
        """The run's pods made since `before`, looked for every `look_every_s` for as long as a create whose
        answer was lost could still be made (`create_answer_s`); [] when none came."""
        looks = max(1, math.ceil(self.create_answer_s / self.look_every_s))
        for _ in range(looks):
            self.sleep(self.look_every_s)  # a create that timed out may still be under way at RunPod
            try:
                made = [p for p in self.api.pods() if mine(p) and p.get("id") not in before]
            except api.ApiError as e:
                _log.warn(f"cannot list your pods to look for the pod just created ({e.message}); looking again")
                continue
            if made:
                return sorted(made, key=created_order)
        return []

    def only_one(self, pod: dict, mine, before=()) -> dict:
        """Exactly one pod of the run left: of `pod` and the run's other live pods made since `before`, the
        one created first stays; the others are terminated while they are still starting (nothing of theirs
        is lost), and one already running is named for a person to end (the workspace lease keeps it from
        training). Returns the one that stays."""
        try:
            others = [p for p in self.api.pods() if mine(p) and maybe_live(p)
                      and p.get("id") not in set(before) | {pod["id"]}]
        except api.ApiError:
            return pod  # asked again at the next look (the watch, wait_running)
        if not others:
            return pod
        first = min([pod, *others], key=created_order)
        for extra in (p for p in [pod, *others] if p is not first):
            if api.pod_state(extra) == "starting":
                _log.warn(f"pod {extra['id']} is a second pod of the run beside pod {first['id']} (created first): "
                          "terminating it while it is still starting")
                try:
                    self.act(extra["id"], "terminate")
                except PodkitError as e:
                    _log.error(f"could not terminate pod {extra['id']} ({e.message}): terminate it yourself "
                               f"(`podkit deploy terminate {extra['id']}`); the workspace lease keeps it from training")
            else:
                _log.error(f"pod {extra['id']} ({extra.get('status')}) is a second pod of the run beside pod "
                           f"{first['id']}: it bills; `podkit deploy terminate {extra['id']}` when you have looked")
        return first

    def wait_running(self, pod_id: str, timeout_s: float, poll_s: float = 5.0) -> dict:
        t0 = time.monotonic()
        last = None
        while True:
            pod = self.api.pod(pod_id)
            if pod is None:
                raise PodkitError(f"pod {pod_id} is gone while starting (terminated, or RunPod removed it)",
                                  "`podkit deploy status` on its id; look in the console")
            if (run := run_of(pod)) and (first := self.only_one(pod, lambda p: run_of(p) == run))["id"] != pod_id:
                _log.info(f"following pod {first['id']}, the run's pod created first")
                pod_id, pod = first["id"], first
            state = pod.get("status")
            ready = running(pod)
            if state != last or ready:
                _log.info(f"pod {pod_id}: {state}{', runtime up' if ready else ''} ({time.monotonic() - t0:.0f}s)")
                last = state
            if ready:
                return pod
            if state == "ERROR":
                raise PodkitError(f"pod {pod_id} is in ERROR (RunPod could not start its container)",
                                  f"`podkit deploy logs {pod_id} --system` tells why (an image pull, a CUDA the "
                                  "host's driver cannot run)")
            if time.monotonic() - t0 > timeout_s:
                raise PodkitError(f"pod {pod_id} not running after {timeout_s:.0f}s (state {state})",
                                  f"`podkit deploy logs {pod_id} --system`; `podkit deploy status {pod_id}`")
            self.sleep(poll_s)

    def act(self, pod_id: str, action: str) -> dict | None:
        """start | stop | terminate. A stop of a pod already stopped, or a terminate of one gone, is done."""
        try:
            return self.api.action(pod_id, action)
        except api.ApiError as e:
            if e.status == 404 and action == "terminate":
                return None
            if e.status == 409:
                pod = self.api.pod(pod_id)
                if pod and action == "stop" and pod.get("status") == "EXITED":
                    return pod
                if pod and action == "start" and api.pod_state(pod) in ("starting", "running"):
                    return pod  # a start whose first answer was lost, sent again
                if pod and pod.get("locked") and action == "stop":
                    raise PodkitError(f"pod {pod_id} is locked: RunPod does not stop a locked pod",
                                      "unlock it in the console (or PATCH locked: false), then stop it") from None
                state = pod.get("status") if pod else "gone"
                raise PodkitError(f"RunPod cannot {action} pod {pod_id} while it is {state} (it allows: "
                                  f"{', '.join((pod or {}).get('actions') or []) or 'nothing'})") from None
            raise

    def status(self, pod_id: str) -> dict:
        pod = self.api.pod(pod_id)
        if not pod:
            raise PodkitError(f"RunPod has no pod {pod_id}", "it was terminated, or migrated to a new pod with a new "
                              "id: `podkit deploy status` lists your pods")
        return pod


def created_order(pod: dict) -> tuple[bool, str, str]:
    """Created first comes first; a pod whose answer has no createdAt comes after those that do."""
    made = pod.get("createdAt")
    return not (isinstance(made, str) and made), str(made or ""), str(pod.get("id"))


def maybe_live(pod: dict) -> bool:
    """Not a pod RunPod documents as stopped, in error or gone (a status it does not document may be live)."""
    return api.pod_state(pod) not in ("stopped", "error", "gone")


def lost_answer(e: api.ApiError) -> bool:
    """RunPod may have acted on the request: no answer, a 5xx, or a 2xx that could not be read."""
    return e.status == 0 or e.status >= 500 or 200 <= e.status < 300


def running(pod: dict | None) -> bool:
    return bool(pod) and pod.get("status") == "RUNNING" and pod.get("runtime") is not None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def mounted_volumes(pod: dict) -> set[str]:
    network = _list(_dict(pod.get("mounts")).get("network"))
    return {m.get("volumeId") for m in network if isinstance(m, dict) and isinstance(m.get("volumeId"), str)}


def gpu_count(pod: dict) -> int:
    n = (pod.get("gpu") or {}).get("count") if isinstance(pod.get("gpu"), dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def how_to_reach(pod: dict) -> list[str]:
    lines = []
    direct = _dict(_dict(pod.get("ssh")).get("direct"))
    if direct.get("host") and direct.get("port"):
        lines.append(f"ssh {direct.get('username') or 'root'}@{direct['host']} -p {direct['port']}")
    for p in _list(_dict(pod.get("runtime")).get("ports")):
        if not isinstance(p, dict):
            continue
        if not lines and p.get("private") == 22 and p.get("public") and p.get("ip"):
            lines.append(f"ssh root@{p['ip']} -p {p['public']}")
        elif p.get("type") == "http":
            lines.append(f"https://{pod['id']}-{p.get('private')}.proxy.runpod.net")
    lines.append(f"logs: podkit deploy logs {pod.get('id')} --follow (every line prefixed with its program), or "
                 "over SSH: podkit status; tail -f /workspace/logs/trainer.log")
    return lines


def pod_line(pod: dict) -> str:
    rt = _dict(pod.get("runtime"))
    gpus = [g for g in _list(rt.get("gpus")) if isinstance(g, dict)]
    util = f", GPU util {'/'.join(str(g.get('util', '?')) for g in gpus)}%" if gpus else ""
    vols = ", ".join(sorted(mounted_volumes(pod)))
    return (f"{pod.get('id')} {pod.get('name')}: {pod.get('status')}, {gpu_count(pod)}x "
            f"{_dict(pod.get('gpu')).get('id', '?')}, uptime {rt.get('uptime') or 0}s{util}"
            + (f", network volume {vols}" if vols else ""))


# -- watch: relaunch after a lost pod ----------------------------------------------------------------------
class Watch:
    """Follows one pod through RunPod's API (v2 statuses: PROVISIONING, STARTING, RUNNING, EXITED, ERROR,
    TERMINATED, or no such pod; api.STATUSES: any other status says nothing). A pod that is gone
    (terminated, its host removed), in ERROR, running with zero GPUs (RunPod restarts a pod whose host has
    no free GPU with none), or not running for `lost_after_s` (host down; a pod never seen running gets
    `start_grace_s` more, for its image pull), each said in GONE_AFTER answers in a row, is replaced: the old one is stopped first (never terminated), then a new pod starts on the same network
    volume and resumes from its checkpoints.

    Never two pods on one volume: before a replacement the watch lists the account's pods, and a live pod
    on the run's network volume (RunPod migrated the pod: a new pod with a new id and IP; or another
    watch replaced it) is followed instead of starting another.

    An EXITED pod was stopped on request: by its own cost guard (training finished, the maximum run time,
    a long safe mode) or by a person. That ends the watch, as does a maximum run time that has passed. A
    RunPod API that does not answer is waited out: it says nothing about the pod."""

    GONE_AFTER = 3  # answers in a row saying "no such pod": one could be the API's hiccup
    REFUSALS_MAX = 10  # 401/403 in a row: the API answers, and refuses

    def __init__(self, d: Deployer, pod_id: str, launch, *, volume_id: str = "", lost_after_s: float = 900,
                 start_grace_s: float = 900, poll_s: float = 30, max_relaunches: int = 3, backoff_s: float = 60,
                 clock=time.monotonic, wall=time.time, state_dir=None) -> None:
        self.d, self.pod_id, self.launch, self.volume_id = d, pod_id, launch, volume_id
        self.lost_after_s, self.start_grace_s, self.poll_s = lost_after_s, start_grace_s, poll_s
        self.max_relaunches, self.backoff_s = max_relaunches, backoff_s
        self.clock, self.wall, self.state_dir = clock, wall, state_dir
        self.relaunches = 0
        # What a replacement keeps from the first pod: its image, name, GPU count, maximum run time.
        self.carry: dict = {}
        self.seen_running = False
        self.refusals = 0
        self.downs = 0  # answers in a row with a status RunPod documents as not running
        self.replaced: set[str] = set()  # the pods this watch replaced: never the run's pod again

    def remember(self, pod: dict) -> None:
        if not self.carry:
            self.carry = {"imageName": pod.get("image") or "", "name": pod.get("name") or "",
                          "gpuCount": gpu_count(pod), "stop_at": carried_stop_at(pod), "run": run_of(pod)}
        elif not self.carry["gpuCount"]:
            self.carry["gpuCount"] = gpu_count(pod)

    def verdict(self, pod: dict | None, down_since: float | None, nones: int) -> tuple[str, str]:
        """(state, why): running | waiting | stopped | lost. Only what RunPod documents counts toward a loss
        (api.STATUSES), and only when it has said so `GONE_AFTER` times in a row: a status it does not
        document (none, null, a migration state) says nothing, and is waited out like an unreadable answer."""
        if pod is None and nones < self.GONE_AFTER:
            return "waiting", "RunPod does not know the pod (asking again)"
        state, status = api.pod_state(pod) if pod else "gone", (pod or {}).get("status")
        if state == "unknown":
            return "waiting", (f"RunPod reports the pod in a status it does not document ({status!r:.40}): that "
                               "says nothing about it; asking again")
        if state == "stopped":
            return "stopped", ("the pod was stopped on request: by its own cost guard (training finished, its "
                               "maximum run time, a long safe mode) or by a person")
        sure = pod is None or self.downs >= self.GONE_AFTER
        if state == "gone":
            if sure:
                return "lost", "the pod is gone (terminated, migrated, or its host was removed)"
            return "waiting", f"RunPod reports the pod {status} (asking again before it counts)"
        if state == "error":
            if sure:
                return "lost", "RunPod reports the pod in ERROR (its container could not start or run)"
            return "waiting", "RunPod reports the pod in ERROR (asking again before it counts)"
        rt = pod.get("runtime")
        if state == "running" and isinstance(rt, dict) and rt.get("gpus") == [] and self.carry.get("gpuCount"):
            return "lost", "the pod runs with zero GPUs (its host had none free when it restarted)"
        if running(pod):
            return "running", "running"
        down = self.clock() - down_since if down_since is not None else 0.0
        limit = self.lost_after_s + (0 if self.seen_running else self.start_grace_s)
        if down >= limit and sure:
            return "lost", f"the pod has not been running for {down:.0f} s (state {status}; host down or unreachable)"
        return "waiting", f"not running yet ({status})"

    def notify(self, event: str, text: str) -> None:
        from podkit import notify

        t = notify.send(event, text, self.state_dir)
        if t:
            t.join(10)

    def ask(self) -> tuple[bool, dict | None]:
        """(answered, the pod or None)."""
        try:
            pod = self.d.api.pod(self.pod_id)
            self.refusals = 0
            return True, pod
        except api.ApiError as e:
            if e.status in (401, 403):
                self.refusals += 1
                if self.refusals >= self.REFUSALS_MAX:
                    raise PodkitError(f"RunPod refused {self.REFUSALS_MAX} questions in a row about pod "
                                      f"{self.pod_id}: {e.message}", e.hint) from None
                why = f"refused the question (HTTP {e.status})"
            else:
                why = f"does not answer ({e.message})"
        _log.warn(f"RunPod's API {why}; asking again in {self.poll_s:g} s")
        return False, None

    def ours(self, pod: dict) -> bool:
        """The same run: its run id (a migration and a replacement keep the env), or without one its name."""
        if self.carry.get("run"):
            return run_of(pod) == self.carry["run"]
        return bool(self.carry.get("name")) and pod.get("name") == self.carry["name"]

    def successor(self) -> dict | None:
        """A live pod of this run on its network volume, other than the one followed. A live pod of
        anything else there (a pod opened to look at the checkpoints) holds the replacement back."""
        if not self.volume_id:
            return None
        try:
            others = self.d.pods_on(self.volume_id, but=self.pod_id)
        except api.ApiError as e:
            raise _Unsure(f"cannot list your pods: {e.message}") from None
        mine = [p for p in others if self.ours(p)]
        if mine:
            return mine[0]
        if others:
            p = others[0]
            raise _Unsure(f"pod {p.get('id')} ({p.get('name')}, {p.get('status')}) is on network volume "
                          f"{self.volume_id} and is not this run's: no replacement beside it; stop it, and the watch "
                          "replaces the run's pod")
        return None

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
            up = running(pod)
            self.seen_running = self.seen_running or up
            if pod is not None and api.pod_state(pod) == "unknown":
                down_since, self.downs = None, 0  # says nothing: a loss is counted afresh from what RunPod documents
            else:
                down_since = None if up else (down_since if down_since is not None else self.clock())
                self.downs = 0 if up else self.downs + 1
            if not self.seen_running and pod is not None:
                self.only_one(pod)
            state, why = self.verdict(pod, down_since, nones)
            if why != said:
                _log.info(f"pod {self.pod_id}: {why}")
                said = why
            if state == "stopped":
                _log.info("watch ends: a pod stopped on request is left stopped")
                return 0
            if state == "lost":
                try:
                    outcome = self.replace(why, pod)
                except _Unsure as e:
                    _log.warn(f"no replacement yet: {e}; asking again in {self.poll_s:g} s")
                    self.d.sleep(self.poll_s)
                    continue
                if outcome not in ("replaced", "followed"):
                    return 0 if outcome == "deadline" else 1
                down_since, said, nones, self.seen_running, self.downs = None, "", 0, False, 0
                continue
            self.d.sleep(self.poll_s)

    def follow(self, other: dict, why: str) -> str:
        old, self.pod_id = self.pod_id, other["id"]
        msg = (f"pod {old} is lost ({why}), and pod {other['id']} ({other.get('name')}, {other.get('status')}) is "
               f"on network volume {self.volume_id}: RunPod migrated the pod (a new pod, new id and IP) or another "
               "watch replaced it; following it, not starting another")
        _log.info(msg)
        self.notify("relaunch", msg)
        return "followed"

    def replace(self, why: str, now: dict | None) -> str:
        """Stop the lost pod, then start its replacement, a failed start tried again after a back-off
        that doubles from the second attempt on: replaced | followed | deadline | gave-up."""
        old = self.pod_id
        self.replaced.add(old)
        if now and api.pod_state(now) not in ("stopped", "gone"):
            try:  # it may come back: it must not then train beside its replacement
                self.d.act(old, "stop")
                _log.info(f"pod {old} stopped (not terminated: `podkit deploy terminate {old}` when done with it)")
            except PodkitError as e:  # an unreachable host may refuse; the workspace lease still guards
                _log.warn(f"could not stop pod {old} ({e.message}); if it comes back, its replacement waits for "
                          "the workspace lease to lapse")
        if other := self.successor():
            return self.follow(other, why)
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
                if other := self.successor():  # made meanwhile (a migration, another watch)
                    return self.follow(other, why)
            try:
                pod = self.launch(self.carry)
                new_id = pod["id"]
            except Exception as e:  # noqa: BLE001 - any failure to start one is a failed attempt, not the watch's end
                what = e.message if isinstance(e, PodkitError) else f"{type(e).__name__}: {self.d._redact(str(e))}"
                _log.error(f"replacement attempt {n} of {self.max_relaunches} for pod {old} failed: {what}")
                self.notify("relaunch", f"pod {old} is lost ({why}); replacement attempt {n} of "
                            f"{self.max_relaunches} failed: {what}")
                continue
            if rival := self.rival(pod, old):
                return self.follow(rival, why)
            self.pod_id = new_id
            msg = (f"pod {old} is lost ({why}); replacement {n} of {self.max_relaunches} is pod {new_id} on "
                   "the same network volume, resuming from its checkpoints")
            _log.info(msg)
            self.notify("relaunch", msg)
            return "replaced"


    def rival(self, ours: dict, old: str) -> dict | None:
        """Two watches that found the run lost at the same moment each start a pod (or one create of this
        watch was made twice): the one started first stays, the later ones are terminated at once (still
        starting: nothing of them is lost). The pod that stays when it is not `ours`."""
        if not self.volume_id:
            return None
        first = self.d.only_one(ours, self.on_volume, before=self.replaced | {old})
        return None if first["id"] == ours["id"] else first

    def on_volume(self, pod: dict) -> bool:
        return self.ours(pod) and self.volume_id in mounted_volumes(pod)

    def only_one(self, pod: dict) -> None:
        """While the followed pod starts, a second pod of the run that shows up late (a create RunPod answered
        after podkit gave up on it) is terminated, or, created first, followed instead."""
        if (first := self.rival(pod, "")) is not None:
            _log.info(f"following pod {first['id']}, the run's pod created first, instead of pod {self.pod_id}")
            self.pod_id = first["id"]


class _Unsure(Exception):
    """No replacement now: the account's pods could not be listed, or a pod of something else is on the
    volume; a replacement might be a second pod on it."""


BACKOFF_MAX_S = 900.0


def carried_stop_at(pod: dict) -> float:
    """The pod's maximum run time (its guard.stop_pod_at, from its env)."""
    env = pod.get("env") if isinstance(pod.get("env"), dict) else {}
    try:
        value = float(str(env.get(STOP_AT_ENV, "")))
    except ValueError:
        return 0.0
    return value if config.is_stop_time(value) else 0.0


def relauncher(d: Deployer, tpl: dict, vol: dict, cloud: str, gpus: int, name: str | None,
               capacity_timeout_s: float, image: str | None = None):
    """Watch's `launch`: a replacement like the first pod watched (its image unless --image names one,
    its GPU count while it had GPUs, its name and maximum run time), with the template's env and secrets,
    on the network volume."""
    def launch(carry: dict) -> dict:
        n = carry.get("gpuCount") or gpus
        t = dict(tpl, imageName=image or carry.get("imageName") or tpl["imageName"])
        d.save_template(t)
        return d.create_pod(pod_body(t, n, cloud, name or carry.get("name") or f"{t['name']}-{n}xa40", vol,
                                     carry.get("stop_at") or 0, carry.get("run") or new_run()), capacity_timeout_s)
    return launch


def new_run() -> str:
    """A run's id (PODKIT_RUN_ID): what its watch's replacements keep, and what guards.json entries and
    the watch's "is this pod ours" questions go by."""
    return secrets.token_hex(8)


def run_of(pod: dict) -> str:
    env = pod.get("env") if isinstance(pod.get("env"), dict) else {}
    raw = env.get(guardfile.RUN_ENV)
    return raw if isinstance(raw, str) and guardfile.RUN_ID.match(raw) else ""


def default_template() -> Path:
    return config.packaged("runpod/template.yaml")


def main(args) -> int:
    return _main(args)


def _main(args) -> int:
    action = args.action or "create"
    if action.startswith("cluster"):
        return _cluster(args, action)
    if action == "status" and not args.pod:
        pods = Deployer().api.pods()
        if args.json:
            print(json.dumps(pods, indent=2))
        for pod in [] if args.json else pods:
            print(pod_line(pod))
        return 0
    if action in ("stop", "start", "terminate", "status", "logs"):
        if not args.pod:
            raise ConfigError("command line", "POD", f"`podkit deploy {action}` needs a pod id")
        check_pod_id(args.pod)
        d = Deployer()
        if action == "logs":
            return _logs(d, args)
        if action == "stop":
            d.act(args.pod, "stop")
            _log.info(f"pod {args.pod} stopped (its volume is kept; `podkit deploy start {args.pod}` resumes it)")
        elif action == "start":
            d.act(args.pod, "start")
            _log.info(f"pod {args.pod} starting (if its GPUs were taken meanwhile, RunPod offers to migrate it: a "
                      "new pod with a new id and IP, which `podkit deploy status` lists)")
        elif action == "terminate":
            d.act(args.pod, "terminate")
            _log.info(f"pod {args.pod} terminated")
        else:
            pod = d.status(args.pod)
            print(json.dumps(pod, indent=2) if args.json else pod_line(pod))
            if not args.json:
                for line in how_to_reach(pod):
                    print("  " + line)
        return 0
    if action == "watch":
        return _watch(args)
    if action != "create":
        raise ConfigError("command line", "ACTION", f"unknown action {action!r}", "create | status | stop | start | "
                          "terminate | logs | watch | cluster | cluster-status | cluster-delete")
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
        base = api.base_url()
        vol = {"id": args.network_volume, "dataCenter": "<its data center>"} if args.network_volume else None
        print(f"# 1. GET {base}/v2/templates  (Authorization: Bearer $RUNPOD_API_KEY; finds {tpl['name']!r})")
        print(f"# 2. POST {base}/v2/templates  (PATCH {base}/v2/templates/<id> when one named {tpl['name']!r} exists)")
        print(json.dumps(template_body(tpl), indent=2, ensure_ascii=False))
        if vol:
            print(f"# 3. GET {base}/v2/network-volumes  (finds {vol['id']}'s data center)")
        print(f"# {4 if vol else 3}. GET {base}/v2/pods  (the pods named {name!r} already there: a create whose "
              "answer is lost is looked for, not sent twice)")
        print(f"# {5 if vol else 4}. POST {base}/v2/pods")
        print(json.dumps(pod_body(tpl, args.gpus, args.cloud, name, vol, stop_at, "<a new run id>"), indent=2,
                         ensure_ascii=False))
        print("# nothing was sent (--dry-run)")
        return 0
    d = Deployer()
    vol = d.network_volume(args.network_volume) if args.network_volume else None
    if vol and (busy := d.pods_on(vol["id"])):
        raise PodkitError(f"network volume {vol['id']} is in use by pod {busy[0]['id']} ({busy[0].get('name')}, "
                          f"{busy[0].get('status')}): two pods on one volume would train over each other",
                          f"stop it first (`podkit deploy stop {busy[0]['id']}`), or use another volume")
    d.save_template(tpl)
    pod = d.create_pod(pod_body(tpl, args.gpus, args.cloud, name, vol, stop_at, new_run()), args.capacity_timeout)
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
    else:
        print("its checkpoints live on the pod's own volume: a pod RunPod migrates or terminates takes them with it; "
              "--network-volume keeps them apart from any one pod")
    return 0


def _logs(d: Deployer, args) -> int:
    """`podkit deploy logs POD [--follow] [--system] [--tail N]`: the pod's log stream, secrets redacted."""
    if args.tail is not None and not 0 <= args.tail <= 5000:
        raise ConfigError("command line", "--tail", f"{args.tail}: 0..5000 lines (RunPod's limit)")
    scrub = Redactor({f"env {k}": v for k, v in os.environ.items() if secret_name(k)})
    source = "system" if args.system else "container"
    try:
        for event in d.api.logs(args.pod, source=source, tail=args.tail, follow=args.follow):
            print(scrub(d.api.redact(event["line"])), flush=True)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 0


def check_cloud(args) -> None:
    if args.cloud not in CLOUDS:
        raise ConfigError("command line", "--cloud", f"{args.cloud!r} is not one of {', '.join(CLOUDS)}",
                          hint="RunPod's REST API v2 places a pod in one cloud (SECURE by default)")
    if args.network_volume and args.cloud == "COMMUNITY":
        raise ConfigError("command line", "--cloud", "network volumes are in Secure Cloud only",
                          hint="--cloud SECURE (the default)")


def check_pod_id(pod: str, what: str = "pod") -> None:
    if not POD_ID.match(pod):  # it goes into a URL path
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
        members = d.api.cluster_pods(args.pod)
        if args.json:
            print(json.dumps(dict(c, members=members), indent=2))
        else:
            print("\n".join(cluster_summary(c, members)))
        return 0
    if args.pod:
        raise ConfigError("command line", "CLUSTER", f"`podkit deploy cluster` creates one and takes no id ({args.pod!r})",
                          hint="podkit deploy cluster-status CLUSTER | cluster-delete CLUSTER")
    if not args.network_volume:
        raise ConfigError("command line", "--network-volume", "a cluster needs a network volume: every node "
                          "mounts it at /workspace, where the run's checkpoints, logs and records are shared",
                          hint="create one under Storage in the cluster's data center; --network-volume ID")
    check_cluster_shape(args.nodes, args.gpus_per_node, args.gpu_type)
    source = args.template or "runpod/template.yaml"
    tpl = load_template(Path(args.template) if args.template else default_template())
    if args.image:
        tpl["imageName"] = args.image
    check_cluster_image(tpl, source)
    cluster_env(tpl, args.nodes, args.gpus_per_node)  # refuse a shape without a cluster config before anything is sent
    stop_at = max_runtime_until(args)
    name = args.name or f"{tpl['name']}-{args.nodes}x{args.gpus_per_node}"
    if args.dry_run:
        vol = {"id": args.network_volume, "dataCenter": "<the network volume's data center>"}
        body = cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at)
        print(f"# 1. GET {api.base_url()}/v2/network-volumes  (Authorization: Bearer $RUNPOD_API_KEY; finds the "
              "volume's data center)")
        print(f"# 2. POST {api.base_url()}/v2/clusters")
        print(json.dumps(body, indent=2, ensure_ascii=False))
        print("# nothing was sent (--dry-run)")
        return 0
    d = Deployer()
    vol = d.network_volume(args.network_volume)
    c = d.create_cluster(cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at,
                                      new_run()))
    cid = c["id"]
    print(f"cluster {cid} created: {args.nodes} nodes x {args.gpus_per_node} {args.gpu_type.strip()}, network "
          f"volume {vol['id']} at /workspace ({vol['dataCenter']})")
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
    if not d.api.pod(args.pod):
        raise PodkitError(f"RunPod knows no pod {args.pod!r}", "check the id: `podkit deploy status` lists your "
                          "pods; the watch replaces pods it has seen, never one it could not find")
    launch = relauncher(d, tpl, vol, args.cloud, args.gpus, args.name, args.capacity_timeout, args.image)
    _log.info(f"watching pod {args.pod} every {args.poll:g} s; lost after {args.lost_after:g} s not running; up to "
              f"{args.max_relaunches} replacement(s) on network volume {vol['id']} ({vol['dataCenter']})")
    w = Watch(d, args.pod, launch, volume_id=vol["id"], lost_after_s=args.lost_after, start_grace_s=args.wait_timeout,
              poll_s=args.poll, max_relaunches=args.max_relaunches, backoff_s=args.backoff)
    with one_watch(vol["id"]):
        try:
            return w.run()
        except KeyboardInterrupt:
            _log.info(f"watch interrupted; the pod now followed is {w.pod_id}")
            return 130


@contextlib.contextmanager
def one_watch(volume_id: str):
    """One watch per run on this machine: a lock on the run's network volume id, held while it watches
    (two watches would each replace a lost pod). Watches on other machines meet on RunPod's pod list."""
    root = Path(os.environ.get("PODKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                           Path.home() / ".cache") / "podkit")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"watch-{re.sub(r'[^A-Za-z0-9_-]', '_', volume_id)[:64]}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise PodkitError(f"another `podkit deploy watch` (pid {holder}) on this machine follows the run on network "
                              f"volume {volume_id}: one watch per run, or a lost pod would be replaced twice",
                              f"stop that one first, or let it do the watching ({path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
