"""The cost guards as one table: one row per guard (guard.<key>, whose setting is settings.py's Field), with how
`podkit guard set` reads a value, how a value is said, which of them the log listener's Deadline enforces (and
its words), and its forecast: when it would stop the pod, on what evidence, worked out once for every view
(status, the page). config checks the values, guardfile keeps `podkit guard set`'s, costguard enforces them and
the CLI's help lists them from here: a new guard is a row here and a Field in settings.py."""

from __future__ import annotations

import re
import time

from podkit import config, settings
from podkit.errors import ConfigError
from podkit.money import spend

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class Guard:
    """One guard: its key; `example` (`podkit guard set`'s hint and help); `parse(text, now)` for a value given on
    the command line (None: as the config reads it); `show(value, now)`; `enforced`: (the stop's thread, who asks
    for the trainer's stop, what a change that calls it off is called) for a line the listener's Deadline
    crosses, else None; `forecast(value, ctx)`: {"at", "words", "on"}."""

    __slots__ = ("key", "example", "help", "parse", "show", "enforced", "forecast")

    def __init__(self, key, example, help_, parse, show, enforced, forecast) -> None:
        self.key, self.example, self.help, self.parse, self.show = key, example, help_, parse, show
        self.enforced, self.forecast = enforced, forecast


def _span(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _when(t: float, now: float) -> str:
    return f"in {_span(t - now)}" if t >= now else f"{_span(now - t)} ago"


def _duration(name: str, t: str) -> float:
    m = DURATION.match(t)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError("command line", name, f"'+{t}' is not a duration from now",
                          hint="e.g. +90m, +6h, +2d or +3600 (s); or a Unix time; 0: no maximum run time")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def _check(key: str, value, from_env: bool = True):
    return config.check("guard", key, value, "command line", from_env=from_env)


# -- stop_pod_at: the maximum run time ---------------------------------------------------------------------------
def _parse_at(text: str, now: float):
    t = text.strip().lower()
    if t.startswith("+"):
        return _check("stop_pod_at", now + _duration("guard.stop_pod_at", t[1:]), from_env=False)
    return 0.0 if t in ("none", "never", "off") else _check("stop_pod_at", text)


def _show_at(value, now: float) -> str:
    if not value:
        return "0 (no maximum run time)"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(value))} ({_when(value, now)})"


def _forecast_at(at, ctx: dict) -> dict:
    return {"at": at or None, "on": "guard.stop_pod_at",
            "words": f"at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(at))}, {_when(at, ctx['now'])}"
            if at else "no maximum run time"}


# -- stop_pod_when_finished ---------------------------------------------------------------------------------------
def _forecast_finished(value, ctx: dict) -> dict:
    step, total, rate, now = (ctx["st"].get("trainer") or {}).get("step"), ctx["total_steps"], ctx["rate"], ctx["now"]
    left = (total - step) / rate * 60 if total and isinstance(step, int) and rate and step < total else None
    return {"at": now + left if left is not None and value == "auto" else None,
            "on": "the trainer's pace" if left is not None else "the trainer's end",
            "words": "never" if value != "auto" else "when training finishes" + (
                f" (step {total}; at this pace {_when(now + left, now)})" if left is not None else "")}


# -- stop_pod_after_s: unable to train ---------------------------------------------------------------------------
def _parse_after(text: str, now: float):
    m = DURATION.match(text.strip().lower())
    return _check("stop_pod_after_s", float(m.group(1)) * UNIT_S[m.group(2)], from_env=False) if m else \
        _check("stop_pod_after_s", text)


def _show_after(value, now: float) -> str:
    return f"{config._format(value)} s" + (" (never)" if not value else "")


def sooner(after: float, at: float, since: float, how: str = "") -> tuple[float, str]:
    """How long from `since` until the pod stops, and which setting says so: the sooner of
    guard.stop_pod_after_s and guard.stop_pod_at (deploy's maximum run time); 0: never."""
    if at and (not after or at - since < after):
        return max(at - since, 0.001), f"guard.stop_pod_at, the maximum run time{how}"
    return after, f"guard.stop_pod_after_s{how}"


def unable_since(st: dict) -> tuple[float | None, str]:
    """(since when, why) the pod cannot train now: the standing status.collect judged (standing.py), rendered;
    (None, "") when it can."""
    from podkit.judge import standing

    s = st.get("standing") or {}
    since = s.get("since") if isinstance(s.get("since"), (int, float)) else None
    if s.get("run") == standing.SAFE_MODE:
        return since, "in safe mode"
    if s.get("stuck") is True or s.get("run") == standing.CANNOT:  # what the listener's cost guard counts
        return since, str(s.get("why") or "it cannot train")
    return None, ""


def _forecast_after(after, ctx: dict) -> dict:
    st, now, at = ctx["st"], ctx["now"], ctx["values"].get("stop_pod_at") or 0
    after = after or 0
    since, why = unable_since(st)
    base = f"after {_span(after)} not training (safe mode, a program FATAL, a trainer nothing will start)"
    f = {"at": None, "on": why or "the pod trains", "words": base if after else "never"}
    if after and why:
        if isinstance(since, (int, float)) and since == since and abs(since) != float("inf"):
            left, how = sooner(after, at, since)
            f.update(at=since + left, words=f"{base}: {why} since {_when(since, now)}, so {_when(since + left, now)}"
                     f" ({how})")
        else:
            f.update(at=now + after, words=f"{base}: now {why}, so within {_span(after)}")
    return f


# -- max_spend: the budget ----------------------------------------------------------------------------------------
def _parse_budget(text: str, now: float):
    return _check("max_spend", text.strip().removeprefix("$"))


def _show_budget(value, now: float) -> str:
    return spend.usd(value) if value else "0 (no budget)"  # as set: $0.000000001 is not "$0.00"


def _forecast_budget(budget, ctx: dict) -> dict:
    now, c = ctx["now"], ctx["st"].get("cost") if isinstance(ctx["st"].get("cost"), dict) else None
    total = spend.total(c)
    sure = spend.total_sureness(c) if c else "no cost.json"
    # the run's pace: this pod's price and its other running pods' (a cluster's nodes)
    rate = (c.get("total") or {}).get("per_hour") or c.get("per_hour") if c else None
    f = {"at": None, "on": sure, "words": "no budget"}
    if budget:
        f["words"] = f"once the run has cost {spend.usd(budget)}"
        if ctx["st"].get("safe_mode"):  # no trainer to stop and no cost meter reading the spend
            f.update(on="safe mode", words=f"{f['words']}: not in safe mode, where nothing reads the spend (safe "
                     "mode stops the pod by guard.stop_pod_after_s and guard.stop_pod_at)")
        elif total is None:
            f["words"] += ": what it has spent is not known, so the budget cannot act" if c else \
                ": no spend read yet (the log listener reads RunPod's price), so the budget cannot act yet"
        elif total >= budget:
            f.update(at=now, words=f"{f['words']}: it has spent {spend.cents(total)} ({sure}): now")
        else:
            f["words"] += f": {spend.cents(total)} so far ({sure})"
            if rate:
                f["at"] = now + (budget - total) / rate * 3600
                f["words"] += f", at {spend.cents(rate)}/h {_when(f['at'], now)}"
    return f


TABLE: dict[str, Guard] = {g.key: g for g in (
    Guard("stop_pod_at", "stop_pod_at=+6h", "+6h, a Unix time, 0", _parse_at, _show_at,
          ("max-runtime", "the maximum run time (guard.stop_pod_at)", "moved"), _forecast_at),
    Guard("stop_pod_when_finished", "stop_pod_when_finished=never", "auto, never", None, lambda v, now: str(v), None,
          _forecast_finished),
    Guard("stop_pod_after_s", "stop_pod_after_s=2h", "2h, seconds, 0", _parse_after, _show_after, None,
          _forecast_after),
    Guard("max_spend", "max_spend=25", "USD, 0", _parse_budget, _show_budget,
          ("max-spend", "the budget (guard.max_spend)", "was raised"), _forecast_budget),
)}
KEYS = tuple(TABLE)
EXAMPLES = " | ".join(g.example for g in TABLE.values())
HELP = ", ".join(f"{k} ({g.help})" for k, g in TABLE.items())


def parse(key: str, text: str, now: float) -> object:
    """A value given on the command line, checked as the config checks it (its row's reading first: durations,
    "+6h", "$25")."""
    if key not in TABLE:
        spec = settings.SCHEMA["guard"].get(key)
        hint = (f"guard.{key} is read when the pod boots: set it in the pod config or env (a restart)" if spec
                else config._did_you_mean(key, KEYS) or f"one of {', '.join(KEYS)}")
        raise ConfigError("command line", f"guard.{key}", "not a guard that changes on a running pod", hint=hint)
    g = TABLE[key]
    return g.parse(text, now) if g.parse else _check(key, text)


def show(key: str, value, now: float | None = None) -> str:
    return TABLE[key].show(value, time.time() if now is None else now) if key in TABLE else str(value)


def forecast(st: dict, guards: dict, now: float, rate: float | None = None, total_steps: int = 0) -> dict:
    """Each guard's forecast, worked out once for every view: {key: {"at": when it would stop the pod (a Unix
    time; None: not on what is known now), "words": that in a line, "on": the evidence}}. `guards`:
    guardfile.report's guards; `rate`: steps per minute, where the view knows the pace."""
    values = {k: (g or {}).get("value") for k, g in guards.items()}
    ctx = {"st": st, "now": now, "rate": rate, "total_steps": total_steps, "values": values}
    return {k: TABLE[k].forecast(v, ctx) for k, v in values.items() if k in TABLE}
