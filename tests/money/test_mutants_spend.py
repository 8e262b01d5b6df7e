"""The run's spend as readers take it, where mutation testing (`make mutate`, bench/MUTATION.md) found the earlier
tests silent: spend.total's choice between the run's total and this pod's ledger, how sure each says it is, in
words, and the least sure of several sources; the run total's parts and its words over generated pods."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podkit.money import spend

pytestmark = pytest.mark.timeout(60)
H = 3600.0
T0 = 1_800_000_000.0  # 08:00 UTC


@pytest.mark.parametrize("ledger,want", [
    (None, None), ({}, None),
    ({"total": {"spent": 3.0, "source": "read"}, "spent": 1.0}, 3.0),  # the run's total, not this pod's
    ({"total": {"spent": None, "source": "unknown"}, "spent": 2.0}, None),  # the run's is not known: said so
    ({"total": {"spent": None, "source": "read"}, "spent": 2.0, "run_before": 1.0}, 3.0),  # a total that is none
    ({"total": "x", "spent": 2.0}, 2.0), ({"spent": None, "run_before": 0.0}, None),
    ({"spent": None, "run_before": 1.5}, 1.5),  # a replacement whose own spend is not known yet
    ({"spent": 2.0}, 2.0), ({"spent": 2.0, "run_before": 1.5}, 3.5), ({"spent": 0.0}, 0.0)])
def test_the_runs_spend_is_its_total_else_this_pod_and_the_earlier_pods_it_carries(ledger, want):
    assert spend.total(ledger) == want


def test_each_sureness_says_what_it_is_with_since_when_and_why():
    assert spend.sureness({"source": "estimated", "since": T0, "why": "w"}) == "estimated since 08:00 UTC: w"
    assert spend.sureness({"source": "estimated"}) == "estimated"
    assert spend.sureness({"source": "unknown", "why": "w"}) == "unknown: w"
    assert spend.sureness({"source": "unknown"}) == "unknown"
    assert spend.sureness({"source": "billed", "why": "w"}) == "billed"
    assert spend.sureness({"source": "read"}) == "read"
    # the run's total's sureness when it has one it can say, else this pod's
    est = {"source": "estimated", "since": T0, "why": "w"}
    assert spend.total_sureness({"source": "read", "total": est}) == "estimated since 08:00 UTC: w"
    assert spend.total_sureness({"source": "read", "total": {"source": "nope"}}) == "read"
    assert spend.total_sureness({**est, "total": "x"}) == "estimated since 08:00 UTC: w"


@given(st.lists(st.sampled_from(spend.SOURCES)))
def test_the_weakest_source_is_the_least_sure_and_billed_for_none(sources):
    want = spend.SOURCES[max((spend.SOURCES.index(s) for s in sources), default=0)]
    assert spend.weakest(sources) == want


# -- the run's total across its pods: each rule's whole answer -----------------------------------------------
def ledger(t, spent=1.0, pod="me", run="run-1", started=None, source="read", per_hour=1.0, **kw):
    return {"pod": pod, "run": run, "spent": spent, "source": source, "per_hour": per_hour, "time": t,
            "started": T0 if started is None else started, "why": None, "since": None, "carried": {}, **kw}


def fig(pod, spent, t, run="run-1", per_hour=1.0, source="read", stopped=False):
    return {"pod": pod, "run": run, "spent": spent, "source": source if spent is not None else "unknown",
            "per_hour": per_hour, "time": t, "stopped": stopped}


LAST = [fig("pod-a", 5.0, T0 - 1200, per_hour=3.0)]
RT = {
    "a lost pod, billed": (ledger(T0 + 60, spent=0.05), LAST,
                           {"pod-a": {"state": "stopped", "bill": 5.75, "ended": T0 + 60}}, T0 + 60, None),
    "a lost pod, its bill refused": (ledger(T0 + 60, spent=0.05, source="estimated", why="RunPod did not answer",
                                            since=T0 + 30), LAST,
                                     {"pod-a": {"state": "stopped", "bill": None, "bill_why": "HTTP 403",
                                                "ended": T0 + 60}}, T0 + 60, None),
    "a node running beside": (ledger(T0 + H, spent=1.0, per_hour=2.0), [fig("node-1", 12.0, T0 + H - 60, per_hour=6.0)],
                              {}, T0 + H, None),
    "nothing known": (ledger(T0 + 60, spent=None, source="unknown", why="no price"), [], {}, T0 + 60, None),
    "this pod unknown, another known": (ledger(T0 + 60, spent=None, source="unknown", why="no price"),
                                        [fig("pod-a", 2.0, T0 - 60, stopped=True)], {}, T0 + 60, None),
    "an earlier look counted more": (ledger(T0 + 60, spent=1.0), [fig("pod-a", 2.0, T0 - 60, stopped=True)], {},
                                     T0 + 60, {"spent": 9.0, "parts": [
                                         {"pod": "pod-b", "spent": 4.0, "source": "read", "per_hour": 3.0},
                                         {"pod": "me", "spent": 4.0, "source": "read", "per_hour": 3.0},
                                         "x", {"pod": "pod-c", "spent": None}]}),
    "another run and this pod are no parts": (ledger(T0 + 60, spent=1.0, run=""), [fig("pod-a", 2.0, T0 - 60, run="")],
                                              {}, T0 + 60, None),
}
WANT = {
    'a lost pod, billed':
        {'parts': [{'ended': 1800000060.0,
                    'per_hour': 0.0,
                    'pod': 'pod-a',
                    'since': None,
                    'source': 'billed',
                    'spent': 5.75,
                    'time': 1799998800.0,
                    'until': 1800000000.0,
                    'why': None}],
         'per_hour': 1.0,
         'pods': 2,
         'since': None,
         'source': 'read',
         'spent': 5.8,
         'time': 1800000060.0,
         'why': None},
    'a lost pod, its bill refused':
        {'parts': [{'ended': 1800000060.0,
                    'per_hour': 0.0,
                    'pod': 'pod-a',
                    'since': 1799998800.0,
                    'source': 'estimated',
                    'spent': 6.0,
                    'time': 1799998800.0,
                    'until': 1800000000.0,
                    'why': 'its last record at 07:40 UTC; RunPod says it stopped by 08:00 UTC: its price until '
                           'then; its bill cannot be read (HTTP 403)'}],
         'per_hour': 1.0,
         'pods': 2,
         'since': 1799998800.0,
         'source': 'estimated',
         'spent': 6.05,
         'time': 1800000060.0,
         'why': 'this pod: RunPod did not answer; pod pod-a ($6.00): its last record at 07:40 UTC; RunPod says it '
                'stopped by 08:00 UTC: its price until then; its bill cannot be read (HTTP 403)'},
    'a node running beside':
        {'parts': [{'ended': None,
                    'per_hour': 6.0,
                    'pod': 'node-1',
                    'since': None,
                    'source': 'read',
                    'spent': 12.1,
                    'time': 1800003540.0,
                    'until': 1800003600.0,
                    'why': None}],
         'per_hour': 8.0,
         'pods': 2,
         'since': None,
         'source': 'read',
         'spent': 13.1,
         'time': 1800003600.0,
         'why': None},
    'nothing known':
        {'parts': [],
         'per_hour': 1.0,
         'pods': 1,
         'since': None,
         'source': 'unknown',
         'spent': None,
         'time': 1800000060.0,
         'why': 'this pod: no price'},
    'this pod unknown, another known':
        {'parts': [{'ended': None,
                    'per_hour': 0.0,
                    'pod': 'pod-a',
                    'since': None,
                    'source': 'read',
                    'spent': 2.0,
                    'time': 1799999940.0,
                    'until': 1799999940.0,
                    'why': None}],
         'per_hour': 1.0,
         'pods': 2,
         'since': None,
         'source': 'estimated',
         'spent': 2.0,
         'time': 1800000060.0,
         'why': 'this pod: no price'},
    'an earlier look counted more':
        {'parts': [{'ended': None,
                    'per_hour': 0.0,
                    'pod': 'pod-a',
                    'since': None,
                    'source': 'read',
                    'spent': 2.0,
                    'time': 1799999940.0,
                    'until': 1799999940.0,
                    'why': None},
                   {'per_hour': 0.0, 'pod': 'pod-b', 'source': 'read', 'spent': 4.0}],
         'per_hour': 1.0,
         'pods': 3,
         'since': None,
         'source': 'read',
         'spent': 9.0,
         'time': 1800000060.0,
         'why': None},
    'another run and this pod are no parts':
        {'parts': [],
         'per_hour': 1.0,
         'pods': 1,
         'since': None,
         'source': 'read',
         'spent': 1.0,
         'time': 1800000060.0,
         'why': None},
}


@pytest.mark.parametrize("what", list(RT))
def test_each_rule_of_the_run_total_gives_its_whole_answer(what):
    assert spend.run_total(*RT[what]) == WANT[what], what


def test_a_carried_pod_runpod_says_is_running_counts_its_price_until_now():
    mine = {**ledger(T0 + H), "carried": {"pod-a": {"spent": 4.0, "source": "read", "time": T0 - 600, "per_hour": 1.0}}}
    got = spend.run_total(mine, [], {"pod-a": {"state": "running", "price": 1.0}}, T0 + H)
    assert got["parts"][0]["spent"] == pytest.approx(4.0 + (H + 600) / H) and got["parts"][0]["per_hour"] == 1.0


def test_a_ledger_with_no_start_counts_a_lost_pod_until_its_own_first_look():
    """This pod's start not known: its first look stands for it (a lost pod is stopped before its replacement)."""
    mine = {**ledger(T0 + 60), "started": None}
    got = spend.run_total(mine, LAST, {"pod-a": {"state": None, "why": "HTTP 403"}}, T0 + H)
    assert got["parts"][0]["spent"] == pytest.approx(5.0 + 3.0 * 1260 / H)
    assert "until this pod started" in got["parts"][0]["why"]


def test_a_part_never_goes_down_from_the_last_look_whatever_the_total_held():
    prev = {"parts": [{"pod": "pod-a", "spent": 5.0, "source": "read"}]}
    got = spend.run_total(ledger(T0 + 60), [fig("pod-a", 2.0, T0 - 60, stopped=True)], {}, T0 + 60, prev)
    assert got["parts"][0]["spent"] == 5.0 and got["spent"] == 6.0


def test_this_pods_source_not_podkits_is_not_known_and_its_why_is_said_only_when_not_sure():
    got = spend.run_total({**ledger(T0 + 60), "source": "bogus"}, [], {}, T0 + 60)
    assert (got["source"], got["spent"]) == ("estimated", 1.0)
    assert spend.run_total({**ledger(T0 + 60), "why": "w"}, [], {}, T0 + 60)["why"] is None
    assert spend.run_total({**ledger(T0 + 60), "why": "w", "source": "estimated"}, [], {}, T0 + 60)["why"] == \
        "this pod: w"
    assert spend.run_total({**ledger(T0 + 60), "source": "estimated"}, [], {}, T0 + 60)["why"] is None


def test_a_pod_that_recorded_no_spend_is_said_not_known_never_counted_as_nothing():
    got = spend.run_total(ledger(T0 + 60), [fig("pod-a", None, T0 - 60, stopped=True)], {}, T0 + 60)
    assert got["parts"][0]["spent"] is None and got["spent"] == 1.0 and got["source"] == "estimated"
    assert got["why"] == "pod pod-a (not known): its spend is not known (it recorded none)"


def test_the_total_is_as_late_as_this_pods_estimate_goes_back_and_as_fast_as_its_running_pods():
    mine = {**ledger(T0 + 60, per_hour=0.0), "source": "estimated", "why": "w", "since": T0 + 30}
    got = spend.run_total(mine, [], {}, T0 + 60)
    assert (got["since"], got["per_hour"]) == (T0 + 30, 0.0)
    # a pod whose price RunPod reads but whose bill it refuses: read, its bill's why no reason for doubt
    node = spend.run_total(ledger(T0 + 60), [fig("pod-a", 2.0, T0)],
                           {"pod-a": {"state": "running", "price": 1.0, "bill": None, "bill_why": "HTTP 403"}}, T0 + 60)
    assert node["parts"][0]["source"] == "read" and node["why"] is None and node["source"] == "read"


def test_a_last_total_below_this_one_takes_nothing_away():
    got = spend.run_total(ledger(T0 + 60, spent=1.0), [], {}, T0 + 60, {"spent": 0.5, "parts": []})
    assert got["spent"] == 1.0
    unknown = spend.run_total(ledger(T0 + 60, spent=None, source="unknown"), [], {}, T0 + 60, {"spent": 0.5})
    assert unknown["spent"] == 0.5


def test_the_total_is_rounded_to_the_nano_dollar_its_pace_to_the_micro_and_its_why_to_600_characters():
    got = spend.run_total({**ledger(T0 + 60, spent=1.0000000004, per_hour=1.5000004), "source": "estimated",
                           "why": "w" * 700}, [], {}, T0 + 60)
    assert (got["spent"], got["per_hour"]) == (1.0, 1.5) and got["why"] == ("this pod: " + "w" * 700)[:600]
