"""The run's spend as readers take it, where mutation testing (`make mutate`, bench/MUTATION.md) found the earlier
tests silent: spend.total's choice between the run's total and this pod's ledger, how sure each says it is, in
words, and the least sure of several sources; the run total's parts and its words over generated pods."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podkit import spend

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
