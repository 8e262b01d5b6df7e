"""The spend ledger (spend.advance) as a pure function: its rules as properties over generated looks at RunPod
(Hypothesis), beside the cases issue 48 found, each a sequence of looks with the spend a person would expect."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podkit.money import spend

H = 3600.0
T0 = 1_800_000_000.0


def look(t: float, price=1.0, ok=True, started=T0, bill=None, dt=None, pod="pod-a", run="run-1", **kw) -> dict:
    return {"time": t, "dt": dt, "pod": pod, "run": run, "ok": ok, "price": price, "running": True,
            "started": started, "start_raw": "x" if started is None else None, "bill": bill, "catalogue": None,
            "boot": T0, "failed": "HTTP 503", **kw}


def walk(looks: list[dict]) -> list[dict]:
    out, ledger = [], None
    for lk in looks:
        ledger = spend.advance(ledger, lk)
        out.append(ledger)
    return out


def test_a_price_change_never_reprices_the_past():
    """$1/h for an hour, then $3/h: $1 for the first hour, $4 after the second (RunPod's re-read price times the
    whole start said $3, then $6)."""
    ls = walk([look(T0, 1.0), look(T0 + H, 1.0), look(T0 + 2 * H, 3.0), look(T0 + 3 * H, 3.0)])
    assert [lg["spent"] for lg in ls] == [0.0, 1.0, 2.0, 5.0]
    assert all(lg["source"] == "read" for lg in ls)


def test_a_failed_read_extrapolates_at_the_last_price_and_says_since_when():
    """A $10 budget saw $5 for six hours while the pod spent $21: the spend now runs on at the last price,
    estimated since the last good read, and the next good read goes on from there."""
    ls = walk([look(T0, 3.0), look(T0 + H, 3.0)] + [look(T0 + H * (2 + i), ok=False) for i in range(6)]
              + [look(T0 + 8 * H, 3.0)])
    assert ls[2]["spent"] == 6.0 and ls[2]["source"] == "estimated" and ls[2]["since"] == T0 + H
    assert "RunPod did not answer (HTTP 503)" in ls[2]["why"]
    assert ls[7]["spent"] == 21.0 and ls[7]["since"] == T0 + H
    assert ls[8]["spent"] == 24.0 and ls[8]["source"] == "read" and ls[8]["since"] is None


def test_a_price_of_zero_on_a_running_pod_is_not_zero_spend():
    """RunPod answers cost 0 for a running pod: the last price read holds; with none read, the GPU catalogue's
    price; with neither, the spend is unknown (never $0.00)."""
    ls = walk([look(T0, 2.0), look(T0 + H, 0.0), look(T0 + 2 * H, 0.0)])
    assert [lg["spent"] for lg in ls] == [0.0, 2.0, 4.0] and ls[2]["source"] == "estimated"
    assert "the last price read" in ls[2]["why"]
    cat = walk([look(T0 + H, 0.0, catalogue=0.44)])
    assert cat[0]["spent"] == pytest.approx(0.44) and "catalogue" in cat[0]["why"]
    unknown = walk([look(T0 + H, 0.0), look(T0 + 2 * H, 0.0)])
    assert [lg["spent"] for lg in unknown] == [None, None] and unknown[-1]["source"] == "unknown"
    assert spend.total(unknown[-1]) is None
    # a pod that is stopped costs 0: that is a price
    stopped = walk([look(T0, 2.0), look(T0 + H, 0.0, running=False)])
    assert stopped[-1]["spent"] == 2.0 and stopped[-1]["source"] == "read"


def test_a_start_time_that_cannot_be_read_counts_from_this_containers_boot():
    """A Go-style startedAt RunPod might send: the spend is the price since this container's boot, estimated."""
    ls = walk([look(T0 + H, 2.0, started=None, start_raw="2026-11-28 13:00:00 +0000 UTC")])
    assert ls[0]["spent"] == 2.0 and ls[0]["source"] == "estimated" and "cannot be read" in ls[0]["why"]


def test_a_clock_stepped_back_keeps_every_start_spent():
    ls = walk([look(T0, 1.0), look(T0 + 2 * H, 1.0), look(T0 - 5 * H, 1.0, started=T0 - 6 * H)])
    assert ls[-1]["spent"] >= 2.0


def test_the_bill_corrects_up_and_a_lagging_bill_is_not_the_spend():
    ls = walk([look(T0, 1.0, bill=0.0), look(T0 + H, 1.0, bill=5.0), look(T0 + 2 * H, 1.0, bill=5.0)])
    assert ls[1]["spent"] == 5.0 and ls[1]["source"] == "billed"
    assert ls[2]["spent"] == 6.0 and ls[2]["source"] == "read", "a bill an hour behind is lagging"


def test_a_replacement_pod_of_the_run_carries_its_spend_and_another_runs_pod_does_not():
    first = walk([look(T0, 1.0), look(T0 + 3 * H, 1.0)])[-1]
    second = spend.advance(first, look(T0 + 4 * H, 1.0, pod="pod-b", started=T0 + 3.5 * H))
    assert second["spent"] == 0.5 and spend.total(second) == 3.5 and second["carried_from"] == "pod-a"
    other = spend.advance(first, look(T0 + 4 * H, 1.0, pod="pod-b", run="run-2", started=T0 + 3.5 * H))
    assert spend.total(other) == 0.5 and other["carried_from"] is None


@pytest.mark.parametrize("v, shown", [(1e-9, "$0.000000001"), (5, "$5.00"), (5.5, "$5.50"), (0.005, "$0.005"),
                                      (1234.5, "$1,234.50"), (0.1 + 0.2, "$0.30"), (12.345, "$12.345"),
                                      (float("nan"), "?"), (-1, "?"), (True, "?")])
def test_an_amount_is_shown_with_the_precision_it_was_set_with(v, shown):
    assert spend.usd(v) == shown


# -- properties ---------------------------------------------------------------------------------------------------
prices = st.one_of(st.just(0.0), st.floats(0.01, 50.0), st.none(), st.just(float("nan")), st.just(-1.0))
steps = st.lists(st.tuples(st.floats(-7200, 7200),  # the wall clock's move since the last look (back too)
                           st.floats(0, 7200),  # the monotonic clock's
                           prices, st.booleans(),  # the price RunPod shows; whether it answered
                           st.one_of(st.none(), st.floats(0, 500)),  # its bill
                           st.sampled_from([0, 0, 0, 1])),  # a new start
                 min_size=1, max_size=25)


def looks_of(seq, same_process: bool = True) -> list[dict]:
    t, started, out = T0, T0 - 60, []
    for wall, mono, price, ok, bill, restart in seq:
        t += wall
        if restart:
            started = t - 1
        out.append(look(t, price, ok=ok, bill=bill, started=started, dt=mono if same_process else None,
                        catalogue=None))
    return out


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_spend_never_goes_down_and_once_known_is_never_unknown(seq):
    known = None
    for lg in walk(looks_of(seq)):
        assert lg["source"] in spend.SOURCES
        assert (lg["spent"] is None) == (lg["source"] == "unknown")
        if known is not None:
            assert lg["spent"] is not None and lg["spent"] >= known - 1e-9
        if lg["spent"] is not None:
            assert math.isfinite(lg["spent"]) and lg["spent"] >= 0
            known = lg["spent"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 7200), st.floats(0.01, 50.0)), min_size=2, max_size=20))
def test_with_every_read_answered_the_spend_is_the_sum_of_each_price_over_its_interval(seq):
    """No bill, one start: exactly the integral of the price in force (the earlier read's), whatever order the
    prices come in."""
    t, ls, want = T0, [], 0.0
    for i, (dt, price) in enumerate(seq):
        if i:
            want += seq[i - 1][1] * dt / H
        t += dt if i else 0
        ls.append(look(t, price, dt=dt if i else None))
    assert walk(ls)[-1]["spent"] == pytest.approx(want, rel=1e-6, abs=1e-6)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_a_spend_says_how_sure_it_is(seq):
    """"read" or "billed" only when RunPod answered that look; every estimate says why and since when, and never
    starts after the look."""
    ls = looks_of(seq)
    for lk, lg in zip(ls, walk(ls), strict=True):
        if lg["source"] in ("read", "billed"):
            assert lk["ok"]
        if lg["source"] == "estimated":
            assert lg["why"] and lg["since"] is not None and lg["since"] <= lk["time"]
        if not lk["ok"] and lg["spent"] is not None:
            assert lg["source"] == "estimated"


@settings(max_examples=200, deadline=None)
@given(steps, st.floats(0.01, 50.0))
def test_a_known_price_and_time_running_never_leave_the_spend_at_zero(seq, price):
    """Once a price was read and the pod ran (its start before the look), the spend is above zero: the budget
    acts on it, never on $0.00, whatever failed after."""
    ls = [look(T0, price, started=T0 - 600)] + looks_of(seq)
    for lg in walk(ls):
        assert lg["spent"] is not None and lg["spent"] > 0


@settings(max_examples=200, deadline=None)
@given(steps, st.booleans())
def test_the_runs_spend_carries_over_a_replacement_pod_and_never_over_another_run(seq, same):
    ls = walk(looks_of(seq))
    before = spend.total(ls[-1]) or 0.0
    nxt = spend.advance(ls[-1], look(ls[-1]["time"] + 60, 1.0, pod="pod-b", run="run-1" if same else "run-2",
                                     started=ls[-1]["time"] + 30))
    assert spend.total(nxt) == pytest.approx((before if same else 0.0) + 30 / H, abs=1e-6)


# -- the run's spend across its pods (spend.run_total) ------------------------------------------------------------
def ledger(t: float, spent=1.0, pod="me", run="run-1", started=None, source="read", per_hour=1.0, **kw) -> dict:
    """This pod's ledger as spend.advance leaves it."""
    return {"pod": pod, "run": run, "spent": spent, "source": source, "per_hour": per_hour, "time": t,
            "started": T0 if started is None else started, "why": None, "since": None, "carried": {}, **kw}


def fig(pod: str, spent, t: float, run="run-1", per_hour=1.0, source="read", stopped=False) -> dict:
    """Another pod's figures, as the run's record or its ledger holds them."""
    return {"pod": pod, "run": run, "spent": spent, "source": source if spent is not None else "unknown",
            "per_hour": per_hour, "time": t, "stopped": stopped}


def test_a_lost_pods_minutes_until_runpod_stopped_it_are_in_the_run_total():
    """Pod a's last record at T0 - 20 min ($5, $3/h); it was lost, stopped by the watch, and this pod (its
    replacement) started at T0. RunPod's bill for it ($5.75, its last 15 minutes in) is the part; refused the bill,
    its price from its last record until this pod started (RunPod says it stopped, first seen at T0 + 1 min), said
    as an estimate; refused everything, the same bound, saying RunPod cannot be asked."""
    mine = ledger(T0 + 60, spent=0.05)
    last = [fig("pod-a", 5.0, T0 - 1200, per_hour=3.0)]
    billed = spend.run_total(mine, last, {"pod-a": {"state": "stopped", "bill": 5.75, "ended": T0 + 60}}, T0 + 60)
    [a] = billed["parts"]
    assert (a["spent"], a["source"]) == (5.75, "billed") and billed["spent"] == pytest.approx(5.8)
    assert billed["source"] == "read" and billed["pods"] == 2
    refused = spend.run_total(mine, last, {"pod-a": {"state": "stopped", "bill": None, "bill_why": "HTTP 403",
                                                     "ended": T0 + 60}}, T0 + 60)
    [a] = refused["parts"]
    assert a["spent"] == pytest.approx(5.0 + 3.0 * 1200 / H) and a["source"] == "estimated"
    assert "RunPod says it stopped by" in a["why"] and "its bill cannot be read (HTTP 403)" in a["why"]
    assert refused["source"] == "estimated" and "pod pod-a ($6.00): its last record at" in refused["why"]
    dark = spend.run_total(mine, last, {"pod-a": {"state": None, "why": "HTTP 403: Forbidden"}}, T0 + 600)
    assert dark["parts"][0]["spent"] == pytest.approx(6.0) and "until this pod started" in dark["parts"][0]["why"]
    assert "RunPod cannot be asked about it (HTTP 403: Forbidden)" in dark["parts"][0]["why"]


def test_a_pod_that_recorded_its_stop_counts_nothing_after_it_and_a_running_one_counts_to_now():
    mine = ledger(T0 + H, spent=1.0)
    stopped = spend.run_total(mine, [fig("pod-a", 2.0, T0 - H, stopped=True)], {"pod-a": {"state": "stopped"}},
                              T0 + H)
    assert stopped["parts"][0]["spent"] == 2.0 and stopped["parts"][0]["source"] == "read"
    # a cluster's node, its ledger a minute old (fresh: RunPod not asked): its price since then
    node = spend.run_total(mine, [fig("node-1", 12.0, T0 + H - 60, per_hour=6.0)], {}, T0 + H)
    assert node["parts"][0]["spent"] == pytest.approx(12.1) and node["source"] == "read"
    assert node["per_hour"] == pytest.approx(7.0), "the run's pace: this pod's and its node's"


def test_the_run_total_keeps_a_pod_once_whatever_holds_its_figures_and_never_another_runs():
    """Pod a carried in this pod's ledger (from the volume's cost.json, $4) and in the run's record ($4.50, newer):
    one part of $4.50. Another run's pod under the same names, and this pod's own entry, are not parts."""
    mine = ledger(T0 + H, carried={"pod-a": {"spent": 4.0, "source": "read", "time": T0 - 600, "per_hour": 0.0}})
    obs = [fig("pod-a", 4.5, T0 - 300, per_hour=0.0, stopped=True), fig("pod-z", 99.0, T0, run="run-2"),
           fig("me", 50.0, T0)]
    got = spend.run_total(mine, obs, {}, T0 + H)
    assert [p["pod"] for p in got["parts"]] == ["pod-a"] and got["spent"] == pytest.approx(5.5)


run_pods = st.sampled_from(["pod-a", "pod-b", "pod-c", "me"])
figs = st.lists(st.builds(fig, run_pods, st.one_of(st.none(), st.floats(0, 100)), st.floats(T0 - 3 * H, T0 + H),
                          st.sampled_from(["run-1", "run-1", "run-2"]), st.one_of(st.none(), st.floats(0, 20)),
                          st.sampled_from(["billed", "read", "estimated"]), st.booleans()), max_size=8)
seens = st.dictionaries(run_pods, st.fixed_dictionaries({
    "state": st.sampled_from(["running", "stopped", "gone", None]), "why": st.sampled_from([None, "HTTP 403"]),
    "price": st.one_of(st.none(), st.floats(0, 20)), "bill": st.one_of(st.none(), st.floats(0, 200)),
    "ended": st.one_of(st.none(), st.floats(T0 - H, T0 + 2 * H))}), max_size=4)


carries = st.dictionaries(st.sampled_from(["pod-a", "pod-b"]), st.builds(
    lambda spent, t: {"spent": spent, "source": "read", "time": t, "per_hour": 1.0}, st.floats(0, 100),
    st.floats(T0 - 3 * H, T0)), max_size=2)


@settings(max_examples=300, deadline=None)
@given(figs, seens, st.one_of(st.none(), st.floats(0, 50)), st.floats(0, 3 * H), carries)
def test_the_run_total_is_never_below_a_part_counts_each_pod_once_and_never_another_runs(obs, seen, mine_spent, later,
                                                                                          carry):
    """A pod in the run's record and in the volume's carry is one part; another run's pod none; the total is the
    sum of the parts and this pod's spend, never below any figure recorded of a pod of this run."""
    now = T0 + H + later
    mine = ledger(T0 + H, spent=mine_spent, source="read" if mine_spent is not None else "unknown", carried=carry)
    got = spend.run_total(mine, obs, seen, now)
    pods = [p["pod"] for p in got["parts"]]
    assert len(pods) == len(set(pods)) and "me" not in pods, "each other pod once; this pod is its ledger"
    assert set(pods) == {o["pod"] for o in obs if o["run"] == "run-1" and o["pod"] != "me"} | set(carry)
    for o in obs + [{"pod": p, "run": "run-1", **c} for p, c in carry.items()]:  # never below a recorded figure
        if o["run"] == "run-1" and o["pod"] != "me" and o["spent"] is not None:
            assert next(p for p in got["parts"] if p["pod"] == o["pod"])["spent"] >= o["spent"] - 1e-8
    known = [p["spent"] for p in got["parts"] if p["spent"] is not None] + ([mine_spent] if mine_spent is not None
                                                                             else [])
    if known:
        assert got["spent"] == pytest.approx(sum(known), abs=1e-8) and all(got["spent"] >= k - 1e-8 for k in known)
    else:
        assert got["spent"] is None and got["source"] == "unknown"
    assert got["source"] == spend.weakest([p["source"] for p in got["parts"]] + [mine["source"]]) or \
        got["source"] == "estimated" and "unknown" in [p["source"] for p in got["parts"]] + [mine["source"]]
    for p in got["parts"]:  # how sure each part is, and why when it is not
        assert p["source"] in spend.SOURCES and (p["spent"] is None) == (p["source"] == "unknown")
        if p["source"] in ("estimated", "unknown"):
            assert p["why"]
    if any(p["source"] == "unknown" for p in got["parts"]) and got["spent"] is not None:
        assert got["source"] == "estimated" and "not known" in got["why"]
    other = spend.run_total(mine, obs + [fig("pod-x", 1e6, T0, run="run-2")], seen, now)
    assert other["spent"] == got["spent"], "another run's pod changes nothing"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(figs, seens, st.floats(0, 600)), min_size=1, max_size=6))
def test_the_run_total_never_goes_down(looks):
    """Look after look, with what is known of each pod changing as it will (a record pulled, a bill refused, a pod
    seen gone), the run's total and each pod's part never go down."""
    prev, t, spent = None, T0 + H, 0.0
    for obs, seen, dt in looks:
        t += dt
        spent += dt / H
        got = spend.run_total(ledger(t, spent=spent), obs, seen, t, prev)
        if prev is not None:
            assert got["spent"] >= prev["spent"] - 1e-9
            before = {p["pod"]: p["spent"] for p in prev["parts"] if p["spent"] is not None}
            for p in got["parts"]:
                if p["pod"] in before:
                    assert p["spent"] is not None and p["spent"] >= before[p["pod"]] - 1e-9
        prev = spend.checked_total(got)
        assert prev is not None, "the total as stored reads back"


def test_a_replacement_carries_the_earlier_pods_pod_by_pod():
    """pod-a, then pod-b (carrying pod-a), then pod-c: pod-c's ledger carries both, by pod, and its run total counts
    each once even when the run's record holds them too."""
    a = walk([look(T0, 1.0, pod="pod-a"), look(T0 + H, 1.0, pod="pod-a")])[-1]
    b = spend.advance(a, look(T0 + 2 * H, 1.0, pod="pod-b", started=T0 + 1.5 * H))
    c = spend.advance(b, look(T0 + 3 * H, 1.0, pod="pod-c", started=T0 + 2.5 * H))
    assert set(c["carried"]) == {"pod-a", "pod-b"} and c["run_before"] == pytest.approx(1.5)
    total = spend.run_total(c, [fig("pod-a", 1.0, T0 + H, stopped=True), fig("pod-b", 0.5, T0 + 2 * H, stopped=True)],
                            {}, T0 + 3 * H)
    assert total["spent"] == pytest.approx(2.0) and total["pods"] == 3
    legacy = spend.advance({**a, "carried": None, "run_before": 7.0}, look(T0 + 2 * H, 1.0, pod="pod-b",
                                                                         started=T0 + 1.5 * H))
    assert legacy["carried"][spend.EARLIER]["spent"] == 7.0 and legacy["carried"]["pod-a"]["spent"] == 1.0


# -- a start read another way (issue 56) --------------------------------------------------------------------------
def _hourly(n: int, **at) -> list[dict]:
    """n + 1 looks an hour apart at $2/h on one start (this container booted half an hour after it), the look `k` in
    `at` changed as given."""
    return [look(T0 + k * H, 2.0, dt=H if k else None, boot=T0 + H / 2, **at.get(str(k), {})) for k in range(n + 1)]


@pytest.mark.parametrize("what,odd", [
    ("startedAt missing from one answer", {"started": None, "start_raw": None}),
    ("startedAt that cannot be read, once", {"started": None, "start_raw": "T23:59:60Z"}),
    ("the same start in Go's format with its nanoseconds", {"started": T0 + 0.123456789}),
])
def test_one_answer_with_its_start_missing_or_in_another_shape_never_re_adds_the_whole_run(what, odd):
    """10 h at $2/h is $20: one answer without startedAt (or in RunPod's other time format) was taken as a new start
    and re-added the whole run ($40, $60), and nothing was said."""
    ls = walk(_hourly(10, **{"7": odd}))
    assert [lg["spent"] for lg in ls][-1] == pytest.approx(20.0), (what, [lg["spent"] for lg in ls])
    assert ls[-1]["started"] == T0


def test_a_start_readable_after_reads_that_counted_from_the_boot_is_not_counted_twice():
    """The first answers' start could not be read (counted from this container's boot, an hour after the pod's
    start); then it can: the run is its start's, once (not the boot's hours plus the start's)."""
    boot = T0 + H
    ls = walk([look(T0 + 2 * H, 2.0, started=None, boot=boot), look(T0 + 3 * H, 2.0, dt=H, boot=boot)])
    assert ls[0]["spent"] == pytest.approx(2.0) and ls[1]["spent"] == pytest.approx(6.0), [lg["spent"] for lg in ls]


def test_a_host_clock_hours_ahead_times_the_run_by_runpods_clock():
    """RunPod's answer dated T0 + 1 h, the pod started at T0 by RunPod's clock, the host's clock 3 h ahead: an hour
    at $2/h is $2, not $8."""
    ls = walk([look(T0 + 4 * H, 2.0, server_time=T0 + H)])
    assert ls[0]["spent"] == pytest.approx(2.0), ls[0]


@pytest.mark.parametrize("raw", ["2026-11-28T23:59:60Z", "2026-11-28T24:00:00Z", "2026-02-30T10:00:00Z",
                                 "2026-13-01T00:00:00+00:00"])
def test_a_start_shaped_like_a_time_but_not_one_is_no_start_and_no_failed_read(raw):
    from podkit import runpod

    assert runpod.started_at({"startedAt": raw}) is None
    ls = walk([look(T0 + H, 2.0, started=None, start_raw=raw)])
    assert ls[0]["source"] == "estimated" and ls[0]["spent"] == pytest.approx(2.0) and "cannot be read" in ls[0]["why"]


# -- a start read another way, the adversarial pass's cases (issue 56) -----------------------------------------------
def test_a_new_container_after_a_real_restart_counts_from_its_boot_not_across_the_hours_stopped():
    """2 h at $2/h, the pod stopped 10 h, started again: the new container's first answer has no startedAt. The 10 h
    stopped were billed ($34 for a $14 run: the known start kept across a restart); a new container counts from its
    own boot, estimated."""
    ls = walk([look(T0, 2.0), look(T0 + H, 2.0, dt=H), look(T0 + 2 * H, 2.0, dt=H)])
    new = spend.advance(ls[-1], look(T0 + 13 * H, 2.0, started=None, boot=T0 + 12 * H))  # dt None: a new process
    assert new["spent"] == pytest.approx(6.0) and new["source"] == "estimated", new


@pytest.mark.parametrize("start", [T0 + 60 + 120, T0])  # RunPod's start 2 min after the boot, or 1 min before it
def test_a_start_readable_hours_after_the_boots_estimate_corrects_it_once(start):
    """The start could not be read for 5 h (counted from the boot, at T0 + 60 s), then it can: $10 and change, never
    the overlap twice ($21.93 for about $12)."""
    boot = T0 + 60
    ls = walk([look(boot + k * H, 2.0, started=None, boot=boot, dt=H if k else None) for k in range(6)]
              + [look(boot + 6 * H, 2.0, started=start, boot=boot, dt=H)])
    assert ls[5]["spent"] == pytest.approx(10.0)
    assert ls[6]["spent"] == pytest.approx(2.0 * (boot + 6 * H - start) / H, abs=0.01), ls[6]  # RunPod's start


def test_an_old_answer_with_the_start_before_a_restart_never_counts_the_run_twice():
    """Started at T0, restarted at T0 + 5 h, then one answer carries the old start, then the new one again: $16 for
    8 h at $2, not $26."""
    restart = T0 + 5 * H
    ls = walk([look(T0 + k * H, 2.0, dt=H if k else None) for k in range(5)]
              + [look(restart + H, 2.0, started=restart, dt=2 * H), look(restart + 2 * H, 2.0, dt=H),
                 look(restart + 3 * H, 2.0, started=restart, dt=H)])
    assert ls[-1]["spent"] == pytest.approx(8.0 + 2 * 3.0), [lg["spent"] for lg in ls]


@pytest.mark.parametrize("what,server,host", [
    ("a Date a day ahead (a proxy's, planted)", T0 + H + 86400, T0 + H),
    ("a host clock 3 h behind RunPod's", T0 + H, T0 + H - 3 * H),
])
def test_the_run_is_timed_by_runpods_clock_only_where_its_date_is_plausible(what, server, host):
    """An hour's run at $2/h is $2 whatever one Date says (a day-ahead Date made it $52, for good) and wherever this
    host's clock is (3 h behind with the start missing at first: $11.97 for $4)."""
    skew = server - host if abs(server - host) < 6 * H else 0
    first = look(host, 2.0, server_time=server, started=None if "behind" in what else T0, boot=T0 - skew)
    ls = walk([first, look(host + 1, 2.0, server_time=server + 1, dt=1.0)])
    assert ls[-1]["spent"] == pytest.approx(2.0, abs=0.01), (what, ls[-1])
