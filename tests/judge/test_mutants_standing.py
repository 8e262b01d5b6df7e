"""The standing's rules where mutation testing (`make mutate`, bench/MUTATION.md) found the earlier tests silent:
each branch of standing.judge with its whole answer (the words a person reads, what must start again, since
when), the edges of its time rules (a start's slack, an ask's freshness), and properties over generated evidence:
the trainer's state and its last end are reported as they are, whatever the rule that decided."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podkit.host.supervisord import BACKOFF, EXITED, FATAL, RUNNING, STARTING, STOPPED, STOPPING
from podkit.judge import ending, standing
from podkit.judge.standing import Evidence, Program

pytestmark = pytest.mark.timeout(60)
T0 = 1_000_000.0
NOW = T0 + 1000
STATES = (STARTING, RUNNING, BACKOFF, STOPPING, EXITED, STOPPED, FATAL)


def end(by, t, pid=4242, step=7, **kw):
    return {"by": by, "time": T0 + t, "program": pid, "step": step, "message": "KeyError: 'answer'", **kw}


def ev(trainer=None, rec=None, sglang=RUNNING, **kw):
    programs = {"sglang": Program(sglang, T0 + 1, T0)}
    if trainer is not None:
        programs["trainer"] = trainer
    return Evidence(programs, rec, now=NOW, booted=T0 - 10, **kw)


CRASH = end(ending.CRASH_LOOP, 85)
FIN = end(ending.FINISHED_KINDS[0], 80)
YOU = ({"program": "trainer", "by": "you (podkit ctl stop trainer)", "time": T0 + 89},)
GAVE_UP = {"gave_up": True, "last_failure": T0 + 29, "head": "10.0.0.1:6379"}
TR = "the trainer"
CASES = [
    # (what, evidence, (run, can_train, why, who, since, stuck))
    ("safe mode", ev(Program(EXITED, T0 + 90, T0 + 5, 4242), CRASH,
                     safe_mode={"stage": "config", "message": "bad key", "since": T0 + 3}),
     ("safe-mode", False, "in safe mode (config): bad key", "", T0 + 3, False)),
    ("safe mode with no time", ev(None, None, safe_mode={"stage": "boot", "message": "m", "since": "soon"}),
     ("safe-mode", False, "in safe mode (boot): m", "", None, False)),
    ("supervisord gone", ev(None, CRASH, reachable=False, exited=True),
     ("not-running", None, "the pod is not running (supervisord has exited)", "", None, False)),
    ("supervisord silent", ev(None, None, reachable=False),
     ("unknown", None, "supervisord does not answer", "", None, False)),
    ("trainer FATAL", ev(Program(FATAL, T0 + 90, T0 + 5, 4242), CRASH),
     ("cannot-train", False, "trainer FATAL (supervisord gave up starting it)", TR, T0 + 90, True)),
    ("sglang FATAL", ev(Program(RUNNING, T0 + 5, T0 + 5, 4242), sglang=FATAL),
     ("cannot-train", False, "sglang FATAL (supervisord gave up starting it)", "sglang", T0 + 1, True)),
    ("ray gave up", Evidence({"ray": Program(EXITED, T0 + 60, T0 + 30)}, None, GAVE_UP, now=NOW),
     ("cannot-train", False, "this node cannot join its cluster (the Ray head at 10.0.0.1:6379)", "`ray`", T0 + 60,
      True)),
    ("no trainer", ev(None, None), ("no-trainer", None, "no trainer program on this node", "", None, False)),
    ("final, exited", ev(Program(EXITED, T0 + 90, T0 + 5, 4242), CRASH),
     ("cannot-train", False, "the trainer stopped for good (crash-loop)", TR, T0 + 90, True)),
    ("final, stopped", ev(Program(STOPPED, T0 + 95, T0 + 5, 4242), end(ending.NEVER_TRAINED, 80)),
     ("cannot-train", False, "the trainer stopped for good (never-trained)", TR, T0 + 95, True)),
    ("finished", ev(Program(EXITED, T0 + 90, T0 + 5, 4242), FIN),
     ("finished", False, "it finished its run at step 7", "", T0 + 90, False)),
    ("finished, stopped", ev(Program(STOPPED, T0 + 91, T0 + 5, 4242), FIN),
     ("finished", False, "it finished its run at step 7", "", T0 + 91, False)),
    ("stopped by you", ev(Program(STOPPED, T0 + 90, T0 + 5, 4242), end(ending.SIGTERM, 89), asked=YOU),
     ("stopped", True, "the trainer is stopped by you (podkit ctl stop trainer): the cost guard leaves the pod up "
      "(`podkit ctl start trainer` starts it)", TR, T0 + 90, False)),
    ("stopped by the watchdog", ev(Program(STOPPED, T0 + 90, T0 + 5, 4242), end(ending.SIGTERM, 89),
                                   asked=({"program": "all", "by": "the watchdog (a hang)", "time": T0 + 89},)),
     ("stopped", True, "the trainer is stopped (by the watchdog (a hang)) and nothing will start it (`podkit ctl "
      "start trainer` does)", TR, T0 + 90, True)),
    ("stopped by nobody", ev(Program(STOPPED, T0 + 90, T0 + 5, 4242), None),
     ("stopped", True, "the trainer is stopped (not by podkit ctl) and nothing will start it (`podkit ctl start "
      "trainer` does)", TR, T0 + 90, True)),
    ("exited with an end", ev(Program(EXITED, T0 + 90, T0 + 5, 4242), end(ending.FAILED, 88)),
     ("ended", None, "the trainer exited (failed: KeyError: 'answer') and nothing will start it", TR, T0 + 90, True)),
    ("exited with no end", ev(Program(EXITED, T0 + 90, T0 + 5, 4242), None),
     ("ended", None, "the trainer exited without recording a final end", TR, T0 + 90, True)),
    ("exited, another's end", ev(Program(EXITED, T0 + 90, T0 + 5, 4343), CRASH),
     ("ended", None, "the trainer exited without recording a final end", TR, T0 + 90, True)),
    ("backoff", ev(Program(BACKOFF, T0 + 90, T0 + 5, 4242), end(ending.FAILED, 89)),
     ("restarting", True, "the trainer is restarting", TR, T0 + 90, False)),
    ("stopping", ev(Program(STOPPING, T0 + 92, T0 + 5, 4242)),
     ("restarting", True, "the trainer is restarting", TR, T0 + 92, False)),
    ("starting", ev(Program(STARTING, T0 + 90, T0 + 90, 4242)), ("starting", True, "", "", T0 + 90, False)),
    ("training", ev(Program(RUNNING, T0 + 5, T0 + 5, 4242)), ("training", True, "", "", T0 + 5, False)),
    ("a state supervisord never names", ev(Program("UNKNOWN", T0 + 6, T0 + 5, 4242)),
     ("unknown", None, "the trainer is UNKNOWN", TR, T0 + 6, False)),
]


@pytest.mark.parametrize("what,evidence,want", CASES, ids=[c[0] for c in CASES])
def test_each_rule_of_the_standing_gives_its_whole_answer(what, evidence, want):
    s = standing.judge(evidence)
    assert (s.run, s.can_train, s.why, s.who, s.since, s.stuck) == want, what


def test_a_ray_that_gave_up_counts_from_its_start_less_the_slack_exactly():
    def judged(last_failure, started):
        loop = {"gave_up": True, "last_failure": last_failure, "head": "h:1"}
        return standing.judge(Evidence({"ray": Program(EXITED, T0 + 60, started)}, None, loop, now=NOW))
    assert judged(T0 + 30 - standing.SLACK_S, T0 + 30).stuck  # stamped a second early: this start's
    assert not judged(T0 + 30 - standing.SLACK_S - 0.01, T0 + 30).stuck
    assert judged(-0.5, None).stuck  # no start known: any failure on record is this start's
    assert not judged(-1.5, None).stuck
    # a loop record that is not a dict (a corrupt file) is no evidence, never a crash
    assert standing.judge(Evidence({"ray": Program(EXITED, T0 + 60, T0 + 30)}, None, None, now=NOW)).run == \
        standing.NO_TRAINER


def test_an_end_counts_for_the_run_from_its_start_less_the_slack_and_by_its_own_process():
    rec = end(ending.CRASH_LOOP, 4)  # the start at T0 + 5, stamped a second before it
    edge = standing.judge(ev(Program(EXITED, T0 + 90, T0 + 5, 4242), rec))
    assert edge.last["this_run"] and edge.run == standing.CANNOT
    early = standing.judge(ev(Program(EXITED, T0 + 90, T0 + 5, 4242), end(ending.CRASH_LOOP, 3.99)))
    assert not early.last["this_run"] and early.run == standing.ENDED
    # no start known: the boot counts (booted T0 - 10)
    assert standing.judge(ev(Program(EXITED, T0 + 90, None, 4242), end(ending.CRASH_LOOP, -11))).last["this_run"]
    assert not standing.judge(ev(Program(EXITED, T0 + 90, None, 4242), end(ending.CRASH_LOOP, -11.5))).last[
        "this_run"]
    # an end stamped at the epoch (a clock never set) is before any start after it, however close
    stamped_0 = {**end(ending.CRASH_LOOP, 0), "time": 0.0}
    assert not standing.judge(ev(Program(EXITED, T0 + 90, 1.5, 4242), stamped_0)).last["this_run"]
    # a process named as True (not a pid) or a trainer whose pid is not known: the record is not another's
    for named, pid in ((True, 4343), (4242, None), ("4343", 4242)):
        s = standing.judge(ev(Program(EXITED, T0 + 90, T0 + 5, pid), end(ending.CRASH_LOOP, 85, pid=named)))
        assert s.last["this_run"] and s.run == standing.CANNOT, (named, pid)


@pytest.mark.parametrize("at,start,t,who", [
    # since the trainer's start (a stop may take its whole grace), up to 5 s after the stop
    (T0 + 500, T0 + 50, T0 + 49, "you"), (T0 + 500, T0 + 50, T0 + 48.9, ""),
    (T0 + 500, T0 + 50, T0 + 500 - ending.ASKED_FRESH_S - 0.1, "you"),
    (T0 + 500, T0 + 50, T0 + 505, "you"), (T0 + 500, T0 + 50, T0 + 505.1, ""),
    (None, T0 + 50, T0 + 49, "you"), (None, T0 + 50, T0 + 48.9, ""),
    # no start known: within ASKED_FRESH_S before the stop
    (T0 + 500, None, T0 + 500 - ending.ASKED_FRESH_S, "you"), (T0 + 500, None, T0 + 500 - ending.ASKED_FRESH_S - 0.1, ""),
    (None, None, T0 + 49, "")])
def test_an_ask_counts_for_a_stop_within_its_freshness_and_its_grace(at, start, t, who):
    trainer = Program(STOPPED, at, start, 4242)
    asked = ({"program": "trainer", "by": "you (podkit ctl stop trainer)", "time": t},)
    assert standing.stopped_by(asked, trainer) == ("you (podkit ctl stop trainer)" if who else "")


def test_the_last_ask_that_counts_names_the_stop_and_what_is_not_an_ask_is_skipped():
    trainer = Program(STOPPED, T0 + 500, T0 + 50, 4242)
    asks = ({"program": "trainer", "by": "you (first)", "time": T0 + 480},
            {"program": "sglang", "by": "you (sglang)", "time": T0 + 490}, "not an ask",
            {"program": "trainer", "by": 7, "time": T0 + 491}, {"program": "trainer", "by": "x", "time": True},
            {"program": "all", "by": "y" * 300, "time": T0 + 495},
            {"program": "trainer", "by": "late", "time": T0 + 600})
    assert standing.stopped_by(asks, trainer) == "y" * 200
    assert standing.stopped_by(asks[:4], trainer) == "you (first)"
    assert standing.stopped_by([asks[0]], trainer) == "you (first)"  # a list, as read back from JSON
    assert standing.stopped_by(None, trainer) == "" and standing.stopped_by("you", trainer) == ""


times = st.floats(0, 2000, allow_nan=False)
programs_ = st.builds(Program, st.sampled_from(STATES + ("UNKNOWN",)), st.one_of(st.none(), times.map(lambda t: T0 + t)),
                      st.one_of(st.none(), times.map(lambda t: T0 + t)), st.sampled_from([None, 4242, 4343]))
ends = st.one_of(st.none(), st.builds(end, st.sampled_from(tuple(ending.KINDS)), st.floats(-100, 1200),
                                      st.sampled_from([4242, 4343, None]),
                                      st.one_of(st.none(), st.integers(0, 50), st.just(True))))
evidence = st.builds(
    Evidence, st.fixed_dictionaries({}, optional={"trainer": programs_, "sglang": programs_, "ray": programs_}), ends,
    st.one_of(st.just({}), st.fixed_dictionaries({"gave_up": st.booleans(), "last_failure": times.map(lambda t: T0 + t),
                                                  "head": st.just("h:1")})),
    st.sampled_from([None, None, None, {"stage": "config", "message": "m", "since": T0}]),
    st.sampled_from([True, True, True, False, None]), st.booleans(), st.one_of(st.none(), times.map(lambda t: T0 + t)),
    st.just(NOW))


@settings(max_examples=300, deadline=None)
@given(evidence)
def test_the_trainer_and_its_last_end_are_reported_as_they_are_whatever_rule_decided(e):
    s = standing.judge(e)
    t = e.programs.get("trainer")
    assert s.state == ({"name": t.state, "since": t.since, "pid": t.pid} if t else
                       {"name": None, "since": None, "pid": None})
    rec = ending.of(e.end, now=e.now)
    if rec is None:
        assert s.last is None
        return
    step = e.end["step"] if isinstance(e.end["step"], int) and e.end["step"] is not True else None
    assert s.last == {"kind": rec.kind.name, "family": rec.family, "words": rec.words(), "said": rec.said(),
                      "time": e.end["time"], "step": step, "first": rec.first(),
                      "fix": rec.hint or rec.kind.fix or "", "this_run": s.last["this_run"]}
    # what must start again is named exactly when it cannot train or waits on a restart, never while it trains
    assert (s.who == "") == (s.run in (standing.TRAINING, standing.STARTING_, standing.FINISHED, standing.SAFE_MODE,
                                       standing.NOT_RUNNING, standing.UNKNOWN, standing.NO_TRAINER)
                             and not (s.run == standing.UNKNOWN and t is not None and e.reachable is not False))
    assert (s.why == "") == (s.run in (standing.TRAINING, standing.STARTING_))

