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

The stub is in parts: tests/runpod_shapes.py (the document, and the checks that hold both sides to it),
tests/runpod_wire.py (requests, answers, routing and the scripted faults), tests/runpod_pods.py (pods,
clusters and logs) and tests/runpod_catalog.py (templates, network volumes, the GPU catalog, billing). This
module keeps the stub's state and its test controls, and every name the tests import from it.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
import shutil
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from runpod_catalog import Catalog
from runpod_pods import (
    ACTIONS,
    BILLED,
    CAPACITY_DETAIL,
    DATA_CENTERS,
    DEFAULT_DATA_CENTER,
    GPU_TYPES,
    KEEPALIVE,
    MISSING,
    PORT,
    SSH_PUBLIC_PORT,
    PodMeta,
    Pods,
)
from runpod_shapes import SPEC, SPEC_PATH, check_object, now_ts, schema_errors, validator
from runpod_wire import HOSTILE_ID, Fault, Handler, Refusal, Request, Wire

__all__ = ["ACTIONS", "BILLED", "CAPACITY_DETAIL", "DATA_CENTERS", "DEFAULT_DATA_CENTER", "GPU_TYPES", "HOSTILE_ID",
           "KEEPALIVE", "MISSING", "PORT", "SPEC", "SPEC_PATH", "SSH_PUBLIC_PORT", "Fault", "Refusal", "Request",
           "RunPodV2Stub", "schema_errors", "validator"]


class RunPodV2Stub(Pods, Catalog, Wire):
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
        self._meta: dict[str, PodMeta] = {}
        self._listed: set[str] = set()  # pods GET /v2/pods has shown (list_lag_s hides only new ones)
        self._log_ts: dict[str, list[tuple[dt.datetime, str]]] = {}
        self._last_ts = dt.datetime.now(dt.UTC)
        self._count = {"pod": 0, "ip": 6, "template": 0, "cluster": 0, "volume": 0}
        self._lock = threading.RLock()
        self.add_volume("vol-ckpt1", "checkpoints", 500, DEFAULT_DATA_CENTER)

        handler = type("Handler", (Handler,), {"stub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="runpod-stub", daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # podkit's deploy cache (a pending create's note, a watch's lock) for the commands a test runs against this
        # stub: one shared by the suite's workers read another test's create as an interrupted deploy of its own
        self.cache_dir = tempfile.mkdtemp(prefix="podkit-deploy-cache-")

    # -- lifetime and what the tests read ----------------------------------------------------------

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.cache_dir, ignore_errors=True)

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
        check_object("NetworkVolume", vol)
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
                   "globalNetworking": {"enabled": False}, "createdAt": now_ts(), "startedAt": None}
            if volume is not None:
                pod["mounts"] = {"network": [{"volumeId": volume, "path": mount_path}]}
                pod["dataCenterId"] = self.volumes[volume]["dataCenter"]
            pod.update(overrides)
            self._store_pod(pod)
            self._listed.add(pid)
            self._enter(pid, status)
            view = self._view(pid)
        check_object("Pod", view)
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
            new.update(id=self._new_id(), createdAt=now_ts(), startedAt=None)
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
