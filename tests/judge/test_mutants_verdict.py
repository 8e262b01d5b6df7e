"""The judge of a run's end (verdict.decide), where mutation testing (`make mutate`, bench/MUTATION.md) found the
earlier tests silent: each of decide's rules with the whole end it gives (its words, its step, its evidence and
hint), at the edges of its time rules (an ask's slack, a tie between two exceptions), and properties over
generated evidence: what is not evidence (an exception with no time, an own record of no record) decides nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podkit.judge import ending, verdict

pytestmark = pytest.mark.timeout(60)
T0 = 1_000_000.0  # the run's start
def err(t, type_="ValueError", message="bad row", rank=0, **facts):
    return {"time": T0 + t, "rank": rank, "type": type_, "message": message, "where": "train.py:42", **facts}


def ev(**kw):
    base = {"rc": 1, "started": T0, "finished": T0 + 100, "program": 4242, "place": "pod", "own": None,
            "asked": None, "errors": [], "signalled": [], "silent": [], "oom": "", "cgroup": "", "inference": None,
            "progress": {"step": 5, "time": T0 + 50}, "hang": None, "lease": ""}
    return {**base, **kw}


def own(by, t, **kw):
    return {"by": by, "time": T0 + t, "program": 4242, "message": f"{by} said", **kw}


def asked(t, by="you (podkit ctl restart trainer)", supervisord=True, **kw):
    return {"at": T0 + t, "by": by, "supervisord": supervisord, **kw}


KILL = {"rank": 1, "pid": 8, "signal": "SIGKILL"}
CASES = {
    "lease lost: the trainer's own word": ev(own=own(ending.LEASE_LOST, 10), errors=[err(5)]),
    "an own record of no-record is no record": ev(rc=0, own=own(ending.ENDED, 10)),
    "an own record with no time is no record": ev(rc=0, own={"by": ending.CRASH_LOOP, "time": None}),
    "a stray signal before any failure": ev(rc=1, signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 30}],
                                            errors=[err(40)]),
    "a forwarded signal is no one's kill": ev(rc=1, signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 30,
                                                                "forwarded": True}], errors=[err(40)]),
    "finished": ev(rc=0, own=own(ending.DONE, 60, step=9)),
    "a failure after the finish": ev(rc=1, own=own(ending.DONE, 60, step=9), errors=[err(70)]),
    "killed, with its error": ev(rc=None, errors=[err(40)]),
    "killed, a hang": ev(rc=None, errors=[err(40)], hang={"time": T0 + 30, "reason": "no step", "where": "w.py:1",
                                                         "dump": "d.txt"}),
    "asked, with an error before it": ev(rc=1, asked=asked(50), errors=[err(40), err(60)]),
    "asked, an error a second before is after it": ev(rc=1, asked=asked(50), errors=[err(49.5)]),
    "asked, refused before": ev(rc=1, asked=asked(50), own=own(ending.CONFIG_ERROR, 40)),
    "asked, refused within the slack": ev(rc=1, asked=asked(50), own=own(ending.CONFIG_ERROR, 49.5)),
    "asked, noted": ev(rc=1, asked=asked(50, noted="it was killed after the grace", cut=True)),
    "asked by a clock": ev(rc=1, asked=asked(50, supervisord=False), clock="12:00:00"),
    "asked, a hang": ev(rc=1, asked=asked(50, by="the watchdog", kind=ending.HANG)),
    "never trained, a rank failed first": ev(rc=0, own=own(ending.NEVER_TRAINED, 60), errors=[err(40, rank=1)]),
    "never trained, failed after": ev(rc=0, own=own(ending.NEVER_TRAINED, 60), errors=[err(70)]),
    "config error with an error before": ev(rc=1, own=own(ending.CONFIG_ERROR, 60), errors=[err(40)]),
    "stale weights": ev(rc=75, own=own(ending.STALE, 60), errors=[err(40)]),
    "inference stopped, own": ev(rc=75, own=own(ending.INFERENCE_STOPPED, 60), errors=[err(40)]),
    "own SIGTERM, no errors": ev(rc=1, own=own(ending.SIGTERM, 60, step=4)),
    "own SIGTERM with errors": ev(rc=1, own=own(ending.SIGTERM, 60), errors=[err(40)]),
    "a rank killed first": ev(rc=1, silent=[KILL], errors=[err(40, "RuntimeError", "Connection closed by peer")]),
    "a rank killed, but signalled first": ev(rc=1, silent=[KILL], signalled=[{"rank": 1, "signal": "SIGTERM",
                                                                               "at": T0 + 50, "forwarded": True}],
                                             errors=[err(40)]),
    "two errors, the first decides": ev(rc=1, errors=[err(41, "KeyError", "b"), err(40, "KeyError", "a")]),
    "errors at one time, by content": ev(rc=1, errors=[err(40, "KeyError", "b"), err(40, "KeyError", "a")]),
    "errors with no time are no errors": ev(rc=1, errors=[{**err(40), "time": None}, {**err(40), "time": float("nan")},
                                                          {**err(40), "time": True}, "x"]),
    "silence": ev(rc=1),
    "silence, exit 0": ev(rc=0),
}

WANT = {
    "lease lost: the trainer's own word":
        {'by': 'lease-lost', 'message': 'lease-lost said', 'program': 4242, 'time': 1000010.0},
    'an own record of no-record is no record':
        {'by': 'no-record', 'step': 5},
    'an own record with no time is no record':
        {'by': 'no-record', 'step': 5},
    'a stray signal before any failure':
        {'asked': "a SIGTERM sent to rank 1, not by podkit (someone's kill)",
         'by': 'stray SIGTERM',
         'cut': None,
         'message': '',
         'step': 5},
    "a forwarded signal is no one's kill":
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'ValueError: bad row at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'finished':
        {'by': 'done', 'message': 'done said', 'program': 4242, 'step': 9, 'time': 1000060.0},
    'a failure after the finish':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000070.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'after training finished (at step 9, its checkpoint whole): ValueError: bad row at train.py:42',
         'step': 9,
         'where': 'train.py:42'},
    'killed, with its error':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'ValueError: bad row at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'killed, a hang':
        {'by': 'hung',
         'evidence': ["the watchdog's restart (d.txt)"],
         'hint': 'the code at w.py:1 waits for something that never comes: give that wait a timeout '
                 '(asyncio.wait_for for an await) or fix what it waits for; the dump names every thread and task',
         'message': 'no step',
         'step': 5,
         'where': 'w.py:1'},
    'asked, with an error before it':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'ValueError: bad row at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'asked, an error a second before is after it':
        {'asked': 'you (podkit ctl restart trainer)', 'by': 'SIGTERM', 'cut': None, 'message': '', 'step': 5},
    'asked, refused before':
        {'by': 'config-error', 'message': 'config-error said', 'program': 4242, 'time': 1000040.0},
    'asked, refused within the slack':
        {'asked': 'you (podkit ctl restart trainer)', 'by': 'SIGTERM', 'cut': None, 'message': '', 'step': 5},
    'asked, noted':
        {'asked': 'you (podkit ctl restart trainer)',
         'by': 'SIGTERM',
         'cut': True,
         'evidence': ['it was killed after the grace'],
         'message': '',
         'step': 5},
    'asked by a clock':
        {'asked': 'you (podkit ctl restart trainer)',
         'by': 'stray SIGTERM',
         'cut': None,
         'evidence': ['a SIGTERM at 12:00:00, asked by you (podkit ctl restart trainer)'],
         'message': '',
         'step': 5},
    'asked, a hang':
        {'asked': 'the watchdog',
         'by': 'hung',
         'cut': None,
         'hint': 'no frame of your code was waiting: read the dump (logs/hang-*.txt) for where AReaL or torch '
                 'waited (a collective, a lost rank, a dead rollout server)',
         'message': 'the watchdog',
         'step': 5},
    'never trained, a rank failed first':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 1,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'ValueError: bad row at train.py:42 (the script then exited 0)',
         'step': 5,
         'where': 'train.py:42'},
    'never trained, failed after':
        {'by': 'never-trained', 'message': 'never-trained said', 'program': 4242, 'time': 1000060.0},
    'config error with an error before':
        {'by': 'config-error', 'message': 'config-error said', 'program': 4242, 'time': 1000060.0},
    'stale weights':
        {'by': 'stale-weights', 'message': 'stale-weights said', 'program': 4242, 'time': 1000060.0},
    'inference stopped, own':
        {'by': 'inference-stopped', 'message': 'inference-stopped said', 'program': 4242, 'time': 1000060.0},
    'own SIGTERM, no errors':
        {'asked': "a SIGTERM sent to the ranks, not to the trainer program (someone's kill)",
         'by': 'stray SIGTERM',
         'message': 'SIGTERM said',
         'step': 4},
    'own SIGTERM with errors':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'ValueError: bad row at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'a rank killed first':
        {'by': 'killed-by-signal',
         'evidence': ['no OOM kill on record (no memory cgroup to read here)',
                      'then rank 0: RuntimeError: Connection closed by peer at train.py:42 (its fallout)'],
         'hint': 'an OOM kill leaves no trace where the cgroup cannot be read: check `dmesg` on the host; else '
                 'find who sends it',
         'message': 'rank 1 (pid 8, SIGKILL) ended without a word: killed by SIGKILL that podkit did not send',
         'step': 5},
    'a rank killed, but signalled first':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000040.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': ["then rank 1 ended without a word (torchrun's stop)"],
         'hint': '',
         'message': 'ValueError: bad row at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'two errors, the first decides':
        {'by': 'script-error',
         'error': {'message': 'a', 'rank': 0, 'time': 1000040.0, 'type': 'KeyError', 'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'KeyError: a at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'errors at one time, by content':
        {'by': 'script-error',
         'error': {'message': 'a', 'rank': 0, 'time': 1000040.0, 'type': 'KeyError', 'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'KeyError: a at train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'errors with no time are no errors':
        {'by': 'script-error',
         'message': 'exit 1, no exception recorded (logs/trainer.log has what it printed)',
         'step': 5},
    'silence':
        {'by': 'script-error',
         'message': 'exit 1, no exception recorded (logs/trainer.log has what it printed)',
         'step': 5},
    'silence, exit 0':
        {'by': 'no-record', 'step': 5},}


# the edges of decide's time rules, and the trainer's own word where no rule above it speaks
MORE = {
    "a signal to a rank after another ended without a word is torchrun's": ev(
        rc=1, signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 30}], silent=[{"rank": 0, "pid": 7, "signal": None}]),
    "finished with no step of its own, then failed": ev(rc=1, own={"by": ending.DONE, "time": T0 + 60, "program": 4242},
                                                         errors=[err(70)]),
    "asked, an error exactly the slack before": ev(rc=1, asked=asked(50), errors=[err(49)]),
    "asked, refused exactly the slack before": ev(rc=1, asked=asked(50), own=own(ending.CONFIG_ERROR, 49)),
    "asked, the trainer's own SIGTERM after": ev(rc=1, asked=asked(50), own=own(ending.SIGTERM, 51, step=4)),
    "never trained, a rank failed at the same moment": ev(rc=0, own=own(ending.NEVER_TRAINED, 60), errors=[err(60)]),
    "a stray SIGTERM the trainer recorded, with errors": ev(rc=1, own=own(ending.STRAY, 60), errors=[err(40)]),
    "own SIGTERM with no message": ev(rc=1, own={"by": ending.SIGTERM, "time": T0 + 60, "program": 4242}),
}
CASES.update(MORE)
WANT.update({
    "a signal to a rank after another ended without a word is torchrun's":
        {'by': 'killed-by-signal',
         'evidence': ['no OOM kill on record (no memory cgroup to read here)'],
         'hint': 'an OOM kill leaves no trace where the cgroup cannot be read: check `dmesg` on the host; else '
                 'find who sends it',
         'message': 'rank 0 (pid 7) ended without a word: killed by a signal that podkit did not send',
         'step': 5},
    'finished with no step of its own, then failed':
        {'by': 'script-error',
         'error': {'message': 'bad row',
                   'rank': 0,
                   'time': 1000070.0,
                   'type': 'ValueError',
                   'where': 'train.py:42'},
         'evidence': None,
         'hint': '',
         'message': 'after training finished (before its first step, its checkpoint whole): ValueError: bad row at '
                    'train.py:42',
         'step': 5,
         'where': 'train.py:42'},
    'asked, an error exactly the slack before':
        {'asked': 'you (podkit ctl restart trainer)', 'by': 'SIGTERM', 'cut': None, 'message': '', 'step': 5},
    'asked, refused exactly the slack before':
        {'asked': 'you (podkit ctl restart trainer)', 'by': 'SIGTERM', 'cut': None, 'message': '', 'step': 5},
    "asked, the trainer's own SIGTERM after":
        {'asked': 'you (podkit ctl restart trainer)',
         'by': 'SIGTERM',
         'cut': None,
         'message': 'SIGTERM said',
         'step': 4},
    'never trained, a rank failed at the same moment':
        {'by': 'never-trained', 'message': 'never-trained said', 'program': 4242, 'time': 1000060.0},
    'a stray SIGTERM the trainer recorded, with errors':
        {'by': 'stray SIGTERM', 'message': 'stray SIGTERM said', 'program': 4242, 'time': 1000060.0},
    'own SIGTERM with no message':
        {'asked': "a SIGTERM sent to the ranks, not to the trainer program (someone's kill)",
         'by': 'stray SIGTERM',
         'message': '',
         'step': 5},
})


@pytest.mark.parametrize("what", list(CASES))
def test_each_rule_of_decide_gives_its_whole_end(what):
    assert verdict.decide(CASES[what]) == WANT[what], what


NOT_ERRORS = st.one_of(st.just("x"), st.builds(lambda t: {**err(40), "time": t},
                                               st.sampled_from([None, True, False, float("nan"), float("inf"), "40"])))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(CASES)), st.lists(NOT_ERRORS, max_size=3), st.randoms())
def test_an_exception_with_no_time_is_no_evidence_wherever_it_stands(what, junk, rnd):
    e = CASES[what]
    errors = list(e["errors"]) + junk
    rnd.shuffle(errors)
    assert verdict.decide({**e, "errors": errors}) == WANT[what]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(CASES)), st.sampled_from([ending.ENDED, None]), st.floats(-100, 100))
def test_an_own_record_of_no_record_or_with_no_time_decides_nothing(what, by, t):
    e = CASES[what]
    if e["own"] is not None:
        return
    rec = {"by": by or ending.CRASH_LOOP, "time": T0 + t if by else None, "program": 4242}
    assert verdict.decide({**e, "own": rec}) == WANT[what]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(CASES)), st.sampled_from(["x", {}, {"by": "you"}, {"at": None, "by": "you"},
                                                       {"at": float("nan")}, {"at": 0}]))
def test_an_ask_with_no_time_is_no_ask(what, junk):
    e = CASES[what]
    if e["asked"] is not None:
        return
    assert verdict.decide({**e, "asked": junk}) == WANT[what]


def test_the_fallout_of_a_rank_killed_first_names_a_rank_it_cannot_know_as_a_question_mark():
    e = ev(rc=1, silent=[KILL], errors=[{k: v for k, v in err(40, "RuntimeError", "Connection closed by peer").items()
                                         if k != "rank"}])
    assert verdict.decide(e)["evidence"][-1] == \
        "then rank ?: RuntimeError: Connection closed by peer at train.py:42 (its fallout)"
