"""The stub's HTTP side: what a request and an answer are, the routing of each request to the stub's method
for its operation, the checks on both sides (tests/runpod_shapes.py), and the scripted faults (a status, a
late answer, a byte-at-a-time answer, an unreadable one)."""

from __future__ import annotations

import json
import re
import socket
import time
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from runpod_shapes import check_params, match_operation, problem, response_errors, schema_errors

if TYPE_CHECKING:
    from runpod_stub import RunPodV2Stub

HOSTILE_ID = "victim/action?x="  # garble("bad-id"): an id that would address another endpoint in a path


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
    """A scripted answer (fail, answer_late, garble): to which requests, how many times (None: all), what."""
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
class Answer:
    """What a method of the stub answers; serve holds it to the document and sends it."""
    status: int
    body: Any = None  # JSON-able, or None for no body
    headers: dict[str, str] = field(default_factory=dict)
    scripted: bool = False  # a shape a test asked for (show_status): not held to the document


class Wire:
    """Routing, validation and answering, mixed into RunPodV2Stub: each request is recorded, held to the
    document (422 with its errors when it breaks it), faulted as a test scripted, or handed to the stub's method
    that ROUTES names; each answer is held to the document before it is sent."""

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

    def _rule(self, req: Request, detail: str) -> Answer:
        """A rule of the document's descriptions broken (the body matches the schema): 400, as RunPod does."""
        self.refused.append(Refusal(req, 400, [detail]))
        return Answer(400, problem(400, detail))

    def _check_response(self, op: dict | None, status: int, ctype: str | None, body: Any, call: str) -> None:
        """What the document refuses in the stub's own answer lands in stub.errors: a bug in the stub."""
        self.errors.extend(response_errors(op, status, ctype, body, call))

    def _send(self, h: Handler, op: dict | None, answer: Answer, call: str = "") -> None:
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
    def _write(h: Handler, status: int, out: bytes, ctype: str | None, headers: dict[str, str]) -> None:
        h.send_response(status)
        if ctype:
            h.send_header("Content-Type", ctype)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(out)))
        h.end_headers()
        h.wfile.write(out)

    def _fault(self, h: Handler, req: Request) -> bool:
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
            body, ctype = json.dumps(problem(fault.status, detail)).encode(), ctype or "application/problem+json"
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
    def _drip(h: Handler, status: int, out: bytes, ctype: str | None, headers: dict[str, str], every_s: float) -> None:
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

    def serve(self, h: Handler, method: str) -> None:
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
            return self._send(h, None, Answer(410, problem(410, "stub: RunPod's GraphQL API is not used here; "
                                                                "use the REST API v2")), call)
        matched = match_operation(method, url.path)
        op = matched[2] if matched else None
        if h.headers.get("Authorization") != f"Bearer {self.key}":
            detail = "missing bearer token" if not h.headers.get("Authorization") else "invalid bearer token"
            return self._send(h, op, Answer(401, problem(401, detail)), call)
        if self._fault(h, req):
            return None
        if matched is None:
            with self._lock:
                self.unknown.append(req)
            return self._send(h, None, Answer(404, problem(404, f"no such path: {url.path}")), call)
        template, item, op, params = matched
        if op is None:
            with self._lock:
                self.unknown.append(req)
            allowed = ", ".join(m.upper() for m in item if m != "parameters")
            return self._send(h, None, Answer(405, problem(405, f"{method} is not allowed on {template}"),
                                              {"Allow": allowed}), call)
        handler = self.ROUTES.get((method, template))
        if handler is None:
            with self._lock:
                self.unknown.append(req)
            return self._send(h, None, Answer(404, problem(404, f"stub: {op['operationId']} ({method} "
                                                                f"{template}) is not implemented by the stub")), call)
        with self._lock:
            errors, query = check_params(item, op, req.query, req.headers)
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
                return self._send(h, op, Answer(status, problem(status, detail, errors)), call)
            if handler != "stream_logs":
                answer = getattr(self, handler)(req, params, query)
        if handler == "stream_logs":
            return self.stream_logs(h, req, params, query, op)
        if late := self._take(self.late, req):
            time.sleep(late.delay_s)  # done already; the answer comes late (or finds the client gone)
        if garbled := self._take(self.garbles, req):
            return self._garbled(h, answer, garbled.body)
        return self._send(h, op, answer, call)

    def _garbled(self, h: Handler, answer: Answer, how: str) -> None:
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


class Handler(BaseHTTPRequestHandler):
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
