"""The spend ledger (spend.advance) as a pure function: its rules as properties over generated looks at RunPod
(Hypothesis), beside the cases issue 48 found, each a sequence of looks with the spend a person would expect."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podkit import spend

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
