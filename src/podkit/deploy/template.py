"""runpod/template.yaml: the template as data, read and checked once per verb, and the container fields
(image, disk, ports, start command, registry) that the template, a pod and a cluster all carry, built in
one place. A real deploy refuses an image no RunPod host can pull (check_image)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from podkit import config
from podkit.errors import ConfigError
from podkit.redact import literal_secret
from podkit.remote import rclonesecrets

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
        if why := literal_secret(v, k, data["env"]):  # the env tells an rclone remote's type: whose options
            raise ConfigError(str(path), f"env.{k}", f"looks like a literal secret ({why})",
                              hint=f'reference a RunPod secret: "{{{{ RUNPOD_SECRET_{k} }}}}"')
        if param := rclonesecrets.unquoted_reference(v):
            raise ConfigError(str(path), f"env.{k}", f"the RunPod secret reference of rclone parameter {param} is "
                              "not quoted: the secret is filled in as is, and a ':' or ',' in it (a JSON key, a SAS "
                              "URL) would end the value there and put the rest where rclone shows it",
                              hint=f"quote it: {param}='{{{{ RUNPOD_SECRET_... }}}}'")
    return data


def default_template() -> Path:
    return config.packaged("runpod/template.yaml")


def from_args(args) -> dict:
    """The template of --template (default runpod/template.yaml), read once per verb, with --image in
    place of its imageName."""
    tpl = load_template(Path(args.template) if args.template else default_template())
    if args.image:
        tpl["imageName"] = args.image
    return tpl


def ports(tpl: dict) -> list[str]:
    return [p for p in (tpl.get("ports") or "").replace(" ", "").split(",") if p]


def container(tpl: dict) -> dict:
    """The container fields every body carries: image, container disk, ports, start command (empty: the
    image's ENTRYPOINT) and private-registry credentials (None: a public image). A template's and a pod's
    body always send the last two: a PATCH leaves what it omits as it was, and a start command or registry
    removed from template.yaml must go from the template too."""
    return {"image": tpl["imageName"], "disk": int(tpl.get("containerDiskInGb") or 40), "ports": ports(tpl),
            "args": tpl.get("dockerArgs") or "", "registry": tpl.get("registry") or None}


def persistent_mount(tpl: dict) -> dict:
    """The pod volume of template.yaml's volumeInGb at /workspace."""
    return {"persistent": {"size": int(tpl["volumeInGb"]), "path": tpl["volumeMountPath"]}}


def template_body(tpl: dict) -> dict:
    """createTemplate's body (CreateTemplateRequest); PATCH takes the same fields. A pod template, SSH on,
    JupyterLab off (v2 starts it by default), private."""
    body = {"name": tpl["name"], **container(tpl), "env": dict(tpl["env"]), "startSsh": True, "startJupyter": False,
            "public": False, "serverless": False}
    if tpl.get("volumeInGb"):
        body["mounts"] = persistent_mount(tpl)
    if tpl.get("minCudaVersion"):
        body["allowedCudaVersions"] = []  # no exact set: the pod's gpu.minCudaVersion is the floor
    return body


# -- the image: one a RunPod host can pull ---------------------------------------------------------------------
# Docker's reference grammar (distribution/reference): [host[:port]/]component(/component)*[:tag][@digest].
# Which registry a name is pulled from (its normalize.go, splitDockerDomain): the part before the first "/"
# is a registry host only when it has a "." or a ":" or is "localhost"; otherwise the name is Docker Hub's,
# and a name of one component is Docker Hub's official-images namespace (podkit:latest is
# docker.io/library/podkit:latest, which nobody publishes: it is the local tag `docker build` gave).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
IMAGE_REFERENCE = re.compile(rf"^(?:(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?/)?"
                             rf"{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                             r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
LOOPBACK_HOST = re.compile(r"^(?:localhost|127(?:\.\d{1,3}){3}|\[(?:0*:)*:?0*1\])(?::\d+)?$", re.I)


def unpullable(image: str) -> str:
    """Why no RunPod host can pull `image` ("" when one can): not an image reference; a name without a
    registry that Docker would look up among Docker Hub's official images (a local tag); or a registry on
    this machine's loopback."""
    if not IMAGE_REFERENCE.match(image):
        return "is not an image reference ([registry/]name[:tag][@digest], lowercase name)"
    first, slash, _ = image.partition("/")
    host = first if slash and ("." in first or ":" in first or first == "localhost") else ""
    if not slash:
        return ("names no registry: Docker would look it up among Docker Hub's official images (library/), where "
                "no podkit image is; it is the local tag of an image built on this machine")
    if host and LOOPBACK_HOST.match(host):
        return f"is in a registry on this machine's loopback ({host}), which no RunPod host can reach"
    return ""


def check_image(tpl: dict, args) -> None:
    """A real deploy refuses an image no RunPod host can pull: the pod would wait on its pull for ever."""
    if why := unpullable(tpl["imageName"]):
        source, key = ("command line", "--image") if args.image else (args.template or "runpod/template.yaml",
                                                                       "imageName")
        raise ConfigError(source, key, f"{tpl['imageName']!r} {why}",
                          hint="push the image built from this repo's Dockerfile to a registry RunPod can pull from "
                          "and name it: --image ghcr.io/<you>/podkit:<tag> (or docker.io's <you>/podkit:<tag>; a "
                          "private one needs the template's `registry`)")
