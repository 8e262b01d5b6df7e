"""`podkit run page`: the run at a glance, a web page of the pod's run (page.host:page.port; 0: off).

Drawn at each request from the records `podkit status` and `podkit doctor` read, and from nothing else:
status.collect (the programs and their restarts, the trainer's progress and last end, the start-up timeline,
the sync, the cost), doctor's findings, the loop bound's record, the cost guards in force (guardfile.report),
the per-step history (records.HISTORY) and the last lines of the logs. Readable on a phone, it refreshes by
itself (a meta refresh), runs no JavaScript and fetches nothing from elsewhere: the pictures are SVG drawn here,
the history downsampled to the picture's width (min and max per bucket of steps).

Here: the records read into one model (`Source.gather`), the login and the server. pageview.py draws the model,
panel by panel, into templates/ (HTML and CSS files); web.py is the HTTP server this and /metrics share.

Nobody else reads it: with PODKIT_PAGE_TOKEN set (required beyond loopback: checks.page), a request without
the session cookie gets a login form, nothing else. The form posts the token; the answer sets an HttpOnly
SameSite=Strict cookie holding an expiry and an HMAC of it keyed by the token (never the token) and redirects.
A wrong token is answered at once, never slept on in a connection's slot: past WRONG_PER_S wrong tokens a second
(everyone's together) it gets 429; the right one always gets in (a token the check lets stand is no guess). A query string is refused (a
token in a URL lands in histories and proxies' logs), and no request is logged with its query or an unknown
path. Everything shown is escaped and record text is redacted (redact.py), and every answer carries a
Content-Security-Policy without any script source.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import signal
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, unquote

from podkit import log, records
from podkit.areal import checks
from podkit.areal.checks import PAGE_TOKEN_ENV, loopback, page_token_ok
from podkit.judge import health
from podkit.money import costguard, guardfile
from podkit.redact import Redactor
from podkit.views import pageview, status, web
from podkit.views.pageview import login_page, render

_log = log.get("page")

SESSION_S = 7 * 86400    # a login lasts a week on one browser; a new token ends every session at once
COOKIE = "podkit_page"
LOG_LINES = 12           # the last lines of each log shown
LOGS = ("trainer", "sglang", "watchdog")
DOCTOR_EVERY_S = 600.0   # doctor's findings are looked for again after this, while someone looks at the page...
DOCTOR_SOONEST_S = 30.0  # ...and when something changed (a restart, an end), not more often than this
REQUEST_S = 5.0          # a request's line, headers and body arrive within this, all together, or it is closed
MAX_CONNECTIONS = 16
KEPT = 4                 # of them, kept for requests with a valid session: a stranger's flood never takes the last
WRONG_PER_S, WRONG_BURST = 2.0, 10  # wrong tokens taken per second, for everyone together; past that 429 at once
MAX_BODY = 4096          # a login form's body
BIND_RETRY_S = 10.0

# No script source at all: a script that slipped past the escaping still would not run.
CSP = (f"default-src 'none'; style-src 'sha256-{pageview.CSS_HASH}'; frame-ancestors 'none'; base-uri 'none'; "
       "form-action 'self'")
HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"), ("X-Frame-Options", "DENY"))


# -- the session: a login form, then a cookie that is not the token ------------------------------------------------
class Session:
    """The cookie is `<expiry>.<HMAC-SHA256 of the expiry, keyed by the token>`: it proves the token was given
    without holding it, lapses by itself, and a new token ends every session."""

    def __init__(self, token: str) -> None:
        self.key = hashlib.sha256(b"podkit page session\0" + token.encode()).digest() if token else b""
        self.token = token.encode()

    @property
    def required(self) -> bool:
        return bool(self.key)

    def token_ok(self, sent: str) -> bool:
        return bool(self.key) and hmac.compare_digest(sent.encode("utf-8", "replace"), self.token)

    def cookie(self, now: float | None = None) -> str:
        expires = int((time.time() if now is None else now) + SESSION_S)
        return f"{expires}.{self._mac(expires)}"

    def valid(self, value: str, now: float | None = None) -> bool:
        exp, _, mac = value.partition(".")
        if not self.key or not exp.isdigit() or len(exp) > 12:
            return False
        if int(exp) < (time.time() if now is None else now):
            return False
        return hmac.compare_digest(mac.encode("ascii", "replace"), self._mac(int(exp)).encode())

    def _mac(self, expires: int) -> str:
        return hmac.new(self.key, f"expires {expires}".encode(), hashlib.sha256).hexdigest()


# -- what the page shows: read from the records ---------------------------------------------------------------------
class HistoryCache:
    """records.HISTORY's file, read once and then only what was appended (a compaction is a new file: read
    again). Bounded like the record: at most its READ_BYTES, a partial or bad line skipped."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock = path, threading.Lock()
        self.key, self.offset, self.points = None, 0, []

    def get(self) -> list:
        with self.lock:
            try:
                self._read()
            except OSError:
                self.key, self.offset, self.points = None, 0, []
            return self.points

    def _read(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            self.key, self.offset, self.points = None, 0, []
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            key, limit = (st.st_dev, st.st_ino), records.HISTORY.READ_BYTES
            if key != self.key or st.st_size < self.offset:
                self.key, self.offset, self.points = key, 0, []
            if st.st_size <= self.offset:
                return
            start = self.offset
            if st.st_size - start > limit:  # more than the record ever holds: its end only, from a whole line
                start, self.points = st.st_size - limit, []
            os.lseek(fd, start, os.SEEK_SET)
            data = b""
            while len(data) < st.st_size - start and (chunk := os.read(fd, st.st_size - start - len(data))):
                data += chunk
        finally:
            os.close(fd)
        skip = 0
        if start and start != self.offset:
            skip = data.find(b"\n") + 1
            if not skip:
                return
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        if end > skip:
            self.points = self.points + records.parse_history(data[skip:end])
            if len(self.points) > 4 * records.HISTORY.MAX_LINES:  # a file past its bound that keeps growing
                self.points = self.points[-2 * records.HISTORY.MAX_LINES:]
        self.offset = start + max(end, skip)


class Findings:
    """doctor's findings, looked for in a thread of their own (its checks read logs, probe the volume, run
    dmesg): never while a request waits. Again after DOCTOR_EVERY_S while the page is looked at, or sooner when
    the pod changed (a restart, an end, safe mode)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.lock = cfg, threading.Lock()
        self.value: list[dict] | None = None
        self.when, self.sig, self.running = 0.0, None, False

    def get(self, sig) -> list[dict] | None:
        now = time.monotonic()
        with self.lock:
            due = self.value is None or now - self.when > DOCTOR_EVERY_S or \
                (sig != self.sig and now - self.when > DOCTOR_SOONEST_S)
            if due and not self.running:
                self.running, self.sig = True, sig
                threading.Thread(target=self._look, name="doctor", daemon=True).start()
            return self.value

    def _look(self) -> None:
        try:
            from podkit.views import (
                doctor,  # its checks' own imports (gpu, watchdog): only once someone looks
            )

            found = [f.to_dict() for f in doctor.examine(self.cfg, self.cfg.workspace_path)]
        except Exception as e:  # noqa: BLE001 - a check that fails must not take the page with it
            found = [{"id": "doctor", "severity": "info", "title": f"doctor could not look ({type(e).__name__}: {e})",
                      "evidence": [], "fix": "`podkit doctor` on the pod says more"}]
        with self.lock:
            self.value, self.when, self.running = found, time.monotonic(), False


class Source:
    """The pod whose page this is: its config, its records and logs, and what is cached between requests."""

    def __init__(self, cfg, environ=None) -> None:
        self.cfg = cfg
        self.ws, self.state, self.logs = Path(cfg.workspace_path), Path(cfg.state_dir), Path(cfg.log_dir)
        self.history = HistoryCache(records.HISTORY.path(self.state))
        self.findings = Findings(cfg)
        self.redact = Redactor.for_pod(cfg, os.environ if environ is None else environ)
        self.loop_key, self.loop = None, {}

    def gather(self) -> dict:
        """The model the panels draw: the records as read, each list and text bounded where the view walks it."""
        st = pageview.bound(status.collect(self.ws, self.state, bool(self.cfg.checkpoint.remote)), depth=12)
        now = time.time()
        loop = self._loop()
        try:
            guards = guardfile.report(self.cfg)
        except Exception as e:  # noqa: BLE001 - the guards' file is data: the page still draws without it
            guards = {"guards": {}, "problem": f"cannot read the guards ({type(e).__name__})", "run": ""}
        t = st["trainer"]
        try:
            sig = (tuple(sorted((n, p["state"], p["restarts"]) for n, p in st["programs"].items())),
                   (t.get("stopped") or {}).get("time"), (st.get("safe_mode") or {}).get("since"),
                   repr(t.get("loop"))[:2000], tuple(repr(a)[:200] for a in (st.get("watchdog") or [])[-8:]))
        except Exception:  # noqa: BLE001 - records of the wrong shape: doctor looks on its own schedule
            sig = None
        try:
            problem = status.health_problem(st, self.cfg.health.progress_timeout_s, self.cfg.multi_node) \
                if st["supervisord"].get("reachable") else None
        except Exception as e:  # noqa: BLE001 - one fact among many
            problem = f"cannot tell ({type(e).__name__})"
        logs = {name: health.tail(self.logs / f"{name}.log", 64 << 10)[-LOG_LINES:] for name in LOGS}
        return {"st": st, "now": now, "history": self.history.get(), "loop": loop, "guards": guards,
                "findings": self.findings.get(sig), "logs": logs, "total_steps": self.cfg.trainer.max_steps,
                "on_runpod": costguard.on_runpod(), "health": problem}

    def _loop(self) -> dict:
        """The loop bound's record, bounded, read again only when its file changed (a planted one of 16 MiB is
        parsed once, not at every request)."""
        path = records.TRAINER_LOOP.path(self.state)
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key is None or key != self.loop_key:
            loop = records.TRAINER_LOOP.read(self.state)
            self.loop_key, self.loop = key, pageview.bound(loop) if isinstance(loop, dict) else {}
        return self.loop

    def page(self) -> bytes:
        return render(self.gather(), self.redact).encode()


# -- the server -------------------------------------------------------------------------------------------------------
def cookies(headers, name: str, most: int = 8) -> list[str]:
    """The values of each cookie called `name`, among any others however they are written: every Cookie header
    (a proxy may send several), split on ';' by hand. SimpleCookie stops at the first cookie it cannot parse
    (another app's `prefs={"theme":"dark"}`), which would log the owner out for good."""
    out = []
    for header in headers.get_all("Cookie") or []:
        for part in header.split(";"):
            key, eq, value = part.strip().partition("=")
            if eq and key.strip() == name:
                value = value.strip()
                out.append(unquote(value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value))
                if len(out) >= most:  # each costs an HMAC: a header full of them is not a person's
                    return out
    return out


class _Server(web.Server):
    max_connections = MAX_CONNECTIONS
    request_s = REQUEST_S

    def __init__(self, address, handler) -> None:
        self.said: dict[str, float] = {}
        self.strangers = threading.BoundedSemaphore(MAX_CONNECTIONS - KEPT)
        self.wrong = web.Budget(WRONG_PER_S, WRONG_BURST)
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:
        """A request that broke its handler: one line per 10 s, not a traceback each (anyone may send them)."""
        import sys

        e = sys.exc_info()[1]
        self.say("error", f"a request failed: {type(e).__name__}: {str(e)[:200]}")

    def say(self, what: str, msg: str, every_s: float = 10.0) -> None:
        """A refused request's line, at most one of each kind per every_s: guesses must not flood the logs."""
        now = time.monotonic()
        if now - self.said.get(what, -every_s) >= every_s:
            self.said[what] = now
            _log.info(msg)


def server(host: str, port: int, source, token: str = "") -> web.Server:
    """GET / (the page), GET and POST /login; everything else 404. With a token, the page only with a session.
    Nothing a request without a session sends waits: a wrong token is answered at once (429 past the budget of
    wrong tries for everyone), so the owner's cookie always finds a slot."""
    session = Session(token)

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_S  # each read's; the request's own deadline is the server's (web.Server)
        server_version, sys_version = "podkit-page", ""

        def parse_request(self):
            ok = super().parse_request()
            if ok and self.command != "POST":  # all in; a POST's body is read next, still under the deadline
                self.server.heard(self.connection)
            return ok

        def handle_one_request(self):
            self.stranger = False
            try:
                super().handle_one_request()
            finally:
                if self.stranger:
                    self.server.strangers.release()

        def _room(self) -> bool:
            """A request without a session takes one of the rooms strangers may have; KEPT stay the owner's."""
            if session.required and self._signed_in():
                return True
            if not self.server.strangers.acquire(blocking=False):
                self.close_connection = True
                self._answer(503, b"busy: try again in a second\n", "text/plain", retry=True)
                return False
            self.stranger = True
            return True

        def do_GET(self):
            if not self._plain() or not self._room():
                return
            if self.path == "/login":
                if not session.required:
                    return self._answer(303, b"", "text/plain", "/")
                return self._answer(200, login_page(), "text/html")
            if self.path != "/":
                return self._answer(404, b"not here: the page is at /\n", "text/plain")
            if session.required and not self._signed_in():
                return self._answer(401, login_page(), "text/html")
            try:
                body = source.page()
            except Exception as e:  # noqa: BLE001 - a record that breaks the drawing must say so, not kill the page
                _log.error(f"the page failed: {type(e).__name__}: {str(e)[:300]}")
                return self._answer(500, f"the page failed: {type(e).__name__} (page.log says more)\n".encode(),
                                    "text/plain")
            self._answer(200, body, "text/html")

        def do_HEAD(self):
            self._answer(405, b"", "text/plain")

        def do_POST(self):
            # A stranger's room is taken once the form is in: forms trickled a byte a second never fill the rooms
            # (their reading is the server's, bounded by its slots and deadline), so a login from a new browser
            # gets one
            if not self._plain():
                return
            if self.path != "/login":
                return self._answer(404, b"not here\n", "text/plain")
            try:
                length = int(self.headers.get("Content-Length") or "")
            except ValueError:
                return self._answer(411, b"a login form has a length\n", "text/plain")
            if not 0 <= length <= MAX_BODY:
                return self._answer(413, b"too long for a login form\n", "text/plain")
            raw = self.rfile.read(length)
            self.server.heard(self.connection)
            if len(raw) < length:  # cut at the deadline: not a try of any token
                self.close_connection = True
                return self._answer(400, b"the form came too slowly\n", "text/plain")
            if not self._room():
                return
            body = raw.decode("utf-8", "replace")
            try:
                sent = (parse_qs(body, max_num_fields=4).get("token") or [""])[0] if "=" in body else ""
            except ValueError:  # more fields than a login form has: not a person's login
                return self._answer(400, b"not a login form\n", "text/plain")
            if not session.required:
                return self._answer(303, b"", "text/plain", "/")
            # Compared whatever the budget (in constant time): the owner's token gets in through any flood, and a
            # token the check lets stand (16+ characters a person did not pick) is no guess at HTTP's pace
            if not session.token_ok(sent.rstrip("\r\n")):
                if not self.server.wrong.take():  # past the budget: 429 at once, said once per 10 s
                    self.server.say("flood", "refused logins at once: more wrong tokens than "
                                    f"{WRONG_PER_S:g} a second (one line per 10 s at most)")
                    return self._answer(429, login_page("too many wrong tokens just now: try again in a few "
                                                        "seconds"), "text/html", retry=True)
                self.server.say("refused", "refused a login: wrong token (one line per 10 s at most)")
                return self._answer(401, login_page("wrong token"), "text/html")
            self.server.say("login", "a login: a new session for a week", every_s=0)
            secure = "; Secure" if self.headers.get("X-Forwarded-Proto", "").lower() == "https" else ""
            self._answer(303, b"", "text/plain", "/", cookie=f"{COOKIE}={session.cookie()}; Path=/; "
                         f"Max-Age={SESSION_S}; HttpOnly; SameSite=Strict{secure}")

        def _plain(self) -> bool:
            """A request without a query string: a token must never travel in a URL (nor be logged from one). Without
            a token (loopback), one addressed to this machine by name: a web page elsewhere that points a name of
            its own at 127.0.0.1 (DNS rebinding) reads nothing."""
            if not session.required and not local_host(self.headers.get("Host", "")):
                self._answer(421, b"this page answers to 127.0.0.1 or localhost only\n", "text/plain")
                return False
            if "?" in self.path or "#" in self.path:
                path = self.path.split("?", 1)[0].split("#", 1)[0]
                self.server.say("query", f"refused a request with a query string ({self.command} "
                                f"{path if path in ('/', '/login') else 'an unknown path'}): the token goes in the "
                                "login form, never in a URL")
                self._answer(400, b"no query strings here: the token goes in the login form (POST), never in a URL\n",
                             "text/plain")
                return False
            return True

        def _signed_in(self) -> bool:
            return any(session.valid(v) for v in cookies(self.headers, COOKIE))

        def _answer(self, code: int, body: bytes, ctype: str, location: str | None = None,
                    cookie: str | None = None, retry: bool = False) -> None:
            self.send_response(code)
            for k, v in HEADERS:
                self.send_header(k, v)
            self.send_header("Content-Type", f"{ctype}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if location:
                self.send_header("Location", location)
            if cookie:
                self.send_header("Set-Cookie", cookie)
            if retry:
                self.send_header("Retry-After", "1")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def send_error(self, code, message=None, explain=None):
            # http.server's own errors (a malformed request, an unknown method) carry the same headers.
            self.close_connection = True
            try:
                self._answer(code, f"{code} {message or ''}\n".encode("latin-1", "replace"), "text/plain")
            except OSError:
                pass

        def log_message(self, *_):
            pass  # http.server would log the request line, query string and all

    return _Server((host, port), Handler)


def _stop(*_):
    raise SystemExit(0)


def local_host(header: str) -> bool:
    """A Host header naming this machine: 127.0.0.1, localhost or [::1], with or without a port."""
    h = header.strip().lower()
    h = h[1:].partition("]")[0] if h.startswith("[") else h.rpartition(":")[0] if h.count(":") == 1 else h
    return h in ("127.0.0.1", "localhost", "::1")


def endpoint(host: str, token: str) -> str:
    """Where the page may be served: beyond loopback only with a usable token (the check's rule, applied again
    where the socket is made); otherwise loopback."""
    return host if loopback(host) or page_token_ok(token) else "127.0.0.1"


def file_token(cfg) -> str:
    """The token the render stage handed to the page alone (render.hand_page_token): a file in the run dir that
    only podkit's user may read; a file anyone else could have written is not the token."""
    from podkit.boot.render import PAGE_TOKEN_FILE

    try:
        fd = os.open(cfg.run_path / PAGE_TOKEN_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > 4096:
            _log.warn(f"{cfg.run_path / PAGE_TOKEN_FILE} is not podkit's own 0600 file: not the page's token")
            return ""
        return checks.page_token({PAGE_TOKEN_ENV: os.read(fd, 4096).decode("utf-8", "replace")})
    finally:
        os.close(fd)


def listen_on(cfg) -> tuple[str, str]:
    """(host, token) the page serves on: page.host behind a usable token, else loopback without a login."""
    token = checks.page_token(os.environ) or file_token(cfg)  # a pasted secret's line end is not the token's
    host = endpoint(cfg.page.host, token)
    if not page_token_ok(token):
        if token or host != cfg.page.host:
            _log.warn(checks.page_loopback_only(cfg) or f"{PAGE_TOKEN_ENV} is ignored")
        token = ""  # loopback without a usable token: as on `podkit up`, no login
    return host, token


def serve_in_background(cfg) -> bool:
    """For the boot waiting in safe mode (when a person looks): the page from a thread, showing why the pod
    waits and the fix, as status does; False when there is no page or it cannot bind."""
    if not cfg.page.port:
        return False
    host, token = listen_on(cfg)
    try:
        httpd = server(host, cfg.page.port, Source(cfg), token)
    except OSError as e:
        _log.warn(f"cannot serve the page on {host}:{cfg.page.port} in safe mode ({e.strerror or e})")
        return False
    threading.Thread(target=httpd.serve_forever, name="page", daemon=True).start()
    _log.info(f"serving the run at a glance in safe mode on port {cfg.page.port}" + (" (log in with the token)"
                                                                                     if token else " (loopback)"))
    return True


def main(cfg) -> int:
    p = cfg.page
    signal.signal(signal.SIGTERM, _stop)
    if not p.port:
        from podkit.programs import idle

        return idle("page", "page.port is 0: no page")
    host, token = listen_on(cfg)
    source = Source(cfg)
    told = ""
    while True:  # a port taken by something else: said once, tried again, never a FATAL program
        try:
            httpd = server(host, p.port, source, token)
            break
        except OSError as e:
            why = str(e.strerror or e)
            if why != told:  # the port's fault only when it is taken; an address this machine lacks is the host's
                fix = "page.port: another port, or 0 for no page" if e.errno == errno.EADDRINUSE else \
                    f"page.host {p.host!r}: an address of this machine (0.0.0.0 or :: for all, 127.0.0.1 for itself)"
                _log.error(f"cannot listen on {host}:{p.port} ({why}); trying again every {BIND_RETRY_S:.0f} s ({fix})")
                told = why
            time.sleep(BIND_RETRY_S)
    source.history.get()  # the whole history read once now, not at the first person's request
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    _log.info(f"serving the run at a glance on http://{shown}:{p.port}/" + (" (log in with the token)" if token
                                                                            else ""))
    httpd.serve_forever()
    return 0
