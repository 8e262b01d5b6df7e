"""`podkit deploy`: the RunPod template from runpod/template.yaml, and a pod on A40s from it.

Uses the official runpod SDK: its transport (`run_graphql_query`), `create_pod`, `get_pod`,
`stop_pod`, `terminate_pod`. The SDK pastes values into its GraphQL text without escaping, so
every string podkit hands it is pre-encoded as the inside of a GraphQL string literal. The SDK has
no template update, so the template is saved with `saveTemplate` (create, or update by id when one
of that name exists) through the SDK's own transport. The API key is never printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import yaml

from podkit import config, log
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


def config_for(tpl: dict, gpus: int) -> dict:
    """The template's env with PODKIT_CONFIG naming the shipped A40 config for `gpus`; a config of the
    user's own (not a shipped one) is kept as it is."""
    env = dict(tpl["env"])
    current = env.get("PODKIT_CONFIG", "")
    shipped = {SHIPPED_CONFIG.format(n) for n in SHIPPED_GPUS}
    if current and current not in shipped:
        return env
    if gpus not in SHIPPED_GPUS:
        raise ConfigError("command line", "--gpus", f"no shipped A40 pod config for {gpus} GPUs",
                          hint=f"use --gpus {' | '.join(map(str, SHIPPED_GPUS))}, or set PODKIT_CONFIG in the "
                          "template's env to a pod config of your own in the image")
    env["PODKIT_CONFIG"] = SHIPPED_CONFIG.format(gpus)
    return env


def pod_args(tpl: dict, template_id: str | None, gpus: int, cloud: str, name: str) -> dict:
    """create_pod's arguments, strings pre-encoded (the SDK pastes them into its query as they are)."""
    return dict(name=gql(name), image_name=gql(tpl["imageName"]), gpu_type_id=GPU_TYPE, cloud_type=cloud,
                gpu_count=gpus, volume_in_gb=int(tpl.get("volumeInGb", 0)),
                container_disk_in_gb=int(tpl.get("containerDiskInGb", 40)),
                docker_args=gql(tpl.get("dockerArgs", "")), ports=tpl.get("ports") or None,
                # The SDK's default is /runpod-volume, which would bypass podkit's workspace.
                volume_mount_path=gql(tpl["volumeMountPath"]),
                env={gql(k): gql(v) for k, v in config_for(tpl, gpus).items()}, template_id=template_id)


FIND_TEMPLATES = "query { myself { podTemplates { id name imageName } } }"


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


def default_template() -> Path:
    return config.packaged("runpod/template.yaml")


def main(args) -> int:
    if runpod is None:
        raise PodkitError("podkit deploy needs the RunPod SDK, which is not installed",
                          "pip install 'podkit[deploy]' where you deploy from (make test installs it)")
    try:
        return _main(args)
    except requests.RequestException as e:
        api = os.environ.get("RUNPOD_API_BASE_URL", "https://api.runpod.io")
        raise PodkitError(f"cannot reach the RunPod API at {api}: {type(e).__name__}",
                          "check the network; nothing may have been created, `podkit deploy status` tells") from None
    except (error.QueryError, error.AuthenticationError) as e:
        key = os.environ.get("RUNPOD_API_KEY") or ""
        msg = str(e).replace(key, "***") if key else str(e)
        raise PodkitError(f"RunPod answered: {msg}", "an invalid API key shows as Unauthorized") from None


def _main(args) -> int:
    action = args.action or "create"
    if action in ("stop", "terminate", "status"):
        if not args.pod:
            raise ConfigError("command line", "POD", f"`podkit deploy {action}` needs a pod id")
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
    if action != "create":
        raise ConfigError("command line", "ACTION", f"unknown action {action!r}", "create | stop | terminate | status")
    tpl = load_template(Path(args.template) if args.template else default_template())
    if args.image:
        tpl["imageName"] = args.image
    if args.cloud not in CLOUDS:
        raise ConfigError("command line", "--cloud", f"{args.cloud!r} is not one of {', '.join(CLOUDS)}")
    if args.gpus < 1:
        raise ConfigError("command line", "--gpus", f"{args.gpus}: at least 1")
    config_for(tpl, args.gpus)  # refuse a GPU count without a pod config before anything is sent
    name = args.name or f"{tpl['name']}-{args.gpus}xa40"
    if args.dry_run:
        print("# 1. query (finds an existing template of this name):")
        print(FIND_TEMPLATES)
        print(f"# 2. mutation (create; with id: \"<existing id>\" when one named {tpl['name']!r} exists):")
        print(template_mutation(tpl))
        print("# 3. mutation (the SDK's create_pod, after its GPU type check):")
        a = pod_args(tpl, "<template id>", args.gpus, args.cloud, name)
        # create_pod's own defaults for what podkit does not set, so this is exactly what it sends.
        a.update(support_public_ip=True, start_ssh=True, min_vcpu_count=1, min_memory_in_gb=1)
        print(generate_pod_deployment_mutation(**a).strip())
        print("# nothing was sent (--dry-run)")
        return 0
    d = Deployer()
    saved = d.save_template(tpl)
    pod = d.create_pod(pod_args(tpl, saved["id"], args.gpus, args.cloud, name), args.capacity_timeout)
    pod = d.wait_running(pod["id"], args.wait_timeout)
    print(f"pod {pod['id']} is running. Reach it with:")
    for line in how_to_reach(pod):
        print("  " + line)
    print(f"stop it: podkit deploy stop {pod['id']}   terminate: podkit deploy terminate {pod['id']}")
    return 0
