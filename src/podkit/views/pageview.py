"""The page's view: the numbers worked out from the records (`Source.gather`'s model) and the panels drawn
from them, into the markup of templates/ (page.html, login.html, page.css: files, not Python strings).

The run's records are data and may hold anything: every number is drawn through `_num` and `_frac` (NaN, the
infinities, 1e307 or a subnormal give a short label and a coordinate inside the picture), every text through
`said` (cut before it is redacted and made printable), every list cut to its last entries before it is walked.
Each panel is drawn on its own: one that fails shows as a note in its place and the rest of the page stands.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import html
import math
import time
from pathlib import Path
from string import Template

from podkit import log
from podkit.judge import ending, standing
from podkit.money import ledger
from podkit.views import status

_log = log.get("page")

TEMPLATES = Path(__file__).with_name("templates")
CSS = (TEMPLATES / "page.css").read_text()
PAGE = Template((TEMPLATES / "page.html").read_text())
LOGIN = Template((TEMPLATES / "login.html").read_text())
CSS_HASH = base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()

REFRESH_S = 15           # the page reloads itself this often (a meta refresh: no script)
LINE_CHARS = 240         # a log line is cut here (after redaction: a secret is never cut in two)
WIDTH, HEIGHT = 420, 130  # a chart's drawing; page.css caps its width so its 11-unit text stays ~15 px
BUCKETS = 210            # points per chart: two units of WIDTH each
MARKS = 40               # restarts and failures marked on the step axis, the last ones
ENTRIES = 400            # a record's list (the loop bound's starts and ends, the watchdog's acts) read from its end
READ_CHARS = 8           # a text is cut to this many times its shown length before it is redacted
TEXT = 64 << 10          # a record's text is cut to this before anything reads it (a traceback's worth)


def esc(v) -> str:
    return html.escape(str(v), quote=True)


def clip(v, limit: int = 600, redact=lambda s: s) -> str:
    """A record's text as one printable line of at most `limit` characters: cut first (a 15 MiB reason costs
    what a short one does), then redacted, made printable (no ESC, NUL or direction mark) and cut again."""
    try:
        s = v if isinstance(v, str) else "" if v is None else str(v)
    except ValueError:  # an int past Python's digit limit
        s = "(a number too long to show)"
    return status.printable(redact(s[:limit * READ_CHARS + 256]), limit)


def bound(v, depth: int = 8):
    """A record as the view may walk it: each list cut to its last ENTRIES, each dict to its first ENTRIES keys,
    each text to TEXT characters, nested at most `depth` deep. A record is at most 16 MiB (records.MAX_BYTES);
    what is drawn from it is far less, and this costs what the drawing then uses, not what was planted."""
    if isinstance(v, str):
        return v[:TEXT]
    if depth <= 0:
        return None
    if isinstance(v, list):
        return [bound(x, depth - 1) for x in v[-ENTRIES:]]
    if isinstance(v, dict):
        return {k: bound(x, depth - 1) for k, x in list(v.items())[:ENTRIES]}
    return v


def _last(v) -> list:
    return v[-ENTRIES:] if isinstance(v, list) else []


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    rate = (last_step - first_step) / (last_t - first_t) * 60.0
    return rate if math.isfinite(rate) else None


def step_times(points: list, starts: list[float]) -> list[tuple[int, float]]:
    """(step, seconds per step) between consecutive history lines, over the steps between them; never across a
    start of the trainer (that gap is its restart, not training) nor a step that went back."""
    out = []
    starts = sorted(s for s in _last(starts) if _real(s))
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
        b = min(max(int((step - lo) * per), 0), n - 1)
        count[b] += 1
        steps[b] += step
        total[b] += v
        if v < low[b]:
            low[b] = v
        if v > high[b]:
            high[b] = v
    out = []
    for b, c in enumerate(count):
        if c:
            mean = total[b] / c
            if not math.isfinite(mean):  # the sum of huge values overflowed: the middle of the band instead
                mean = low[b] / 2 + high[b] / 2
            out.append((steps[b] / c, low[b], high[b], mean))
    return out


def _frac(v: float, lo: float, hi: float) -> float:
    """Where v lies between lo and hi, as 0..1, whatever the three are (halved first: hi - lo may overflow)."""
    d = hi / 2 - lo / 2
    if not d > 0:
        return 0.5
    f = (v / 2 - lo / 2) / d
    return 0.5 if f != f else 0.0 if f < 0 else 1.0 if f > 1 else f


def step_at(times: list, points: list, t: float) -> int | None:
    """The last step recorded at or before time t (the step a restart or a failure came after)."""
    i = bisect.bisect_right(times, t)
    return points[i - 1][0] if i else None


def marks(data: dict) -> list[tuple[int, str, str]]:
    """(step, kind, words) of the trainer's starts, ends and the watchdog's actions, on the step axis: from the loop
    bound's record, the trainer's last end and the watchdog's record. kind: fail | restart | stop. Words are
    raw: the caller redacts and cuts them."""
    points, loop, st = data["history"], data["loop"], data["st"]
    times = [p[1] for p in points]
    out: list[tuple[int, str, str]] = []
    for t in _last(loop.get("started")):
        if _real(t) and (step := step_at(times, points, t)) is not None:
            out.append((step, "restart", "the trainer started again"))
    for e in _last(loop.get("ends")):
        if not isinstance(e, dict):
            continue
        step = e.get("step") if isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool) else \
            step_at(times, points, e.get("time")) if _real(e.get("time")) else None
        if step is None:
            continue
        kind = ending.kind(e.get("by"))
        out.append((step, "fail" if kind.family in (ending.FAILURE, ending.FINAL) else "stop",
                    f"{kind.words}" + (f": {clip(e['what'])}" if e.get("what") else "")))
    end = ending.of(st["trainer"].get("stopped"))
    if end is not None and isinstance(end.step, int) and end.family in (ending.FAILURE, ending.FINAL, ending.STOP):
        out.append((end.step, "fail" if end.family != ending.STOP else "stop", clip(end.words())))
    for a in _last(st.get("watchdog")):
        if isinstance(a, dict) and _real(a.get("time")) and (step := step_at(times, points, a["time"])) is not None:
            out.append((step, "fail", f"the watchdog: {clip(a.get('action'), 40)} {clip(a.get('program'), 40)}: "
                                      f"{clip(a.get('reason'))}"))
    seen, unique = set(), []
    for m in out:  # the loop bound's end and the trainer's own record of it are one end
        if m[:2] not in seen:
            seen.add(m[:2])
            unique.append(m)
    return sorted(unique, key=lambda m: m[0])[-MARKS:]


# -- drawing ----------------------------------------------------------------------------------------------------------
def _num(v) -> str:
    """A figure in at most ten characters, whatever it is (NaN and the infinities by name: a diverged loss)."""
    if not _real(v):
        return "-"
    try:
        v = float(v)
    except OverflowError:
        return "huge"
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if 1000 <= a < 1e6:
        return f"{v:.0f}"
    if 0.0001 <= a < 1000 or a == 0:  # "0.005", not "5.00e-03": a start-up phase of 5 ms reads as one
        return f"{v:.3g}" if a >= 0.001 else f"{v:.1g}"
    return f"{v:.2e}"


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
    if unit == "s" and len(pts) > 10:  # a step time's spikes (a checkpoint, a slow rollout) must not flatten the rest
        means = sorted(p[3] for p in pts)
        ymax = min(ymax, means[int(len(means) * 0.98)] * 2.0)

    def x(step: float) -> float:
        return left + _frac(step, lo, hi) * w

    def y(v: float) -> float:
        return top + h - _frac(v, ymin, ymax) * h

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
                       f"<title>step {step}: {esc(clip(words, 300))}</title></line>")
    out += [f'<text x="{left}" y="11" font-size="11" fill="#57606a">{esc(_num(ymax))}{unit}</text>',
            f'<text x="{left}" y="{top + h - 3}" font-size="11" fill="#57606a">{esc(_num(ymin))}{unit}</text>',
            f'<text x="{left}" y="{HEIGHT - 3}" font-size="11" fill="#57606a">step {lo}</text>',
            f'<text x="{left + w}" y="{HEIGHT - 3}" font-size="11" fill="#57606a" text-anchor="end">step {hi}</text>',
            "</svg>"]
    return "\n".join(out)


def startup_bars(t: dict) -> str:
    """The start-up timeline as bars by phase, each from where the one before it ended (status's `startup`)."""
    def sane(v) -> bool:
        return _real(v) and math.isfinite(v) and abs(v) < 1e12

    phases = [p for p in _last(t.get("phases")) if isinstance(p, dict) and sane(p.get("took_s"))
              and p["took_s"] >= 0 and sane(p.get("at"))][:40]
    boot = t.get("boot")
    if not phases or not sane(boot):
        return ""
    end = max(p["at"] for p in phases)
    total = max(end - boot, 0.001)
    row, label_w = 20, 118
    w = WIDTH - label_w - 40
    slow = max(p["took_s"] for p in phases)
    out = [f'<svg viewBox="0 0 {WIDTH} {row * len(phases) + 6}" role="img" '
           f'aria-label="start-up: {len(phases)} phases, {_num(total)} s">']
    for i, p in enumerate(phases):
        x0 = label_w + _frac(p["at"] - p["took_s"] - boot, 0, total) * w
        bw = max(_frac(p["took_s"], 0, total) * w, 1.5)
        y = 3 + i * row
        took = f"{_num(round(p['took_s']))}s" if p.get("whole_s") else f"{_num(p['took_s'])}s"
        name = clip(str(p.get("phase")).replace("_", " "), 40)
        out.append(f'<text x="4" y="{y + 13}" font-size="12">{esc(name)}</text>'
                   f'<rect class="bar{" slow" if p["took_s"] == slow and slow > 0 else ""}" x="{x0:.1f}" y="{y + 2}" '
                   f'width="{bw:.1f}" height="{row - 6}"><title>{esc(name)}: {esc(took)}</title></rect>'
                   f'<text x="{x0 + bw + 4:.1f}" y="{y + 13}" font-size="11" fill="#57606a">{esc(took)}</text>')
    out.append("</svg>")
    return "\n".join(out)


# -- words for times and money ------------------------------------------------------------------------------------
def _ago(t, now: float) -> str:
    if not _real(t) or not math.isfinite(t):
        return "never"
    return f"{_span(now - t)} ago" if now >= t else f"in {_span(t - now)}"


def _span(s) -> str:
    if not _real(s) or s != s:
        return "?"
    if s >= 100 * 365 * 86400:
        return "over 100 years"
    s = int(max(s, 0))
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def _utc(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if _real(t) else "-"
    except (OverflowError, OSError, ValueError):  # past the calendar's end
        return "-"


def _usd(v) -> str:
    if not _real(v) or not math.isfinite(v):
        return "?"
    return f"${v:,.2f}" if abs(v) < 1e12 else f"${v:.3g}"


_WORDS = {"training": "ok", "finished": "ok", "safe-mode": "bad", "cannot-train": "bad", "not-running": "warn"}


def state_of(st: dict) -> tuple[str, str]:
    """The run in a word or three, and its colour (ok | warn | bad): the standing status.collect judged."""
    s = st.get("standing") or {}
    run, sv = s.get("run"), st["supervisord"]
    if run == "unknown" and not sv.get("reachable"):
        return ("not running", "warn") if not sv.get("socket") else ("not answering", "bad")
    if run == "cannot-train":
        last = s.get("last") or {}
        return ("stopped for good" if last.get("this_run") and last.get("family") == ending.FINAL
                else "cannot train"), "bad"
    return clip(str(run or "starting").replace("-", " "), 40), _WORDS.get(run, "warn")


# -- the panels: each a function of the model, drawn on its own -----------------------------------------------------
class View:
    """What the panels share, worked out once from the model: the run's state, its pace and its marks."""

    def __init__(self, data: dict, redact) -> None:
        self.data, self.redact = data, redact
        self.st, self.now, self.points = data["st"], data["now"], data["history"]
        self.t = self.st["trainer"]
        try:
            self.word, self.colour = state_of(self.st)
        except Exception:  # noqa: BLE001 - a state record of the wrong shape: the panels still draw
            self.word, self.colour = "unknown", "warn"
        try:
            self.rate = pace(self.points, self.now)
        except Exception:  # noqa: BLE001 - the pace is one figure among many
            self.rate = None

    def said(self, v, limit: int = 600) -> str:
        return esc(clip(v, limit, self.redact))

    def name(self) -> str:
        code = self.t.get("code") if isinstance(self.t.get("code"), dict) else {}
        return self.t.get("run") or code.get("entry") or Path(str(self.st.get("workspace") or "run")).name


def head(v: View) -> str:
    code = v.t.get("code") if isinstance(v.t.get("code"), dict) else {}
    sync = v.st.get("sync") if isinstance(v.st.get("sync"), dict) else {}
    commit = str(code.get("commit") or sync.get("new") or "")
    return (f'<h1>{v.said(v.name(), 120)} <span class="state {v.colour}">{esc(v.word)}</span></h1>'
            f'<p class="muted">{v.said(v.t.get("kind") or "", 40)} trainer'
            + (f", {v.said(code['entry'], 200)}" if code.get("entry") else "")
            + (f" at {v.said(commit[:12], 12)}" if commit else "") + (" (uncommitted changes)" if code.get("dirty") else "")
            + f"; read {time.strftime('%H:%M:%S UTC', time.gmtime(v.now))}, again every {REFRESH_S} s</p>")


def facts(v: View) -> str:
    t, step, total, rate, now = v.t, v.t.get("step"), v.data.get("total_steps") or 0, v.rate, v.now
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    rows = [("step", (f"{step} of {total}" if total else f"{step}") if step is not None else "none yet")]
    if rate:
        rows.append(("pace", f"{_num(rate)} steps/min"))
    if total and step is not None and rate and step < total and v.word == "training":
        left = (total - step) / rate * 60
        rows.append(("the end", f"in {_span(left)} at this pace ({_utc(now + left)})"))
    elif not total:
        rows.append(("the end", "no step limit (trainer.max_steps 0): the script's own"))
    rows += [("last step", _ago(t.get("last_progress"), now)),
             ("checkpoint", f"step {clip(t['checkpoint_step'], 40)}" if t.get("checkpoint_step") else "none"),
             ("inference", clip((v.st.get("inference") or {}).get("phase"), 40)),
             *((k, _num(t[k])) for k in ("reward", "loss") if _real(t.get(k)))]
    if v.data.get("health") is not None or v.st["supervisord"].get("reachable"):
        rows.append(("health", v.data["health"] or "healthy"))
    d = v.st.get("durable")
    if isinstance(d, dict) and d:
        rows.append(("off the pod", _durable(d, v.now)))
    cost = v.st.get("cost")
    if isinstance(cost, dict) and cost:
        rows.append(("cost", _cost(cost, v.now)))
    return '<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{v.said(x)}</dd>" for k, x in rows) + "</dl>"


def _durable(d: dict, now: float) -> str:
    """The last durable step and what is at risk since, in standing's one line (the restore and the remote ahead of
    the pod have trouble boxes of their own: said there whole, not cut here)."""
    try:
        return standing.durable_words({**d, "restore": None, "ahead": None}, now)
    except Exception:  # noqa: BLE001 - a record of the wrong shape: what can be said of it
        return f"step {clip(d.get('step'), 40)}"


def _cost(c: dict, now: float) -> str:
    """The spend in costguard's one line: the price, the spend and how sure it is (billed, read, estimated since
    when and why, unknown), the run's with its earlier pods, the end at this pace, and its age."""
    try:
        return ledger.words(c, now)
    except Exception:  # noqa: BLE001 - a record of the wrong shape: what can be said of it
        return f"{_usd(c.get('per_hour'))}/h, spent {_usd(c.get('spent'))}"


def trouble(v: View) -> str:
    """What went wrong, in the user's own words, with the fix."""
    out, st, said = [], v.st, v.said
    sm = st.get("safe_mode")
    if sm:
        out.append(f'<div class="box"><b>safe mode</b> since {esc(_ago(sm.get("since"), v.now))}: '
                   f'{said(sm.get("stage"), 40)}: <span class="quote">{said(sm.get("message"))}</span>'
                   + (f'<p class="fix">fix: {said(sm["hint"])}</p>' if sm.get("hint") else "") + "</div>")
    s = st.get("standing") or {}
    last = s.get("last") or {}
    if last.get("family") in (ending.FAILURE, ending.FINAL):
        out.append(f'<div class="box"><b>the last failure</b>, {esc(_ago(last.get("time"), v.now))}: '
                   f'<span class="quote">{said(last.get("said"))}</span>'
                   + (f'<p class="fix">why: <span class="quote">{said(last["first"])}</span></p>'
                      if last["family"] == ending.FINAL and last.get("first") else "")
                   + (f'<p class="fix">fix: {said(last["fix"])}</p>' if last.get("fix") else "") + "</div>")
    if s.get("run") == "cannot-train" and not (last.get("this_run") and last.get("family") == ending.FINAL):
        out.append(f'<div class="box"><b>it cannot train</b>: {said(s.get("why"))}</div>')
    d = st.get("durable")
    if isinstance(d, dict) and d.get("failing"):
        out.append(f'<div class="box"><b>checkpoints are not reaching the remote</b>: '
                   f'<span class="quote">{said(d["failing"].get("why"))}</span></div>')
    if isinstance(d, dict) and isinstance(d.get("final"), dict):
        out.append(f'<div class="box"><b>the last checkpoint is not off the pod</b>: '
                   f'<span class="quote">{said(standing.final_words(d["final"], v.now))}</span></div>')
    if isinstance(d, dict) and isinstance(d.get("blocked"), dict):
        out.append(f'<div class="box"><b>this pod uploads nothing</b>: '
                   f'<span class="quote">{said(d["blocked"].get("why"))}</span></div>')
    if isinstance(d, dict) and isinstance(d.get("ahead"), dict):
        out.append(f'<div class="box"><b>the remote is ahead of this pod</b>: '
                   f'<span class="quote">{said(standing.ahead_words(d["ahead"]))}</span></div>')
    if isinstance(d, dict) and isinstance(d.get("restore"), dict):
        box = "box" if d["restore"].get("outcome") == "failed" else "box note"
        out.append(f'<div class="{box}"><b>the restore</b>: '
                   f'<span class="quote">{said(standing.restore_words(d["restore"], v.now))}</span></div>')
    loop = v.t.get("loop") or {}
    if loop and not loop.get("gave_up"):
        out.append(f'<div class="box note">the loop bound: {said(loop.get("failures") or 0, 20)} failure(s) in a row '
                   "without a new step" + (f'; the last: <span class="quote">{said(loop["last"])}</span>'
                                          if loop.get("last") else "") + "</div>")
    found = v.data.get("findings")
    if found is None:
        out.append('<p class="muted">doctor is looking; its findings show at the next refresh</p>')
    for f in _last(found)[:10]:
        note = f.get("severity") != "problem"
        evidence = "".join(f"<li>{said(e, 300)}</li>" for e in _last(f.get("evidence"))[:6])
        out.append(f'<div class="box{" note" if note else ""}"><b>{"note" if note else "doctor"}:</b> '
                   f'{said(f.get("title"), 300)}' + (f"<ul>{evidence}</ul>" if evidence else "")
                   + f'<p class="fix">fix: {said(f.get("fix"))}</p></div>')
    return "\n".join(out)


def charts(v: View) -> str:
    """The pictures over the steps, with the restarts and failures marked."""
    points = v.points
    if not points:
        return '<h2>Over the steps</h2><p class="muted">no step recorded yet</p>'
    ms = [(step, kind, clip(words, 300, v.redact)) for step, kind, words in marks(v.data)]
    lo, hi = min(p[0] for p in points), max(p[0] for p in points)
    rewards = [(p[0], p[2]) for p in points if p[2] is not None]
    losses = [(p[0], p[3]) for p in points if p[3] is not None]
    times = step_times(points, v.data["loop"].get("started") or [])
    out = ["<h2>Over the steps</h2>"]
    for title, series, unit, floor in (("reward", rewards, "", None), ("loss", losses, "", None),
                                       ("step time", times, "s", 0.0)):
        if series:
            out.append(f'<p class="muted">{esc(title)}</p>' + chart(title, series, lo, hi, ms, unit, floor))
    if ms:
        out.append('<ul class="marks">' + "".join(f"<li>step {m[0]}: {esc(m[2])}</li>" for m in ms[-8:]) + "</ul>")
    return "\n".join(out)


def startup(v: View) -> str:
    s = v.st.get("startup") if isinstance(v.st.get("startup"), dict) else {}
    bars = startup_bars(s)
    if not bars:
        return ""
    total_s = s.get("total_s")
    return "<h2>Start-up</h2>" + bars + (f'<p class="muted">{_num(total_s)} s from the boot to the first step</p>'
                                         if _real(total_s) else "")


def programs(v: View) -> str:
    out = ["<h2>Programs</h2><table><tr><th>program</th><th>state</th><th>up</th><th>restarts</th><th>pid</th></tr>"]
    for pname, p in sorted(v.st["programs"].items()):
        out.append(f"<tr><td>{v.said(pname, 40)}</td><td>{v.said(p['state'], 40)}</td>"
                   f"<td>{esc(_span(p['uptime_s']) if p.get('uptime_s') else '-')}</td>"
                   f"<td>{v.said(p['restarts'], 20)}</td><td>{v.said(p['pid'] or '-', 20)}</td></tr>")
    out.append("</table>")
    if not v.st["programs"]:
        error = v.st["supervisord"].get("error")
        out.append(f'<p class="muted">supervisord does not answer{": " + v.said(error, 200) if error else ""}</p>')
    return "\n".join(out)


def guards(v: View) -> str:
    """Each cost guard in force (guardfile.report) and its forecast (guards.forecast: when it would stop the pod,
    on what evidence), worked out by the one model every view renders."""
    from podkit.money import guards as table

    rep, st, now = v.data["guards"], v.st, v.now
    gs = rep.get("guards") or {}
    out = ['<h2>Cost guards <span class="muted">(guard.*)</span></h2>']
    if not v.data.get("on_runpod"):
        out.append('<p class="muted">off here: not a RunPod pod (no RUNPOD_POD_ID and RUNPOD_API_KEY)</p>')
    fc = table.forecast(st, gs, now, rate=v.rate, total_steps=v.data.get("total_steps") or 0)
    rows = []
    for key, g in gs.items():
        when = (fc.get(key) or {}).get("words") or str(g.get("shown") or g.get("value"))
        rows.append(f'<tr><td class="key">{v.said(key, 60)}</td><td>{v.said(when, 300)}</td></tr>')
        if g.get("stale"):
            rows.append(f'<tr><td></td><td class="muted">{v.said(g["stale"], 300)}</td></tr>')
    if rows:
        out.append("<table>" + "".join(rows) + "</table>")
    if rep.get("problem"):
        out.append(f'<p class="muted">{v.said(rep["problem"], 300)}</p>')
    return "\n".join(out)


def logs(v: View) -> str:
    out = ["<h2>Last log lines</h2>"]
    for lname, lines in v.data["logs"].items():
        if lines:
            text = "\n".join(status.printable(ln, 10_000)[:LINE_CHARS]
                             for ln in v.redact("\n".join(lines)).split("\n"))
            out.append(f'<p class="muted">{esc(lname)}.log</p><pre>{esc(text)}</pre>')
    return "\n".join(out)


PANELS = (("the heading", head), ("the facts", facts), ("what went wrong", trouble), ("the pictures", charts),
          ("the start-up", startup), ("the programs", programs), ("the cost guards", guards), ("the logs", logs))
_told: dict[str, float] = {}


def panel(name: str, draw, v: View) -> str:
    """One panel, or a note in its place: a record that breaks one drawing leaves the rest of the page whole."""
    try:
        return draw(v)
    except Exception as e:  # noqa: BLE001 - the page never fails because the run's records are odd
        now = time.monotonic()
        if now - _told.get(name, -600.0) >= 600.0:  # once per panel per ten minutes: a refresh every 15 s
            _told[name] = now
            _log.error(f"{name} could not be drawn: {type(e).__name__}: {clip(e, 300)}")
        return f'<div class="box note">{esc(name)} could not be drawn ({esc(type(e).__name__)}); page.log says more</div>'


def render(data: dict, redact=lambda s: s, panels=PANELS) -> str:
    """The page, from `gather`'s model. Record text (a user's exception, a log line, doctor's evidence) is cut,
    redacted, made printable and escaped; podkit's own words are escaped."""
    v = View(data, redact)
    try:
        title = f"{v.said(v.name(), 80)}: {esc(v.word)}"
    except Exception:  # noqa: BLE001 - the name's record of the wrong shape
        title = "podkit"
    return PAGE.substitute(refresh=REFRESH_S, title=title, css=CSS,
                           panels="\n".join(panel(name, draw, v) for name, draw in panels))


def login_page(said: str = "") -> bytes:
    return LOGIN.substitute(css=CSS, said=f'<p class="state bad">{esc(said)}</p>' if said else "").encode()
