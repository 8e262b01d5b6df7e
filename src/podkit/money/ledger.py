"""The cost record, `<state_dir>/cost.json` (records.COST): the spend ledger the cost meter (costguard.Meter)
writes, read back checked for every reader (status, doctor, the page, notifications, the budget's words), and the
run's id that says whose it is. A reader of money: it imports no enforcer (costguard) and no guard file."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from podkit import records
from podkit.money import spend
from podkit.money.spend import cents, sureness

RUN_ENV = "PODKIT_RUN_ID"  # `podkit deploy` gives each run one; its watch's replacements keep it (run_id())
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{0,64}$")

def run_id(environ=None) -> str:
    """This run's id, the one place it is decided: PODKIT_RUN_ID (`podkit deploy` sets it, and its watch's
    replacements keep it); else on RunPod `pod-<RUNPOD_POD_ID>`: a pod started from the console is a run of
    its own, and RunPod keeps a pod's id across its restarts, so its own guards hold over a restart and an
    earlier pod's on the volume do not; else '' (compose, a local box: the cost guards are off there)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(RUN_ENV, "")
    if raw and RUN_ID.match(raw):
        return raw
    pod = environ.get("RUNPOD_POD_ID", "").strip()
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"pod-{pod}")[:64] if pod else ""


PER_HOUR_MAX = 1000.0  # USD/h: a pod of 8 of RunPod's dearest GPUs costs a few tens; more is not a price
SPENT_MAX = 1e7  # USD
OLD_SOURCES = {"billing": "billed", "estimate": "estimated"}  # cost.json written by podkit before the ledger


def _money(value, limit: float) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= limit
    return float(value) if ok else None  # NaN fails the comparison


def _time(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e11 else None


def checked(rec: dict, future_ok: bool = False) -> dict | None:
    """A cost.json record as spend.advance and the readers take it, or None when it cannot be trusted: a price
    or spend that is not a finite amount from 0 to a bound (an unknown one is None, said by source "unknown"),
    a source not podkit's, a time not a time, or (for readers) read in the future: not a read of this clock's."""
    if not isinstance(rec, dict) or not rec:
        return None
    source = OLD_SOURCES.get(rec.get("source"), rec.get("source"))
    per_hour, spent = _money(rec.get("per_hour"), PER_HOUR_MAX), _money(rec.get("spent"), SPENT_MAX)
    t = _time(rec.get("time"))
    if source not in spend.SOURCES or t is None or (not future_ok and t > time.time() + 300) \
            or (rec.get("per_hour") is not None and per_hour is None) or (spent is None) != (source == "unknown"):
        return None
    started = _time(rec.get("started"))
    text = {k: rec[k][:300] if isinstance(rec.get(k), str) else None for k in ("why", "price_from")}
    ids = {k: rec[k] if isinstance(rec.get(k), str) and len(rec[k]) <= 64 else None
           for k in ("pod", "run", "carried_from")}
    return {"per_hour": per_hour, "spent": spent, "source": source,
            "started": started if started is not None and started <= t + 300 else None, "time": t,
            "projected": _money(rec.get("projected"), SPENT_MAX), **ids,
            "before": _money(rec.get("before"), SPENT_MAX) or 0.0,
            "run_before": _money(rec.get("run_before"), SPENT_MAX) or 0.0,
            "bill": _money(rec.get("bill"), SPENT_MAX), "read_at": _time(rec.get("read_at")),
            "since": _time(rec.get("since")), **text, "carried": spend.carried(rec),
            "looked": _time(rec.get("looked")),
            "start_from": rec.get("start_from") if rec.get("start_from") in ("boot", "runpod") else None,
            "total": spend.checked_total(rec.get("total"))}


def cost(state_dir: Path | None, environ=None) -> dict | None:
    """cost.json, checked (the spend ledger: spend.advance), or None when there is none, it cannot be trusted
    (records.COST's shape sets a corrupt file aside), or it is another run's (a reused volume's, before this pod's
    meter wrote its own: never shown as this run's spend). Fields that are not what they say are dropped to None."""
    c = None if state_dir is None else checked(newest(state_dir))
    return c if c is not None and ours(c, environ) else None


def run_dir_of(state_dir: Path) -> Path | None:
    where = records.CURRENT.read(state_dir).get("run_dir")
    return Path(where) if isinstance(where, str) and where.startswith("/") else None


def newest(state_dir: Path) -> dict:
    """cost.json, or its copy in the run dir (local disk) where that one is newer: written there while the volume
    could not take it, so every view shows the spend the budget acts on."""
    vol = records.COST.read(state_dir)
    run_dir = run_dir_of(state_dir)
    local = records.COST.read_owned(run_dir) if run_dir is not None else {}
    t = lambda r: r.get("time") if isinstance(r.get("time"), (int, float)) else -1  # noqa: E731
    return local if local and t(local) > t(vol) else vol


def ours(c: dict, environ=None) -> bool:
    """Whether ledger `c` is this run's (run_id) or this pod's; off RunPod (no run id), any is."""
    environ = os.environ if environ is None else environ
    run = run_id(environ)
    return not run or c.get("run") == run or not c.get("run") and c.get("pod") == environ.get("RUNPOD_POD_ID")


def words(c: dict, now: float | None = None) -> str:
    """cost() in a line: "$0.35/h, $1.20 spent (billed), ~$3.10 to the end at this pace", and the run's spend
    across its pods when it has others: "; $5.30 this run, over 3 pods (estimated since ...: pod x ...)"."""
    now = time.time() if now is None else now
    price = f"${c['per_hour']:.2f}/h" if c.get("per_hour") else "price unknown"
    out = (f"{price}, {cents(c['spent'])} spent ({sureness(c)})" if c["spent"] is not None
           else f"{price}, spend {sureness(c)}")
    run = c.get("total")
    if run and run.get("parts"):
        out += (f"; {cents(run['spent'])} this run, over {run['pods']} pods ({sureness(run)})" if run["spent"]
                is not None else f"; this run's spend over {run['pods']} pods {sureness(run)}")
    elif c.get("run_before") and c["spent"] is not None:
        out += f"; {cents(c['run_before'] + c['spent'])} this run, with its earlier pods"
    if c.get("projected") is not None:
        out += f", ~{cents(c['projected'])} to the end at this pace"
    if now - c["time"] > 600:  # the reader (the log listener) is not running, or RunPod has not answered
        out += f" (read {(now - c['time']) / 60:.0f} min ago)"
    return out
