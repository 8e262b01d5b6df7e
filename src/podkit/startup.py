"""The start-up timeline: from the boot to the trainer's first step, each phase with when it ended and how
long it took, read from what is already on record (no writer of its own):

- the boot's stages and their durations (boots.json: preflight, reap, sync, setup, render);
- supervisord's start (current.json), and each program's start as supervisord reports it;
- inference's own log lines since its last start, with SGLang's timestamps: weights loaded, CUDA graphs
  captured, ready (the stand-ins print the same lines);
- the trainer's first step (progress.json's first_step_time, written by whichever trainer runs).

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

from podkit import health, records

STAGES = ("preflight", "reap", "sync", "setup", "render")
LOG_PHASES = (("weights_loaded", re.compile(r"Load weight end")),
              ("graphs_captured", re.compile(r"Capture cuda graph end")),
              ("inference_ready", re.compile(r"The server is fired up and ready to roll!")))
# SGLang's line prefix: "[2026-11-25 14:37:48]" or "[2026-11-25 14:37:48 TP0]" (local time)
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?(?: [^\]]*)?\]")


def log_times(path: Path, unread: list[str] | None = None) -> dict[str, float]:
    """When each start-up line of inference's log appeared since its last start (first of each). The log is
    data (a torn write, a planted line): a start-up line whose stamp is not a time is skipped, and said in
    `unread`, never raised."""
    lines = health.tail(path)
    for i in range(len(lines) - 1, -1, -1):
        if health.START_MARK in lines[i]:
            lines = lines[i:]
            break
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
                seen[name] = t
    return seen


def _seconds(v) -> bool:
    """A stage's duration as boots.json holds it: a finite number of seconds, not negative."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e9


def timeline(state_dir: Path, log_dir: Path, program_starts: dict[str, float]) -> dict:
    """{"phases": [{"phase", "at", "took_s"}...] in order, "total_s": boot to first step or None, and, when
    there are any, "unread": the log lines skipped because their time could not be read}."""
    boots = records.BOOTS.read(state_dir)
    boot = boots[-1] if boots else {}
    start = boot.get("time")
    if not isinstance(start, (int, float)):
        return {"phases": [], "total_s": None}
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
    for name, key in (("inference_started", "sglang"), ("trainer_started", "trainer")):
        t = program_starts.get(key)
        if isinstance(t, (int, float)) and t >= start - 1:  # supervisord's start times are whole seconds
            marks.append((name, max(t, at)))
            if key == "sglang":
                inference_at = max(t, at)
    whole = set()
    for name, t in log_times(log_dir / "sglang.log", unread).items():
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
    out = {"phases": phases, "total_s": round(done - start, 3) if done else None, "boot": start}
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
    return f"start-up: {parts}{end}{since}{unread}"


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
