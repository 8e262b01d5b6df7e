"""What a pod has cost, as an integral over time, and how sure that is: the cost meter's one rule.

`advance(ledger, look)` is a pure function (no I/O, no clock): the ledger after one look at RunPod. The cost
meter (costguard.Meter) makes the looks and keeps the ledger in cost.json; the budget, status, doctor, the page
and the notifications read it. Its rules, each an invariant tests/test_spend.py checks over generated looks:

- Spend grows by the price in force over each interval: the price a read saw is what the pod cost from that read
  to the next, so a price change never re-prices the past (RunPod's `cost` is the price now, not an average).
- The spend never goes down, and once known never becomes unknown: a bill that stops answering, a read that
  fails, a clock stepped back (an interval is never negative) lose nothing.
- A read that fails extrapolates at the last price, "estimated since" the last good read.
- RunPod's price 0 for a running pod is not a price (it shows 0.0 only once a pod is stopped): the last price
  read holds, else the GPU catalogue's list price for the pod's GPUs; with neither the spend is "unknown",
  never $0. A start RunPod gives in a shape that cannot be read counts from this container's boot, estimated.
- The bill corrects the integral upward when it is ahead; a bill behind the integral by more than a few
  minutes of the price is a lagging bill, not the pod's spend.
- A replacement pod of the same run (`deploy watch`) carries the earlier pods' spend: the budget is the run's.
  Another run's record on a reused volume is not carried.

Each spend says how sure it is (`source`): "billed" (RunPod's bill), "read" (the prices RunPod showed, over
the time this pod ran), "estimated" (`why` says what was missing, `since` from when), or "unknown".
"""

from __future__ import annotations

import decimal
import math
import time

SOURCES = ("billed", "read", "estimated", "unknown")
LAG_S = 300.0  # RunPod's bill lags the pod's running by minutes: a bill further behind is not yet the spend
AMOUNT_MAX = 1e7  # USD: past it a number is not an amount of one pod's money


def _money(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= AMOUNT_MAX
    return float(v) if ok else None  # NaN and inf fail the comparison


def advance(ledger: dict | None, look: dict) -> dict:
    """The ledger after one look. `look`: time (wall clock), dt (seconds since the last look by this process's
    monotonic clock, None in a new process), pod, run (guardfile.run_id), ok (RunPod answered the pod),
    price (its `cost`), running (its status bills), started (startedAt as a Unix time; None: not given or not
    readable), start_raw (startedAt as RunPod wrote it), catalogue (the list price of its GPUs, or None),
    boot (this container's boot, for a start that cannot be read), bill (RunPod's bill, or None), failed
    (why the read failed). `ledger`: the last one (cost.json, checked), or None."""
    now = float(look["time"])
    prev = dict(ledger or {})
    if prev and prev.get("pod") != look.get("pod"):
        # another pod's record on the volume: a replacement of this run carries its spend, another run's is not ours
        same_run = bool(look.get("run")) and prev.get("run") == look.get("run")
        carried = (_money(prev.get("run_before")) or 0.0) + (_money(prev.get("spent")) or 0.0) if same_run else 0.0
        prev = {"run_before": carried, "carried_from": prev.get("pod") if same_run else None}
    run_before = _money(prev.get("run_before")) or 0.0
    last_t = prev.get("time")
    dt = look.get("dt")
    if dt is None:
        dt = now - last_t if isinstance(last_t, (int, float)) else 0.0
    dt = max(0.0, float(dt)) if math.isfinite(dt) else 0.0  # a clock stepped back never takes spend away
    spent_prev = _money(prev.get("spent"))
    rate_prev = _money(prev.get("per_hour")) or 0.0
    out = {"pod": look.get("pod"), "run": look.get("run") or None, "run_before": run_before,
           "carried_from": prev.get("carried_from"), "time": now, "started": prev.get("started"),
           "before": _money(prev.get("before")) or 0.0, "bill": _money(prev.get("bill")),
           "read_at": prev.get("read_at"), "price_from": prev.get("price_from")}
    why, since = "", None

    if not look.get("ok"):  # RunPod did not answer: the last price runs on
        spent = spent_prev + rate_prev * dt / 3600 if spent_prev is not None and rate_prev else spent_prev
        out["per_hour"] = rate_prev or None
        since = prev.get("since") or prev.get("read_at") or prev.get("time")
        why = f"RunPod did not answer ({str(look.get('failed') or '?')[:200]})"
    else:
        price = _money(look.get("price"))
        running = bool(look.get("running", True))
        price_from = "read"
        if not price and running:  # 0 or no price for a pod that bills: not a price
            if rate_prev and prev.get("price_from") in ("read", "last read"):
                price, price_from = rate_prev, "last read"
                why = f"RunPod shows no price for the running pod ({look.get('price')!r:.40}): the last price read"
            elif _money(look.get("catalogue")):
                price, price_from = _money(look["catalogue"]), "catalogue"
                why = f"RunPod shows no price for the running pod ({look.get('price')!r:.40}): the GPU catalogue's"
            else:
                price, price_from = None, None
                why = f"RunPod shows no price for the running pod ({look.get('price')!r:.40}), and the GPU " \
                      "catalogue has none for its GPUs"
        started = look.get("started")
        started = float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) \
            and math.isfinite(started) and 0 < started <= now + 300 else None
        if started is None and running:  # a running pod whose start cannot be read: this container's boot
            boot = look.get("boot")
            started = float(boot) if isinstance(boot, (int, float)) and 0 < boot <= now else None
            raw = look.get("start_raw")
            why = why or (f"RunPod's start time {str(raw)[:40]!r} cannot be read" if raw else
                          "RunPod gives no start time") + ": counted from this container's boot"
        if spent_prev is None or started is not None and prev.get("started") not in (None, started):
            # the first look at this start: the time before it is priced at what the pod costs now
            before = spent_prev or 0.0
            ran = max(0.0, now - started) if started is not None else 0.0
            spent = before + price * ran / 3600 if price else spent_prev
            if spent is None and not ran:
                spent = 0.0  # not started yet: nothing spent, and that is known
            out["before"], out["started"] = before, started
        else:
            # the interval since the last look, at the price that was in force over it
            rate = rate_prev or price or 0.0
            spent = spent_prev + rate * dt / 3600
            if started is not None:
                out["started"] = started
        out["per_hour"], out["price_from"] = price, price_from if price else None
        if price_from == "read" and price:
            out["read_at"] = now
        bill = _money(look.get("bill"))
        if bill is not None:
            out["bill"] = bill
            lag = (price or rate_prev or 0.0) * LAG_S / 3600
            if spent is None or bill >= spent - lag:
                spent = bill if spent is None else max(spent, bill)
                out["source"] = "billed"
    if spent is not None and spent_prev is not None:
        spent = max(spent, spent_prev)  # never down
    if spent is None and spent_prev is not None:
        spent = spent_prev
    out["spent"] = round(spent, 9) if spent is not None else None
    if out["spent"] is None:
        out["source"] = "unknown"
    elif "source" not in out:
        out["source"] = "estimated" if why or not look.get("ok") else "read"
    out["why"] = why or None if out["source"] != "billed" else None
    # (a clock stepped back may leave the last read "after" now: an estimate never starts after its look)
    out["since"] = min(since or prev.get("since") or now, now) if out["source"] == "estimated" else None
    return out


def total(ledger: dict | None) -> float | None:
    """The run's spend: this pod's and the earlier pods' of the same run; None while both are unknown (a
    replacement pod whose own spend is not known yet has at least its run's earlier pods')."""
    if not ledger:
        return None
    mine, before = _money(ledger.get("spent")), _money(ledger.get("run_before")) or 0.0
    return None if mine is None and not before else before + (mine or 0.0)


def usd(v) -> str:
    """An amount as a person set or would read it: cents for most, every digit a smaller one needs ($0.000000001
    is a budget, not "$0.00"); never an exponent, never more than 12 significant digits."""
    v = _money(v) if not isinstance(v, (int, float)) or v >= 0 else None
    if v is None:
        return "?"
    if v == 0 or v >= 0.01 and round(v, 2) == round(v, 9):
        return f"${v:,.2f}"
    d = decimal.Decimal(repr(v)).normalize()
    with decimal.localcontext() as ctx:
        ctx.prec = 12
        d = +d
    text = format(d, "f")
    whole, _, frac = text.partition(".")
    return f"${int(whole):,}.{frac.ljust(2, '0')}"


def cents(v) -> str:
    """A spend in a line: cents, and "<$0.01" under one (a budget is shown as set: usd)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
        return "?"
    return "<$0.01" if 0 < v < 0.005 else f"${v:,.2f}"


def sureness(c: dict) -> str:
    """How sure the spend is, in words: "billed", "read", "estimated since 14:02: why", "unknown: why"."""
    if c["source"] == "estimated":
        when = f" since {time.strftime('%H:%M', time.gmtime(c['since']))} UTC" if c.get("since") else ""
        return f"estimated{when}" + (f": {c['why']}" if c.get("why") else "")
    if c["source"] == "unknown":
        return "unknown" + (f": {c['why']}" if c.get("why") else "")
    return c["source"]
