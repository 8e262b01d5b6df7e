"""The request bodies `podkit deploy` sends: createPod's and createCluster's, with the env each pod gets
(the shipped pod config for its GPU count, the maximum run time, the run's id). Pure: nothing here talks
to RunPod."""

from __future__ import annotations

import re
import secrets

from podkit import config
from podkit.deploy.template import container, persistent_mount
from podkit.errors import ConfigError
from podkit.money import ledger
from podkit.remote import rclonesecrets, remote

GPU_TYPE = "NVIDIA A40"

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


REMOTE_ENV = config.env_name("checkpoint", "remote")


def checkpoint_remote(tpl: dict, source: str) -> str:
    """The run's checkpoint.remote from the template's env ("" without one): where a pod of the run in any data
    center restores from, so a pod needs no network volume. Its URL must be one (remote.parse), and the env must
    carry its credentials (RunPod secret references: load_template refuses literal ones), or a pod without a
    network volume would train with nowhere durable to put its checkpoints. Returned as shown: a connection
    string's secret parameters taken out."""
    env = tpl["env"]
    url = env.get(REMOTE_ENV, "").strip()
    if not url:
        return ""
    said = rclonesecrets.shown(url, env)  # in every word below: no secret parameter of a connection string
    try:
        where, options = remote.parse(url)
    except ValueError as e:
        raise ConfigError(source, f"env.{REMOTE_ENV}", str(e), hint="s3://bucket/prefix, an rclone remote "
                          "name:path configured by RCLONE_CONFIG_<NAME>_* in the template's env, or rclone's "
                          "connection string :backend,option=value:path") from None
    s3 = url.startswith("s3://")
    if s3:
        need = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    elif "TYPE" in options or where.startswith(":"):  # an on-the-fly remote: its backend is in its name
        need = []
    else:  # rclone reads a remote from RCLONE_CONFIG_<NAME>_*, or from a config file that RCLONE_CONFIG names
        need = [] if env.get("RCLONE_CONFIG") else [f"RCLONE_CONFIG_{where.partition(':')[0].upper()}_TYPE"]
    missing = [k for k in need if not env.get(k, "").strip()]
    if missing:
        k = missing[0]
        hint = (f'{k}: "{{{{ RUNPOD_SECRET_{k} }}}}" in the template\'s env, with a RunPod secret of that name '
                "(and AWS_ENDPOINT_URL off AWS: R2, B2, RunPod's S3 API)" if s3 else
                f"{k} (e.g. s3) and the remote's options as RCLONE_CONFIG_{k[14:-5]}_* in the template's env, each "
                'secret one a RunPod secret reference ("{{ RUNPOD_SECRET_<NAME> }}")')
        raise ConfigError(source, f"env.{k}", f"missing: {REMOTE_ENV} {said!r} needs it on the pod, whose uploads "
                          "and restores authenticate with it", hint=hint)
    return said


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
        env[ledger.RUN_ENV] = run
    gpu = {"id": GPU_TYPE, "count": gpus}
    if tpl.get("minCudaVersion"):
        gpu["minCudaVersion"] = tpl["minCudaVersion"]  # the host's driver must run the image's CUDA
    body = {"name": name, **container(tpl), "env": env, "cloud": cloud, "gpu": gpu, "startSsh": True}
    if volume:  # network and persistent mounts are exclusive; the network volume is what outlives the pod
        env[NETWORK_VOLUME_ENV] = "refuse"  # a pod that came up without it must not train onto a throwaway disk
        body["mounts"] = network_mount(tpl, volume)
        body["dataCenterIds"] = [volume["dataCenter"]]
    elif tpl.get("volumeInGb"):
        body["mounts"] = persistent_mount(tpl)
    # Without a network volume no dataCenterIds: RunPod's scheduler places the pod in any data center of the
    # cloud with the GPUs free (a checkpoint.remote is what such a pod resumes from).
    return body


def network_mount(tpl: dict, volume: dict) -> dict:
    """The run's network volume at /workspace (a pod's or every node's of a cluster)."""
    return {"network": [{"volumeId": volume["id"], "path": tpl["volumeMountPath"]}]}


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
        env[ledger.RUN_ENV] = run
    return with_stop_at(env, stop_at)


def cluster_body(tpl: dict, name: str, nodes: int, gpus_per_node: int, gpu_type: str, volume: dict,
                 stop_at: float = 0, run: str = "") -> dict:
    """createCluster's body (CreateClusterRequest): every node runs the template's image, env and start
    command, with the network volume at /workspace, in the volume's data center."""
    # No registry (clusters pull public images only) and no empty start command: the request has neither.
    fields = {k: v for k, v in container(tpl).items() if k != "registry" and (k != "args" or v)}
    return {"name": name, "type": CLUSTER_TYPE,
            "compute": {"gpuTypeId": gpu_type.strip(), "gpuCountPerPod": gpus_per_node, "podCount": nodes},
            **fields, "env": cluster_env(tpl, nodes, gpus_per_node, stop_at, run),
            "dataCenterIds": [volume["dataCenter"]], "mounts": network_mount(tpl, volume), "startSsh": True}


def new_run() -> str:
    """A run's id (PODKIT_RUN_ID): what its watch's replacements keep, and what guards.json entries and
    the watch's "is this pod ours" questions go by."""
    return secrets.token_hex(8)
