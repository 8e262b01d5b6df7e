"""A loopback stub of RunPod's REST API v2 for the tests: a stub, not RunPod. It listens on 127.0.0.1 (port 0)
in a daemon thread, keeps pods, templates, network volumes and clusters in memory, and holds both sides to
RunPod's own OpenAPI document (tests/runpod/openapi.json, see tests/runpod/README.md):

- every request body and query is validated against the operation's schema with jsonschema's 2020-12
  validator, as the document's dialect reads it (`unevaluatedProperties: false`: a field the document does
  not define is refused). A refused request is answered 422 application/problem+json with the messages in
  `errors`, as RunPod answers, and kept in `stub.refused`;
- every JSON answer the stub sends is validated against the operation's response schema for that status (or
  `default`); a mismatch is a bug in the stub and lands in `stub.errors` (`stub.assert_clean()`).

Where the document only describes behaviour in words (the pod lifecycle, which actions a status allows, how
logs resume, what a pod bills), the stub does what the words say. The test controls (`add_pod`, `set_status`,
`vanish`, `migrate`, `capacity_failures`, `full` (data centers without a GPU free), `fail`, `logs`,
`drop_logs_after`, `follow_s`, `scale_cluster`, `set_price`, `charge`) script what RunPod does on its own. Billing: a pod bills its `cost` (its GPUs' secure
list price x count) while it is PROVISIONING, STARTING or RUNNING, and `charge` adds to its bill; `GET
/v2/billing/pods` answers that in time buckets. Answers of other shapes and timings are scripted too, and are not held to the
document: `show_status` (a pod shown with a status the document does not have, or none), `fail(..., body=
b"null")` (any body), `answer_late` (the request is done at once, its answer sent later), `list_lag_s` (a new
pod shows in the pod list only that long after it was made, read on `clock`, which a test may fake) and `unlisted` (a pod left out of it), `fail(..., drip_s=)` (an answer sent a byte at a
time), `garble` (the request is done, its answer unreadable: an id of another shape, a body cut short, a
connection dropped mid-body) and `keepalive_s` (SSE keep-alive comments while a log stream is followed). Any request to a GraphQL
path is recorded in `stub.graphql` and answered 410.

    stub = RunPodV2Stub(key="rpa_TESTKEY0123456789")
    ... point the client at stub.url (it calls <url>/v2/...) ...
    stub.assert_clean(); stub.close()
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import jsonschema

SPEC_PATH = Path(__file__).parent / "runpod" / "openapi.json"
SPEC: dict = json.loads(SPEC_PATH.read_text())

# createPod's 400 when a GPU cannot be placed: RunPod gives capacity no code of its own, only this detail.
CAPACITY_DETAIL = ("There are no longer any instances available with the requested specifications. "
                   "Please refresh and try again.")
SSH_PUBLIC_PORT = 22022  # the public port of every pod's 22/tcp; each pod has an IP of its own (203.0.113.0/24)
DEFAULT_DATA_CENTER = "EU-SE-1"
DATA_CENTERS = (DEFAULT_DATA_CENTER, "US-TX-3", "CA-MTL-1")  # where the scheduler looks, in order, without dataCenterIds
# Which actions a status allows, as podAction's description says.
ACTIONS = {"PROVISIONING": ["stop", "terminate"], "STARTING": ["stop", "terminate"],
           "RUNNING": ["stop", "restart", "terminate"], "EXITED": ["start", "terminate"],
           "ERROR": ["start", "terminate"], "TERMINATED": []}
# GPU types the stub places (GET /v2/catalog/gpus answers these): id -> (name, memory GB, $/h secure, max count)
GPU_TYPES = {
    "NVIDIA A40": ("A40", 48, 0.40, 10),  # podkit's GPU: RunPod's A40 hosts go up to 10
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 80, 2.69, 8),
    "NVIDIA H100 PCIe": ("H100 PCIe", 80, 2.39, 8),
    "NVIDIA H100 NVL": ("H100 NVL", 94, 2.59, 8),
    "NVIDIA H200": ("H200 SXM", 141, 3.59, 8),
    "NVIDIA A100-SXM4-80GB": ("A100 SXM", 80, 1.49, 8),
    "NVIDIA A100 80GB PCIe": ("A100 PCIe", 80, 1.39, 8),
    "NVIDIA L40S": ("L40S", 48, 0.86, 8),
    "NVIDIA RTX A6000": ("RTX A6000", 48, 0.49, 8),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 24, 0.69, 8),
}
BILLED = ("PROVISIONING", "STARTING", "RUNNING")  # the statuses whose pod shows a cost, and bills it
HOSTILE_ID = "victim/action?x="  # garble("bad-id"): an id that would address another endpoint in a path
PORT = re.compile(r"^(\d{1,5})/(tcp|http)$")
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")

MISSING = object()  # show_status: the pod is shown without a status field
KEEPALIVE = b": keep-alive\n\n"

FORMATS = jsonschema.FormatChecker(())  # only date-time, checked without optional dependencies


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if isinstance(value, str):
        _parse_ts(value)
    return True


def _parse_ts(value: str) -> dt.datetime:
    if not RFC3339.match(value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _rfc3339(t: dt.datetime, micro: bool = False) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return _rfc3339(dt.datetime.now(dt.UTC))


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def _bucket_floor(t: dt.datetime, size: str) -> dt.datetime:
    """The start of the billing bucket (BillingBucketSize, UTC; weeks from Monday) that holds `t`."""
    t = t.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    if size == "hour":
        return t
    t = t.replace(hour=0)
    if size == "week":
        return t - dt.timedelta(days=t.weekday())
    return t if size == "day" else t.replace(day=1) if size == "month" else t.replace(month=1, day=1)


def _bucket_step(t: dt.datetime, size: str, back: bool = False) -> dt.datetime:
    """The next bucket's start after the bucket starting at `t` (or the one before it, `back`)."""
    n = -1 if back else 1
    if size in ("hour", "day", "week"):
        return t + n * dt.timedelta(**{"hour": {"hours": 1}, "day": {"days": 1}, "week": {"weeks": 1}}[size])
    if size == "year":
        return t.replace(year=t.year + n)
    months = t.year * 12 + t.month - 1 + n
    return t.replace(year=months // 12, month=months % 12 + 1)


_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    """A 2020-12 validator for a schema of the document (its $refs resolve in the document's components)."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft202012Validator({**schema, "components": SPEC["components"]},
                                                           format_checker=FORMATS)
    return _VALIDATORS[key]


def schema_errors(schema: dict, instance: object) -> list[str]:
    """The validation messages, RunPod's way: `$.path: message`."""
    errors = sorted(validator(schema).iter_errors(instance), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"{e.json_path}: {e.message}" for e in errors]


def _resolve(obj: dict) -> dict:
    while "$ref" in obj:
        node: Any = SPEC
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def _problem(status: int, detail: str, errors: list[str] | None = None) -> dict:
    out = {"title": HTTPStatus(status).phrase, "status": status, "detail": detail}
    if errors is not None:
        out["errors"] = errors
    return out


# The document's operations: (compiled path, template, path item), literal paths before templated ones.
_OPERATIONS = sorted(
    ((re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(p)) + "$"), p, item)
     for p, item in SPEC["paths"].items()), key=lambda o: o[1].count("{"))


@dataclass
class Request:
    """One request as the stub received it. `headers` has lower-case names."""
    method: str
    path: str
    query: dict[str, str]
    body: Any
    headers: dict[str, str]
    raw: bytes = b""


@dataclass
class Refusal:
    """A request the stub refused for breaking the document or a rule it states (400/422)."""
    request: Request
    status: int
    errors: list[str]


@dataclass
class Fault:
    method: str
    path_regex: re.Pattern
    status: int | None
    times: int | None
    retry_after: int | float | str | None = None
    body: Any = None
    content_type: str | None = None
    delay_s: float = 0.0
    drip_s: float = 0.0


@dataclass
class _PodMeta:
    ip: str
    price: float
    made: float = field(default_factory=time.monotonic)
    polls_needed: int = 1
    polls: int = 0
    running_since: float | None = None
    start_ssh: bool = True
    billing_since: float | None = None  # wall clock: the open stretch of its bill, at `price`


@dataclass
class _Answer:
    status: int
    body: Any = None  # JSON-able, or None for no body
    headers: dict[str, str] = field(default_factory=dict)
    scripted: bool = False  # a shape a test asked for (show_status): not held to the document


class RunPodV2Stub:
    """A stub of RunPod's REST API v2 on 127.0.0.1: see the module's docstring."""

    def __init__(self, key: str = "rpa_TESTKEY0123456789") -> None:
        self.key = key
        self.requests: list[Request] = []
        self.refused: list[Refusal] = []
        self.errors: list[str] = []     # the stub's own answers the document refuses: bugs in the stub
        self.unknown: list[Request] = []
        self.graphql: list[Request] = []
        self.terminated: set[str] = set()       # pods terminated through the API (action or DELETE)
        self.vanished: set[str] = set()         # pods gone by vanish() or migrate()
        self.migrations: dict[str, str] = {}    # old pod id -> new pod id
        self.deleted_clusters: set[str] = set()
        self.pods: dict[str, dict] = {}         # stored fields; pod(id) adds the derived ones
        self.templates: dict[str, dict] = {}
        self.volumes: dict[str, dict] = {}
        self.clusters: dict[str, dict] = {}
        self.logs: dict[str, list[tuple[str, str]]] = {}
        self.polls_until_running = 1
        self.capacity_failures = 0
        self.full: set[str] = set()  # data centers with no GPU free: a pod asked of them only is refused for capacity
        self.new_pod_ids: list[str] = []
        self.drop_logs_after: int | None = None
        self.follow_s = 0.0
        self.log_clock_s = 0.0  # how far ahead of the API's clock (its Date) the log lines' ts are
        self.keepalive_s = 0.0  # while a followed log stream has nothing new: a ": keep-alive" comment this often
        self.list_lag_s = 0.0  # a pod made through the API shows in GET /v2/pods only this long after
        self.clock = time.monotonic  # what list_lag_s is measured on (a test's fake clock: minutes at once)
        self.shown_status: dict[str, Any] = {}  # pod id -> the status shown for it (MISSING: no status field)
        self.late: list[Fault] = []
        self.garbles: list[Fault] = []
        # What each pod has billed, kept after it is gone: (from, to, USD/h) stretches and (time, USD) charges.
        self.ledger: dict[str, list[tuple[float, float, float]]] = {}
        self.charges: dict[str, list[tuple[float, float]]] = {}
        self.gpu_availability: dict[str, str] = {}  # GPU id -> NONE/LOW/MEDIUM/HIGH (default HIGH)
        self.faults: list[Fault] = []
        self.gpus_lost: set[str] = set()  # RUNNING pods whose runtime shows no GPU (restarted on a host without one)
        self._meta: dict[str, _PodMeta] = {}
        self._listed: set[str] = set()  # pods GET /v2/pods has shown (list_lag_s hides only new ones)
        self._log_ts: dict[str, list[tuple[dt.datetime, str]]] = {}
        self._last_ts = dt.datetime.now(dt.UTC)
        self._count = {"pod": 0, "ip": 6, "template": 0, "cluster": 0, "volume": 0}
        self._lock = threading.RLock()
        self.add_volume("vol-ckpt1", "checkpoints", 500, DEFAULT_DATA_CENTER)

        handler = type("Handler", (_Handler,), {"stub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="runpod-stub", daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # -- lifetime and what the tests read ----------------------------------------------------------

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> RunPodV2Stub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def calls(self) -> list[str]:
        """Every request as "METHOD /path" (no query), in order."""
        return [f"{r.method} {r.path}" for r in self.requests]

    def assert_clean(self) -> None:
        assert self.errors == [], "the stub answered what RunPod's document refuses:\n" + "\n".join(self.errors)

    def pod(self, pod_id: str) -> dict:
        """The complete Pod as GET /v2/pods/{id} answers it now (without counting as a poll)."""
        with self._lock:
            return self._view(pod_id)

    def log_events(self, pod_id: str) -> list[tuple[str, str, str]]:
        """(ts, source, line) of every line in stub.logs[pod_id]; a line gets its ts when first seen."""
        with self._lock:
            return [(ts, *entry) for (_, ts), entry in zip(self._stamps(pod_id), self.logs.get(pod_id, []),
                                                            strict=True)]

    # -- test controls -----------------------------------------------------------------------------

    def add_volume(self, id: str, name: str, size: int, dataCenter: str, type: str = "STANDARD") -> dict:
        vol = {"id": id, "name": name, "size": size, "dataCenter": dataCenter, "type": type}
        self._check_object("NetworkVolume", vol)
        with self._lock:
            self.volumes[id] = vol
        return dict(vol)

    def add_pod(self, volume: str | None = None, mount_path: str = "/workspace", **overrides: Any) -> dict:
        """A RUNNING pod (H100 x1, 22/tcp) with the fields given replacing the defaults; `volume` mounts
        that network volume at `mount_path` and places the pod in its data center. Returns the Pod."""
        with self._lock:
            pid = overrides.pop("id", None) or self._new_id()
            status = overrides.pop("status", "RUNNING")
            pod = {"id": pid, "name": "podkit-stub", "image": "registry.example/podkit:1.0", "args": "", "disk": 50,
                   "ports": ["22/tcp"], "env": {}, "registry": None, "status": status, "mounts": {},
                   "gpu": {"id": "NVIDIA H100 80GB HBM3", "count": 1}, "cloud": "SECURE",
                   "dataCenterId": DEFAULT_DATA_CENTER, "cudaVersion": "12.8", "template": None, "locked": False,
                   "globalNetworking": {"enabled": False}, "createdAt": _now(), "startedAt": None}
            if volume is not None:
                pod["mounts"] = {"network": [{"volumeId": volume, "path": mount_path}]}
                pod["dataCenterId"] = self.volumes[volume]["dataCenter"]
            pod.update(overrides)
            self._store_pod(pod)
            self._listed.add(pid)
            self._enter(pid, status)
            view = self._view(pid)
        self._check_object("Pod", view)
        return view

    def set_status(self, pod_id: str, status: str) -> None:
        with self._lock:
            self._enter(pod_id, status)

    def hold(self, pod_id: str, status: str) -> None:
        """The pod enters `status` (PROVISIONING or STARTING) and stays there, however often it is asked
        about, until set_status moves it: a host that went down, an image that pulls for ever."""
        with self._lock:
            self._enter(pod_id, status)
            self._meta[pod_id].polls_needed = 10 ** 9

    def lose_gpus(self, pod_id: str) -> None:
        """RunPod restarted the pod on a host with no free GPU: it runs, and its runtime shows none."""
        with self._lock:
            self.gpus_lost.add(pod_id)

    def vanish(self, pod_id: str) -> None:
        """The pod is gone (404 from now on), nobody having terminated it."""
        with self._lock:
            self._drop_pod(pod_id)
            self.vanished.add(pod_id)

    def migrate(self, pod_id: str) -> str:
        """RunPod's migration: the pod is gone (404) and a new one, with a new id and IP and the same name,
        image, env, ports, mounts and GPUs, runs in its place. Returns the new id."""
        with self._lock:
            old = self.pods[pod_id]
            new = copy.deepcopy(old)
            new.update(id=self._new_id(), createdAt=_now(), startedAt=None)
            self.vanish(pod_id)
            self._store_pod(new)
            self._listed.add(new["id"])
            self._enter(new["id"], "RUNNING")
            self.migrations[pod_id] = new["id"]
            return new["id"]

    def scale_cluster(self, cluster_id: str, extra_pods: int) -> list[str]:
        """Adds extra_pods member pods (PROVISIONING, next ranks) to the cluster, or with a negative number
        removes the highest-ranked ones; compute.podCount follows. Returns the ids added or removed."""
        with self._lock:
            cluster = self.clusters[cluster_id]
            members = self._members(cluster_id)
            if extra_pods >= 0:
                ids = [self._new_member(cluster, len(members) + i) for i in range(extra_pods)]
            else:
                ids = [p["id"] for p in members[extra_pods:]]
                for pid in ids:
                    self._drop_pod(pid)
                    self.vanished.add(pid)
            cluster["compute"]["podCount"] = len(self._members(cluster_id))
            return ids

    def show_status(self, pod_id: str, status: Any = None) -> None:
        """From now on the pod is shown (GET and lists) with this status, which the document may not have
        (None: null; MISSING: no status field; "MIGRATING"), whatever it really is; None as the pod id's
        entry removed (clear_shown) shows it as it is again."""
        with self._lock:
            self.shown_status[pod_id] = status

    def clear_shown(self, pod_id: str) -> None:
        with self._lock:
            self.shown_status.pop(pod_id, None)

    def unlisted(self, pod_id: str, hidden: bool = True) -> None:
        """The pod is left out of GET /v2/pods (hidden) or shown there again: a pod list that lags."""
        with self._lock:
            (self._listed.discard if hidden else self._listed.add)(pod_id)

    def set_price(self, pod_id: str, per_hour: float) -> None:
        """The pod's cost (USD/h) from now on: what GET shows while it bills, and what its bill grows by."""
        with self._lock:
            self._bill(pod_id, open_=False)
            self._meta[pod_id].price = per_hour
            self._bill(pod_id, open_=self.pods[pod_id]["status"] in BILLED)

    def charge(self, pod_id: str, usd: float) -> None:
        """`usd` more on the pod's bill, now (a run of hours in a moment)."""
        with self._lock:
            self.charges.setdefault(pod_id, []).append((time.time(), usd))

    def garble(self, method: str, path_regex: str, how: str, times: int | None = 1) -> None:
        """The next `times` matching requests are done (a create makes its pod) and answered unreadably: "bad-id"
        (the answer's id is not of RunPod's shape), "cut" (the body cut short, its Content-Length the cut's) or
        "drop" (the connection closed halfway through a body whose Content-Length is the whole)."""
        assert how in ("bad-id", "cut", "drop"), how
        with self._lock:
            self.garbles.append(Fault(method.upper(), re.compile(path_regex), None, times, body=how))

    def answer_late(self, method: str, path_regex: str, delay_s: float, times: int | None = 1) -> None:
        """The next `times` matching requests are done at once (a create makes its pod), and answered only
        after delay_s: RunPod slow to answer what it did."""
        with self._lock:
            self.late.append(Fault(method.upper(), re.compile(path_regex), None, times, delay_s=delay_s))

    def fail(self, method: str, path_regex: str, status: int | None, times: int | None = 1,
             retry_after: int | float | str | None = None, body: Any = None, content_type: str | None = None,
             delay_s: float = 0, drip_s: float = 0) -> None:
        """The next `times` requests (None: all) whose method matches ("*": any) and whose path (no query)
        fullmatches path_regex are answered `status` after delay_s seconds, instead of what the stub would
        answer. body: bytes or str are sent as they are (text/plain unless content_type), a dict or list as
        JSON, None as a problem+json for the status. status None: only the delay, then the stub's own answer.
        drip_s: the whole answer (status line, headers, body) is sent one byte every drip_s seconds.
        Faults are not checked against the document: they are what a test asks for."""
        with self._lock:
            self.faults.append(Fault(method.upper(), re.compile(path_regex), status, times, retry_after, body,
                                     content_type, delay_s, drip_s))

    # -- pods --------------------------------------------------------------------------------------

    def _new_id(self) -> str:
        if self.new_pod_ids:
            return self.new_pod_ids.pop(0)
        self._count["pod"] += 1
        return f"stubpod{self._count['pod']:03d}"

    def _store_pod(self, pod: dict, start_ssh: bool = True) -> None:
        self._count["ip"] = self._count["ip"] % 250 + 1
        gpu = pod.get("gpu")
        price = GPU_TYPES.get(gpu["id"], ("", 0, 1.0, 8))[2] * gpu.get("count", 1) if gpu else 0.08
        self.pods[pod["id"]] = pod
        self._meta[pod["id"]] = _PodMeta(ip=f"203.0.113.{self._count['ip']}", price=round(price, 2),
                                         polls_needed=self.polls_until_running, start_ssh=start_ssh,
                                         made=self.clock())
        self._bill(pod["id"], open_=pod["status"] in BILLED)

    def _drop_pod(self, pod_id: str) -> None:
        self._bill(pod_id, open_=False)
        self.pods.pop(pod_id)
        self._meta.pop(pod_id)

    def _bill(self, pod_id: str, open_: bool) -> None:
        """Opens the pod's billed stretch (if none is open) or closes it into the ledger."""
        meta, now = self._meta[pod_id], time.time()
        if open_ and meta.billing_since is None:
            meta.billing_since = now
        elif not open_ and meta.billing_since is not None:
            self.ledger.setdefault(pod_id, []).append((meta.billing_since, now, meta.price))
            meta.billing_since = None

    def _enter(self, pod_id: str, status: str) -> None:
        pod, meta = self.pods[pod_id], self._meta[pod_id]
        if status == "RUNNING" and (pod["status"] != "RUNNING" or meta.running_since is None):
            meta.running_since = time.monotonic()
            pod["startedAt"] = _now()
        if status != "RUNNING":
            meta.running_since = None
        if status in ("PROVISIONING", "STARTING"):
            meta.polls = 0
        pod["status"] = status
        self._bill(pod_id, open_=status in BILLED)

    def _poll(self, pod_id: str) -> None:
        """A GET that shows the pod: a PROVISIONING or STARTING pod moves on."""
        pod, meta = self.pods[pod_id], self._meta[pod_id]
        if pod["status"] not in ("PROVISIONING", "STARTING"):
            return
        meta.polls += 1
        if meta.polls >= meta.polls_needed:
            self._enter(pod_id, "RUNNING")
            meta.polls = meta.polls_needed
        elif meta.polls >= meta.polls_needed - 1:
            pod["status"] = "STARTING"

    def _view(self, pod_id: str) -> dict:
        pod, meta = copy.deepcopy(self.pods[pod_id]), self._meta[pod_id]
        status = pod["status"]
        running = status == "RUNNING"
        ports = []
        for i, spec in enumerate(pod.get("ports") or []):
            m = PORT.match(spec)
            if m:
                private, kind = int(m.group(1)), m.group(2)
                public = (SSH_PUBLIC_PORT if private == 22 else 40000 + i) if kind == "tcp" else None
                ports.append({"private": private, "public": public, "type": kind,
                              "ip": meta.ip if kind == "tcp" else None})
        pod["actions"] = list(ACTIONS[status])
        user = f"{pod_id}-64411eb2"
        proxy = {"host": "ssh.runpod.io", "port": 22, "username": user, "command": f"ssh {user}@ssh.runpod.io"}
        direct = {"host": meta.ip, "port": SSH_PUBLIC_PORT, "username": "root",
                  "command": f"ssh root@{meta.ip} -p {SSH_PUBLIC_PORT}"}
        pod["ssh"] = {"proxy": None if status == "PROVISIONING" else proxy,
                      "direct": direct if running and "22/tcp" in (pod.get("ports") or []) else None}
        pod["cost"] = meta.price if status in BILLED else 0.0  # "0.0 when EXITED or TERMINATED"
        pod["runtime"] = None
        if running:
            seen = 0 if pod_id in self.gpus_lost else (pod.get("gpu") or {}).get("count", 0)
            gpus = [{"util": 0, "memoryUtil": 0} for _ in range(seen)]
            pod["runtime"] = {"uptime": int(time.monotonic() - (meta.running_since or time.monotonic())),
                              "gpus": gpus, "cpu": {"util": 0}, "memory": {"util": 0}, "ports": ports}
        order = ["id", "name", "status", "actions", "image", "args", "disk", "mounts", "ports", "env", "registry",
                 "gpu", "cpu", "cloud", "dataCenterId", "cudaVersion", "ssh", "template", "cost", "locked",
                 "globalNetworking", "cluster", "runtime", "createdAt", "startedAt"]
        return {k: pod[k] for k in order if k in pod} | {k: v for k, v in pod.items() if k not in order}

    def _find_pod(self, pod_id: str) -> dict | _Answer:
        if pod_id not in self.pods:
            return _Answer(404, _problem(404, "pod not found"))
        return self.pods[pod_id]

    def list_pods(self, req: Request, params: dict, query: dict) -> _Answer:
        include = query.get("includeClusterPods", False)
        now = self.clock()
        ids = [pid for pid, p in self.pods.items() if (include or "cluster" not in p)
               and (pid in self._listed or now - self._meta[pid].made >= self.list_lag_s)]
        self._listed.update(ids)
        for pid in ids:
            self._poll(pid)
        return _Answer(200, {"pods": [self._shown(pid) for pid in ids]},
                       scripted=any(pid in self.shown_status for pid in ids))

    def _shown(self, pod_id: str) -> dict:
        view = self._view(pod_id)
        if pod_id in self.shown_status:
            status = self.shown_status[pod_id]
            if status is MISSING:
                view.pop("status")
            else:
                view["status"] = status
        return view

    def create_pod(self, req: Request, params: dict, query: dict) -> _Answer:
        body = req.body
        if ("gpu" in body) == ("cpu" in body):
            return self._rule(req, "supply exactly one of gpu or cpu")
        template = None
        if "templateId" in body:
            template = self.templates.get(body["templateId"])
            if template is None:
                return _Answer(404, _problem(404, f"template {body['templateId']!r} not found"))
        base = {k: copy.deepcopy(template[k]) for k in ("image", "args", "disk", "ports", "env", "registry")} \
            if template else {}
        conf = base | {k: body[k] for k in ("image", "args", "disk", "ports", "env", "registry") if k in body}
        bad = [p for p in conf.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        mounts = body.get("mounts", template["mounts"] if template else {})
        dcs = body.get("dataCenterIds") or []
        answer = self._check_mounts(req, mounts, dcs, cpu="cpu" in body)
        if isinstance(answer, _Answer):
            return answer
        gpu = None
        if "gpu" in body:
            g = body["gpu"]
            if g["id"] not in GPU_TYPES:
                return self._rule(req, f"gpu.id: {g['id']!r} is not a GPU type (GET /v2/catalog/gpus lists them)")
            if g.get("count", 1) > GPU_TYPES[g["id"]][3]:
                return self._rule(req, f"gpu.count: at most {GPU_TYPES[g['id']][3]} x {g['id']} on one pod")
            gpu = {"id": g["id"], "count": g.get("count", 1)}
        # Placement: a network volume's data center, else the first of dataCenterIds (or, without them, of every
        # data center: "omit ... to let the scheduler choose") with a GPU free.
        free = [dc for dc in ([answer] if answer else dcs or DATA_CENTERS) if dc not in self.full]
        if self.capacity_failures > 0 or not free:
            self.capacity_failures = max(0, self.capacity_failures - 1)
            return _Answer(400, _problem(400, CAPACITY_DETAIL))
        data_center = free[0]
        allowed = (body.get("gpu") or {}).get("allowedCudaVersions")
        pid = self._new_id()
        gn = body.get("globalNetworking", False)
        pod = {"id": pid, "name": body["name"], "image": conf["image"], "args": conf.get("args", ""),
               "disk": conf.get("disk", 50), "ports": conf.get("ports", []), "env": conf.get("env", {}),
               "registry": conf.get("registry"), "status": "PROVISIONING", "mounts": mounts,
               "cloud": body.get("cloud", "SECURE"), "dataCenterId": data_center,
               "cudaVersion": (max(allowed, key=lambda v: tuple(map(int, v.split(".")))) if allowed else "12.8")
               if gpu else None,
               "template": body.get("templateId"), "locked": False,
               "globalNetworking": {"enabled": True, "ip": f"10.99.0.{self._count['ip'] + 1}",
                                    "internalDns": f"{pid}.runpod.internal"} if gn else {"enabled": False},
               "createdAt": _now(), "startedAt": None}
        if gpu:
            pod["gpu"] = gpu
        else:
            pod["cpu"] = {**body["cpu"], "memory": body["cpu"]["vcpuCount"] * 4}
        self._store_pod(pod, start_ssh=body.get("startSsh", template["startSsh"] if template else False))
        return _Answer(201, self._view(pid))

    def _check_mounts(self, req: Request, mounts: dict, dcs: list[str], cpu: bool) -> _Answer | str | None:
        """A rule the document states for mounts broken: 400. Else the data center a network volume sets."""
        if "persistent" in mounts and "network" in mounts:
            return self._rule(req, "mounts: at most one of persistent or network")
        if cpu and "persistent" in mounts:
            return self._rule(req, "mounts.persistent: not allowed on a CPU pod")
        if mounts.get("network") == []:
            return self._rule(req, "mounts.network: an empty list is not allowed")
        for m in mounts.get("network", []):
            vol = self.volumes.get(m["volumeId"])
            if vol is None:
                return self._rule(req, f"mounts.network: network volume {m['volumeId']!r} not found")
            if dcs and vol["dataCenter"] not in dcs:
                return self._rule(req, f"mounts.network: network volume {m['volumeId']!r} is in "
                                       f"{vol['dataCenter']}, not in dataCenterIds {dcs}")
            return vol["dataCenter"]
        return None

    def get_pod(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, _Answer):
            return found
        self._poll(params["id"])
        return _Answer(200, self._shown(params["id"]), scripted=params["id"] in self.shown_status)

    def update_pod(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, _Answer):
            return found
        if "cluster" in found:
            return _Answer(409, _problem(409, "pod belongs to a cluster: manage it through /v2/clusters/{id}"))
        body = req.body
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        if "mounts" in body and body["mounts"]:
            new, old = body["mounts"], found["mounts"]
            if any(kind not in old for kind in new):
                return self._rule(req, "mounts: the mount kind is fixed at create")
            if "network" in new and (not new["network"] or new["network"][0]["volumeId"]
                                     != old["network"][0]["volumeId"]):
                return self._rule(req, "mounts.network: the volumeId of a network mount cannot change")
            found["mounts"] = copy.deepcopy(new)
        for k in ("name", "image", "args", "disk", "ports", "env", "registry", "locked"):
            if k in body:
                found[k] = copy.deepcopy(body[k])
        if "templateId" in body:
            found["template"] = body["templateId"]
        if "globalNetworking" in body:
            found["globalNetworking"] = {"enabled": body["globalNetworking"]} | (
                {"ip": "10.99.0.2", "internalDns": f"{found['id']}.runpod.internal"} if body["globalNetworking"]
                else {})
        return _Answer(200, self._view(found["id"]))

    def delete_pod(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, _Answer):
            return found
        if "cluster" in found:
            return _Answer(409, _problem(409, "pod belongs to a cluster: delete the cluster instead"))
        self._drop_pod(found["id"])
        self.terminated.add(found["id"])
        return _Answer(204)

    def pod_action(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, _Answer):
            return found
        action, status = req.body["action"], found["status"]
        if "cluster" in found:
            return _Answer(409, _problem(409, "pod belongs to a cluster: manage it through /v2/clusters/{id}"))
        if action not in ACTIONS[status]:
            return _Answer(409, _problem(409, f"cannot {action} a pod that is {status} "
                                              f"(allowed: {', '.join(ACTIONS[status]) or 'none'})"))
        if found["locked"] and action in ("stop", "restart"):
            return _Answer(409, _problem(409, f"pod is locked: cannot {action} it"))
        if action == "terminate":
            self._drop_pod(found["id"])
            self.terminated.add(found["id"])
            return _Answer(204)
        self._enter(found["id"], "EXITED" if action == "stop" else "STARTING")
        self._meta[found["id"]].polls_needed = 1
        return _Answer(200, self._view(found["id"]))

    # -- templates, volumes, catalog ----------------------------------------------------------------

    def list_templates(self, req: Request, params: dict, query: dict) -> _Answer:
        return _Answer(200, {"templates": list(self.templates.values())})

    def create_template(self, req: Request, params: dict, query: dict) -> _Answer:
        body = req.body
        if any(t["name"] == body["name"] for t in self.templates.values()):
            return self._rule(req, f"name: a template named {body['name']!r} exists (names are unique)")
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        self._count["template"] += 1
        tid = f"stubtpl{self._count['template']:03d}"
        tpl = {"id": tid, "name": body["name"], "image": body["image"], "args": "", "disk": 50, "ports": [],
               "env": {}, "registry": None, "mounts": {}, "serverless": False, "public": False, "category": "NVIDIA",
               "startSsh": True, "startJupyter": True, "allowedCudaVersions": []}
        tpl.update(copy.deepcopy(body))
        self.templates[tid] = tpl
        return _Answer(201, tpl)

    def get_template(self, req: Request, params: dict, query: dict) -> _Answer:
        tpl = self.templates.get(params["id"])
        return _Answer(200, tpl) if tpl else _Answer(404, _problem(404, "template not found"))

    def update_template(self, req: Request, params: dict, query: dict) -> _Answer:
        tpl = self.templates.get(params["id"])
        if tpl is None:
            return _Answer(404, _problem(404, "template not found"))
        if any(t["name"] == req.body.get("name") and t is not tpl for t in self.templates.values()):
            return self._rule(req, f"name: a template named {req.body['name']!r} exists (names are unique)")
        tpl.update(copy.deepcopy(req.body))
        return _Answer(200, tpl)

    def delete_template(self, req: Request, params: dict, query: dict) -> _Answer:
        if self.templates.pop(params["id"], None) is None:
            return _Answer(404, _problem(404, "template not found"))
        return _Answer(204)

    def list_volumes(self, req: Request, params: dict, query: dict) -> _Answer:
        return _Answer(200, {"networkVolumes": list(self.volumes.values())})

    def get_volume(self, req: Request, params: dict, query: dict) -> _Answer:
        vol = self.volumes.get(params["id"])
        return _Answer(200, vol) if vol else _Answer(404, _problem(404, "network volume not found"))

    def create_volume(self, req: Request, params: dict, query: dict) -> _Answer:
        self._count["volume"] += 1
        vol = {"type": "STANDARD"} | req.body | {"id": f"stubvol{self._count['volume']:03d}"}
        self.volumes[vol["id"]] = vol
        return _Answer(201, vol)

    def list_gpu_types(self, req: Request, params: dict, query: dict) -> _Answer:
        include, product = query.get("include", []), query.get("product")
        if bool(include) != bool(product):
            return self._rule(req, "product is required with include=AVAILABILITY, and valid only with it")
        return _Answer(200, {"gpus": [self._gpu_type(gid, include) for gid in GPU_TYPES]})

    def _gpu_type(self, gid: str, include: list) -> dict:
        name, memory, price, max_count = GPU_TYPES[gid]
        gpu = {"id": gid, "name": name, "pool": None, "manufacturer": "NVIDIA", "memory": memory,
               "secure": True, "community": False, "price": {"secure": price, "community": 0.0},
               "maxCount": {"secure": max_count, "community": 0}}
        if include:
            gpu["availability"] = self.gpu_availability.get(gid, "HIGH")
        return gpu

    def get_gpu_type(self, req: Request, params: dict, query: dict) -> _Answer:
        include, product = query.get("include", []), query.get("product")
        if bool(include) != bool(product):
            return self._rule(req, "product is required with include=AVAILABILITY, and valid only with it")
        gid = unquote(params["id"])  # "NVIDIA%20A40": the id is a name
        if gid not in GPU_TYPES:
            return _Answer(404, _problem(404, f"GPU type {gid!r} not found"))
        return _Answer(200, self._gpu_type(gid, include))

    def list_pod_billing(self, req: Request, params: dict, query: dict) -> _Answer:
        """listPodBilling: each pod's bill per bucket of the window (only buckets it billed in), as the
        document's parameters describe: startTime snapped down and endTime up to bucket boundaries (defaults:
        30 days ago, now), or lastN buckets ending with the current one; podId narrows to one pod."""
        size = query.get("bucketSize", "day")
        if "lastN" in query and ("startTime" in query or "endTime" in query):
            return self._rule(req, "lastN is mutually exclusive with startTime/endTime")
        now = dt.datetime.now(dt.UTC)
        if "lastN" in query:
            end = _bucket_step(_bucket_floor(now, size), size)
            start = end
            for _ in range(query["lastN"]):
                start = _bucket_step(start, size, back=True)
        else:
            start = _bucket_floor(_parse_ts(query["startTime"]) if "startTime" in query else
                                  now - dt.timedelta(days=30), size)
            end = _parse_ts(query["endTime"]) if "endTime" in query else now
            end = end if _bucket_floor(end, size) == end else _bucket_step(_bucket_floor(end, size), size)
        if end <= start:
            return self._rule(req, "endTime must be after startTime")
        pod = query.get("podId")
        amounts: dict[tuple[str, dt.datetime], float] = {}
        open_now = {pid: [(m.billing_since, time.time(), m.price)] for pid, m in self._meta.items()
                    if m.billing_since is not None}
        for pid in set(self.ledger) | set(open_now) | set(self.charges):
            if pod is not None and pid != pod:
                continue
            for t0, t1, rate in self.ledger.get(pid, []) + open_now.get(pid, []):
                a, b = max(start, _utc(t0)), min(end, _utc(t1))
                bucket = _bucket_floor(a, size) if a < b else b
                while bucket < b:
                    nxt = _bucket_step(bucket, size)
                    seconds = (min(b, nxt) - max(a, bucket)).total_seconds()
                    amounts[pid, bucket] = amounts.get((pid, bucket), 0.0) + rate * seconds / 3600
                    bucket = nxt
            for t, usd in self.charges.get(pid, []):
                if start <= _utc(t) < end:
                    key = (pid, _bucket_floor(_utc(t), size))
                    amounts[key] = amounts.get(key, 0.0) + usd
        rows = [{"startTime": _rfc3339(b), "endTime": _rfc3339(_bucket_step(b, size)), "podId": pid,
                 "totalAmount": round(v, 6), "gpuAmount": round(v, 6), "cpuAmount": 0, "diskAmount": 0}
                for (pid, b), v in sorted(amounts.items(), key=lambda kv: (kv[0][1], kv[0][0])) if v > 0]
        total = round(sum(r["totalAmount"] for r in rows), 6)
        return _Answer(200, {"records": rows, "metadata": {
            "query": {"startTime": _rfc3339(start), "endTime": _rfc3339(end), "bucketSize": size, "podId": pod},
            "recordCount": len(rows), "uniquePodCount": len({r["podId"] for r in rows}),
            "totals": {"totalAmount": total, "gpuAmount": total, "cpuAmount": 0, "diskAmount": 0}}})

    # -- clusters ----------------------------------------------------------------------------------

    def _members(self, cluster_id: str) -> list[dict]:
        return sorted((p for p in self.pods.values() if p.get("cluster", {}).get("id") == cluster_id),
                      key=lambda p: p["cluster"]["rank"])

    def _new_member(self, cluster: dict, rank: int) -> str:
        pid = self._new_id()
        conf = cluster["_container"]
        roles = {"SLURM": ("SLURM_CONTROLLER", "SLURM_COMPUTE"), "RAY": ("RAY_HEAD", "RAY_WORKER")}
        membership = {"id": cluster["id"], "rank": rank, "ip": f"10.65.0.{rank + 2}"}
        if cluster["type"] in roles:
            membership["role"] = roles[cluster["type"]][0 if rank == 0 else 1]
        pod = {"id": pid, "name": f"{cluster['name']}-{rank}", "image": conf.get("image", ""),
               "args": conf.get("args", ""), "disk": conf.get("disk", 50), "ports": conf.get("ports", []),
               "env": conf.get("env", {}), "registry": None, "status": "PROVISIONING",
               "mounts": copy.deepcopy(conf.get("mounts", {})),
               "gpu": {"id": cluster["compute"]["gpuTypeId"], "count": cluster["compute"]["gpuCountPerPod"]},
               "cloud": "SECURE", "dataCenterId": cluster["dataCenterId"], "cudaVersion": "12.8", "template": None,
               "locked": False, "globalNetworking": {"enabled": False}, "cluster": membership,
               "createdAt": _now(), "startedAt": None}
        self._store_pod(copy.deepcopy(pod), start_ssh=conf.get("startSsh", False))
        return pid

    def _cluster_view(self, cluster_id: str) -> dict:
        cluster = self.clusters[cluster_id]
        out = {k: copy.deepcopy(v) for k, v in cluster.items() if not k.startswith("_")}
        members = [self._view(p["id"]) for p in self._members(cluster_id)]
        by_status: dict[str, int] = {}
        for p in members:
            by_status[p["status"]] = by_status.get(p["status"], 0) + 1
        out["pods"] = {"total": len(members), "byStatus": by_status}
        primary = next((p for p in members if p["cluster"]["rank"] == 0), None)
        if primary:
            out["primary"] = {"podId": primary["id"], "status": primary["status"]}
            if primary["ssh"]["direct"]:
                out["primary"]["sshEndpoint"] = f"{primary['ssh']['direct']['host']}:{SSH_PUBLIC_PORT}"
        return out

    def create_cluster(self, req: Request, params: dict, query: dict) -> _Answer:
        body = req.body
        compute = body["compute"]
        if compute["gpuTypeId"] not in GPU_TYPES:
            return self._rule(req, f"compute.gpuTypeId: {compute['gpuTypeId']!r} is not a GPU type")
        if compute["gpuCountPerPod"] > GPU_TYPES[compute["gpuTypeId"]][3]:
            return self._rule(req, f"compute.gpuCountPerPod: at most {GPU_TYPES[compute['gpuTypeId']][3]}")
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        dcs = body.get("dataCenterIds") or []
        answer = self._check_mounts(req, body.get("mounts", {}), dcs, cpu=False)
        if isinstance(answer, _Answer):
            return answer
        self._count["cluster"] += 1
        cid = f"cluster_{self._count['cluster']:03d}"
        cluster = {"id": cid, "name": body["name"], "type": body["type"], "compute": dict(compute),
                   "dataCenterId": answer or (dcs[0] if dcs else DEFAULT_DATA_CENTER),
                   "network": {"cidr": "10.65.0.0/16", "vxlanId": 4100 + self._count["cluster"], "vxlanPort": 4789},
                   "createdAt": _now(),
                   "_container": {k: copy.deepcopy(v) for k, v in body.items()
                                  if k in ("image", "args", "disk", "ports", "env", "mounts", "startSsh")}}
        self.clusters[cid] = cluster
        for rank in range(compute["podCount"]):
            self._new_member(cluster, rank)
        return _Answer(201, self._cluster_view(cid))

    def _find_cluster(self, cluster_id: str) -> dict | _Answer:
        if cluster_id not in self.clusters:
            return _Answer(404, _problem(404, "cluster not found"))
        return self.clusters[cluster_id]

    def list_clusters(self, req: Request, params: dict, query: dict) -> _Answer:
        return _Answer(200, {"clusters": [self._cluster_view(cid) for cid in self.clusters]})

    def get_cluster(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, _Answer):
            return found
        for p in self._members(params["id"]):
            self._poll(p["id"])
        return _Answer(200, self._cluster_view(params["id"]))

    def update_cluster(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, _Answer):
            return found
        found["name"] = req.body["name"]
        return _Answer(200, self._cluster_view(params["id"]))

    def delete_cluster(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, _Answer):
            return found
        for p in self._members(params["id"]):
            self._drop_pod(p["id"])
            self.terminated.add(p["id"])
        del self.clusters[params["id"]]
        self.deleted_clusters.add(params["id"])
        return _Answer(204)

    def list_cluster_pods(self, req: Request, params: dict, query: dict) -> _Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, _Answer):
            return found
        members = self._members(params["id"])
        for p in members:
            self._poll(p["id"])
        return _Answer(200, {"pods": [self._view(p["id"]) for p in members]})

    # -- logs --------------------------------------------------------------------------------------

    def _stamps(self, pod_id: str) -> list[tuple[dt.datetime, str]]:
        """The ts of each line of stub.logs[pod_id], given to a line when first seen: strictly increasing."""
        stamps = self._log_ts.setdefault(pod_id, [])
        for _ in range(len(self.logs.get(pod_id, [])) - len(stamps)):
            t = max(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.log_clock_s),
                    self._last_ts + dt.timedelta(microseconds=1))
            self._last_ts = t
            stamps.append((t, _rfc3339(t, micro=True)))
        return stamps

    def stream_logs(self, h: _Handler, req: Request, params: dict, query: dict, op: dict) -> None:
        pod_id = params["id"]
        with self._lock:
            if pod_id not in self.pods:
                return self._send(h, op, _Answer(404, _problem(404, "pod not found")))
            source = query.get("source")
            stamps, lines = self._stamps(pod_id), list(self.logs.get(pod_id, []))
            picked = [(t, ts, s, line) for (t, ts), (s, line) in zip(stamps, lines, strict=True)
                      if source in (None, s)]
            if "last-event-id" in req.headers:
                after = _parse_ts(req.headers["last-event-id"])
                picked = [e for e in picked if e[0] > after]
            elif "since" in query:
                since = _parse_ts(query["since"])
                picked = [e for e in picked if e[0] >= since]
            else:
                tail = query.get("tail", 100)
                picked = picked[len(picked) - tail:] if tail else []
            seen = len(lines)
            drop, self.drop_logs_after = self.drop_logs_after, None
            follow_until = time.monotonic() + self.follow_s
        h.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                            ("Connection", "keep-alive"), ("X-Accel-Buffering", "no"),
                            ("Transfer-Encoding", "chunked")):
            h.send_header(name, value)
        h.end_headers()
        self._check_response(op, 200, "text/event-stream", None, f"GET {req.path}")
        sent, said = 0, time.monotonic()
        while True:
            for _, ts, s, line in picked:
                if drop is not None and sent >= drop:
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)  # the stream breaks mid-way, as a network does
                    return None
                data = json.dumps({"source": s, "line": line, "ts": ts}, separators=(",", ":"))
                event = f"id: {ts}\ndata: {data}\n\n".encode()
                h.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                h.wfile.flush()
                sent += 1
            if time.monotonic() >= follow_until:
                break
            time.sleep(0.02)
            if self.keepalive_s and time.monotonic() - said >= self.keepalive_s:
                h.wfile.write(b"%x\r\n%s\r\n" % (len(KEEPALIVE), KEEPALIVE))
                h.wfile.flush()
                said = time.monotonic()
            with self._lock:
                if pod_id not in self.pods:
                    break
                stamps, lines = self._stamps(pod_id), list(self.logs.get(pod_id, []))
                picked = [(t, ts, s, line) for (t, ts), (s, line) in list(zip(stamps, lines, strict=True))[seen:]
                          if source in (None, s)]
                seen = len(lines)
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()
        return None

    # -- the machinery: routing, validation, answering -------------------------------------------

    ROUTES = {
        ("GET", "/v2/pods"): "list_pods", ("POST", "/v2/pods"): "create_pod",
        ("GET", "/v2/pods/{id}"): "get_pod", ("PATCH", "/v2/pods/{id}"): "update_pod",
        ("DELETE", "/v2/pods/{id}"): "delete_pod", ("POST", "/v2/pods/{id}/action"): "pod_action",
        ("GET", "/v2/pods/{id}/logs"): "stream_logs",
        ("GET", "/v2/templates"): "list_templates", ("POST", "/v2/templates"): "create_template",
        ("GET", "/v2/templates/{id}"): "get_template", ("PATCH", "/v2/templates/{id}"): "update_template",
        ("DELETE", "/v2/templates/{id}"): "delete_template",
        ("GET", "/v2/network-volumes"): "list_volumes", ("POST", "/v2/network-volumes"): "create_volume",
        ("GET", "/v2/network-volumes/{id}"): "get_volume",
        ("GET", "/v2/clusters"): "list_clusters", ("POST", "/v2/clusters"): "create_cluster",
        ("GET", "/v2/clusters/{id}"): "get_cluster", ("PATCH", "/v2/clusters/{id}"): "update_cluster",
        ("DELETE", "/v2/clusters/{id}"): "delete_cluster", ("GET", "/v2/clusters/{id}/pods"): "list_cluster_pods",
        ("GET", "/v2/catalog/gpus"): "list_gpu_types", ("GET", "/v2/catalog/gpus/{id}"): "get_gpu_type",
        ("GET", "/v2/billing/pods"): "list_pod_billing",
    }

    def _rule(self, req: Request, detail: str) -> _Answer:
        """A rule of the document's descriptions broken (the body matches the schema): 400, as RunPod does."""
        self.refused.append(Refusal(req, 400, [detail]))
        return _Answer(400, _problem(400, detail))

    def _check_object(self, schema_name: str, obj: dict) -> None:
        errors = schema_errors({"$ref": f"#/components/schemas/{schema_name}"}, obj)
        assert not errors, f"the stub made a {schema_name} the document refuses: {errors}"

    def _check_response(self, op: dict | None, status: int, ctype: str | None, body: Any, call: str) -> None:
        if op is None:  # no operation: the document's problem shape
            content = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        else:
            declared = op["responses"].get(str(status)) or op["responses"].get("default")
            if declared is None:
                self.errors.append(f"{call}: answered {status}, which the document does not declare")
                return
            content = _resolve(declared).get("content", {})
        if ctype is None:
            if content:
                self.errors.append(f"{call}: answered {status} with no body; the document says {list(content)}")
            return
        if ctype not in content:
            self.errors.append(f"{call}: answered {status} {ctype}; the document says {list(content) or 'no body'}")
            return
        if body is not None and "schema" in content[ctype] and ctype != "text/event-stream":
            for e in schema_errors(content[ctype]["schema"], body):
                self.errors.append(f"{call}: answered {status}: {e}")

    def _send(self, h: _Handler, op: dict | None, answer: _Answer, call: str = "") -> None:
        ctype = None
        out = b""
        if answer.body is not None:
            ctype = "application/json" if answer.status < 400 else "application/problem+json"
            out = json.dumps(answer.body).encode()
        with self._lock:
            if not answer.scripted:
                self._check_response(op, answer.status, ctype, answer.body, call or f"{h.command} {h.path}")
        self._write(h, answer.status, out, ctype, answer.headers)

    @staticmethod
    def _write(h: _Handler, status: int, out: bytes, ctype: str | None, headers: dict[str, str]) -> None:
        h.send_response(status)
        if ctype:
            h.send_header("Content-Type", ctype)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(out)))
        h.end_headers()
        h.wfile.write(out)

    def _fault(self, h: _Handler, req: Request) -> bool:
        """Answers a scripted fault, if one matches. True when it did."""
        fault = self._take(self.faults, req)
        if fault is None:
            return False
        if fault.delay_s:
            time.sleep(fault.delay_s)
        if fault.status is None:
            return False
        body, ctype = fault.body, fault.content_type
        if body is None and fault.status != 204:
            detail = "rate limit exceeded for the minute window" if fault.status == 429 else "stub fault"
            body, ctype = json.dumps(_problem(fault.status, detail)).encode(), ctype or "application/problem+json"
        elif isinstance(body, str):
            body, ctype = body.encode(), ctype or "text/plain"
        elif isinstance(body, bytes):
            ctype = ctype or "text/plain"
        elif body is not None:
            body = json.dumps(body).encode()
            ctype = ctype or ("application/json" if fault.status < 400 else "application/problem+json")
        headers = {} if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
        if fault.drip_s:
            self._drip(h, fault.status, body or b"", ctype, headers, fault.drip_s)
        else:
            self._write(h, fault.status, body or b"", ctype, headers)
        return True

    @staticmethod
    def _drip(h: _Handler, status: int, out: bytes, ctype: str | None, headers: dict[str, str], every_s: float) -> None:
        """The whole answer a byte at a time: each read the client makes gets something, and the answer
        takes len(answer) * every_s to arrive."""
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Length: {len(out)}", "Connection: close"]
        head += [f"Content-Type: {ctype}"] if ctype else []
        head += [f"{k}: {v}" for k, v in headers.items()]
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + out
        h.close_connection = True
        for i in range(len(raw)):
            h.wfile.write(raw[i:i + 1])
            h.wfile.flush()
            time.sleep(every_s)

    def _match(self, method: str, path: str) -> tuple[str, dict, dict | None, dict] | None:
        for regex, template, item in _OPERATIONS:
            m = regex.match(path)
            if m:
                return template, item, item.get(method.lower()), m.groupdict()
        return None

    def _check_params(self, item: dict, op: dict, req: Request) -> tuple[list[str], dict]:
        """The query and header parameters against the operation's: errors, and the query as typed values."""
        declared = [_resolve(p) for p in item.get("parameters", []) + op.get("parameters", [])]
        errors: list[str] = []
        typed: dict[str, Any] = {}
        known = {p["name"] for p in declared if p["in"] == "query"}
        errors += [f"$.query.{name}: unknown query parameter" for name in req.query if name not in known]
        for p in declared:
            if p["in"] not in ("query", "header"):
                continue
            if p["in"] == "query" and p["name"] in req.query:
                raw = req.query[p["name"]]
            elif p["in"] == "header" and p["name"].lower() in req.headers:
                raw = req.headers[p["name"].lower()]
            else:
                if p.get("required"):
                    errors.append(f"$.{p['in']}.{p['name']}: required")
                continue
            kind = _resolve(p["schema"]).get("type")
            value: Any = raw
            if kind == "integer" and re.fullmatch(r"-?\d+", raw):
                value = int(raw)
            elif kind == "boolean" and raw in ("true", "false"):
                value = raw == "true"
            elif kind == "array":
                value = raw.split(",") if raw else []
            errors += [e.replace("$", f"$.{p['in']}.{p['name']}", 1) for e in schema_errors(p["schema"], value)]
            if p["in"] == "query":
                typed[p["name"]] = value
        return errors, typed

    def serve(self, h: _Handler, method: str) -> None:
        """One request, from the handler's thread."""
        url = urlsplit(h.path)
        n = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        req = Request(method, url.path, dict(parse_qsl(url.query, keep_blank_values=True)), body,
                      {k.lower(): v for k, v in h.headers.items()}, raw)
        call = f"{method} {url.path}"
        with self._lock:
            self.requests.append(req)
        if "graphql" in url.path.lower():
            with self._lock:
                self.graphql.append(req)
            return self._send(h, None, _Answer(410, _problem(410, "stub: RunPod's GraphQL API is not used here; "
                                                                  "use the REST API v2")), call)
        matched = self._match(method, url.path)
        op = matched[2] if matched else None
        if h.headers.get("Authorization") != f"Bearer {self.key}":
            detail = "missing bearer token" if not h.headers.get("Authorization") else "invalid bearer token"
            return self._send(h, op, _Answer(401, _problem(401, detail)), call)
        if self._fault(h, req):
            return None
        if matched is None:
            with self._lock:
                self.unknown.append(req)
            return self._send(h, None, _Answer(404, _problem(404, f"no such path: {url.path}")), call)
        template, item, op, params = matched
        if op is None:
            with self._lock:
                self.unknown.append(req)
            allowed = ", ".join(m.upper() for m in item if m != "parameters")
            return self._send(h, None, _Answer(405, _problem(405, f"{method} is not allowed on {template}"),
                                               {"Allow": allowed}), call)
        handler = self.ROUTES.get((method, template))
        if handler is None:
            with self._lock:
                self.unknown.append(req)
            return self._send(h, None, _Answer(404, _problem(404, f"stub: {op['operationId']} ({method} "
                                                                  f"{template}) is not implemented by the stub")), call)
        with self._lock:
            errors, query = self._check_params(item, op, req)
            status, detail = 422, "Request validation failed."
            if "requestBody" in op:
                if raw and body is None:
                    status, detail, errors = 400, "request body is not valid JSON", [f"$: {raw[:80]!r}"]
                elif raw and not (h.headers.get("Content-Type") or "").startswith("application/json"):
                    status, detail, errors = 400, "Content-Type must be application/json", \
                        [f"$: Content-Type {h.headers.get('Content-Type')!r}"]
                else:
                    errors += schema_errors(op["requestBody"]["content"]["application/json"]["schema"], body)
            if errors:
                self.refused.append(Refusal(req, status, errors))
                return self._send(h, op, _Answer(status, _problem(status, detail, errors)), call)
            if handler != "stream_logs":
                answer = getattr(self, handler)(req, params, query)
        if handler == "stream_logs":
            return self.stream_logs(h, req, params, query, op)
        if late := self._take(self.late, req):
            time.sleep(late.delay_s)  # done already; the answer comes late (or finds the client gone)
        if garbled := self._take(self.garbles, req):
            return self._garbled(h, answer, garbled.body)
        return self._send(h, op, answer, call)

    def _garbled(self, h: _Handler, answer: _Answer, how: str) -> None:
        """The answer made unreadable, as garble() says; not held to the document (it is what a test asked for)."""
        if how == "bad-id":
            return self._write(h, answer.status, json.dumps(dict(answer.body or {}, id=HOSTILE_ID)).encode(),
                               "application/json", {})
        out = json.dumps(answer.body).encode()
        if how == "cut":
            return self._write(h, answer.status, out[:len(out) // 2], "application/json", {})
        h.send_response(answer.status)  # "drop": the whole announced, half sent, the connection closed
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(out)))
        h.end_headers()
        h.wfile.write(out[:len(out) // 2])
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)
        return None

    def _take(self, faults: list[Fault], req: Request) -> Fault | None:
        with self._lock:
            fault = next((f for f in faults if f.method in ("*", req.method) and f.path_regex.fullmatch(req.path)),
                         None)
            if fault is not None and fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    faults.remove(fault)
        return fault


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stub: RunPodV2Stub

    def log_message(self, *args: object) -> None:
        pass

    def _serve(self, method: str) -> None:
        try:
            self.stub.serve(self, method)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True  # the client gave up (its timeout): nothing to answer
        except Exception:
            self.stub.errors.append(f"the stub crashed on {method} {self.path}:\n{traceback.format_exc()}")
            self.close_connection = True
            try:
                self.send_error(500)
            except OSError:
                pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")
