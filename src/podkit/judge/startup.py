"""The start-up timeline: from the boot to the trainer's first step, each phase with when it ended and how
long it took, read from what is already on record:

- the boot's stages and their durations (boots.json: preflight, reap, sync, setup, render);
- supervisord's start (current.json), and each program's first start in this boot, from supervisord's own
  log (supervisord.log: every start, to the millisecond);
- inference's own log lines of that first start, with SGLang's timestamps: weights loaded, CUDA graphs
  captured, ready (the stand-ins print the same lines);
- the trainer's first step (progress.json's first_step_time, written by whichever trainer runs).

The timeline is the boot's (inference's log phases are kept in startup.json once seen: its log scrolls and
rotates): a later restart (`podkit ctl restart sglang`, the watchdog's, a crash) never moves
a phase; it is an event on it ("events": when, and who asked, from ending.ASKED).

`podkit status` shows it, /metrics exports it (podkit_startup_phase_seconds), the bundle carries it in
status.json, and doctor names the slowest phase of a slow start with the cache that was cold.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from datetime import datetime
from pathlib import Path

from podkit import records
from podkit.judge import ending, health

STAGES = ("preflight", "reap", "sync", "setup", "restore", "render")
LOG_PHASES = (("weights_loaded", re.compile(r"Load weight end")),
              ("graphs_captured", re.compile(r"Capture cuda graph end")),
              ("inference_ready", re.compile(r"The server is fired up and ready to roll!")))
# SGLang's line prefix: "[2026-11-25 14:37:48]" or "[2026-11-25 14:37:48 TP0]" (local time)
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?(?: [^\]]*)?\]")
START_PID = re.compile(re.escape(health.START_MARK) + r"\S+ \(pid (\d+)\)")
# supervisord's own log (supervisor 4, loggers.py and process.py), local time to the millisecond:
# "2026-11-28 14:05:12,123 INFO spawned: 'sglang' with pid 812", "... WARN exited: sglang (exit status 1; not
# expected)", "... INFO stopped: sglang (terminated by SIGTERM)"
SUPERVISORD_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) [A-Z]+ "
                              r"(?:spawned: '([^']+)' with pid (\d+)|(exited|stopped): (\S+) \((.{0,200})\))$")
PROGRAM_WORD = {"sglang": "inference", "trainer": "trainer"}  # the programs on the timeline, by their phase name


def log_times(path: Path, unread: list[str] | None = None, pid: int | None = None,
              since: float | None = None) -> dict[str, float]:
    """When each start-up line of inference's log appeared in the run of `pid` (by its start line), or since its
    last start when no pid is given (first of each), not before `since`. The log is data (a torn write, a planted
    line): a start-up line whose stamp is not a time is skipped, and said in `unread`, never raised."""
    lines = health.tail(path)
    if pid is None:
        for i in range(len(lines) - 1, -1, -1):
            if health.START_MARK in lines[i]:
                lines = lines[i:]
                break
    else:  # each run of that pid (an earlier boot's run with the same pid has older stamps: see timeline)
        mine, its = [], False
        for line in lines:
            if health.START_MARK in line:
                m = START_PID.search(line)
                its = bool(m) and int(m.group(1)) == pid
            elif its:
                mine.append(line)
        lines = mine
    seen: dict[str, float] = {}
    ahead = time.time() + records.FUTURE_SKEW_S
    for line in lines:
        m = STAMP.match(line)
        if not m:
            continue
        for name, pattern in LOG_PHASES:
            if name not in seen and pattern.search(line):
                try:  # local time, as SGLang writes it
                    t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                    if t > ahead:
                        raise ValueError("a day or more in the future")
                except (ValueError, OverflowError, OSError) as e:
                    if unread is not None and len(unread) < 3:
                        unread.append(f"{path.name}: {line[:120]!r} ({e})")
                    continue
                if since is not None and t < since:
                    continue  # an earlier boot's run, by the same pid
                seen[name] = t
    return seen


def _seconds(v) -> bool:
    """A stage's duration as boots.json holds it: a finite number of seconds, not negative."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e9


def _local(stamp: str) -> float | None:
    try:
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
    except (ValueError, OverflowError, OSError):
        return None


def runs(log_dir: Path, since: float) -> dict[str, list[dict]]:
    """Each start of each program since `since`, from supervisord's log: [{"at", "pid", "ended"}] in order,
    "ended" being how that run ended as supervisord said it ("exited: exit status 1; not expected"), or absent.
    A line that does not parse is not a start (the log is data)."""
    out: dict[str, list[dict]] = {}
    for line in health.tail(log_dir / "supervisord.log", 1 << 20):
        m = SUPERVISORD_LINE.match(line)
        t = _local(m.group(1)) if m else None
        if t is None or (t := t + int(m.group(2)) / 1000) < since - 1:  # the boot's second: see timeline
            continue
        if m.group(3):
            out.setdefault(m.group(3), []).append({"at": t, "pid": int(m.group(4))})
        elif out.get(m.group(6)) and "ended" not in out[m.group(6)][-1]:
            out[m.group(6)][-1]["ended"] = f"{m.group(5)}: {m.group(7)}"
    return out


def asker(asks: list, program: str, after: float, before: float) -> str:
    """Who asked for the stop that ended a run started at `after` and was followed by a start at `before`: the
    last ask (ending.ASKED) for that program, or for all, made in between; "" when nobody asked (it crashed, a
    kill from outside). An ask before `after` was for the run before."""
    found = [a for a in asks if isinstance(a, dict) and a.get("program") in (program, "all")
             and isinstance(a.get("time"), (int, float)) and after - 1 <= a["time"] <= before]
    return str(max(found, key=lambda a: a["time"]).get("by") or "")[:200] if found else ""


def by_you(asked: str) -> bool:
    """A stop the user asked for (podkit ctl, podkit resume, a signal to podkit up): ending.ask's "you (...)"."""
    return asked.startswith("you ")


def restarts(program_runs: dict[str, list[dict]], asks: list, boot: float) -> list[dict]:
    """Every start after a program's first in this boot, as an event on the timeline: when (and how long after
    the boot), who asked for the stop before it, and how supervisord said the run before ended."""
    out = []
    for name, word in PROGRAM_WORD.items():
        seen = program_runs.get(name) or []
        for before, run in zip(seen, seen[1:], strict=False):
            who = asker(asks, name, before["at"], run["at"])
            ev = {"event": f"{word}_restarted", "program": name, "at": round(run["at"], 3),
                  "after_s": round(max(0.0, run["at"] - boot), 3), "asked": who, "by_you": by_you(who)}
            if before.get("ended"):
                ev["ended"] = before["ended"]
            out.append(ev)
    return sorted(out, key=lambda e: e["at"])


# The log phases of this boot's first run of inference, kept once seen: its lines scroll out of the tail read
# (256 KiB, minutes of a busy server's lines) and rotate away, and the boot's phases must not go with them.
# Written by whichever reader of the timeline sees a phase first (status, /metrics, the page, doctor).
KEPT = records.STARTUP


def keep(state_dir: Path, boot: float, seen: dict[str, float]) -> dict[str, float]:
    """`seen` with what was kept for this boot (the kept time wins: it was read first); keeps what is new.
    The record is data: a time that is not this boot's is ignored. Never raises: status must not fail on a
    read-only volume."""
    rec = KEPT.read(state_dir)
    ahead = time.time() + records.FUTURE_SKEW_S
    kept = {n: float(t) for n, t in (rec.get("phases") or {}).items()
            if rec.get("boot") == boot and n in dict(LOG_PHASES) and isinstance(t, (int, float))
            and not isinstance(t, bool) and math.isfinite(t) and boot - 1 <= t <= ahead}
    out = {**seen, **kept}
    if set(out) - set(kept):
        try:
            KEPT.write(state_dir, {"boot": boot, "phases": out})
        except OSError:
            pass
    return out


def timeline(state_dir: Path, log_dir: Path, program_starts: dict[str, float], restarted=()) -> dict:
    """{"phases": [{"phase", "at", "took_s"}...] in order, "total_s": boot to first step or None, "events": the
    restarts since (restarts()), and, when there are any, "unread": the log lines skipped because their time
    could not be read}. Each program's start is its first in this boot (supervisord's log); without that log,
    `program_starts` (supervisord's word on the running process) counts only for a program not in `restarted`,
    and inference's log phases are its last run's only while it has not restarted."""
    boots = records.BOOTS.read(state_dir)
    boot = boots[-1] if boots else {}
    start = boot.get("time")
    if not isinstance(start, (int, float)):
        return {"phases": [], "total_s": None, "events": []}
    marks: list[tuple[str, float]] = []
    unread: list[str] = []
    at = start
    took_s = boot.get("took_s") or {}
    for name in STAGES:
        took = took_s.get(name)
        if _seconds(took):
            at += took
            marks.append((name, at))
    current = records.CURRENT.read(state_dir)
    if isinstance(current.get("started"), (int, float)) and current["started"] >= start:
        marks.append(("supervisord", current["started"]))
        at = current["started"]
    inference_at = at
    program_runs = runs(log_dir, start)
    firsts = {n: r[0]["at"] for n, r in program_runs.items() if r}
    firsts.update({n: t for n, t in program_starts.items() if n not in firsts and n not in restarted})
    for name, key in (("inference_started", "sglang"), ("trainer_started", "trainer")):
        t = firsts.get(key)
        if isinstance(t, (int, float)) and t >= start - 1:  # supervisord's start times are whole seconds
            marks.append((name, max(t, at)))
            if key == "sglang":
                inference_at = max(t, at)
    whole = set()
    # Its first run's lines, by the pid supervisord spawned; without supervisord's log, its last run's, and none
    # once it has restarted (they are a restart's, not the boot's)
    first_pid = (program_runs.get("sglang") or [{}])[0].get("pid")
    seen = {} if first_pid is None and "sglang" in restarted else \
        log_times(log_dir / "sglang.log", unread, first_pid, since=start - 1)
    seen = keep(state_dir, start, seen)
    for name, t in seen.items():
        # The log's stamps are whole seconds: a line from the boot's first second would sort before the
        # stages that ran before inference could print it, so it is never placed before inference's start
        if t >= start - 1:
            marks.append((name, max(t, inference_at)))
            whole.add(name)
    progress = records.PROGRESS.read(state_dir)
    first = progress.get("first_step_time")
    if isinstance(first, (int, float)) and first >= start:
        marks.append(("first_step", first))
    marks.sort(key=lambda m: m[1])
    phases, before = [], start
    for name, t in marks:
        phase = {"phase": name, "at": round(t, 3), "took_s": round(max(0.0, t - before), 3)}
        if name in whole:
            phase["whole_s"] = True  # read from a whole-second stamp: no tenths to show
        phases.append(phase)
        before = max(before, t)
    done = next((p["at"] for p in phases if p["phase"] == "first_step"), None)
    run_dir = current.get("run_dir")
    asks = ending.ASKED.read_owned(Path(run_dir)) if isinstance(run_dir, str) and run_dir else []
    out = {"phases": phases, "total_s": round(done - start, 3) if done else None, "boot": start,
           "events": restarts(program_runs, asks, start)}
    ra = progress.get("reattach") or {}
    if ra.get("count") or ra.get("fell_back"):
        # After the start-up, inference restarts the trainer went on through: not trainer restarts
        out["reattached"], out["fell_back"] = ra.get("count") or 0, ra.get("fell_back") or 0
    return {**out, "unread": unread} if unread else out


def _took(p: dict) -> str:
    """A phase's duration as precisely as it was measured: inference's log stamps are whole seconds."""
    if p.get("whole_s"):
        return "<1s" if p["took_s"] < 1 else f"{p['took_s']:.0f}s"
    return f"{p['took_s']:.1f}s"


def describe(t: dict) -> str:
    if not t.get("phases"):
        return "start-up: no boot on record"
    parts = ", ".join(f"{p['phase'].replace('_', ' ')} +{_took(p)}" for p in t["phases"])
    end = f"; {t['total_s']:.0f}s from boot to the first step" if t.get("total_s") is not None else \
        "; no first step yet"
    unread = "".join(f"; could not read {u}" for u in t.get("unread") or ())
    since = ""
    if t.get("reattached") or t.get("fell_back"):
        since = f"; since: inference restarted {t['reattached']} time(s) without a trainer restart"
        since += f", {t['fell_back']} with one" if t.get("fell_back") else ""
    events = [e for e in t.get("events") or () if isinstance(e, dict)]
    if events:
        shown = "; ".join(event_words(e) for e in events[-SHOW_EVENTS:])
        more = f" ({len(events) - SHOW_EVENTS} earlier)" if len(events) > SHOW_EVENTS else ""
        since += f"\n  restarts since the start-up{more}: {shown}"
    return f"start-up: {parts}{end}{since}{unread}"


SHOW_EVENTS = 5  # the last restarts status shows (all are in --json)


def _after(s: float) -> str:
    return f"{s:.0f}s" if s < 90 else f"{s / 60:.0f}m" if s < 5400 else f"{s / 3600:.1f}h"


def event_words(e: dict) -> str:
    """"inference restarted at +5.0h (asked by you: podkit ctl restart sglang)". The asker's words are data
    (a file on disk): only printable characters reach the terminal."""
    def clean(v) -> str:
        return "".join(c if c.isprintable() else "?" for c in str(v or ""))[:200]

    who = clean(e.get("asked"))
    if who.startswith("you (") and who.endswith(")"):
        who = "you: " + who[5:-1]
    why = f"asked by {who}" if who else "nobody asked for it" + (f"; {clean(e['ended'])}" if e.get("ended") else "")
    after = e.get("after_s")
    when = f" at +{_after(after)}" if isinstance(after, (int, float)) and not isinstance(after, bool) else ""
    return f"{clean(e.get('event')).replace('_', ' ')}{when} ({why})"


# Which cache or download a slow phase points at (doctor): phase -> (what, directories under the workspace)
COLD = {"weights_loaded": ("the model's weights (downloaded at start when the HF cache on the volume is cold)",
                           ("hf",)),
        "graphs_captured": ("CUDA graph capture and kernel compiles (FlashInfer JIT, SGLang's piecewise graphs)",
                            ("cache/flashinfer", "cache/sglang", "cache/tvm-ffi")),
        "inference_ready": ("SGLang's warm-up", ()),
        "first_step": ("the trainer's first step (torch.compile: inductor and Triton caches)",
                       ("cache/inductor", "cache/triton")),
        "sync": ("the repo's clone or fetch", ()), "setup": ("the repo's setup command (a venv on the volume)", ())}


def cold_caches(workspace: Path, dirs: tuple[str, ...], boot: float) -> list[str]:
    """The cache directories that were empty or made during this boot: what a warm volume would have had."""
    out = []
    for d in dirs:
        p = workspace / d
        try:
            warm = any(c.lstat().st_mtime < boot - 1 for c in itertools.islice(p.iterdir(), 1000))
        except OSError:
            warm = False
        if not warm:
            out.append(str(p))
    return out
