"""`podkit run page`: the run at a glance, a web page of the pod's run (page.host:page.port; 0: off).

Drawn at each request from the records `podkit status` and `podkit doctor` read, and from nothing else:
status.collect (the programs and their restarts, the trainer's progress and last end, the start-up timeline,
the sync, the cost), doctor's findings, the loop bound's record, the cost guards in force (guardfile.report),
the per-step history (records.HISTORY) and the last lines of the logs. Readable on a phone, it refreshes by
itself (a meta refresh), runs no JavaScript and fetches nothing from elsewhere: the pictures are SVG drawn here,
the history downsampled to the picture's width (min and max per bucket of steps).

Nobody else reads it: with PODKIT_PAGE_TOKEN set (required beyond loopback: checks.page), a request without
the session cookie gets a login form, nothing else. The form posts the token; the answer sets an HttpOnly
SameSite=Strict cookie holding an expiry and an HMAC of it keyed by the token (never the token) and redirects.
A query string is refused (a token in a URL lands in histories and proxies' logs), and no request is logged
with its query or an unknown path. Everything shown is escaped and record text is redacted (redact.py), and
every answer carries a Content-Security-Policy without any script source.
"""

from __future__ import annotations

import base64
import bisect
import errno
import hashlib
import hmac
import html
import math
import os
import signal
import stat
import threading
import time
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from podkit import checks, costguard, ending, guardfile, health, log, records, status, supervisord
from podkit.checks import PAGE_TOKEN_ENV, loopback, page_token_ok
from podkit.redact import Redactor

_log = log.get("page")

REFRESH_S = 15           # the page reloads itself this often (a meta refresh: no script)
SESSION_S = 7 * 86400    # a login lasts a week on one browser; a new token ends every session at once
COOKIE = "podkit_page"
LOG_LINES = 12           # the last lines of each log shown
LOGS = ("trainer", "sglang", "watchdog")
LINE_CHARS = 240         # a line is cut here (after redaction: a secret is never cut in two)
WIDTH, HEIGHT = 420, 130  # a chart's drawing, scaled to the screen's width (a phone's is about this)
BUCKETS = 210            # points per chart: two units of WIDTH each
MARKS = 40               # restarts and failures marked on the step axis, the last ones
DOCTOR_EVERY_S = 600.0   # doctor's findings are looked for again after this, while someone looks at the page...
DOCTOR_SOONEST_S = 30.0  # ...and when something changed (a restart, an end), not more often than this
IDLE_S = 5.0             # a connection that sends nothing within this is closed
MAX_CONNECTIONS = 16
MAX_BODY = 4096          # a login form's body
BIND_RETRY_S = 10.0

CSS = """
body{font:15px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:60em;padding:.6em;
color:#1b1f24;background:#fff;overflow-wrap:anywhere}
h1{font-size:1.25em;margin:.2em 0}h2{font-size:1.05em;margin:1.2em 0 .3em;border-bottom:1px solid #d0d7de}
.muted{color:#57606a;font-size:.9em}.state{display:inline-block;padding:0 .5em;border-radius:.6em;font-weight:600}
.ok{background:#dafbe1;color:#1a7f37}.warn{background:#fff8c5;color:#7d4e00}.bad{background:#ffebe9;color:#cf222e}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:.1em .8em;margin:.4em 0}dt{color:#57606a}dd{margin:0}
.box{border:1px solid #d0d7de;border-left:4px solid #cf222e;border-radius:4px;padding:.4em .7em;margin:.6em 0}
.box.note{border-left-color:#9a6700}.fix{margin:.2em 0 0}.quote{white-space:pre-wrap;overflow-wrap:anywhere}
svg{width:100%;height:auto;display:block;background:#f6f8fa;border-radius:4px}
svg text{font-family:system-ui,sans-serif}
.line{fill:none;stroke:#0969da;stroke-width:1.5}.band{fill:#0969da;fill-opacity:.18;stroke:none}
.grid{stroke:#d0d7de;stroke-width:1}.m-fail{stroke:#cf222e;stroke-width:1.5}.m-restart{stroke:#bf8700;stroke-width:1.5;
stroke-dasharray:4 3}.m-stop{stroke:#57606a;stroke-width:1;stroke-dasharray:2 3}.bar{fill:#0969da}.bar.slow{fill:#bf8700}
table{border-collapse:collapse;width:100%;font-size:.92em}td,th{text-align:left;padding:.15em .4em;
border-bottom:1px solid #eaeef2}th{color:#57606a;font-weight:500}td.key{overflow-wrap:normal}
pre{background:#f6f8fa;padding:.5em;overflow-x:auto;font-size:.8em;line-height:1.3;margin:.2em 0 .6em;
white-space:pre-wrap;overflow-wrap:anywhere}
ul.marks{margin:.2em 0;padding-left:1.2em;font-size:.9em}
form{margin:2em 0}input{font-size:1em;padding:.3em;width:min(24em,100%)}button{font-size:1em;padding:.3em 1em}
"""
_CSS_HASH = base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()
# No script source at all: a script that slipped past the escaping still would not run.
CSP = (f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; frame-ancestors 'none'; base-uri 'none'; "
       "form-action 'self'")
HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"), ("X-Frame-Options", "DENY"))


def esc(v) -> str:
    return html.escape(str(v), quote=True)


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
            from podkit import doctor  # its checks' own imports (gpu, watchdog): only once someone looks

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

    def gather(self) -> dict:
        st = status.collect(self.ws, self.state)
        now = time.time()
        loop = records.TRAINER_LOOP.read(self.state)
        try:
            guards = guardfile.report(self.cfg)
        except Exception as e:  # noqa: BLE001 - the guards' file is data: the page still draws without it
            guards = {"guards": {}, "problem": f"cannot read the guards ({type(e).__name__})", "run": ""}
        t = st["trainer"]
        sig = (tuple(sorted((n, p["state"], p["restarts"]) for n, p in st["programs"].items())),
               (t.get("stopped") or {}).get("time"), (st.get("safe_mode") or {}).get("since"),
               tuple((t.get("loop") or {}).values()), tuple(a.get("time") for a in st.get("watchdog") or []))
        logs = {name: health.tail(self.logs / f"{name}.log", 64 << 10)[-LOG_LINES:] for name in LOGS}
        return {"st": st, "now": now, "history": self.history.get(), "loop": loop, "guards": guards,
                "findings": self.findings.get(sig), "logs": logs, "total_steps": self.cfg.trainer.max_steps,
                "on_runpod": costguard.on_runpod(), "health": status.health_problem(
                    st, self.cfg.health.progress_timeout_s, self.cfg.multi_node) if st["supervisord"].get(
                    "reachable") else None}

    def page(self) -> bytes:
        return render(self.gather(), self.redact).encode()


# -- the numbers ------------------------------------------------------------------------------------------------
def pace(points: list, now: float, window_s: float = 600.0) -> float | None:
    """Steps per minute over the last window_s of the history's steps since its last restart (a step that went
    back, a gap of more than ten minutes); None when two steps do not say."""
    if len(points) < 2:
        return None
    last_step, last_t = points[-1][0], points[-1][1]
    first_step, first_t = last_step, last_t
    for step, t, *_ in reversed(points[:-1]):
        if step >= first_step or first_t - t > 600 or last_t - t > window_s:
            break
        first_step, first_t = step, t
    if last_t <= first_t or last_step <= first_step:
        return None
    return (last_step - first_step) / (last_t - first_t) * 60.0


def step_times(points: list, starts: list[float]) -> list[tuple[int, float]]:
    """(step, seconds per step) between consecutive history lines, over the steps between them; never across a
    start of the trainer (that gap is its restart, not training) nor a step that went back."""
    out = []
    starts = sorted(s for s in starts if isinstance(s, (int, float)))
    for (s0, t0, *_), (s1, t1, *_) in zip(points, points[1:], strict=False):
        if s1 <= s0 or t1 < t0:
            continue
        i = bisect.bisect_right(starts, t0)
        if i < len(starts) and starts[i] <= t1:
            continue
        out.append((s1, (t1 - t0) / (s1 - s0)))
    return out


def buckets(series: list[tuple[int, float]], lo: int, hi: int, n: int = BUCKETS) -> list[tuple[float, float, float,
                                                                                              float]]:
    """(mean step, min, max, mean) per bucket of steps, in order; non-finite values left out. One pass over
    plain lists: a long run's history is drawn at every request."""
    per = n / max(hi - lo, 1)
    count, steps, total = [0] * n, [0] * n, [0.0] * n
    low, high = [math.inf] * n, [-math.inf] * n
    for step, v in series:
        if v is None or v - v != 0:  # NaN and the infinities: not drawn
            continue
        b = int((step - lo) * per)
        if b >= n:
            b = n - 1
        count[b] += 1
        steps[b] += step
        total[b] += v
        if v < low[b]:
            low[b] = v
        if v > high[b]:
            high[b] = v
    return [(steps[b] / c, low[b], high[b], total[b] / c) for b, c in enumerate(count) if c]


def step_at(points: list, t: float) -> int | None:
    """The last step recorded at or before time t (the step a restart or a failure came after)."""
    i = bisect.bisect_right([p[1] for p in points], t)
    return points[i - 1][0] if i else None


def marks(data: dict) -> list[tuple[int, str, str]]:
    """(step, kind, words) of the trainer's starts, ends and the watchdog's actions, on the step axis: from the loop
    bound's record, the trainer's last end and the watchdog's record. kind: fail | restart | stop."""
    points, loop, st = data["history"], data["loop"], data["st"]
    out: list[tuple[int, str, str]] = []
    for t in loop.get("started") or []:
        if isinstance(t, (int, float)) and (step := step_at(points, t)) is not None:
            out.append((step, "restart", "the trainer started again"))
    for e in loop.get("ends") or []:
        if not isinstance(e, dict):
            continue
        step = e.get("step") if isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool) else \
            step_at(points, e.get("time")) if isinstance(e.get("time"), (int, float)) else None
        if step is None:
            continue
        kind = ending.kind(e.get("by"))
        out.append((step, "fail" if kind.family in (ending.FAILURE, ending.FINAL) else "stop",
                    f"{kind.words}" + (f": {e['what']}" if e.get("what") else "")))
    end = ending.of(st["trainer"].get("stopped"))
    if end is not None and isinstance(end.step, int) and end.family in (ending.FAILURE, ending.FINAL, ending.STOP):
        out.append((end.step, "fail" if end.family != ending.STOP else "stop", end.words()))
    for a in st.get("watchdog") or []:
        if isinstance(a.get("time"), (int, float)) and (step := step_at(points, a["time"])) is not None:
            out.append((step, "fail", f"the watchdog: {a.get('action')} {a.get('program')}: {a.get('reason')}"))
    seen, unique = set(), []
    for m in out:  # the loop bound's end and the trainer's own record of it are one end
        if m[:2] not in seen:
            seen.add(m[:2])
            unique.append(m)
    return sorted(unique, key=lambda m: m[0])[-MARKS:]


# -- drawing ----------------------------------------------------------------------------------------------------------
def _num(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.3g}" if a >= 0.01 or a == 0 else f"{v:.2e}"


def chart(title: str, series: list[tuple[int, float]], lo: int, hi: int, ms: list, unit: str = "",
          floor: float | None = None) -> str:
    """An SVG line of the series over the steps lo..hi: the mean per bucket, the band between min and max, the
    marks as vertical lines (each with its words as a title), the range written at the edges."""
    pts = buckets(series, lo, hi)
    left, top, w, h = 4, 14, WIDTH - 8, HEIGHT - 30
    if not pts:
        return ""
    ymin = min(p[1] for p in pts) if floor is None else floor
    ymax = max(p[2] for p in pts)
    if unit == "s":  # a step time's spikes (a checkpoint, a slow rollout) must not flatten the rest
        means = sorted(p[3] for p in pts)
        ymax = min(ymax, means[int(len(means) * 0.98)] * 2.0) if len(means) > 10 else ymax
    if ymax <= ymin:
        ymin, ymax = ymin - 1, ymax + 1
    span = max(hi - lo, 1)

    def x(step: float) -> float:
        return left + (step - lo) * w / span

    def y(v: float) -> float:
        return top + h - (min(max(v, ymin), ymax) - ymin) * h / (ymax - ymin)

    line = " ".join(f"{x(s):.1f},{y(m):.1f}" for s, _, _, m in pts)
    band = " ".join(f"{x(s):.1f},{y(hi_):.1f}" for s, _, hi_, _ in pts) + " " + \
        " ".join(f"{x(s):.1f},{y(lo_):.1f}" for s, lo_, _, _ in reversed(pts))
    last = series[-1][1] if series else None
    label = f"{title}: {len(series)} steps drawn, last {_num(last)}{unit}"
    out = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{esc(label)}">',
           f"<title>{esc(label)}</title>",
           f'<line class="grid" x1="{left}" y1="{top}" x2="{left + w}" y2="{top}"/>',
           f'<line class="grid" x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}"/>',
           f'<polygon class="band" points="{band}"/>',
           f'<polyline class="line" data-points="{len(pts)}" points="{line}"/>']
    for step, kind, words in ms:
        if lo <= step <= hi:
            out.append(f'<line class="m-{kind}" x1="{x(step):.1f}" y1="{top}" x2="{x(step):.1f}" y2="{top + h}">'
                       f"<title>step {step}: {esc(words)}</title></line>")
    out += [f'<text x="{left}" y="11" font-size="11" fill="#57606a">{esc(_num(ymax))}{unit}</text>',
            f'<text x="{left}" y="{top + h - 3}" font-size="11" fill="#57606a">{esc(_num(ymin))}{unit}</text>',
            f'<text x="{left}" y="{HEIGHT - 3}" font-size="11" fill="#57606a">step {lo}</text>',
            f'<text x="{left + w}" y="{HEIGHT - 3}" font-size="11" fill="#57606a" text-anchor="end">step {hi}</text>',
            "</svg>"]
    return "\n".join(out)


def startup_bars(t: dict) -> str:
    """The start-up timeline as bars by phase, each from where the one before it ended (status's `startup`)."""
    phases = [p for p in t.get("phases") or [] if isinstance(p, dict) and isinstance(p.get("took_s"), (int, float))
              and isinstance(p.get("at"), (int, float))]
    boot = t.get("boot")
    if not phases or not isinstance(boot, (int, float)):
        return ""
    end = max(p["at"] for p in phases)
    total = max(end - boot, 0.001)
    row, label_w = 20, 118
    w = WIDTH - label_w - 40
    slow = max(p["took_s"] for p in phases)
    out = [f'<svg viewBox="0 0 {WIDTH} {row * len(phases) + 6}" role="img" '
           f'aria-label="start-up: {len(phases)} phases, {total:.0f} s">']
    for i, p in enumerate(phases):
        x0 = label_w + max(p["at"] - p["took_s"] - boot, 0) * w / total
        bw = max(p["took_s"] * w / total, 1.5)
        y = 3 + i * row
        took = f"{p['took_s']:.0f}s" if p.get("whole_s") else f"{p['took_s']:.1f}s"
        out.append(f'<text x="4" y="{y + 13}" font-size="12">{esc(str(p["phase"]).replace("_", " "))}</text>'
                   f'<rect class="bar{" slow" if p["took_s"] == slow and slow > 0 else ""}" x="{x0:.1f}" y="{y + 2}" '
                   f'width="{bw:.1f}" height="{row - 6}"><title>{esc(p["phase"])}: {esc(took)}</title></rect>'
                   f'<text x="{x0 + bw + 4:.1f}" y="{y + 13}" font-size="11" fill="#57606a">{esc(took)}</text>')
    out.append("</svg>")
    return "\n".join(out)


# -- the page ---------------------------------------------------------------------------------------------------------
def _ago(t, now: float) -> str:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "never"
    return f"{_span(now - t)} ago" if now >= t else f"in {_span(t - now)}"


def _span(s: float) -> str:
    s = int(max(s, 0))
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def _utc(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if isinstance(t, (int, float)) else "-"


def state_of(st: dict) -> tuple[str, str]:
    """The run in a word or three, and its colour: ok | warn | bad."""
    if st.get("safe_mode"):
        return "safe mode", "bad"
    sv = st["supervisord"]
    trainer = (st["programs"].get("trainer") or {}).get("state")
    end = ending.of(st["trainer"].get("stopped"))
    if not sv.get("reachable"):
        return ("not running", "warn") if sv.get("exited") or not sv.get("socket") else ("not answering", "bad")
    if end is not None and end.family == ending.FINISHED and trainer in (supervisord.EXITED, supervisord.STOPPED):
        return "finished", "ok"
    if end is not None and end.family == ending.FINAL and trainer == supervisord.EXITED:
        return "stopped for good", "bad"
    if any(p["state"] == supervisord.FATAL for p in st["programs"].values()):
        return "a program is FATAL", "bad"
    if trainer == supervisord.RUNNING:
        return "training", "ok"
    return (str(trainer).lower() if trainer else "starting"), "warn"


def render(data: dict, redact=lambda s: s) -> str:
    """The page, from `gather`'s data. Record text (a user's exception, a log line, doctor's evidence) is
    redacted, made printable and escaped; podkit's own words are escaped."""
    def said(v, limit: int = 600) -> str:
        return esc(status.printable(redact(str(v if v is not None else "")), limit))

    st, now, points = data["st"], data["now"], data["history"]
    t = st["trainer"]
    word, colour = state_of(st)
    code = t.get("code") or {}
    sync = st.get("sync") or {}
    commit = code.get("commit") or sync.get("new") or ""
    name = t.get("run") or code.get("entry") or Path(st.get("workspace") or "run").name
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f'<meta http-equiv="refresh" content="{REFRESH_S}">',
           f"<title>{said(name, 80)}: {esc(word)}</title>", f"<style>{CSS}</style></head><body>",
           f'<h1>{said(name, 120)} <span class="state {colour}">{esc(word)}</span></h1>',
           f'<p class="muted">{esc(t.get("kind") or "")} trainer'
           + (f", {said(code['entry'], 200)}" if code.get("entry") else "")
           + (f" at {said(commit[:12], 12)}" if commit else "") + (" (uncommitted changes)" if code.get("dirty") else "")
           + f"; read {time.strftime('%H:%M:%S UTC', time.gmtime(now))}, again every {REFRESH_S} s</p>"]

    # The run's facts.
    step = t.get("step")
    total = data.get("total_steps") or 0
    rate = pace(points, now)
    facts = [("step", (f"{step} of {total}" if total else f"{step}") if isinstance(step, int) else "none yet")]
    if rate:
        facts.append(("pace", f"{rate:.3g} steps/min"))
    if total and isinstance(step, int) and rate and step < total and word == "training":
        left = (total - step) / rate * 60
        facts.append(("the end", f"in {_span(left)} at this pace ({_utc(now + left)})"))
    elif not total:
        facts.append(("the end", "no step limit (trainer.max_steps 0): the script's own"))
    facts += [("last step", _ago(t.get("last_progress"), now)),
              ("checkpoint", f"step {t['checkpoint_step']}" if t.get("checkpoint_step") else "none"),
              ("inference", str((st.get("inference") or {}).get("phase"))),
              *((k, _num(t[k])) for k in ("reward", "loss") if isinstance(t.get(k), (int, float)))]
    if data.get("health") is not None or st["supervisord"].get("reachable"):
        facts.append(("health", data["health"] or "healthy"))
    cost = st.get("cost")
    if isinstance(cost, dict) and cost:
        facts.append(("cost", _cost(cost)))
    out.append('<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{said(v)}</dd>" for k, v in facts) + "</dl>")

    # What went wrong, in the user's own words, with the fix.
    out += _trouble(st, data, said)

    # The pictures.
    ms = [(step, kind, redact(words)) for step, kind, words in marks(data)]  # an exception's text may hold a secret
    if points:
        lo, hi = min(p[0] for p in points), max(p[0] for p in points)
        rewards = [(p[0], p[2]) for p in points if p[2] is not None]
        losses = [(p[0], p[3]) for p in points if p[3] is not None]
        times = step_times(points, [s for s in data["loop"].get("started") or [] if isinstance(s, (int, float))])
        out.append("<h2>Over the steps</h2>")
        for title, series, unit, floor in (("reward", rewards, "", None), ("loss", losses, "", None),
                                           ("step time", times, "s", 0.0)):
            if series:
                out.append(f'<p class="muted">{esc(title)}</p>' + chart(title, series, lo, hi, ms, unit, floor))
        if ms:
            out.append('<ul class="marks">' + "".join(
                f"<li>step {m[0]}: {said(m[2], 300)}</li>" for m in ms[-8:]) + "</ul>")
    else:
        out.append('<h2>Over the steps</h2><p class="muted">no step recorded yet</p>')

    bars = startup_bars(st.get("startup") or {})
    if bars:
        total_s = (st.get("startup") or {}).get("total_s")
        out.append("<h2>Start-up</h2>" + bars + (f'<p class="muted">{total_s:.0f} s from the boot to the first step</p>'
                                                  if isinstance(total_s, (int, float)) else ""))

    out.append("<h2>Programs</h2><table><tr><th>program</th><th>state</th><th>up</th><th>restarts</th>"
               "<th>pid</th></tr>")
    for pname, p in sorted(st["programs"].items()):
        out.append(f"<tr><td>{esc(pname)}</td><td>{esc(p['state'])}</td>"
                   f"<td>{esc(_span(p['uptime_s']) if p.get('uptime_s') else '-')}</td><td>{esc(p['restarts'])}</td>"
                   f"<td>{esc(p['pid'] or '-')}</td></tr>")
    out.append("</table>")
    if not st["programs"]:
        error = st["supervisord"].get("error")
        out.append(f'<p class="muted">supervisord does not answer{": " + said(error, 200) if error else ""}</p>')

    out += _guards(data, rate, said)

    out.append("<h2>Last log lines</h2>")
    for lname, lines in data["logs"].items():
        if lines:
            text = "\n".join(status.printable(ln, 10_000)[:LINE_CHARS] for ln in redact("\n".join(lines)).split("\n"))
            out.append(f'<p class="muted">{esc(lname)}.log</p><pre>{esc(text)}</pre>')
    out.append("</body></html>")
    return "\n".join(out)


def _cost(c: dict) -> str:
    def usd(v):
        return f"${v:,.2f}" if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else "?"

    parts = [f"{usd(c.get('per_hour'))}/h", f"spent {usd(c.get('spent'))}"
             + (f" ({c['source']})" if isinstance(c.get("source"), str) and c.get("source") else "")]
    parts.append(f"projected {usd(c['projected'])} to the end" if isinstance(c.get("projected"), (int, float))
                 else "no end to project to")
    return ", ".join(parts)


def _trouble(st: dict, data: dict, said) -> list[str]:
    out = []
    sm = st.get("safe_mode")
    if sm:
        out.append(f'<div class="box"><b>safe mode</b> since {esc(_ago(sm.get("since"), data["now"]))}: '
                   f'{said(sm.get("stage"), 40)}: <span class="quote">{said(sm.get("message"))}</span>'
                   + (f'<p class="fix">fix: {said(sm["hint"])}</p>' if sm.get("hint") else "") + "</div>")
    t = st["trainer"]
    end = ending.of(t.get("stopped"))
    if end is not None and end.family in (ending.FAILURE, ending.FINAL):
        out.append(f'<div class="box"><b>the last failure</b>, {esc(_ago(end.time, data["now"]))}: '
                   f'<span class="quote">{said(end.said())}</span>'
                   + (f'<p class="fix">why: <span class="quote">{said(end.first())}</span></p>'
                      if end.family == ending.FINAL and end.first() else "")
                   + (f'<p class="fix">fix: {said(end.hint or end.kind.fix)}</p>' if end.hint or end.kind.fix else "")
                   + "</div>")
    loop = t.get("loop") or {}
    if loop and not loop.get("gave_up"):
        out.append(f'<div class="box note">the loop bound: {esc(loop.get("failures") or 0)} failure(s) in a row '
                   "without a new step" + (f'; the last: <span class="quote">{said(loop["last"])}</span>'
                                          if loop.get("last") else "") + "</div>")
    found = data.get("findings")
    if found is None:
        out.append('<p class="muted">doctor is looking; its findings show at the next refresh</p>')
    for f in (found or [])[:10]:
        note = f.get("severity") != "problem"
        evidence = "".join(f"<li>{said(e, 300)}</li>" for e in (f.get("evidence") or [])[:6])
        out.append(f'<div class="box{" note" if note else ""}"><b>{"note" if note else "doctor"}:</b> '
                   f'{said(f.get("title"), 300)}' + (f"<ul>{evidence}</ul>" if evidence else "")
                   + f'<p class="fix">fix: {said(f.get("fix"))}</p></div>')
    return out


def _guards(data: dict, rate: float | None, said) -> list[str]:
    """Each cost guard in force (guardfile.report) and when it would stop the pod, from the records."""
    rep, st, now = data["guards"], data["st"], data["now"]
    guards = rep.get("guards") or {}
    out = ['<h2>Cost guards <span class="muted">(guard.*)</span></h2>']
    if not data.get("on_runpod"):
        out.append('<p class="muted">off here: not a RunPod pod (no RUNPOD_POD_ID and RUNPOD_API_KEY)</p>')
    rows = []
    values = {k: g.get("value") for k, g in guards.items()}
    for key, g in guards.items():
        v = g.get("value")
        if key == "stop_pod_at":
            when = f"at {_utc(v)}, {_ago(v, now)}" if v else "no maximum run time"
        elif key == "stop_pod_when_finished":
            total, step = data.get("total_steps") or 0, st["trainer"].get("step")
            when = "never" if v != "auto" else "when training finishes" + (
                f" (step {total}; at this pace {_ago(now + (total - step) / rate * 60, now)})"
                if total and isinstance(step, int) and rate and step < total else "")
        elif key == "stop_pod_after_s":
            when = _unable(st, v, values.get("stop_pod_at") or 0, now) if v else "never"
        elif key == "max_spend":
            cost = st.get("cost") if isinstance(st.get("cost"), dict) else {}
            spent, per_hour = cost.get("spent"), cost.get("per_hour")
            when = "no budget" if not v else f"once the pod has cost ${v:,.2f}" + (
                f": ${spent:,.2f} so far" + (f", at ${per_hour:,.2f}/h {_ago(now + (v - spent) / per_hour * 3600, now)}"
                                             if isinstance(per_hour, (int, float)) and per_hour > 0 and spent < v else "")
                if isinstance(spent, (int, float)) else "")
        else:
            when = str(g.get("shown") or v)
        rows.append(f'<tr><td class="key">{esc(key)}</td><td>{said(when, 300)}</td></tr>')
        if g.get("stale"):
            rows.append(f'<tr><td></td><td class="muted">{said(g["stale"], 300)}</td></tr>')
    if rows:
        out.append("<table>" + "".join(rows) + "</table>")
    if rep.get("problem"):
        out.append(f'<p class="muted">{said(rep["problem"], 300)}</p>')
    return out


def _unable(st: dict, after: float, at: float, now: float) -> str:
    """guard.stop_pod_after_s in words: what it stops, and, when the pod cannot train now, when it would."""
    since, why = None, ""
    if st.get("safe_mode"):
        since, why = (st["safe_mode"] or {}).get("since"), "in safe mode"
    else:
        end = ending.of(st["trainer"].get("stopped"))
        trainer = (st["programs"].get("trainer") or {}).get("state")
        if end is not None and end.family == ending.FINAL and trainer == supervisord.EXITED:
            since, why = end.time, "the trainer is stopped for good"
        elif any(p["state"] == supervisord.FATAL for p in st["programs"].values()):
            why = "a program is FATAL"
    base = f"after {_span(after)} unable to train (safe mode, the trainer stopped for good, a program FATAL)"
    if not why:
        return base
    if not isinstance(since, (int, float)):
        return f"{base}: now {why}, so within {_span(after)}"
    left, how = costguard.sooner(after, at, since)
    return f"{base}: {why} since {_ago(since, now)}, so {_ago(since + left, now)} ({how})"


LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>podkit: log in</title><style>{css}</style></head><body>
<h1>podkit</h1><p>This pod's page needs its token (PODKIT_PAGE_TOKEN).</p>{said}
<form method="post" action="/login"><p><label>token <input type="password" name="token" autocomplete="current-password"
required autofocus></label></p><p><button type="submit">open the page</button></p></form>
</body></html>
"""


def login_page(said: str = "") -> bytes:
    return LOGIN.format(css=CSS, said=f'<p class="state bad">{esc(said)}</p>' if said else "").encode()


# -- the server -------------------------------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address, handler) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.said: dict[str, float] = {}
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):  # busy: a new connection is closed, the served ones go on
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

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


def server(host: str, port: int, source, token: str = "") -> ThreadingHTTPServer:
    """GET / (the page), GET and POST /login; everything else 404. With a token, the page only with a session."""
    session = Session(token)

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_S
        server_version, sys_version = "podkit-page", ""

        def do_GET(self):
            if not self._plain():
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
                _log.error(f"the page failed: {type(e).__name__}: {e}")
                return self._answer(500, f"the page failed: {type(e).__name__} (page.log says more)\n".encode(),
                                    "text/plain")
            self._answer(200, body, "text/html")

        def do_HEAD(self):
            self._answer(405, b"", "text/plain")

        def do_POST(self):
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
            body = self.rfile.read(length).decode("utf-8", "replace")
            try:
                sent = (parse_qs(body, max_num_fields=4).get("token") or [""])[0] if "=" in body else ""
            except ValueError:  # more fields than a login form has: not a person's login
                return self._answer(400, b"not a login form\n", "text/plain")
            if not session.required:
                return self._answer(303, b"", "text/plain", "/")
            if not session.token_ok(sent):
                self.server.say("refused", "refused a login: wrong token (one line per 10 s at most)")
                time.sleep(1.0)  # one guess a second per connection: a token of 16+ characters is out of reach
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
            try:
                jar = SimpleCookie(self.headers.get("Cookie", ""))
            except CookieError:
                return False
            morsel = jar.get(COOKIE)
            return morsel is not None and session.valid(morsel.value)

        def _answer(self, code: int, body: bytes, ctype: str, location: str | None = None,
                    cookie: str | None = None) -> None:
            self.send_response(code)
            for k, v in HEADERS:
                self.send_header(k, v)
            self.send_header("Content-Type", f"{ctype}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if location:
                self.send_header("Location", location)
            if cookie:
                self.send_header("Set-Cookie", cookie)
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


def main(cfg) -> int:
    p = cfg.page
    signal.signal(signal.SIGTERM, _stop)
    if not p.port:
        from podkit.programs import idle

        return idle("page", "page.port is 0: no page")
    token = os.environ.get(PAGE_TOKEN_ENV, "")
    host = endpoint(p.host, token)
    if not page_token_ok(token):
        if token or host != p.host:
            _log.warn(checks.page_loopback_only(cfg) or f"{PAGE_TOKEN_ENV} is ignored")
        token = ""  # loopback without a usable token: as on `podkit up`, no login
    source = Source(cfg)
    told = ""
    while True:  # a port taken by something else: said once, tried again, never a FATAL program
        try:
            httpd = server(host, p.port, source, token)
            break
        except OSError as e:
            if e.strerror != told:
                _log.error(f"cannot listen on {host}:{p.port} ({e.strerror}); trying again every "
                           f"{BIND_RETRY_S:.0f} s (page.port: another port, or 0 for no page)")
                told = e.strerror
            time.sleep(BIND_RETRY_S)
    source.history.get()  # the whole history read once now, not at the first person's request
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    _log.info(f"serving the run at a glance on http://{shown}:{p.port}/" + (" (log in with the token)" if token
                                                                            else ""))
    httpd.serve_forever()
    return 0
