"""Notifications: a JSON POST to the webhook in PODKIT_NOTIFY_WEBHOOK_URL when the pod needs a person or
is done: safe mode (a config error too), the crash-loop guard, a program gone FATAL, a watchdog
restart, a stop beginning, training finished. `text` (Slack) and `content` (Discord) carry the same
line, shown as is. On RunPod the ends of a run (finished, a pod's stop, a stop beginning) also say what the
pod has cost (cost.json: `"cost"` in the JSON, and its words in the line).

The URL is a secret (anyone with it can post to the channel): it comes from the environment only (an
env file, a RunPod secret), never a config file, so a boot whose config does not load still has it.
Sending never blocks boot or training: a daemon thread, a few brief attempts. A dead webhook is logged
once per boot, not per event (`.podkit/notify.json` remembers it across programs), and again when it works.
Once the container is stopping (`stopping`), every attempt ends by the stop's deadline and none starts
past it: a webhook that never answers must not make PID 1 overrun the stop timeout and be killed.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from podkit import log, records
from podkit.money import ledger

ENV = "PODKIT_NOTIFY_WEBHOOK_URL"
ATTEMPTS = 3
TIMEOUT_S = 5.0
_log = log.get("notify")
_pending: list[threading.Thread] = []
_until: list[float] = []  # the stop's deadline (time.monotonic()) once the container is stopping
EXIT_S = 0.5  # the listener's own exit after the last attempt, before PID 1's deadline
SPEND_EVENTS = ("finished", "pod-stop", "pod-stop-failed", "stopping")  # a run's ends: what it cost


def stopping(deadline_s: float) -> None:
    """The container is stopping, and PID 1 kills what is left `deadline_s` from now (0: no deadline): no
    attempt past EXIT_S before it, and the attempts in flight are cut there."""
    if deadline_s > 0:
        _until[:] = [time.monotonic() + deadline_s - EXIT_S]


def _left() -> float:
    """Seconds left before the stop's deadline; infinite while not stopping."""
    return _until[0] - time.monotonic() if _until else float("inf")


left = _left  # the listener's final upload at the stop (programs/logs.py) ends by the same deadline


def pod_name(environ) -> str:
    return environ.get("RUNPOD_POD_ID") or socket.gethostname()


def send(event: str, text: str, state_dir: Path | None, environ=None) -> threading.Thread | None:
    """Post in the background; returns the thread (None when no webhook is set)."""
    environ = os.environ if environ is None else environ
    url = environ.get(ENV, "").strip()
    if not url:
        return None
    pod = pod_name(environ)
    text = _redacted(text, environ)
    try:
        spend = ledger.cost(state_dir) if event in SPEND_EVENTS else None
    except Exception:  # noqa: BLE001 - a notification goes out whatever the cost record holds
        spend = None
    if spend:
        text += f" (this pod's cost: {ledger.words(spend)})"
    body = {"text": f"[podkit {pod}] {text}", "content": f"[podkit {pod}] {text}", "event": event, "pod": pod,
            "time": round(time.time(), 3)}
    if spend:
        body["cost"] = spend
    t = threading.Thread(target=_post, args=(url, body, state_dir), name=f"notify-{event}", daemon=True)
    t.start()
    _pending[:] = [p for p in _pending if p.is_alive()] + [t]
    return t


def _redacted(text: str, environ) -> str:
    """The line with every secret of the pod's environment, and whatever has a secret's shape, taken out: an
    event's words quote errors (rclone's, git's), and a channel is read by more people than the pod."""
    from podkit.redact import Redactor, secret_name

    try:
        return Redactor({f"env {k}": v for k, v in environ.items() if secret_name(k, environ)})(text)
    except Exception:  # noqa: BLE001 - a notification goes out whatever an env value holds; its shape rules only
        return Redactor({})(text)


def drain(timeout_s: float) -> None:
    """Give notifications in flight up to `timeout_s` in all before the process ends."""
    until = time.monotonic() + min(timeout_s, _left())
    for t in list(_pending):
        t.join(max(0.0, until - time.monotonic()))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirected POST would come back as a GET without its body, and count as delivered."""

    def redirect_request(self, *_):
        return None  # the 3xx is then an HTTPError, like any other refusal


ANSWER_S = 10.0  # a whole answer within this, however slowly it drips: TIMEOUT_S bounds each read only


def _open(req: urllib.request.Request) -> None:
    """POST and read the answer's start within ANSWER_S in all: a webhook that sends a byte every few
    seconds never trips the per-read timeout; past the deadline its socket is shut, and the read fails."""
    socks, expired = [], threading.Event()

    class Conn(http.client.HTTPConnection):
        def connect(self):
            super().connect()
            socks.append(self.sock)

    class TLSConn(http.client.HTTPSConnection):
        def connect(self):
            super().connect()
            socks.append(self.sock)

    class Plain(urllib.request.HTTPHandler):
        def http_open(self, r):
            return self.do_open(Conn, r)

    class TLS(urllib.request.HTTPSHandler):
        def https_open(self, r):
            return self.do_open(TLSConn, r, context=self._context)

    def cut() -> None:
        expired.set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    limit = min(ANSWER_S, max(0.0, _left()))  # the stop's deadline cuts it shorter
    timer = threading.Timer(limit, cut)
    timer.daemon = True
    timer.start()
    try:
        timeout = min(TIMEOUT_S, max(0.01, _left()))
        with urllib.request.build_opener(_NoRedirect, Plain, TLS).open(req, timeout=timeout) as r:
            r.read(4096)
    except Exception:
        if expired.is_set():
            raise TimeoutError(f"no complete answer in {limit:.2g} s") from None
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        raise TimeoutError(f"no complete answer in {limit:.2g} s")


def _reason(e: Exception) -> str:
    """What went wrong, in words of podkit's or the OS's only: http.client's and urllib's messages quote
    parts of the URL (a password read as a port, a path with a control character), which is a secret."""
    reason = getattr(e, "reason", None) or e
    if isinstance(reason, TimeoutError) and str(reason).startswith("no complete answer"):
        return str(reason)
    if isinstance(reason, OSError) and reason.strerror:
        return f"{type(e).__name__}: {reason.strerror}"
    if isinstance(e, ValueError | http.client.InvalidURL):
        return f"{type(e).__name__}: the webhook URL is malformed"
    return type(reason).__name__ if isinstance(reason, Exception) else type(e).__name__


def _scrub(text: str, url: str) -> str:
    """The URL is a secret: neither it nor its path (where webhooks keep their token) goes in a log."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        parts = [p for p in (url, url.split("://", 1)[-1], u.netloc, u.path, u.query, u.fragment) if len(p) > 1]
    except ValueError:
        parts = [url]
    for part in sorted(parts, key=len, reverse=True):
        text = text.replace(part, "<webhook>")
    return text


def _post(url: str, body: dict, state_dir: Path | None) -> None:
    data = json.dumps(body).encode()
    error = ""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(min(attempt, max(0.0, _left())))
        if _left() <= 0:
            error = error or "not sent: the container's stop deadline had passed"
            break
        try:
            req = urllib.request.Request(url, data=data, method="POST", headers={
                "Content-Type": "application/json", "User-Agent": "podkit-notify"})
            _open(req)
            _worked(state_dir)
            return
        except urllib.error.HTTPError as e:
            error = f"HTTP {e.code}" + (" (a redirect, not followed: the webhook URL must be the final one)"
                                        if 300 <= e.code < 400 else "")
            if 300 <= e.code < 500 and e.code != 429:
                break  # a wrong URL, a redirect or a refused payload: trying again changes nothing
        except Exception as e:  # noqa: BLE001 - a malformed URL, no HTTP there, timeouts: recorded, never raised
            error = _scrub(_reason(e), url)
            if isinstance(e, ValueError):
                break  # a malformed URL stays malformed
    _failed(state_dir, body["event"], error)


_failing_logged = []


def _failed(state_dir: Path | None, event: str, error: str) -> None:
    rec = records.NOTIFY.read(state_dir) if state_dir else {}
    # Once per boot, not per run: each boot is a new container log, where a person looks for it. An earlier
    # boot's record (an earlier run's, on a reused volume) must not keep this boot's failure out of its log.
    since = rec.get("failing_since")
    if _failing_logged or since and since >= _boot_started(state_dir):
        return
    _failing_logged.append(1)
    _log.warn(f"the webhook ({ENV}) did not take the {event!r} notification: {error}; further failures are "
              "not logged until it works again")
    if state_dir:
        try:
            records.NOTIFY.write(state_dir, {"failing_since": time.time(), "error": error})
        except OSError:
            pass


def _boot_started(state_dir: Path | None) -> float:
    """When this pod's boot began (its boots.json entry, which every boot writes first, safe mode too); 0
    without one (`podkit deploy watch`, a state dir no boot wrote)."""
    boots = records.BOOTS.read(state_dir) if state_dir else []
    t = boots[-1].get("time") if boots else None
    return t if isinstance(t, (int, float)) else 0.0


def _worked(state_dir: Path | None) -> None:
    was = records.NOTIFY.read(state_dir).get("failing_since") if state_dir else None
    if was or _failing_logged:
        _failing_logged.clear()
        _log.info("the webhook takes notifications again")
        if state_dir:
            records.NOTIFY.path(state_dir).unlink(missing_ok=True)
