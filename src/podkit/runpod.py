"""RunPod's REST API v2: the one client podkit has. `podkit deploy` (templates, pods, watch, logs,
clusters) and the pod's own cost guard all speak through it; nothing in podkit speaks GraphQL, which
RunPod retires in early 2027.

The shapes are those of RunPod's published OpenAPI document (runpod/docs, api-reference-v2/openapi.json,
"Runpod REST API" 2.0.0, commit a900806e, 2026-08-20): bearer auth, wrapped lists ({"pods": [...]}),
one `POST /v2/pods/{id}/action` for start | stop | restart | terminate, RFC 9457 errors (title, status,
detail, errors), `Retry-After` on 429, logs as server-sent events resumable with `Last-Event-ID`.

Stdlib only (urllib): the image's cost guard uses it too. The key is sent to RunPod's host alone: a base
URL that is not https (loopback aside), or a redirect, is refused, and no message or log carries the key.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import http.client
import io
import ipaddress
import json
import os
import random
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from podkit.errors import PodkitError

API_BASE = "https://api.runpod.io"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_AFTER_MAX_S = 120.0  # a Retry-After longer than this is RunPod saying "not now": the caller decides
ANSWER_MAX_BYTES = 8 << 20  # a pod list of a large account fits; an endless answer does not
SSE_LINE_MAX = 256 << 10  # one log event's line; a longer one is skipped (said so), never held whole in memory
SHOWN_MAX = 400  # what of an error answer a message quotes, cut after the key is taken out
# RunPod's ids (pods, templates, clusters, volumes): what may go into a URL path. An id of another shape in
# an answer is skipped or refused, never sent on ("victim/action?x=" would address another endpoint).
ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# RunPod's pod statuses (PodStatus in its OpenAPI document) and what each says about the pod: the one map
# every question about a pod's state goes through. A status not here (missing, null, a migration state, one
# added later) says nothing: never that the pod is down, never that it is gone.
STATUSES = {"PROVISIONING": "starting", "STARTING": "starting", "RUNNING": "running", "EXITED": "stopped",
            "ERROR": "error", "TERMINATED": "gone"}
REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
           422: "Unprocessable Entity", 429: "Too Many Requests", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
HINTS = {401: "the API key is invalid or revoked: make a new one in the RunPod console (Settings, API Keys) "
              "and export RUNPOD_API_KEY",
         403: "the API key lacks access to this: give it read/write on pods, templates and storage",
         429: "RunPod's rate limit: wait a minute and run it again"}


class ApiError(PodkitError):
    """RunPod answered with an error, or did not answer. `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, hint: str = "", status: int = 0, detail: str = "") -> None:
        super().__init__(message, hint)
        self.status, self.detail = status, detail


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect would carry the Authorization header to wherever it points: refused, as an error."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ARG002 - urllib's signature
        return None


class Deadline:
    """When a request must be over, by the monotonic clock: every read of its answer (status line, headers,
    body, each SSE line) gets what is left, so an answer that drips a byte a second ends at `at` too. The
    log stream moves `at` on as events come (keep-alive comments do not)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """The socket's reader (socket.SocketIO, which keeps the socket open while it reads), each read given
    what is left of the deadline as its timeout."""

    def __init__(self, raw, sock, deadline: Deadline) -> None:
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(b)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """The connection's socket as http.client sees it: the same, but what it reads through obeys the deadline."""

    def __init__(self, sock, deadline: Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode="r", buffering=None, **kw):
        return io.BufferedReader(_DeadlineReader(self._sock.makefile("rb", buffering=0), self._sock, self._deadline))

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _with_deadline(base):
    class Connection(base):
        def __init__(self, *args, deadline: Deadline, **kw) -> None:
            super().__init__(*args, **kw)
            self.deadline = deadline

        def connect(self) -> None:
            self.timeout = min(self.timeout, self.deadline.left())
            super().connect()
            self.sock = _DeadlineSocket(self.sock, self.deadline)
    return Connection


_HTTP, _HTTPS = _with_deadline(http.client.HTTPConnection), _with_deadline(http.client.HTTPSConnection)


def _opener(deadline: Deadline):
    """urllib with no redirects, whose connections keep `deadline`."""
    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(_HTTP, req, deadline=deadline)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(_HTTPS, req, deadline=deadline)

    return urllib.request.build_opener(_NoRedirect, Http, Https)


def base_url(environ=None) -> str:
    """RUNPOD_API_BASE_URL (default https://api.runpod.io), checked: the key goes there. https, or http to
    a loopback address (a local stand-in); no credentials, query or fragment in it."""
    environ = os.environ if environ is None else environ
    raw = (environ.get("RUNPOD_API_BASE_URL") or API_BASE).strip().rstrip("/")
    try:
        u = urllib.parse.urlsplit(raw)
        host = u.hostname or ""
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        u, host = None, ""
    loopback = False
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if (not u or not host or u.username or u.password or u.query or u.fragment
            or not (u.scheme == "https" or (u.scheme == "http" and loopback))):
        shown = _shown(re.sub(r"//[^/@]*@", "//<credentials>@", raw))
        raise ApiError(f"RUNPOD_API_BASE_URL {shown!r} is not an https URL of an API host: the API key would be "
                       "sent there", "unset it (the default is https://api.runpod.io)")
    if u.path.rstrip("/"):
        raise ApiError(f"RUNPOD_API_BASE_URL {_shown(raw)!r} has a path: it is the host alone (podkit adds /v2/...)",
                       "e.g. https://api.runpod.io")
    return raw


def _shown(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def api_key(environ=None) -> str:
    environ = os.environ if environ is None else environ
    key = (environ.get("RUNPOD_API_KEY") or "").strip()
    if not key:
        raise ApiError("no RunPod API key", "export RUNPOD_API_KEY=... (RunPod console: Settings, API Keys)")
    if any(c.isspace() or not c.isprintable() for c in key) or len(key) > 512:
        raise ApiError("RUNPOD_API_KEY is not an API key (it holds spaces or control characters)",
                       "copy the key again from the RunPod console")
    return key


def pod_state(pod: dict | None) -> str:
    """What RunPod says of the pod, through STATUSES: starting | running | stopped | error | gone, or
    unknown (a status it does not document, or none)."""
    status = pod.get("status") if isinstance(pod, dict) else None
    return STATUSES.get(status, "unknown") if isinstance(status, str) else "unknown"


AMOUNT_MAX = 1e7  # USD: no price or bill of one pod is near it; past it, a number is not an amount
_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def amount(value) -> float | None:
    """A USD amount from an answer (a price, a bill): a finite number from 0 to AMOUNT_MAX, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= AMOUNT_MAX:
        return None  # NaN fails the comparison too
    return float(value)


def pod_cost(pod: dict | None) -> float | None:
    """The pod's price in USD per hour (its `cost`; RunPod's 0.0 once it is stopped), or None."""
    return amount(pod.get("cost")) if isinstance(pod, dict) else None


# Go's time.Time.String(), which RunPod's answers have carried: "2026-11-28 13:00:00.123456789 +0000 UTC"
_GO_TIME = re.compile(r"^(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?(?:\s+[A-Z]{1,5})?$")


def started_at(pod: dict | None) -> float | None:
    """When the pod last started (its `startedAt`: RFC 3339, or Go's time format), as a Unix time; None when it
    has not or the field is not a time."""
    raw = pod.get("startedAt") if isinstance(pod, dict) else None
    if not isinstance(raw, str) or len(raw) > 64:
        return None
    if _RFC3339.match(raw):
        try:  # shaped like a time but not one (a leap second's :60, 24:00, February 30): no start
            return dt.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    m = _GO_TIME.match(raw.strip())
    if not m:
        return None
    day, clock, frac, zone = m.groups()
    zone = "+00:00" if zone in (None, "Z") else zone if ":" in zone else f"{zone[:3]}:{zone[3:]}"
    try:
        t = dt.datetime.fromisoformat(f"{day}T{clock}{zone}").timestamp()
    except ValueError:
        return None
    return t + (float(f"0.{frac}") if frac else 0.0)


def gpu_price(gpus: list[dict], gpu_id: str, cloud: str, count: int) -> float | None:
    """The list price in USD per hour of `count` x `gpu_id` in `cloud` (SECURE | COMMUNITY) from the GPU
    catalogue (price per GPU x count), or None when the catalogue does not offer it there."""
    gpu = next((g for g in gpus if g.get("id") == gpu_id), None)
    side = cloud.lower()
    if gpu is None or gpu.get(side) is False or not isinstance(gpu.get("price"), dict):
        return None
    each = amount(gpu["price"].get(side))
    return round(each * count, 4) if each else None


def check_id(value, what: str = "pod", redact=lambda t: t) -> str:
    """`value` when it has a RunPod id's shape (it goes into a URL path); else ApiError, which shows the
    value redacted, then cut."""
    if isinstance(value, str) and ID.match(value):
        return value
    raise ApiError(f"{_shown(redact(repr(value)))} is not a RunPod {what} id: not sent to RunPod's API",
                   "RunPod's answer or the command line has an id of another shape", status=200)


def cut(text: str, limit: int = SHOWN_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def problem(status: int, raw: bytes, redact=lambda t: t) -> tuple[str, str]:
    """(one line for people, RunPod's detail) from an error answer: RFC 9457 problem+json (title, detail,
    errors) when it is one, else the answer's first words. `redact` runs on the whole text before anything
    is cut: a cut through the key would leave part of it."""
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and (answer.get("detail") or answer.get("title")):
        detail = redact(str(answer.get("detail") or ""))
        line = ": ".join(str(answer[k]) for k in ("title", "detail") if answer.get(k))
        errors = answer.get("errors")
        if isinstance(errors, list) and errors:
            line += " (" + "; ".join(str(e) for e in errors[:5]) + ")"
        return cut(redact(line)), cut(detail, 4 * SHOWN_MAX)
    text = cut(redact(raw.decode("utf-8", "replace")))
    return (text or REASONS.get(status, "no message")), text


class Client:
    """One RunPod account, through REST API v2. Every call retries 429 (after its Retry-After), 5xx and a
    host that does not answer, with a back-off that doubles, `retries` times; a create is not retried after
    RunPod may have taken it (see `create_pod`). Errors are ApiError, one line: what, which object, why."""

    def __init__(self, key: str | None = None, *, environ=None, timeout_s: float = 30, retries: int = 4,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0, sleep=time.sleep, agent: str = "podkit") -> None:
        self.base = base_url(environ)
        self._key = key or api_key(environ)
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.sleep, self.agent = sleep, agent
        self.answered_at: float | None = None  # the Date of the last answer (RunPod's clock), a Unix time

    def redact(self, text: str) -> str:
        """The key out of `text`, and whatever an Authorization header carries."""
        text = text.replace(self._key, "***") if self._key else text
        return _AUTHORIZATION.sub(lambda m: m.group(1) + "***", text)

    def url(self, path: str, query: dict | None = None) -> str:
        q = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (query or {}).items() if v is not None}
        return f"{self.base}{path}" + (f"?{urllib.parse.urlencode(q)}" if q else "")

    def _request(self, method: str, path: str, body, query, headers: dict | None, timeout_s: float):
        """The answer, open; `timeout_s` is the whole request's (connect, status, headers, body), and the
        answer's `deadline` may be moved on by a reader that wants more (the log stream)."""
        data = None if body is None else json.dumps(body).encode()
        h = {"Authorization": f"Bearer {self._key}", "Accept": "application/json", "User-Agent": self.agent}
        if data is not None:
            h["Content-Type"] = "application/json"
        h.update(headers or {})
        req = urllib.request.Request(self.url(path, query), data=data, method=method, headers=h)
        deadline = Deadline(timeout_s)
        r = _opener(deadline).open(req, timeout=timeout_s)
        r.deadline = deadline
        return r

    def call(self, method: str, path: str, body=None, *, query: dict | None = None, what: str = "",
             retry: bool = True, ok_missing: bool = False, timeout_s: float | None = None):
        """The JSON answer (None for 204 or no body; _GONE for 404 when `ok_missing`). `what` names the object for
        messages ("pod abc123"). `retry=False`: a request RunPod may have acted on is sent once."""
        what = what or path
        attempt = 0
        while True:
            attempt += 1
            wait = None
            try:
                with self._request(method, path, body, query, None, timeout_s or self.timeout_s) as r:
                    raw = r.read(ANSWER_MAX_BYTES + 1)
                    status = r.status
                    when = _answer_date(r.headers.get("Date"))  # RunPod's clock: a start is timed by it
                    self.answered_at = when.timestamp() if when is not None and when.tzinfo is not None else None
            except urllib.error.HTTPError as e:
                status, raw = e.code, _error_body(e)
                if status == 404 and ok_missing:
                    return _GONE
                if 300 <= status < 400:
                    raise ApiError(f"RunPod's API redirected {method} {path} (HTTP {status}): not followed, it "
                                   "would carry the API key elsewhere", "check RUNPOD_API_BASE_URL", status) from None
                line, detail = problem(status, raw, self.redact)
                err = ApiError(f"RunPod answered {method} {path} ({what}) with HTTP {status}: {line}",
                               HINTS.get(status, ""), status, detail)
                # 429 is a refusal, safe to send again; a 5xx may come after RunPod acted on it.
                if attempt > self.retries or not (status == 429 or (retry and status in RETRY_STATUSES)):
                    raise err from None
                after = retry_after(e.headers.get("Retry-After"))
                if after is not None and after > RETRY_AFTER_MAX_S:
                    raise err from None
                wait = after if after is not None else self.backoff(attempt)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # a garbled answer too
                reason = getattr(e, "reason", None) or e
                err = ApiError(f"RunPod's API at {self.base} did not answer {method} {path} ({what}): "
                               f"{type(reason).__name__ if isinstance(reason, Exception) else self.redact(str(reason))}",
                               "check the network; `podkit deploy status` tells what RunPod has")
                # A refused connection never reached RunPod; a timeout may have.
                if attempt > self.retries or not (retry or isinstance(reason, ConnectionRefusedError)):
                    raise err from None
                wait = self.backoff(attempt)
            else:
                if status == 204 or not raw.strip():
                    return None
                if len(raw) > ANSWER_MAX_BYTES:
                    raise ApiError(f"RunPod's answer to {method} {path} is over {ANSWER_MAX_BYTES >> 20} MiB: refused")
                try:
                    return json.loads(raw)
                except ValueError:
                    raise ApiError(f"RunPod answered {method} {path} ({what}) with HTTP {status} and no JSON: "
                                   f"{cut(self.redact(raw[:1 << 16].decode('utf-8', 'replace')), 200)!r}",
                                   "RunPod's API or a proxy in front of it is having trouble; try again",
                                   status) from None
            self.sleep(wait)

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)

    # -- what podkit asks ----------------------------------------------------------------------------------
    def pod(self, pod_id: str) -> dict | None:
        """The pod, or None when RunPod has no such pod (404: terminated, migrated away, or never was). A
        200 without a pod (null, empty, another id) is an answer that cannot be read, never "no such pod"."""
        check_id(pod_id, "pod", self.redact)
        answer = self.call("GET", f"/v2/pods/{pod_id}", what=f"pod {pod_id}", ok_missing=True)
        if answer is _GONE:
            return None
        pod = _object(answer, "pod", status=200)
        if pod.get("id") != pod_id:
            raise ApiError(f"RunPod's answer for pod {pod_id} is not that pod "
                           f"(id {_shown(self.redact(repr(pod.get('id'))))})", status=200)
        return pod

    def pods(self) -> list[dict]:
        return _listed(self.call("GET", "/v2/pods", query={"includeClusterPods": True}, what="your pods"), "pods")

    def create_pod(self, body: dict) -> dict:
        """Sent once: a create that timed out or failed with 5xx may have been made, so it is not repeated
        here; the caller looks for it before trying again (a second pod would bill beside it)."""
        return _made(self.call("POST", "/v2/pods", body, what=f"pod {body.get('name')!r}", retry=False), "pod",
                     self.redact)

    def action(self, pod_id: str, action: str) -> dict | None:
        check_id(pod_id, "pod", self.redact)
        return self.call("POST", f"/v2/pods/{pod_id}/action", {"action": action}, what=f"pod {pod_id}")

    def templates(self) -> list[dict]:
        return _listed(self.call("GET", "/v2/templates", what="your templates"), "templates")

    def save_template(self, body: dict, template_id: str | None) -> dict:
        if template_id:
            check_id(template_id, "template", self.redact)
            return _made(self.call("PATCH", f"/v2/templates/{template_id}", body,
                                   what=f"template {template_id}"), "template", self.redact)
        return _made(self.call("POST", "/v2/templates", body, what=f"template {body.get('name')!r}",
                               retry=False), "template", self.redact)

    def gpu_types(self) -> list[dict]:
        """RunPod's GPU catalogue (`GET /v2/catalog/gpus`): each type's id and list price per GPU per hour.
        Its ids are names ("NVIDIA A40"), never put in a path: entries without a string id are dropped."""
        answer = self.call("GET", "/v2/catalog/gpus", what="the GPU catalogue")
        gpus = answer.get("gpus") if isinstance(answer, dict) else None
        if not isinstance(gpus, list):
            raise ApiError("RunPod's answer has no 'gpus' list", "RunPod's API may have changed", status=200)
        return [g for g in gpus if isinstance(g, dict) and isinstance(g.get("id"), str)]

    def pod_billing(self, pod_id: str, since: str | None = None) -> float:
        """What RunPod has billed for the pod, in USD: the sum of `GET /v2/billing/pods?podId=` records (daily
        buckets from `since`, the pod's createdAt; RunPod's 30 days without it). A record of another pod, or
        whose totalAmount is not a finite amount, is dropped; no records list is an answer that cannot be read."""
        check_id(pod_id, "pod", self.redact)
        query = {"podId": pod_id, "bucketSize": "day"}
        if isinstance(since, str) and _RFC3339.match(since):
            query["startTime"] = since
        answer = self.call("GET", "/v2/billing/pods", query=query, what=f"pod {pod_id}'s billing")
        rows = answer.get("records") if isinstance(answer, dict) else None
        if not isinstance(rows, list):
            raise ApiError(f"RunPod's billing answer for pod {pod_id} has no records list", status=200)
        return sum(r["totalAmount"] for r in rows if isinstance(r, dict) and r.get("podId") == pod_id
                   and amount(r.get("totalAmount")) is not None)

    def network_volumes(self) -> list[dict]:
        return _listed(self.call("GET", "/v2/network-volumes", what="your network volumes"), "networkVolumes")

    def create_cluster(self, body: dict) -> dict:
        return _made(self.call("POST", "/v2/clusters", body, what=f"cluster {body.get('name')!r}", retry=False),
                     "cluster", self.redact)

    def clusters(self) -> list[dict]:
        return _listed(self.call("GET", "/v2/clusters", what="your clusters"), "clusters")

    def cluster(self, cluster_id: str) -> dict:
        check_id(cluster_id, "cluster", self.redact)
        return _object(self.call("GET", f"/v2/clusters/{cluster_id}", what=f"cluster {cluster_id}"), "cluster")

    def cluster_pods(self, cluster_id: str) -> list[dict]:
        check_id(cluster_id, "cluster", self.redact)
        return _listed(self.call("GET", f"/v2/clusters/{cluster_id}/pods", what=f"cluster {cluster_id}"), "pods")

    def delete_cluster(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster", self.redact)
        self.call("DELETE", f"/v2/clusters/{cluster_id}", what=f"cluster {cluster_id}")

    def logs(self, pod_id: str, *, source: str | None = None, tail: int | None = None, follow: bool = True,
             last_id: str | None = None, reconnects: int = 5, idle_timeout_s: float = 300,
             settle_s: float = 5) -> Iterator[dict]:
        """The pod's log events ({source, line, ts}) from the SSE endpoint, each once. RunPod holds the
        stream open after its backlog: without `follow` it ends once the backlog is out: `tail` lines (its
        default 100), or a line stamped after the stream began (by the answer's Date), or no event for
        `settle_s` (keep-alive comments do not count). A stream that drops, or that RunPod ends, is resumed
        with Last-Event-ID (the last event's id; an event repeating it is dropped), and a 429 or 5xx at a
        connect is waited out: `reconnects` failures in a row at most."""
        check_id(pod_id, "pod", self.redact)
        failures, backlog, began, seen = 0, (LOG_TAIL if tail is None else tail), None, False
        quiet_s = idle_timeout_s if follow else settle_s
        while True:
            if not follow and backlog <= 0:
                return
            query = {"source": source, "tail": None if last_id else tail}
            headers = {"Accept": "text/event-stream"}
            if last_id:
                headers["Last-Event-ID"] = last_id
            got, wait = 0, None
            try:
                with self._stream(pod_id, query, headers, quiet_s) as r:
                    began = began or _answer_date(r.headers.get("Date"))
                    for event_id, data in sse_events(r):
                        r.deadline.at = time.monotonic() + quiet_s  # an event, not a comment, moves it on
                        event = _log_event(data) if data is not None else {
                            "source": "", "line": f"[podkit] a log event over {SSE_LINE_MAX >> 10} KiB was skipped",
                            "ts": ""}
                        key = event_id or (event or {}).get("ts") or ""
                        if event is None or (last_id and key == last_id):
                            continue
                        if not follow and began and _stamped_after(event["ts"], began):
                            if seen:
                                return  # a line the pod wrote after the stream began: the backlog is out
                            began = None  # the first line is "later" than the stream: clocks apart, no cut
                        seen = True
                        got += 1
                        last_id = key or last_id
                        yield event
                        backlog -= 1
                        if not follow and backlog <= 0:
                            return
                if not follow and (got == 0 or not last_id):
                    return  # a resume that brought nothing new: the stream was whole
            except TimeoutError:
                if not follow:
                    return  # the backlog is done: nothing more came for settle_s
                failures = 0  # a quiet pod, not a failure: ask again from the last event
                continue
            except ApiError as e:
                if not (e.status == 429 or e.status >= 500):
                    raise
                wait = retry_after(e.detail) if e.status == 429 else None
            except (urllib.error.URLError, http.client.HTTPException, OSError):  # a drop mid-stream, too
                pass
            else:
                failures = 0
                if follow and not got:
                    self.sleep(2.0)  # RunPod ended a followed stream with nothing new: ask again shortly
                continue
            failures = 0 if got else failures + 1
            if failures > reconnects:
                raise ApiError(f"the log stream of pod {pod_id} failed {failures} times in a row",
                               "check the network; `podkit deploy logs` resumes where it stopped")
            self.sleep(wait if wait is not None and wait <= RETRY_AFTER_MAX_S else self.backoff(max(1, failures)))

    def _stream(self, pod_id: str, query: dict, headers: dict, timeout_s: float):
        try:
            return self._request("GET", f"/v2/pods/{pod_id}/logs", None, query, headers, timeout_s)
        except urllib.error.HTTPError as e:
            line, detail = problem(e.code, _error_body(e), self.redact)
            # A 429's detail is where its Retry-After travels to logs(), which waits it out.
            raise ApiError(f"RunPod answered the log stream of pod {pod_id} with HTTP {e.code}: {line}",
                           HINTS.get(e.code, "`podkit deploy status` tells whether the pod exists"), e.code,
                           e.headers.get("Retry-After", "") if e.code == 429 else detail) from None


LOG_TAIL = 100  # RunPod's backlog when no tail is asked for (LogTail's default)
_GONE = object()  # call()'s answer for a 404 that means "no such object"
_AUTHORIZATION = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer|basic|token)?\s*)[^\s'\",}]+")


def _error_body(e: urllib.error.HTTPError) -> bytes:
    """An error answer's first 64 KiB; what does not come within the request's deadline is left."""
    try:
        return e.read(1 << 16) if e.fp else b""
    except (OSError, http.client.HTTPException):
        return b""


def _answer_date(value: str | None) -> dt.datetime | None:
    try:
        return email.utils.parsedate_to_datetime(value) if value else None
    except (TypeError, ValueError):
        return None


def _stamped_after(ts: str, began: dt.datetime) -> bool:
    """A log event's ts later than the stream's start by more than the Date header's second (and a
    second's margin): written after it began."""
    try:
        t = dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return False
    if t.tzinfo is None or began.tzinfo is None:
        return False
    return t > began + dt.timedelta(seconds=2)


def retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (RunPod sends an integer); None when absent or not a number."""
    try:
        seconds = float((value or "").strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def sse_lines(stream, limit: int = SSE_LINE_MAX) -> Iterator[bytes | None]:
    """The lines of a byte stream (its readline), each at most `limit` bytes: a longer one is read through
    in pieces and given as None, so memory stays bounded whatever the stream sends."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the long line, dropped as it comes
            line = stream.readline(limit)
        yield None


def sse_events(stream, limit: int = SSE_LINE_MAX) -> Iterator[tuple[str, str | None]]:
    """(id, data) of each event of a text/event-stream (the WHATWG rules podkit needs: `id:`, multi-line
    `data:`, comments and other fields ignored, an event ends at a blank line), from a byte stream. An
    event whose data is over `limit` bytes comes as (id, None)."""
    event_id, data, size, over = "", [], 0, False
    for raw in sse_lines(stream, limit):
        if raw is None:
            over = True
            continue
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data or over:
                yield event_id, None if over else "\n".join(data)
            data, size, over = [], 0, False
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            size += len(value) + 1
            over = over or size > limit
            data = [] if over else [*data, value]
        elif field == "id" and "\x00" not in value:
            event_id = value
    if data or over:
        yield event_id, None if over else "\n".join(data)


def _log_event(data: str) -> dict | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("line"), str):
        return None
    return {"source": str(event.get("source") or ""), "line": event["line"], "ts": str(event.get("ts") or "")}


def _object(answer, what: str, status: int = 0) -> dict | None:
    """The object of an answer; None for no body, unless `status` says one was due (then it is an answer
    that cannot be read)."""
    if answer is None and not status:
        return None
    if not isinstance(answer, dict):
        raise ApiError(f"RunPod's answer for a {what} is not an object: {type(answer).__name__}", status=200)
    return answer


def _made(answer, what: str, redact=lambda t: t) -> dict:
    """A created or saved object: it must have an id of RunPod's shape, which later requests put in a path."""
    made = _object(answer, what, status=200)
    if not isinstance(made.get("id"), str) or not ID.match(made["id"]):
        raise ApiError(f"RunPod's answer for the {what} has no {what} id of RunPod's shape "
                       f"(id {_shown(redact(repr(made.get('id'))))})", status=200)
    return made


def _listed(answer, key: str) -> list[dict]:
    """v2 wraps lists: {"pods": [...]}. Entries that are not objects, or whose id is not of RunPod's shape
    (it would go into a URL path), are dropped, not trusted."""
    items = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(items, list):
        got = f"keys {sorted(map(str, answer))[:8]}" if isinstance(answer, dict) else type(answer).__name__
        raise ApiError(f"RunPod's answer has no {key!r} list ({got})",
                       "RunPod's API may have changed; podkit speaks REST API v2", status=200)
    return [i for i in items if isinstance(i, dict) and isinstance(i.get("id"), str) and ID.match(i["id"])]
