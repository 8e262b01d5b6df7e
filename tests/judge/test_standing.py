"""The pod's standing as a pure function of gathered evidence (src/podkit/judge/standing.py): the cases a user's runs
make, and property tests (Hypothesis) for its invariants over generated evidence: what may stop the pod (stuck),
that an earlier run's or another process's record never decides, that the listener's events and supervisord's
answer are judged alike, and what the durability figures may say."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podkit.host.supervisord import BACKOFF, EXITED, FATAL, RUNNING, STARTING, STOPPED, STOPPING
from podkit.judge import ending, standing
from podkit.judge.standing import Evidence, Program

pytestmark = pytest.mark.timeout(120)
T0 = 1_000_000.0
STATES = (STARTING, RUNNING, BACKOFF, STOPPING, EXITED, STOPPED, FATAL)
KINDS = tuple(ending.KINDS)


def end(by, t, pid=4242, step=7, **kw):
    return {"by": by, "time": T0 + t, "program": pid, "step": step, "message": "KeyError: 'answer'", **kw}


def judge(trainer=None, end_rec=None, sglang=RUNNING, **kw):
    programs = {"sglang": Program(sglang, T0 + 1, T0)}
    if trainer is not None:
        programs["trainer"] = trainer
    return standing.judge(Evidence(programs, end_rec, now=T0 + 1000, booted=T0 - 10, **kw))


YOU = ({"program": "trainer", "by": "you (podkit ctl stop trainer)", "time": T0 + 89},)
CASES = [
    # (what, trainer, end, asks, run, can_train, stuck: the pod stops after guard.stop_pod_after_s)
    ("a trainer that steps", Program(RUNNING, T0 + 5, T0 + 5, 4242), None, (), standing.TRAINING, True, False),
    ("a trainer that finished its run", Program(EXITED, T0 + 90, T0 + 5, 4242), end(ending.FINISHED_KINDS[0], 80), (),
     standing.FINISHED, False, False),
    ("a finished trainer the watchdog stopped", Program(STOPPED, T0 + 95, T0 + 5, 4242),
     end(ending.FINISHED_KINDS[0], 80), (), standing.FINISHED, False, False),
    ("a script stopped for good by the loop bound", Program(EXITED, T0 + 90, T0 + 5, 4242),
     end(ending.CRASH_LOOP, 85), (), standing.CANNOT, False, True),
    ("a script stopped for good that did not exit, stopped by the watchdog", Program(STOPPED, T0 + 95, T0 + 5, 4242),
     end(ending.NEVER_TRAINED, 80), (), standing.CANNOT, False, True),
    ("the same record, from an earlier run of the trainer", Program(EXITED, T0 + 90, T0 + 50, 4343),
     end(ending.CRASH_LOOP, 20, pid=4242), (), standing.ENDED, None, True),
    ("a record by another process since the start", Program(EXITED, T0 + 90, T0 + 5, 4343),
     end(ending.CRASH_LOOP, 85, pid=4242), (), standing.ENDED, None, True),
    ("a trainer whose end could not be written (a full volume)", Program(EXITED, T0 + 90, T0 + 5, 4242), None, (),
     standing.ENDED, None, True),
    ("a trainer you stopped", Program(STOPPED, T0 + 90, T0 + 5, 4242), end(ending.SIGTERM, 89), YOU,
     standing.STOPPED_, True, False),
    ("a trainer stopped by nobody who said so (supervisorctl)", Program(STOPPED, T0 + 90, T0 + 5, 4242),
     end(ending.SIGTERM, 89), (), standing.STOPPED_, True, True),
    ("a trainer you stopped long before its last stop", Program(STOPPED, T0 + 900, T0 + 500, 4242),
     end(ending.SIGTERM, 899), YOU, standing.STOPPED_, True, True),
    ("a trainer supervisord gave up on", Program(FATAL, T0 + 90, T0 + 5, 4242), None, (), standing.CANNOT, False,
     True),
    # the adversarial pass: a stop you asked for that took its whole stop grace (141 s) is still yours; an ask after
    # the stop is not its cause; `podkit up`'s stop of all; a stop whose start is not known
    ("a trainer you stopped whose stop took its grace", Program(STOPPED, T0 + 300, T0 + 5, 4242),
     end(ending.SIGTERM, 299), ({"program": "trainer", "by": "you (podkit ctl stop trainer)", "time": T0 + 150},),
     standing.STOPPED_, True, False),
    ("an ask of yours after the stop", Program(STOPPED, T0 + 90, T0 + 5, 4242), end(ending.SIGTERM, 89),
     ({"program": "trainer", "by": "you (podkit ctl stop trainer)", "time": T0 + 200},), standing.STOPPED_, True,
     True),
    ("every program stopped by you", Program(STOPPED, T0 + 90, T0 + 5, 4242), end(ending.SIGTERM, 89),
     ({"program": "all", "by": "you (podkit up got SIGINT)", "time": T0 + 88},), standing.STOPPED_, True, False),
    ("a stop of yours, its start not known", Program(STOPPED, T0 + 90, None, 4242), None, YOU, standing.STOPPED_,
     True, False),
    ("`podkit resume` syncing the fix of a trainer stopped for good", Program(EXITED, T0 + 90, T0 + 5, 4242),
     end(ending.CRASH_LOOP, 85), ({"program": "trainer", "by": "you (podkit resume)", "time": T0 + 900,
                                   "kind": "resume"},), standing.RESTARTING, True, False),
    ("a `podkit resume` that gave up long ago", Program(EXITED, T0 - 5000, T0 - 6000, 4242),
     end(ending.CRASH_LOOP, -5010), ({"program": "trainer", "by": "you (podkit resume)", "time": T0 - 4000,
                                      "kind": "resume"},), standing.CANNOT, False, True),
    ("a trainer restarting after a failure", Program(BACKOFF, T0 + 90, T0 + 5, 4242), end(ending.FAILED, 89), (),
     standing.RESTARTING, True, False),
    ("an end stamped an hour ahead (planted, or another node's clock)", Program(EXITED, T0 + 90, T0 + 5, 4242),
     end(ending.CRASH_LOOP, 1000 + 3600), (), standing.ENDED, None, True),
]


@pytest.mark.parametrize("what,trainer,rec,asked,run,can,stuck", CASES, ids=[c[0] for c in CASES])
def test_each_case_is_judged_as_its_user_would(what, trainer, rec, asked, run, can, stuck):
    s = judge(trainer, rec, asked=asked)
    assert (s.run, s.can_train, s.stuck) == (run, can, stuck), (what, s)
    if run == standing.STOPPED_:
        assert ("by you" in s.why) == (not stuck), s.why


def test_a_cluster_nodes_ray_fatal_is_stuck_and_names_ray():
    s = standing.judge(Evidence({"ray": Program(FATAL, T0 + 60, T0 + 30), "trainer": Program(RUNNING, T0, T0)},
                                now=T0 + 100))
    assert s.stuck and s.who == "`ray`" and "ray FATAL" in s.why


def test_inference_fatal_stops_the_run_and_names_sglang_as_what_must_start_again():
    s = judge(Program(RUNNING, T0 + 5, T0 + 5), sglang=FATAL)
    assert s.stuck and s.who == "sglang" and "sglang FATAL" in s.why and s.since == T0 + 1


def test_a_cluster_node_whose_ray_gave_up_in_this_start_cannot_train_and_an_earlier_start_is_history():
    programs = {"ray": Program(EXITED, T0 + 60, T0 + 30)}
    gave_up = {"gave_up": True, "last_failure": T0 + 59, "head": "10.0.0.1:6379"}
    s = standing.judge(Evidence(programs, None, gave_up, now=T0 + 100))
    assert s.stuck and s.who == "`ray`" and "10.0.0.1:6379" in s.why
    earlier = standing.judge(Evidence(programs, None, {**gave_up, "last_failure": T0 + 10}, now=T0 + 100))
    assert not earlier.stuck


def test_safe_mode_and_an_unreachable_supervisord_say_so_before_anything_the_records_hold():
    rec = end(ending.CRASH_LOOP, 85)
    sm = judge(Program(EXITED, T0 + 90, T0 + 5, 4242), rec, safe_mode={"stage": "config", "message": "bad key",
                                                                       "since": T0 + 3})
    assert (sm.run, sm.can_train, sm.since) == (standing.SAFE_MODE, False, T0 + 3) and "bad key" in sm.why
    gone = standing.judge(Evidence({}, rec, reachable=False, exited=True, booted=T0 - 10, now=T0 + 1000))
    assert (gone.run, gone.can_train) == (standing.NOT_RUNNING, None) and gone.last["this_run"]
    before = standing.judge(Evidence({}, rec, reachable=False, exited=True, booted=T0 + 500, now=T0 + 1000))
    assert not before.last["this_run"]  # recorded before this boot: an earlier run's
    hung = standing.judge(Evidence({}, None, reachable=False, now=T0))
    assert (hung.run, hung.can_train) == (standing.UNKNOWN, None)


# -- invariants over generated evidence ------------------------------------------------------------------------------
times = st.floats(0, 2000, allow_nan=False)
programs_ = st.builds(Program, st.sampled_from(STATES), st.one_of(st.none(), times.map(lambda t: T0 + t)),
                      st.one_of(st.none(), times.map(lambda t: T0 + t)), st.one_of(st.none(), st.sampled_from([4242,
                                                                                                                4343])))
ends = st.one_of(st.none(), st.builds(end, st.sampled_from(KINDS + ("not-a-kind",)) | st.sampled_from(
    ending.FINAL_KINDS + ending.FINISHED_KINDS), st.floats(-100, 5000), st.sampled_from([4242, 4343, None])))
# Mostly a trainer and an answering supervisord: where the rules that can stop the pod are
evidence = st.builds(
    Evidence,
    st.one_of(st.fixed_dictionaries({"trainer": programs_}, optional={"sglang": programs_, "ray": programs_}),
              st.fixed_dictionaries({}, optional={"trainer": programs_, "sglang": programs_, "ray": programs_})),
    ends,
    st.one_of(st.just({}), st.fixed_dictionaries({"gave_up": st.booleans(), "last_failure": times.map(lambda t: T0 + t),
                                                  "head": st.just("h:1")})),
    st.sampled_from([None, None, None, {"stage": "config", "message": "m", "since": T0}]),
    st.sampled_from([True, True, True, False]), st.booleans(), st.one_of(st.none(), times.map(lambda t: T0 + t)),
    st.just(T0 + 1000),
    st.one_of(st.just(()), st.lists(st.fixed_dictionaries({
        "program": st.sampled_from(["trainer", "all", "sglang"]),
        "by": st.sampled_from(["you (podkit ctl stop trainer)", "the watchdog (a hang)", "the maximum run time"]),
        "time": times.map(lambda t: T0 + t)}, optional={"kind": st.sampled_from(["", "resume"])}),
        max_size=3).map(tuple)))


def _fatal(ev: Evidence) -> bool:
    return any((ev.programs.get(n) or Program("")).state == FATAL for n in ("trainer", "sglang", "ray"))


@settings(max_examples=600, deadline=None)
@given(evidence)
def test_a_pod_is_stuck_exactly_when_supervisord_will_not_start_a_trainer_whatever_the_records_say(ev):
    """What guard.stop_pod_after_s counts (autostop: idle observed, not recorded): a FATAL program, `ray` given up in
    its last start, the trainer EXITED or STOPPED with no finish of its own last run, unless you stopped it (an ask of
    yours at its stop) and no final end of its run says it can never train. Never while supervisord does not answer
    or safe mode speaks (safe mode has its own rule), never a trainer that runs, starts or backs off; always with its
    why and what must start again. The records give the words: removing them changes no stuck but a finish."""
    s = standing.judge(ev)
    assert s.run in standing.RUNS
    t = ev.programs.get("trainer")
    ray = ev.programs.get("ray")
    this_run = s.last is not None and s.last["this_run"]
    finished = this_run and s.last["family"] == ending.FINISHED
    final = this_run and s.last["family"] == ending.FINAL
    yours = t is not None and standing.stopped_by(ev.asked, t).startswith("you")
    gave_up = ray is not None and ray.state == EXITED and ev.ray_loop.get("gave_up") is True and \
        ev.ray_loop.get("last_failure", 0) >= (ray.started or 0) - standing.SLACK_S
    resumed = t is not None and standing.resuming(ev.asked, t, ev.now)  # `podkit resume` under way holds the pod
    idle = t is not None and not finished and not resumed and (t.state == EXITED or t.state == STOPPED and
                                                                (final or not yours))
    want = bool(ev.reachable) and not ev.safe_mode and (_fatal(ev) or gave_up or idle)
    assert s.stuck == want, (s, ev)
    if s.stuck:
        assert s.why and s.who
    if t is not None and t.state in (RUNNING, STARTING, BACKOFF, STOPPING) and not _fatal(ev) and not gave_up:
        assert not s.stuck
    if s.run == standing.FINISHED:  # never a false "finished": the trainer's own record of this run says so
        assert s.last["this_run"] and s.last["family"] == ending.FINISHED and t.state in (EXITED, STOPPED)


@settings(max_examples=300, deadline=None)
@given(evidence, st.sampled_from([(), YOU, ({"program": "all", "by": "you (podkit up got SIGINT)", "time": T0 + 5},),
                                  ({"program": "trainer", "by": "the watchdog (a hang)", "time": T0 + 500},)]))
def test_only_a_stop_you_asked_for_at_the_trainers_stop_keeps_a_stopped_pod_up(ev, asked):
    """A STOPPED trainer is idle unless an ask of yours came at its stop: the asks change nothing else."""
    s, with_asks = (standing.judge(Evidence(**{**ev.__dict__, "asked": a})) for a in ((), asked))
    t = ev.programs.get("trainer")
    if with_asks.stuck != s.stuck:
        assert t is not None and t.state == STOPPED and s.stuck and not with_asks.stuck
        assert standing.stopped_by(asked, t).startswith("you")
    assert (with_asks.run, with_asks.can_train) == (s.run, s.can_train)


@settings(max_examples=400, deadline=None)
@given(evidence)
def test_can_train_says_how_sure_it_is_and_agrees_with_the_run(ev):
    s = standing.judge(ev)
    sure = {True: {standing.TRAINING, standing.STARTING_, standing.RESTARTING, standing.STOPPED_},
            False: {standing.CANNOT, standing.FINISHED, standing.SAFE_MODE},
            None: {standing.NOT_RUNNING, standing.UNKNOWN, standing.ENDED, standing.NO_TRAINER}}
    assert s.run in sure[s.can_train], s
    if not ev.reachable and not ev.safe_mode:
        assert s.can_train is None  # supervisord does not answer: not known, never a guess


@settings(max_examples=400, deadline=None)
@given(evidence, st.floats(0.5, 5000))
def test_an_end_from_before_the_trainers_start_or_from_the_future_decides_nothing(ev, before):
    t = ev.programs.get("trainer")
    start = t.started if t is not None and t.started is not None else ev.booted
    if start is None or ev.end is None:
        return
    old = {**ev.end, "time": start - standing.SLACK_S - before}
    future = {**ev.end, "time": ev.now + ending.FUTURE_S + before}
    none = standing.judge(Evidence(ev.programs, None, ev.ray_loop, ev.safe_mode, ev.reachable, ev.exited, ev.booted,
                                   ev.now))
    for rec in (old, future):
        s = standing.judge(Evidence(ev.programs, rec, ev.ray_loop, ev.safe_mode, ev.reachable, ev.exited, ev.booted,
                                    ev.now))
        assert (s.run, s.can_train, s.why) == (none.run, none.can_train, none.why)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["trainer", "sglang", "ray"]),
                       st.tuples(st.sampled_from(STATES), times, times, st.sampled_from([4242, 4343])), max_size=3),
       ends)
def test_the_listeners_events_and_supervisords_answer_are_judged_alike(progs, rec):
    """The log listener (its own events, programs.json's shape) and status (supervisord's getAllProcessInfo) see one
    pod: the same standing, so the cost guard never stops a pod that status says trains."""
    events = {n: {"state": s, "since": T0 + since, "started_at": T0 + start, "pid": pid}
              for n, (s, since, start, pid) in progs.items()}
    infos = [{"name": n, "statename": s, "start": T0 + start,
              "stop": T0 + since if s in (EXITED, STOPPED, BACKOFF, FATAL) else 0,
              "pid": 0 if s in (EXITED, STOPPED, BACKOFF, FATAL) else pid}
             for n, (s, since, start, pid) in progs.items()]
    a = standing.judge(Evidence(standing.of_events(events), rec, now=T0 + 1000))
    b = standing.judge(Evidence(standing.of_supervisord(infos, events), rec, now=T0 + 1000))
    assert (a.run, a.can_train, a.why, a.who) == (b.run, b.can_train, b.why, b.who)


# -- durability --------------------------------------------------------------------------------------------------------
def remote(step=40, t=T0 + 100, failed=None):
    rec = {"uploaded": {"outcome": "uploaded", "step": step, "time": t, "where": "s3://b/p/gen-40"}}
    rec["last"] = failed or rec["uploaded"]
    return rec


def test_the_last_durable_step_its_age_and_what_is_at_risk_are_said_with_how_sure_the_dollars_are():
    cost = {"per_hour": 0.36, "source": "read", "started": T0}
    d = standing.durable(remote(), 43, cost, T0 + 100 + 600)
    assert (d["step"], d["age_s"], d["at_risk_steps"]) == (40, 600.0, 3)
    assert d["at_risk_usd"] == pytest.approx(0.06) and d["usd_sureness"] == "read"
    words = standing.durable_words(d, T0 + 700)
    assert "step 40 is off the pod (10m ago" in words and "3 step(s), ~$0.06 (read)" in words
    assert standing.durable({}, 3, cost, T0) is None  # no remote, no record: nothing to say
    none_yet = standing.durable({}, 3, cost, T0 + 3600, configured=True)
    assert none_yet["step"] is None and none_yet["at_risk_steps"] == 3 and none_yet["at_risk_usd"] == pytest.approx(0.36)
    assert "no checkpoint of this run is off the pod yet" in standing.durable_words(none_yet, T0 + 3600)


def test_an_upload_failing_since_the_last_whole_one_is_named_and_an_older_failure_is_not():
    failed = {"outcome": "failed", "step": 44, "why": "s3://b/p refused the credentials", "time": T0 + 200}
    d = standing.durable(remote(failed=failed), 44, None, T0 + 300)
    assert d["failing"]["why"].endswith("refused the credentials") and d["at_risk_usd"] is None
    assert "the last upload failed" in standing.durable_words(d, T0 + 300)
    old = standing.durable(remote(t=T0 + 250, failed={**failed, "time": T0 + 200}), 44, None, T0 + 300)
    assert old["failing"] is None


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 10**6)), st.one_of(st.none(), st.integers(-5, 10**6)),
       st.one_of(st.none(), st.floats(-1, 50)), st.sampled_from(["read", "billed", "estimated", "unknown"]),
       st.floats(0, 10**6), st.floats(0, 10**5))
def test_what_is_at_risk_is_never_negative_never_priced_on_an_unknown_price_and_grows_with_time(
        d_step, step, price, source, t, later):
    rec = {} if d_step is None else remote(step=d_step, t=T0 + t)
    cost = {"per_hour": price, "source": source, "started": T0}
    now = T0 + t + 1
    d = standing.durable(rec, step, cost, now, configured=True)
    assert d["at_risk_steps"] is None or d["at_risk_steps"] >= 0
    if isinstance(step, int) and step >= 0 and d_step is not None and step <= d_step:
        assert d["at_risk_steps"] == 0
    if not price or price <= 0 or source == "unknown":
        assert d["at_risk_usd"] is None and d["usd_sureness"] == "unknown"
    else:
        assert d["at_risk_usd"] >= 0 and d["usd_sureness"] in ("read", "estimated")
        assert standing.durable(rec, step, cost, now + later, configured=True)["at_risk_usd"] >= d["at_risk_usd"]
    standing.durable_words(d, now)  # always says something


def test_the_durability_guard_speaks_only_for_a_run_that_trains_with_steps_at_risk_past_its_limit():
    d = standing.durable(remote(t=T0), 45, None, T0 + 4000)
    assert "more than guard.durable_within_s (3600 s)" in standing.behind(d, 3600, True, T0 - 100, T0 + 4000)
    assert standing.behind(d, 0, True, T0, T0 + 4000) == ""  # off
    assert standing.behind(d, 3600, False, T0, T0 + 4000) == ""  # not training: nothing new at risk
    assert standing.behind(d, 3600, True, T0, T0 + 3000) == ""  # within the limit
    caught_up = standing.durable(remote(step=45, t=T0), 45, None, T0 + 4000)
    assert standing.behind(caught_up, 3600, True, T0, T0 + 4000) == ""  # nothing at risk
    never = standing.durable({}, 5, None, T0 + 4000, configured=True)
    assert "no checkpoint of this run has reached the remote since it started" in \
        standing.behind(never, 3600, True, T0, T0 + 4000)


# -- every view renders it ---------------------------------------------------------------------------------------------
def _podkit(args, ws, **env):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("PODKIT_", "RUNPOD_", "AWS_", "RCLONE_"))}
    return subprocess.run([sys.executable, "-m", "podkit", *args, "--workspace", str(ws)], capture_output=True,
                          text=True, env={**base, **env}, timeout=60)


@pytest.mark.parametrize("failing", [False, True], ids=["behind", "failing"])
def test_status_doctor_and_metrics_say_what_is_off_the_pod_and_what_is_at_risk(tmp_path, failing):
    """A run whose uploads stopped: status and doctor say the last durable step, its age and the steps and dollars
    at risk; doctor names an upload's failure in the user's terms, or the guard's limit crossed; /metrics carries
    the figures. Staged records: the uploader's own (records.REMOTE) and the trainer's progress."""
    import json
    import time

    from prometheus_client import generate_latest

    from podkit import config, records
    from podkit.views import doctor, metrics

    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    records.PROGRESS.write(state, {"step": 52, "time": now - 5, "checkpoint_step": 50})
    up = {"outcome": "uploaded", "step": 40, "time": now - 7200, "where": "s3://b/p/e/t/gen-40", "bytes": 9,
          "took_s": 1.0}
    last = {"outcome": "failed", "step": 50, "time": now - 60,
            "why": "s3://b/p refused the credentials (wrong or missing AWS_ACCESS_KEY_ID)"} if failing else up
    records.REMOTE.write(state, {"uploaded": up, "last": last})
    env = {"PODKIT_CHECKPOINT_REMOTE": "s3://b/p", "PODKIT_GUARD_DURABLE_WITHIN_S": "3600"}
    shown = _podkit(["status"], ws, **env).stdout
    assert "checkpoints off the pod: step 40 is off the pod (2h00m ago, s3://b/p/e/t/gen-40); at risk if the pod " \
           "is lost: 12 step(s)" in shown, shown
    found = {f["id"]: f for f in json.loads(_podkit(["doctor", "--json"], ws, **env).stdout)["findings"]}
    if failing:
        f = found["upload_failing"]
        assert f["severity"] == "problem" and "refused the credentials" in f["evidence"][0], f
    else:
        assert "upload_failing" not in found
        # not training (no supervisord here): the guard speaks for a run that trains only
        assert "durable_behind" not in found
        cfg = config.load(None, environ={**env, "PODKIT_WORKSPACE": str(ws)})
        pod = doctor.Pod(cfg, ws)
        pod.st["standing"]["run"] = standing.TRAINING  # as status.collect judges a pod whose trainer steps
        f = doctor.check_durable(pod, time.time())
        assert f.id == "durable_behind" and f.severity == "problem", f
        assert "the last durable checkpoint is step 40, 2h00m ago, more than guard.durable_within_s (3600 s)" in \
            f.evidence[0], f.evidence
    text = generate_latest(metrics.registry(ws, 600)).decode()
    assert "podkit_durable_step 40.0" in text and "podkit_at_risk_steps 12.0" in text
    assert f"podkit_upload_failing {1.0 if failing else 0.0}" in text


def test_the_listener_notifies_once_when_the_durable_checkpoint_falls_behind_and_says_when_one_reaches_it(
        tmp_path, monkeypatch):
    """The durability guard in the log listener (at each TICK_60): one notification when a run that trains has
    nothing newer than guard.durable_within_s on the remote, not one a minute; a line when the uploads catch up."""
    import io
    import time

    from podkit import notify, records
    from podkit.programs import logs

    state = tmp_path / ".podkit"
    state.mkdir()
    now = time.time()
    records.PROGRESS.write(state, {"step": 52, "time": now - 5})
    records.REMOTE.write(state, {"uploaded": remote(step=40, t=now - 7200)["uploaded"]})
    out = io.StringIO()
    pump = logs.Pump(out, None, state_dir=state)
    pump.states = {"trainer": {"state": RUNNING, "since": now - 100, "started_at": now - 100, "pid": 4242}}
    pump.durable_within_s = 3600
    sent = []
    monkeypatch.setattr(notify, "send", lambda event, text, *a, **k: sent.append((event, text)))
    assert "more than guard.durable_within_s (3600 s)" in pump.durability(now)
    pump.durability(now + 60)
    assert [e for e, _ in sent] == ["durability"] and "12 step(s)" in sent[0][1], sent
    records.REMOTE.write(state, {"uploaded": remote(step=52, t=now + 100)["uploaded"]})
    assert pump.durability(now + 120) == "" and "reach the remote again: step 52" in out.getvalue()
    pump.states["trainer"] = {"state": EXITED, "since": now + 130, "started_at": now - 100, "pid": 4242}
    records.PROGRESS.write(state, {"step": 60, "time": now + 125})
    assert pump.durability(now + 9000) == ""  # not training: nothing new at risk, nothing said


def test_another_runs_record_on_a_reused_volume_is_never_this_runs_durable_step(tmp_path, monkeypatch):
    """remote.json is stamped with its run (remote.note): a new run on a volume another run used says nothing of
    its own is off the pod (with a remote), and without a remote says nothing at all; the uploader's first write
    for the new run drops the old run's entries."""
    import types

    from podkit import records
    from podkit.remote import remote as the_remote
    from podkit.views import status

    old = {**remote(), "run": "gsm8k/old-trial"}
    assert standing.durable(old, 12, None, T0 + 500, configured=True, run="gsm8k/new-trial")["step"] is None
    assert standing.durable(old, 12, None, T0 + 500, run="gsm8k/new-trial") is None
    assert standing.durable(old, 12, None, T0 + 500, configured=True, run="gsm8k/old-trial")["step"] == 40
    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    records.REMOTE.write(state, old)
    records.PROGRESS.write(state, {"step": 12, "time": T0 + 400, "run": "gsm8k/new-trial"})
    assert status.collect(ws, state, remote=False)["durable"] is None
    assert status.collect(ws, state, remote=True)["durable"]["step"] is None
    cfg = types.SimpleNamespace(state_dir=state)
    monkeypatch.setattr(the_remote, "run_id", lambda cfg: "gsm8k/new-trial")
    the_remote.note(cfg, restore={"outcome": "refused", "step": 40, "why": "another run's", "time": T0 + 450})
    rec = records.REMOTE.read(state)
    assert rec["run"] == "gsm8k/new-trial" and "uploaded" not in rec and rec["restore"]["step"] == 40


def test_a_stop_that_left_its_checkpoint_on_the_disk_and_a_pod_kept_off_the_remote_are_named_until_an_upload_lands(
        tmp_path):
    """remote.json's "final" (the stop's upload of the last checkpoint) and "lease" (another pod holds the run's
    lease on the remote): status, doctor, the page and /metrics name them while nothing whole went up after them,
    and say nothing of them once a newer generation did."""
    import json
    import time

    from prometheus_client import generate_latest

    from podkit import records
    from podkit.views import metrics, pageview, status

    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    records.PROGRESS.write(state, {"step": 52, "time": now - 50, "checkpoint_step": 50})
    up = {"outcome": "uploaded", "step": 40, "time": now - 900, "where": "s3://b/p/e/t/gen-40"}
    final = {"outcome": "failed", "step": 50, "time": now - 30,
             "why": "the final upload's deadline passed (600.0 s: checkpoint.remote_final_s)"}
    lease = {"outcome": "blocked", "time": now - 20, "why": "another pod holds this run's lease on the remote (pod b)"}
    records.REMOTE.write(state, {"uploaded": up, "last": up, "final": final, "lease": lease})
    env = {"PODKIT_CHECKPOINT_REMOTE": "s3://b/p"}
    shown = _podkit(["status"], ws, **env).stdout
    assert re.search(r"at the stop \(3\ds ago\), step 50 was NOT uploaded: the final upload's deadline passed", shown), \
        shown  # its age as the subprocess reads the clock, on a busy machine a few seconds on
    assert re.search(r"nothing uploaded since 2\ds ago: another pod holds this run's lease on the remote \(pod b\)",
                     shown), shown
    found = {f["id"]: f for f in json.loads(_podkit(["doctor", "--json"], ws, **env).stdout)["findings"]}
    assert found["final_upload_failed"]["severity"] == "problem", found
    st_ = status.collect(ws, state, remote=True)
    box = pageview.trouble(pageview.View({"st": st_, "now": now, "history": [], "findings": [], "health": None},
                                         lambda s: s))
    assert "the last checkpoint is not off the pod" in box and "this pod uploads nothing" in box, box
    assert "podkit_upload_blocked 1.0" in generate_latest(metrics.registry(ws, 600)).decode()
    # a cut stop ("uploading" never ended) is named too, in other words
    records.REMOTE.write(state, {"uploaded": up, "final": {**final, "outcome": "uploading", "why": ""}})
    assert "the stop's upload of step 50 began (3" in standing.durable_words(
        status.collect(ws, state, remote=True)["durable"], now)
    assert "s ago) and has not said it ended" in \
        standing.durable_words(status.collect(ws, state, remote=True)["durable"], now)
    # a whole generation after them: neither is this pod's trouble any more
    newer = {**up, "step": 51, "time": now - 5}
    records.REMOTE.write(state, {"uploaded": newer, "last": newer, "final": final, "lease": lease})
    d = status.collect(ws, state, remote=True)["durable"]
    assert d["final"] is None and d["blocked"] is None and d["step"] == 51
    assert "NOT uploaded" not in _podkit(["status"], ws, **env).stdout
    found = {f["id"] for f in json.loads(_podkit(["doctor", "--json"], ws, **env).stdout)["findings"]}
    assert not found & {"final_upload_failed", "remote_lease_held"}, found


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 100)), st.floats(0, 1000), st.sampled_from(["failed", "uploading",
       "uploaded", "none", "odd"]), st.integers(0, 120), st.floats(0, 1000), st.sampled_from(["blocked", "held"]),
       st.floats(0, 1000))
def test_the_stop_and_the_lease_are_named_only_when_no_whole_upload_came_after_them(
        d_step, d_t, outcome, f_step, f_t, lease_outcome, l_t):
    rec = {} if d_step is None else remote(step=d_step, t=T0 + d_t)
    rec["final"] = {"outcome": outcome, "step": f_step, "why": "x", "time": T0 + f_t}
    rec["lease"] = {"outcome": lease_outcome, "why": "y", "time": T0 + l_t}
    now = T0 + 2000
    d = standing.durable(rec, 120, None, now, configured=True)
    f_at, l_at, d_at = T0 + f_t, T0 + l_t, T0 + d_t  # the stamps as the records hold them (a float's precision)
    if d["final"]:
        assert outcome in ("failed", "uploading") and (d_step is None or (f_at >= d_at and f_step > d_step))
    if d["blocked"]:
        assert lease_outcome == "blocked" and (d_step is None or l_at >= d_at)
    if d_step is not None and f_at < d_at:
        assert d["final"] is None
    standing.durable_words(d, now)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 300)), st.one_of(st.none(), st.integers(0, 300), st.text(max_size=3)),
       st.sampled_from(["restoring", "retrying", "failed", "restored", "none", "refused", 7]),
       st.one_of(st.none(), st.integers(-3, 10**10)), st.one_of(st.none(), st.integers(-3, 10)),
       st.one_of(st.none(), st.text(max_size=30)))
def test_the_remote_ahead_the_restore_and_the_lineage_are_named_only_on_their_evidence(
        step, ahead, restore_outcome, total, count, lineage_id):
    """The remote ahead of this pod is named only while the trainer's step is below it; the restore only while it is
    under way or given up; the lineage only when the run has had more than one; any shape of these entries is judged
    without raising, and the words stay bounded."""
    rec = remote(step=10, t=T0 + 10)
    rec["ahead"] = {"step": ahead, "where": "s3://b/p/gen", "time": T0 + 20, "from": 3}
    rec["restore"] = {"outcome": restore_outcome, "step": 5, "why": "w" * 2000, "time": T0 + 5, "got": 1,
                      "total": total}
    rec["lineage"] = {"id": lineage_id, "why": "start-over", "since": T0, "count": count}
    now = T0 + 100
    d = standing.durable(rec, step, None, now, configured=True)
    if d["ahead"]:
        assert isinstance(ahead, int) and (step is None or step < ahead)
    elif isinstance(ahead, int) and not isinstance(ahead, bool):
        assert step is not None and step >= ahead
    assert (d["restore"] is not None) == (restore_outcome in ("restoring", "retrying", "failed"))
    assert (d["lineage"] is not None) == (isinstance(count, int) and count > 1)
    words = standing.durable_words(d, now)
    assert len(words) < 4000
    if d["ahead"]:
        assert f"step {ahead}" in words and "podkit restore" in words
    if restore_outcome == "failed":
        assert "without the remote's newest" in words
