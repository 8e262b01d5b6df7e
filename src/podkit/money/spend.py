"""What a pod has cost, as an integral over time, and how sure that is: the cost meter's one rule.

`advance(ledger, look)` is a pure function (no I/O, no clock): the ledger after one look at RunPod. The cost
meter (costguard.Meter) makes the looks and keeps the ledger in cost.json; the budget, status, doctor, the page
and the notifications read it. Its rules, each an invariant tests/money/test_spend.py checks over generated looks:

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
- A replacement pod of the same run (`deploy watch`) carries the earlier pods' spend, pod by pod (`carried`):
  the budget is the run's. Another run's record on a reused volume is not carried.

`run_total(mine, observations, seen, now)` is the run's spend across its pods, pure too: this pod's ledger and,
for each other pod of the same run (its own figures in the run's record, a cluster node's ledger, a carried
part), its last figure plus its price from then until it stopped, or RunPod's bill for it when that is more.
Its rules, each an invariant tests/money/test_spend.py checks:

- Each pod counts once (its figures from several places are one pod's), another run's pod never, and the total is
  never below any pod's part nor any figure a pod recorded.
- The total never goes down from one look to the next (`prev`), as a pod's own spend never does.
- A pod that stopped is what RunPod billed for it, its last minutes in, when the bill can be read and is not behind
  what the pod recorded. Else its time after its last figure is counted at its price until it recorded its stop,
  RunPod says it stopped or is gone (when first seen so), or, when RunPod cannot be asked, until this pod started
  (a lost pod is stopped before its replacement starts) or, for a pod running beside this one (a cluster's node),
  until now; a running pod's bill counts when it is ahead (as advance() takes it).
- Each part says how sure it is, and the total is as sure as its least sure part; a part that is not known is
  said, never counted as $0.

Each spend says how sure it is (`source`): "billed" (RunPod's bill), "read" (the prices RunPod showed, over
the time this pod ran), "estimated" (`why` says what was missing, `since` from when), or "unknown".
"""

from __future__ import annotations

import decimal
import math
import time

SOURCES = ("billed", "read", "estimated", "unknown")  # surest first
CLOCK_SKEW_MAX_S = 6 * 3600.0  # RunPod's Date further from this host's clock than this is not taken as the time
SAME_START_S = 5.0  # one start read twice (RFC 3339 and Go's format, their fractions) differs by less
LAG_S = 300.0  # RunPod's bill lags the pod's running by minutes: a bill further behind is not yet the spend
AMOUNT_MAX = 1e7  # USD: past it a number is not an amount of one pod's money
RATE_MAX = 1000.0  # USD/h: a pod of 8 of RunPod's dearest GPUs costs a few tens; more is not a price
CARRIED_MAX = 64  # pods a ledger carries: a run relaunches a few times
EARLIER = "(earlier pods)"  # a carry of podkit before it was kept pod by pod: not a pod id, never one in the record


def _money(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= AMOUNT_MAX
    return float(v) if ok else None  # NaN and inf fail the comparison


def advance(ledger: dict | None, look: dict) -> dict:
    """The ledger after one look. `look`: time (wall clock), dt (seconds since the last look by this process's
    monotonic clock, None in a new process), pod, run (ledger.run_id), ok (RunPod answered the pod),
    price (its `cost`), running (its status bills), started (startedAt as a Unix time; None: not given or not
    readable), start_raw (startedAt as RunPod wrote it), catalogue (the list price of its GPUs, or None),
    boot (this container's boot, for a start that cannot be read), bill (RunPod's bill, or None), failed
    (why the read failed). `ledger`: the last one (cost.json, checked), or None."""
    now = float(look["time"])
    prev = dict(ledger or {})
    if prev and prev.get("pod") != look.get("pod"):
        # another pod's record on the volume: a replacement of this run carries its spend, another run's is not ours
        same_run = bool(look.get("run")) and prev.get("run") == look.get("run")
        items = carry(prev) if same_run else {}
        prev = {"run_before": sum(i["spent"] for i in items.values()), "carried_from": prev.get("pod") if same_run
                else None, "carried": items}
    run_before = _money(prev.get("run_before")) or 0.0
    last_t = prev.get("time")
    dt = look.get("dt")
    if dt is None:
        dt = now - last_t if isinstance(last_t, (int, float)) else 0.0
    dt = max(0.0, float(dt)) if math.isfinite(dt) else 0.0  # a clock stepped back never takes spend away
    spent_prev = _money(prev.get("spent"))
    rate_prev = _money(prev.get("per_hour")) or 0.0
    out = {"pod": look.get("pod"), "run": look.get("run") or None, "run_before": run_before,
           "carried_from": prev.get("carried_from"), "carried": carried(prev), "time": now,
           "started": prev.get("started"),
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
        # How long the pod has run is timed by RunPod's clock (its answer's Date) where that is plausible (within
        # CLOCK_SKEW_MAX_S of this host's, and not before the start): a host clock hours ahead or behind never makes
        # an hour's run four; a Date a day off (a proxy's, a planted one) is not taken. The boot, a host time, is
        # moved onto the same clock.
        started = look.get("started")
        started = float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) \
            and math.isfinite(started) and started > 0 else None
        clock = look.get("server_time")
        clock = float(clock) if isinstance(clock, (int, float)) and not isinstance(clock, bool) and \
            math.isfinite(clock) and abs(clock - now) <= CLOCK_SKEW_MAX_S and \
            (started is None or clock >= started - 300) else now
        if started is not None and started > clock + 300:
            started = None  # a start after the answer that gives it: not a start
        skew = clock - now
        known, known_boot = _time(prev.get("started")), prev.get("start_from") == "boot"
        same = look.get("dt") is not None  # a look of the process that made `prev` (a new container: a new start may be)
        from_boot = False
        if known is not None:
            if started is None and running and same or started is not None and abs(started - known) <= SAME_START_S:
                # one answer without its start (a field missing, a shape that cannot be read) or the same start in
                # another format: the start known, never a new one that re-adds the whole run
                started, from_boot = known, known_boot
            elif started is not None and started < known and not known_boot:
                started = known  # older than a start RunPod gave (an old answer after a restart): not this start
        if started is None and running:  # a running pod whose start cannot be read: this container's boot
            boot = look.get("boot")
            started = float(boot) + skew if isinstance(boot, (int, float)) and 0 < boot <= now else None
            from_boot = started is not None
            raw = look.get("start_raw")
            why = why or (f"RunPod's start time {str(raw)[:40]!r} cannot be read" if raw else
                          "RunPod gives no start time") + ": counted from this container's boot"
        last = _time(prev.get("looked"))
        moved = started is not None and known is not None and started != known
        # a start after the last look is the pod's restart; one before it, the same start read better (the boot's
        # estimate, then RunPod's): counted once, from the spend before it
        restart = moved and (last is None or started > last - SAME_START_S)
        out["looked"], out["start_from"] = clock, "boot" if from_boot else "runpod"
        if spent_prev is None or restart or moved:
            # the first look at this start: the time before it is priced at what the pod costs now
            before = (_money(prev.get("before")) or 0.0) if moved and not restart else spent_prev or 0.0
            ran = max(0.0, clock - started) if started is not None else 0.0
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


def carried(ledger: dict) -> dict:
    """The earlier pods' parts a ledger carries, {pod: {spent, source, time, per_hour}}, checked; a carry of
    podkit before they were kept pod by pod is one part, EARLIER."""
    raw = ledger.get("carried")
    out = {}
    if isinstance(raw, dict):
        for pod, item in list(raw.items())[:CARRIED_MAX]:
            if isinstance(pod, str) and 0 < len(pod) <= 64 and isinstance(item, dict) \
                    and _money(item.get("spent")) is not None:
                out[pod] = {"spent": _money(item["spent"]), "source": item.get("source") if item.get("source") in
                            SOURCES[:3] else "estimated", "time": _time(item.get("time")),
                            "per_hour": _rate(item.get("per_hour"))}
    elif _money(ledger.get("run_before")):
        out[EARLIER] = {"spent": _money(ledger["run_before"]), "source": "estimated", "time": None, "per_hour": None}
    return out


def carry(ledger: dict) -> dict:
    """What a replacement of the same run carries from `ledger` (the earlier pod's): its parts and the pod itself."""
    items = carried(ledger)
    pod, spent = ledger.get("pod"), _money(ledger.get("spent"))
    if isinstance(pod, str) and pod and spent is not None and len(items) < CARRIED_MAX:
        kept = items.get(pod, {}).get("spent") or 0.0
        items[pod] = {"spent": max(spent, kept), "source": ledger.get("source") if ledger.get("source") in
                      SOURCES[:3] else "estimated", "time": _time(ledger.get("time")),
                      "per_hour": _rate(ledger.get("per_hour"))}
    return items


def total(ledger: dict | None) -> float | None:
    """The run's spend: its total across its pods (run_total) when the ledger has one, else this pod's and the
    earlier pods' it carries; None while nothing of it is known (a replacement pod whose own spend is not known
    yet has at least its run's earlier pods')."""
    if not ledger:
        return None
    run = ledger.get("total")
    if isinstance(run, dict) and (_money(run.get("spent")) is not None or run.get("source") == "unknown"):
        return _money(run.get("spent"))
    mine, before = _money(ledger.get("spent")), _money(ledger.get("run_before")) or 0.0
    return None if mine is None and not before else before + (mine or 0.0)


def total_sureness(ledger: dict) -> str:
    """How sure the run's spend (total()) is, in words: its least sure part's, with why."""
    run = ledger.get("total")
    return sureness(run) if isinstance(run, dict) and run.get("source") in SOURCES else sureness(ledger)


# -- the run's spend across its pods: a pure function of what each pod recorded and what RunPod says ---------------
def _time(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e11 else None


def _rate(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= RATE_MAX
    return float(v) if ok else None


def weakest(sources) -> str:
    """The least sure of `sources` (SOURCES' order); "billed" for none."""
    return max(sources, key=SOURCES.index, default="billed")


def _at(t: float) -> str:
    return time.strftime("%H:%M UTC", time.gmtime(t))


def part(pod: str, figures: list[dict], seen: dict, now: float, mine_started: float | None,
         prev: dict | None = None) -> dict:
    """One other pod's part of the run's spend. `figures`: what is recorded of it ({spent, source, time, per_hour,
    stopped}: its own entries in the run's record, its ledger, a carry), checked. `seen`: what RunPod said of it at
    this look ({} when not asked: its figures are fresh): state (running, stopped, gone, or None: not answered,
    `why`), price, bill (None: not readable, `bill_why`), ended (when a look first saw it not running).
    `mine_started`: when this pod started. `prev`: this part at the last look (a part never goes down)."""
    known = [f for f in figures if f.get("spent") is not None]
    base = max(known, key=lambda f: f["spent"], default=None)
    newest = max(figures, key=lambda f: (f.get("time") or 0.0, bool(f.get("stopped"))), default={})
    t0, rate = newest.get("time"), newest.get("per_hour")
    state, bill = seen.get("state"), _money(seen.get("bill"))
    if state == "running" and _rate(seen.get("price")):
        rate = _rate(seen["price"])
    end, kind, why = t0, None, ""
    if t0 is None or newest.get("stopped"):
        pass  # it recorded its stop (or only a carried amount is known: the ledger it came from was its last)
    elif state == "running":
        end, kind = now, "read"
    elif state in ("stopped", "gone"):
        ended = _time(seen.get("ended")) or now
        end = min(ended, mine_started) if mine_started and t0 < mine_started else ended
        kind = "estimated"
        said = "is gone" if state == "gone" else "stopped"
        why = f"its last record at {_at(t0)}; RunPod says it {said} by {_at(end)}: its price until then"
    elif not seen and not (mine_started and t0 < mine_started):
        end, kind = now, "read"  # its own figures are fresh (a cluster's node): its price since them
    elif mine_started and t0 < mine_started:
        end, kind = mine_started, "estimated"
        why = (f"its last record at {_at(t0)}; RunPod cannot be asked about it ({str(seen.get('why') or 'not asked')[:120]}"
               "): its price until this pod started")
    else:
        end, kind = now, "estimated"
        why = (f"RunPod cannot be asked about it ({str(seen.get('why') or 'not asked')[:120]}): its last price "
               f"since its last record at {_at(t0)}")
    ext = rate * max(0.0, end - t0) / 3600 if rate and t0 is not None and end is not None else 0.0
    est = base["spent"] + ext if base is not None else None
    source = weakest([base["source"] if base else "unknown"] + ([kind] if kind else []))
    if base is None:
        why = "its spend is not known (it recorded none)"
    elif base["source"] == "estimated" and not why:
        why = "its own figure is an estimate"
    over = state in ("stopped", "gone") or bool(newest.get("stopped"))
    if bill is not None and over and (base is None or bill >= base["spent"]):
        spent, source, why = bill, "billed", ""  # its last minutes are in RunPod's bill: the bill, not a bound
    elif bill is not None and not over and (est is None or bill >= est - (rate or 0.0) * LAG_S / 3600):
        spent, source, why = max(bill, est or 0.0), "billed", ""  # a running pod's bill lags: as advance() takes it
    else:
        spent = est
        if bill is None and seen.get("bill_why") and source != "billed":
            why += f"{'; ' if why else ''}its bill cannot be read ({str(seen['bill_why'])[:120]})"
    if prev and _money(prev.get("spent")) is not None and (spent is None or prev["spent"] > spent):
        spent = _money(prev["spent"])  # never down: a look with less to go by keeps what an earlier one counted
        source, why = weakest([source, prev.get("source") if prev.get("source") in SOURCES else "estimated"]), \
            why or prev.get("why") or ""
    running = state == "running" or end == now and kind == "read"
    return {"pod": pod, "spent": round(spent, 9) if spent is not None else None,
            "source": source if spent is not None else "unknown", "why": why[:400] or None,
            "per_hour": rate if running and rate else 0.0, "time": t0, "until": end if ext else t0,
            "ended": _time(seen.get("ended")), "since": t0 if source == "estimated" else None}


def run_total(mine: dict, observations: list[dict], seen: dict, now: float, prev: dict | None = None) -> dict:
    """The run's spend across its pods: this pod's ledger `mine` (spend.advance's) and a part (part()) for each
    other pod of its run, from `observations` (each {pod, run, spent, source, time, per_hour, stopped}, checked:
    its own entries in the run's record, a cluster node's ledger) and the pods `mine` carries. Another run's pod,
    and this pod itself, are not parts. `seen`: {pod: what RunPod said of it}. `prev`: the last look's total."""
    run, me = mine.get("run"), mine.get("pod")
    figures: dict[str, list[dict]] = {}
    for pod, item in carried(mine).items():
        figures.setdefault(pod, []).append({**item, "stopped": False})
    for o in observations:
        if run and o.get("run") == run and isinstance(o.get("pod"), str) and o["pod"] and o["pod"] != me:
            figures.setdefault(o["pod"], []).append(o)
    before = {p["pod"]: p for p in (prev or {}).get("parts") or [] if isinstance(p, dict) and p.get("pod")} \
        if isinstance(prev, dict) else {}
    started = _time(mine.get("started")) or _time(mine.get("time"))
    parts = [part(pod, figs, seen.get(pod) or {}, now, started, before.get(pod))
             for pod, figs in sorted(figures.items())]
    for pod, p in before.items():  # a pod counted at an earlier look stays counted (its entry unread since)
        if pod not in figures and pod != me and _money(p.get("spent")) is not None:
            parts.append({**p, "per_hour": 0.0})
    mine_spent = _money(mine.get("spent"))
    known = [p["spent"] for p in parts if p["spent"] is not None]
    spent = None if mine_spent is None and not known else (mine_spent or 0.0) + sum(known)
    sources = [mine.get("source") if mine.get("source") in SOURCES else "unknown"] + [p["source"] for p in parts]
    source = weakest(sources)
    if source == "unknown" and spent is not None:
        source = "estimated"  # what is known, with what is not said: never $0 for a part not known
    whys = [f"this pod: {mine['why']}"] if mine.get("why") and mine.get("source") in ("estimated", "unknown") else []
    whys += [f"pod {p['pod']} ({cents(p['spent']) if p['spent'] is not None else 'not known'}): {p['why']}"
             for p in parts if p["source"] in ("estimated", "unknown") and p.get("why")]
    since = [t for t in [_time(mine.get("since"))] + [p.get("since") for p in parts] if t]
    rate = (_rate(mine.get("per_hour")) or 0.0) + sum(p["per_hour"] for p in parts)
    if prev and _money(prev.get("spent")) is not None and (spent is None or prev["spent"] > spent):
        spent = _money(prev["spent"])  # the parts never go down: nor does their sum (a part of a changed run id)
    return {"spent": round(spent, 9) if spent is not None else None, "source": source,
            "why": "; ".join(whys)[:600] or None, "since": min(since) if source == "estimated" and since else None,
            "per_hour": round(rate, 6), "pods": 1 + len(parts), "parts": parts, "time": now}


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


def checked_total(raw) -> dict | None:
    """A stored run total (cost.json's `total`) as readers take it, or None when it cannot be trusted: an amount
    that is not one, a source not podkit's, a part that is not a pod's."""
    if not isinstance(raw, dict) or raw.get("source") not in SOURCES:
        return None
    spent = _money(raw.get("spent"))
    if (spent is None) != (raw.get("spent") is None) or (spent is None) != (raw["source"] == "unknown"):
        return None
    parts = []
    for p in raw.get("parts") or []:
        if not isinstance(p, dict) or not isinstance(p.get("pod"), str) or not 0 < len(p["pod"]) <= 64 \
                or p.get("source") not in SOURCES or (p.get("spent") is not None and _money(p["spent"]) is None):
            return None
        parts.append({"pod": p["pod"], "spent": _money(p.get("spent")), "source": p["source"],
                      "why": p["why"][:400] if isinstance(p.get("why"), str) else None,
                      "per_hour": _rate(p.get("per_hour")) or 0.0,
                      **{k: _time(p.get(k)) for k in ("time", "until", "ended", "since")}})
    pods = raw.get("pods")
    return {"spent": spent, "source": raw["source"], "why": raw["why"][:600] if isinstance(raw.get("why"), str)
            else None, "since": _time(raw.get("since")), "per_hour": _rate(raw.get("per_hour")) or 0.0,
            "pods": pods if isinstance(pods, int) and not isinstance(pods, bool) and 0 < pods <= 1000 else
            1 + len(parts), "parts": parts[:CARRIED_MAX * 2], "time": _time(raw.get("time"))}
