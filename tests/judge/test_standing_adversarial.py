"""The standing and the durability figures against a user's run and a corrupt volume (issue 48 item 4, issue 49 item
6): records of the wrong types never make a view fail, and the views say nothing the evidence does not hold (a
replacement pod's restored step is durable; dollars are this pod's; a guard speaks only of steps at risk)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from podkit import config, records
from podkit.host import supervisord
from podkit.judge import standing
from podkit.money import guards
from podkit.views import doctor, metrics, pageview, status

pytestmark = pytest.mark.timeout(120)
T0 = 1_000_000.0


def _info(name, state, now, pid=4242):
    return {"name": name, "statename": state, "start": now - 600, "stop": 0, "now": now, "pid": pid, "exitstatus": 0,
            "description": "", "group": name, "spawnerr": ""}


def _pod(tmp_path, monkeypatch, infos, programs_rec, **files):
    """A workspace whose supervisord answers `infos`, with the listener's programs.json and the given records."""
    ws, run = tmp_path / "ws", tmp_path / "run"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    run.mkdir()
    now = time.time()
    records.CURRENT.write(state, {"run_dir": str(run), "socket": str(tmp_path / "no.sock"), "started": now - 3600})
    (run / "programs.json").write_text(json.dumps(programs_rec))
    for name, data in files.items():
        (state / name).write_text(json.dumps(data))
    server = SimpleNamespace(supervisor=SimpleNamespace(getAllProcessInfo=lambda: infos, getPID=lambda: 1))
    monkeypatch.setattr(supervisord, "rpc", lambda sock, timeout_s=None: server)
    return ws, now


@pytest.mark.parametrize("starts", ["3", None, 1e300, [1], {"a": 1}, True], ids=repr)
def test_a_listeners_record_of_the_wrong_type_never_makes_status_metrics_or_the_page_fail(tmp_path, monkeypatch,
                                                                                         starts):
    """programs.json (the listener's record, local disk) with a start count that is no count: status, its words,
    health, the guards' forecast, a /metrics scrape and the page all answer, the restarts read as none."""
    now = time.time()
    ws, now = _pod(tmp_path, monkeypatch, [_info("trainer", "RUNNING", now), _info("sglang", "RUNNING", now)],
                   {"trainer": {"starts": starts, "pid": "x", "since": "y", "started_at": [1]}})
    st = status.collect(ws)
    assert st["programs"]["trainer"]["restarts"] == 0 and st["standing"]["run"] == standing.TRAINING
    status.human(st)
    status.health_problem(st, 600)
    guards.forecast(st, {"stop_pod_after_s": {"value": 3600}}, now)
    assert b"podkit_run_standing" in generate_latest(metrics.registry(ws, 600))
    html = pageview.render({"st": st, "now": now, "history": [], "loop": {}, "findings": [], "guards": {"guards": {}},
                            "logs": {}, "total_steps": 100, "on_runpod": True, "health": None})
    assert "could not be drawn" not in html


def test_the_durability_guard_does_not_speak_of_steps_at_risk_when_the_run_has_recorded_none():
    """A trainer that loads its model for an hour has no step at risk: no notification that it is behind."""
    d = standing.durable({}, None, None, T0 + 4000, configured=True)
    assert d["at_risk_steps"] is None
    assert standing.behind(d, 3600, True, T0, T0 + 4000) == ""
    d = standing.durable({"uploaded": {"outcome": "uploaded", "step": 40, "time": T0}}, None, None, T0 + 4000)
    assert standing.behind(d, 3600, True, T0, T0 + 4000) == ""


def test_a_replacement_pod_that_restored_a_step_from_the_remote_says_that_step_is_off_the_pod():
    """A pod without a network volume restores the remote's newest step at boot (remote.json's `restore`): that
    step is on the remote, not "no checkpoint of this run is off the pod yet" with every step at risk."""
    rec = {"restore": {"outcome": "restored", "step": 480, "why": "", "time": T0 + 60}}
    cost = {"per_hour": 3.6, "source": "read", "started": T0}
    d = standing.durable(rec, 485, cost, T0 + 3600, configured=True)
    assert d["step"] == 480 and d["at_risk_steps"] == 5, d
    assert "no checkpoint of this run is off the pod yet" not in standing.durable_words(d, T0 + 3600)
    # an upload since is newer: it counts; a refused or failed restore is nothing durable
    up = {**rec, "uploaded": {"outcome": "uploaded", "step": 490, "time": T0 + 3000}}
    assert standing.durable(up, 492, cost, T0 + 3600)["step"] == 490
    for outcome in ("refused", "failed"):
        bad = {"restore": {**rec["restore"], "outcome": outcome}}
        assert standing.durable(bad, 485, cost, T0 + 3600, configured=True)["step"] is None


def test_dollars_at_risk_are_this_pods_since_its_start_not_since_an_earlier_pods_upload():
    """A replacement pod on the same volume: the last upload was the earlier pod's, hours before this pod started;
    this pod's price over the time before it existed is not at risk."""
    rec = {"uploaded": {"outcome": "uploaded", "step": 40, "time": T0}}
    cost = {"per_hour": 3.6, "source": "read", "started": T0 + 7200}  # this pod started 2 h after the upload
    d = standing.durable(rec, 45, cost, T0 + 7200 + 600)
    assert d["at_risk_usd"] == pytest.approx(0.6), d  # 10 minutes of this pod at $3.60/h, not 2h10m


def test_a_failed_uploads_age_is_never_negative_when_the_clock_was_stepped_back():
    rec = {"uploaded": {"outcome": "uploaded", "step": 40, "time": T0},
           "last": {"outcome": "failed", "step": 41, "why": "denied", "time": T0 + 500}}
    d = standing.durable(rec, 41, None, T0 + 100)
    assert "-" not in standing.durable_words(d, T0 + 100).split("failed (")[1].split(")")[0]


def test_doctor_says_nothing_of_uploads_for_a_run_without_a_remote_whatever_an_older_record_holds(tmp_path):
    """A volume whose earlier run had a checkpoint.remote (remote.json with a failed upload) under a run without
    one: doctor names no failing upload and no durability of a remote the run does not have."""
    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    records.PROGRESS.write(state, {"step": 52, "time": now - 5})
    records.REMOTE.write(state, {"uploaded": {"outcome": "uploaded", "step": 40, "time": now - 7200},
                                 "last": {"outcome": "failed", "step": 50, "time": now - 60, "why": "denied"}})
    cfg = config.load(None, environ={"PODKIT_WORKSPACE": str(ws)})
    assert not cfg.checkpoint.remote
    pod = doctor.Pod(cfg, ws)
    assert doctor.check_durable(pod, now) is None


@pytest.mark.parametrize("source", ["billed", "read"])
def test_dollars_at_risk_on_the_gpu_catalogues_list_price_say_they_are_estimated(source):
    """RunPod showed no price for the running pod: the spend ledger prices it at the GPU catalogue's list price
    (price_from "catalogue"), and a bill may still make the spend "billed". What is at risk is that list price over
    time: an estimate, never "read"."""
    rec = {"uploaded": {"outcome": "uploaded", "step": 40, "time": T0}}
    cost = {"per_hour": 3.6, "source": source, "started": T0 - 60, "price_from": "catalogue"}
    d = standing.durable(rec, 45, cost, T0 + 600)
    assert d["at_risk_usd"] == pytest.approx(0.6) and d["usd_sureness"] == "estimated", d
    read = standing.durable(rec, 45, {**cost, "price_from": "read"}, T0 + 600)
    assert read["usd_sureness"] == "read"


# -- the cost guard: the listener's rule before the standing, as the reference -----------------------------------------
def _old_cannot_train(states: dict, state_dir) -> bool:
    """Pump.cannot_train before standing.py (01b0ade): whether the cost guard counted the pod as unable to train."""
    from podkit.host.supervisord import EXITED, FATAL
    from podkit.judge import ending

    if any((states.get(n) or {}).get("state") == FATAL for n in ("trainer", "sglang")):
        return True
    ray = states.get("ray") or {}
    join = records.RAY_LOOP.read(state_dir) if ray.get("state") == EXITED else {}
    if join.get("gave_up") and (join.get("last_failure") or 0) >= (ray.get("started_at") or 0) - 1:
        return True
    rec = states.get("trainer") or {}
    if rec.get("state") != EXITED:
        return False
    started = rec.get("started_at")
    end = ending.read(state_dir, since=started - 1 if isinstance(started, (int, float)) else None,
                      program_pid=rec.get("pid"))
    return end is not None and end.family == ending.FINAL


def _listener_cases():
    from hypothesis import strategies as st

    from podkit.judge import ending

    now = time.time()
    when = st.one_of(st.none(), st.floats(now - 5000, now + 100), st.just("x"))
    rec = st.fixed_dictionaries({"state": st.sampled_from(["STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED",
                                                           "STOPPED", "FATAL", "UNKNOWN"])},
                                optional={"since": when, "started_at": when,
                                          "pid": st.sampled_from([None, 4242, 4343, "4242"])})
    states = st.fixed_dictionaries({}, optional={"trainer": rec, "sglang": rec, "ray": rec})
    end = st.one_of(st.none(), st.fixed_dictionaries(
        {"by": st.sampled_from(list(ending.KINDS) + ["planted"]), "time": st.floats(now - 6000, now + 30)},
        optional={"program": st.sampled_from([4242, 4343])}))
    ray = st.one_of(st.none(), st.fixed_dictionaries({"gave_up": st.booleans(),
                                                      "last_failure": st.floats(now - 6000, now)}))
    return states, end, ray, st.one_of(st.none(), st.floats(now - 7000, now))


def test_the_cost_guard_counts_a_pod_unable_to_train_as_the_listener_did_before_and_a_trainer_nothing_starts(tmp_path):
    """The log listener's cost guard (guard.stop_pod_after_s stops the RunPod pod) over generated events and records,
    its listener's programs.json of the wrong types included: stuck whenever the rule it replaced was (but for an
    earlier boot's end record read for a trainer whose start the listener never saw: the old rule took any), and
    besides only for a trainer EXITED or STOPPED (no ask of yours in a listener without a run dir) with no finish of
    its own run: idle observed, where the old rule waited for a final record that a full volume can lose."""
    import io
    import itertools

    from hypothesis import HealthCheck, given, settings

    from podkit.programs import logs

    counter = itertools.count()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(*_listener_cases())
    def check(states, end, ray, booted):
        d = tmp_path / str(next(counter))
        d.mkdir()
        if end:
            records.PROGRESS.write(d, {"stopped": end})
        if ray:
            records.RAY_LOOP.write(d, ray)
        if booted:
            records.CURRENT.write(d, {"started": booted})
        pump = logs.Pump(io.StringIO(), None, state_dir=d)
        pump.states = states
        new = bool(pump.cannot_train())  # never raises: the old rule did on a start that is no time
        try:
            old = _old_cannot_train(states, d)
        except TypeError:
            return
        trainer = states.get("trainer") or {}
        if old and not new and not isinstance(trainer.get("started_at"), (int, float)) and booted \
                and end["time"] < booted - standing.SLACK_S:
            return  # an earlier boot's record: the one difference, on purpose
        s = pump.standing()
        finished = s.last is not None and s.last["this_run"] and s.last["family"] == "finished"
        nothing_starts = trainer.get("state") in ("EXITED", "STOPPED") and not finished
        ray_fatal = (states.get("ray") or {}).get("state") == "FATAL"  # a cluster node's `ray` given up by supervisord
        assert new == (old or nothing_starts or ray_fatal), (states, end, ray, booted)

    check()


@pytest.mark.parametrize("what,trainer_pid,sglang,stuck", [
    ("the trainer stopped for good by its own record", 4242, "RUNNING", True),
    ("an end recorded by another process", 4343, "RUNNING", True),  # idle all the same: EXITED, nothing starts it
    ("sglang FATAL since", 4343, "FATAL", True),
])
def test_a_listener_restarted_after_the_pod_could_no_longer_train_counts_from_the_state_change(
        tmp_path, monkeypatch, what, trainer_pid, sglang, stuck):
    """supervisord restarts the log listener (a crash, an OOM kill): it reads its programs.json back and the cost
    guard's wait counts from the trainer's (or sglang's) state change, not from its own start; a record another
    process made never gives the stop its words (the trainer exited, and nothing starts it: that is the reason)."""
    import io
    import os

    from podkit.judge import ending
    from podkit.money import costguard
    from podkit.programs import logs

    state, run = tmp_path / ".podkit", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    now = time.time()
    records.CURRENT.write(state, {"started": now - 7200})
    records.PROGRESS.write(state, {"step": 3, "stopped": {"by": ending.CRASH_LOOP, "time": now - 3000,
                                                          "program": 4242, "step": 3}})
    (run / "programs.json").write_text(json.dumps({
        "_supervisord": os.getppid(),
        "trainer": {"state": "EXITED", "since": now - 2990, "started_at": now - 3500, "pid": trainer_pid, "starts": 1},
        "sglang": {"state": sglang, "since": now - 2000, "started_at": now - 7000, "pid": 77, "starts": 1}}))
    seen = []
    monkeypatch.setattr(costguard, "cannot_train", lambda rule, why, who, since, *a, **k: seen.append((why, since)))
    pump = logs.Pump(io.StringIO(), run, state_dir=state)
    pump.idle_rule()
    why, since = seen[-1]
    assert bool(why) == stuck, (what, why)
    assert (ending.CRASH_LOOP in why) == (trainer_pid == 4242 and sglang != "FATAL"), (what, why)
    if stuck:
        assert since == (now - 2990 if sglang != "FATAL" else now - 2000), (what, since, now)


def test_a_planted_remote_record_costs_what_an_honest_one_does():
    """remote.json with a place and a failure of megabytes: the figures carry a bounded text, as the failure's is."""
    rec = {"uploaded": {"outcome": "uploaded", "step": 40, "time": T0, "where": "s3://b/" + "x" * 5_000_000},
           "last": {"outcome": "failed", "step": 41, "why": "y" * 5_000_000, "time": T0 + 10}}
    d = standing.durable(rec, 41, None, T0 + 100)
    assert len(d["where"]) <= 600 and len(d["failing"]["why"]) <= 600
    assert len(standing.durable_words(d, T0 + 100)) < 2000


def test_a_failing_upload_is_named_after_the_clock_was_stepped_back_past_the_last_whole_one():
    """The uploader keeps its newest attempt in `last`: after an upload at 12:00, the clock stepped back an hour and
    an upload failed at "11:10". The failure is the newest attempt whatever its stamp says: named, not hidden."""
    rec = {"uploaded": {"outcome": "uploaded", "step": 40, "time": T0 + 3600},
           "last": {"outcome": "failed", "step": 45, "why": "denied", "time": T0 + 600}}
    d = standing.durable(rec, 45, None, T0 + 700)
    assert d["failing"] is not None and d["failing"]["why"] == "denied", d
