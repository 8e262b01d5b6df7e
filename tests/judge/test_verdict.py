"""The judge of a trainer run's end as a pure function of its evidence (src/podkit/judge/verdict.py): a table of the
cases a user's scripts and mishaps make, each with its evidence and the kind it must be, and property tests
(Hypothesis) over generated evidence for the invariants docs/failures.md writes down. A judge that decides by
which source it reads first fails them: an own record written after the stop, a failure after the finish, an
exception beside an inference restart long over."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from podkit.judge import ending, failure, verdict

pytestmark = pytest.mark.timeout(120)
T0 = 1_000_000.0  # the run's start


def err(t, type_="ValueError", message="bad row", **facts):
    return {"time": T0 + t, "rank": 0, "type": type_, "message": message, "where": "train.py:42", **facts}


def ev(**kw):
    base = {"rc": 1, "started": T0, "finished": T0 + 100, "program": 4242, "place": "pod", "own": None,
            "asked": None, "errors": [], "signalled": [], "silent": [], "oom": "", "cgroup": "", "inference": None,
            "progress": {"step": 5, "time": T0 + 50}, "hang": None, "lease": ""}
    return {**base, **kw}


def own(by, t, **kw):
    return {"by": by, "time": T0 + t, "program": 4242, **kw}


def asked(t, by="you (podkit ctl restart trainer)", supervisord=True, **kw):
    return {"at": T0 + t, "by": by, "supervisord": supervisord, **kw}


def running(start, ready=None, asks=()):
    return {"state": "RUNNING", "start": T0 + start, "ready": None if ready is None else T0 + ready,
            "asked": [{"by": by, "at": T0 + t} for by, t in asks]}


def kind_of(e):
    return verdict.decide(e)["by"]


# -- the cases ------------------------------------------------------------------------------------------------------
CASES = {
    "a script that catches train()'s exception and exits 0 is a failure, not no record":
        (ev(rc=0, errors=[err(40, through="train")]), ending.FAILED),
    "a rank's os._exit(0) mid-training is a failure, not no record":
        (ev(rc=0, silent=[{"rank": 0, "pid": 7, "signal": None}]), ending.FAILED),
    "a rank's os._exit(3) is its exit, not a kill":
        (ev(rc=1, silent=[{"rank": 1, "pid": 8, "signal": None, "exit": 3}]), ending.FAILED),
    "a recover checkpoint torch cannot load is the checkpoint's, once, not the script's loop":
        (ev(errors=[err(5, "CheckpointException", "rank 0: unexpected EOF", checkpoint=True, base="CheckpointException")]),
         ending.CHECKPOINT),
    "a full volume while AReaL saves is the volume's":
        (ev(errors=[err(5, "OSError", "[Errno 28] No space left on device", volume="ENOSPC")]), ending.VOLUME),
    "a stale network handle is the volume's":
        (ev(errors=[err(5, "OSError", "Stale file handle", volume="ESTALE")]), ending.VOLUME),
    "your kill of a rank before train() is a stray stop, not the script's failure":
        (ev(signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 3, "forwarded": False}]), ending.STRAY),
    "your kill of a rank whose script's handler exits 0 is a stray stop, not never-trained":
        (ev(rc=0, own=own(ending.NEVER_TRAINED, 4),
            signalled=[{"rank": 0, "signal": "SIGTERM", "at": T0 + 3, "forwarded": False}]), ending.STRAY),
    "torchrun's teardown SIGTERM after another rank's failure is that failure":
        (ev(errors=[err(2, rank=0)], signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 3, "forwarded": False}]),
         ending.FAILED),
    "your restart while the script loads, under its SIGTERM -> sys.exit(0) handler, is a stop, not never-trained":
        (ev(rc=0, asked=asked(10), own=own(ending.NEVER_TRAINED, 10.4)), ending.SIGTERM),
    "the pod's stop while the script loads is a stop too":
        (ev(rc=0, asked=asked(10, by="the pod's stop (docker stop, a RunPod stop or migration)"),
            own=own(ending.NEVER_TRAINED, 11)), ending.SIGTERM),
    "a refusal before anyone asked for a stop stays the refusal":
        (ev(rc=2, asked=asked(30), own=own(ending.CONFIG_ERROR, 5)), ending.CONFIG_ERROR),
    "a failure before the stop was asked is the failure":
        (ev(asked=asked(30), errors=[err(10)]), ending.FAILED),
    "the script's crash long after you restarted inference, back and stepping since, is the script's":
        (ev(errors=[err(90)], progress={"step": 11, "time": T0 + 80},
            inference=running(20, ready=25, asks=[("you (podkit ctl restart sglang)", 19)])), ending.FAILED),
    "the script's crash after the watchdog's inference restart, stepping since, is the script's":
        (ev(errors=[err(90)], progress={"step": 11, "time": T0 + 80}, inference=running(20, ready=25)), ending.FAILED),
    "a crash while inference you restarted was still coming back is inference's, not counted":
        (ev(errors=[err(22)], progress={"step": 4, "time": T0 + 10},
            inference=running(20, asks=[("you (podkit ctl restart sglang)", 19)])), ending.INFERENCE_STOPPED),
    "the script's crash before inference crashed (supervisord's stop time) is the script's, not inference's":
        (ev(errors=[err(10)], inference={"state": "BACKOFF", "start": T0 - 5, "stop": T0 + 90, "asked": []}),
         ending.FAILED),
    "a crash while inference restarted by the watchdog was still down is inference's":
        (ev(errors=[err(22)], progress={"step": 4, "time": T0 + 10}, inference=running(20)), ending.INFERENCE),
    "a failure after train() returned (a failed push_to_hub) is not finished":
        (ev(own=own(ending.DONE, 60, step=10), errors=[err(65, "HfHubHTTPError", "401 Unauthorized")]), ending.FAILED),
    "a finished run with nothing after it is finished":
        (ev(rc=0, own=own(ending.DONE, 60, step=10)), ending.DONE),
    "'CUDA out of memory' in the script's own message is no OOM":
        (ev(errors=[err(5, "ValueError", "validation: CUDA out of memory in the reward model's log")]), ending.FAILED),
    "AReaL quoting SGLang's out of memory is no trainer OOM":
        (ev(errors=[err(5, "RuntimeError", "Failed after 3 retries. ... 'CUDA out of memory' from the server")]),
         ending.FAILED),
    "torch's OutOfMemoryError is the trainer's GPU OOM":
        (ev(errors=[err(5, "OutOfMemoryError", "CUDA out of memory", oom="GPU")]), ending.OOM),
    "numpy's MemoryError for a 7 TiB array is a shape bug, not a bigger pod":
        (ev(errors=[err(5, "_ArrayMemoryError", "Unable to allocate 7.00 TiB", oom="host", alloc_bytes=7 << 40,
                        memory_bytes=24 << 30)]), ending.FAILED),
    "a MemoryError within the machine's memory is out of memory":
        (ev(errors=[err(5, "MemoryError", "", oom="host", alloc_bytes=1 << 30, memory_bytes=24 << 30)]), ending.OOM),
    "a rank's SIGBUS is shared memory, not the script":
        (ev(silent=[{"rank": 0, "pid": 9, "signal": "SIGBUS"}]), ending.SHM),
    "a permanent error the script raised while handling a network error is its own":
        (ev(errors=[err(5, "FileNotFoundError", "fallback.json")]), ending.FAILED),
    "a network error that may pass is the network's":
        (ev(errors=[err(5, "ConnectionError", "refused", transient="could not reach 10.0.0.9:80")]), ending.NETWORK),
    "a KeyboardInterrupt on someone's SIGINT to a rank (noted by the rank) is a stray stop, not the script's":
        (ev(errors=[err(5, "KeyboardInterrupt", "", base="KeyboardInterrupt")],
            signalled=[{"rank": 0, "signal": "SIGINT", "at": T0 + 4.9, "forwarded": False}]), ending.STRAY),
    "a KeyboardInterrupt the script raised itself (no SIGINT came) is its failure, counted, not restarted for ever":
        (ev(errors=[err(5, "KeyboardInterrupt", "", base="KeyboardInterrupt")]), ending.FAILED),
    "a stop you asked for, with everything after it, is a stop":
        (ev(rc=1, asked=asked(30), errors=[err(30.5, "RuntimeError", "stop")]), ending.SIGTERM),
    "the watchdog's hang restart of a killed program is a hang":
        (ev(rc=None, hang={"time": T0 + 40, "reason": "no step for 600s", "where": "wf.py:3"}), ending.HANG),
    "the stale-weights restart the trainer recorded is a restart, not no record":
        (ev(rc=0, own=own(ending.STALE, 50, step=9), inference=running(40, ready=45)), ending.STALE),
    "the watchdog's hang restart is a hang, whatever the ranks it left noted as the next start stopped them":
        (ev(rc=None, hang={"time": T0 + 40, "reason": "no step"},
            signalled=[{"rank": 0, "signal": "SIGTERM", "at": T0 + 60, "forwarded": False}],
            errors=[err(45, "DistNetworkError", "connection reset")]), ending.HANG),
    "an OOM-killed program is out of memory, whatever its leftovers noted":
        (ev(rc=None, oom="the kernel's OOM killer killed 1 process(es)",
            signalled=[{"rank": 0, "signal": "SIGTERM", "at": T0 + 60, "forwarded": False}]), ending.OOM),
    "another rank's network error, then this rank's handler exits 0 on torchrun's SIGTERM: the network's":
        (ev(rc=1, errors=[err(5, "ConnectionError", "reset", rank=1, transient="could not reach hub")],
            own=own(ending.NEVER_TRAINED, 6)), ending.NETWORK),
    "another rank's teardown noise after the finish is no failure":
        (ev(rc=1, own=own(ending.DONE, 60, step=10), errors=[err(61, "DistNetworkError", "broken", rank=1)]),
         ending.DONE),
    "a network error in the push after the finish is the network's":
        (ev(rc=1, own=own(ending.DONE, 60, step=10), errors=[err(62, "ConnectionError", "reset",
                                                               transient="could not reach huggingface.co")]),
         ending.NETWORK),
    "a program killed with no evidence is killed":
        (ev(rc=None), ending.KILLED),
    "an exit 0 with nothing at all, the lease another pod's, is the lease":
        (ev(rc=0, lease="pod abc (host x)"), ending.LEASE_LOST),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_judge_names_each_case_by_its_evidence(name):
    evidence, expected = CASES[name]
    assert kind_of(evidence) == expected, verdict.decide(evidence)


# -- the invariants ---------------------------------------------------------------------------------------------------
texts = st.text(max_size=40) | st.sampled_from(["CUDA out of memory", "SIGTERM", "Killed", "stopped on request",
                                                  "No space left on device", "Connection refused", "done"])
times = st.floats(min_value=0, max_value=200, allow_nan=False)
facts = st.fixed_dictionaries({}, optional={
    "oom": st.sampled_from(["GPU", "host"]), "transient": st.just("could not reach h:1"),
    "unreachable": st.just("inference unreachable at 127.0.0.1:1"), "volume": st.sampled_from(failure.VOLUME_ERRNOS),
    "checkpoint": st.just(True), "base": st.sampled_from(["KeyboardInterrupt", "CheckpointException"]),
    "through": st.just("train"), "alloc_bytes": st.integers(1, 1 << 44), "memory_bytes": st.integers(1, 1 << 36)})
errors = st.builds(lambda t, ty, msg, f, r: {"time": T0 + t, "type": ty, "message": msg, "rank": r, **f},
                   times, texts, texts, facts, st.integers(0, 3))
owns = st.builds(lambda by, t, step: {"by": by, "time": T0 + t, "step": step, "program": 4242},
                 st.sampled_from(sorted(ending.KINDS)), times, st.none() | st.integers(0, 50))
askeds = st.builds(lambda t, by, sup, kind, cut: {"at": T0 + t, "by": by, "supervisord": sup, "kind": kind, "cut": cut},
                   times, st.sampled_from(["you (podkit ctl restart trainer)", "the pod's stop", "the cost guard"]),
                   st.booleans(), st.sampled_from(["", ending.HANG]), st.booleans())
infs = st.builds(lambda state, start, stop, ready, asks: {"state": state, "start": T0 + start, "stop": stop,
                                                           "ready": ready, "asked": asks},
                 st.sampled_from(["RUNNING", "STARTING", "STOPPED", "STOPPING", "EXITED", "FATAL", "BACKOFF"]),
                 st.floats(-50, 200), st.none() | st.floats(T0 - 50, T0 + 200), st.none() | st.floats(T0, T0 + 200),
                 st.lists(st.builds(lambda by, t: {"by": by, "at": T0 + t},
                                    st.sampled_from(["you (podkit ctl restart sglang)", "the watchdog"]), times),
                          max_size=2))
evidence = st.builds(
    ev, rc=st.none() | st.sampled_from([0, 1, 2, 75, 137, -9, 3]), own=st.none() | owns, asked=st.none() | askeds,
    errors=st.lists(errors, max_size=3),
    signalled=st.lists(st.builds(lambda r, t, f: {"rank": r, "signal": "SIGTERM", "at": T0 + t, "forwarded": f},
                                 st.integers(0, 3), times, st.booleans()), max_size=2),
    silent=st.lists(st.builds(lambda r, s, x: {"rank": r, "pid": 100 + r, "signal": s, "exit": x}, st.integers(0, 3),
                              st.sampled_from([None, "SIGKILL", "SIGBUS", "SIGSEGV", "SIGTERM"]),
                              st.none() | st.integers(1, 5)), max_size=2),
    oom=st.sampled_from(["", "the kernel's OOM killer killed 1 process(es)"]), inference=st.none() | infs,
    progress=st.builds(lambda s, t: {"step": s, "time": T0 + t}, st.none() | st.integers(0, 50), times),
    hang=st.none() | st.just({"time": T0 + 50, "reason": "no step", "where": "wf.py:3"}),
    lease=st.sampled_from(["", "pod other"]))
PROPS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(evidence)
def test_every_end_is_a_known_kind_with_words_a_family_an_exit_code_and_the_judge_reads_only_its_evidence(e):
    before = copy.deepcopy(e)
    out = verdict.decide(e)
    assert e == before, "the judge changed its evidence"
    assert out == verdict.decide(copy.deepcopy(e)), "the same evidence, another end"
    k = ending.KINDS[out["by"]]
    end = ending.End({**out, "time": T0})
    assert k.words and end.words() and isinstance(ending.exit_code(end, e["rc"] or 0), int)


@PROPS
@given(evidence, st.randoms())
def test_the_order_the_sources_are_read_in_decides_nothing(e, rnd):
    shuffled = {**e, "errors": rnd.sample(e["errors"], len(e["errors"]))}
    assert kind_of(shuffled) == kind_of(e)


@PROPS
@given(evidence, askeds)
def test_a_stop_that_was_asked_for_with_nothing_before_it_is_never_counted(e, a):
    """Everything the run recorded came after the ask (moved there): its consequences, never counted. An ask is
    supervisord's stop (ctl, the pod's stop, the cost guard's): a SIGTERM supervisord did not send is nobody's ask
    (ending.who_asked), a stray stop that the loop bound counts when it comes again with no new step."""
    a = {**a, "kind": "", "at": T0 + 1, "supervisord": True}
    e = {**e, "asked": a, "errors": [{**x, "time": x["time"] + 1} for x in e["errors"]],
         "own": e["own"] and {**e["own"], "time": e["own"]["time"] + 1}}
    assert ending.KINDS[kind_of(e)].counts is None, verdict.decide(e)


@PROPS
@given(evidence, st.floats(0, 100), st.floats(0.1, 100), st.floats(0, 60), st.floats(1, 100), st.booleans())
def test_a_ranks_exception_after_inference_was_back_is_never_a_stop_nor_inferences(e, start, step_gap, ask_gap, gap,
                                                                                    yours):
    """You (or the watchdog) restarted inference at `start`; the run stepped since; then the script raised."""
    by = "you (podkit ctl restart sglang)" if yours else "the watchdog"
    inf = {"state": "RUNNING", "start": T0 + start, "ready": None, "asked": [{"by": by, "at": T0 + start - ask_gap}]}
    back = T0 + start + step_gap
    first = {"time": back + gap, "type": "ValueError", "message": "bad", "rank": 0}
    e = {**e, "inference": inf, "asked": None, "own": None, "oom": "", "signalled": [], "progress": {"step": 9,
         "time": back}, "errors": [first, *[x for x in e["errors"] if x["time"] > first["time"]]]}
    k = ending.KINDS[kind_of(e)]
    assert k.family != ending.STOP and k.name not in (ending.INFERENCE, ending.INFERENCE_STOPPED), verdict.decide(e)


@PROPS
@given(evidence, st.sampled_from(["STOPPED", "EXITED", "FATAL", "BACKOFF"]), st.floats(5, 100), st.floats(1.5, 100))
def test_a_ranks_exception_before_inference_went_down_is_never_inferences(e, state, raised, gap):
    """The script raised at `raised`; inference was asked to stop, or died (supervisord's stop time), `gap` later."""
    first = {"time": T0 + raised, "type": "ValueError", "message": "bad", "rank": 0}
    inf = {"state": state, "start": T0 - 10, "stop": T0 + raised + gap,
           "asked": [a for a in (e["inference"] or {}).get("asked", []) if a["at"] > first["time"] + 1.5]}
    e = {**e, "inference": inf, "asked": None, "own": None, "oom": "", "signalled": [],
         "errors": [first, *[x for x in e["errors"] if x["time"] > first["time"]]]}
    assert kind_of(e) not in (ending.INFERENCE, ending.INFERENCE_STOPPED), verdict.decide(e)


@PROPS
@given(evidence)
def test_an_end_with_a_recorded_exception_is_never_no_record(e):
    assume(e["errors"])
    assert kind_of(e) != ending.ENDED


@PROPS
@given(evidence, st.sampled_from(ending.FINISHED_KINDS), times, errors)
def test_a_failure_after_a_finished_record_is_never_finished(e, by, t, late):
    finished = {"by": by, "time": T0 + t, "step": 10, "program": 4242}
    late = {**late, "time": finished["time"] + 0.5 + (late["time"] - T0), "rank": 0}  # rank 0 wrote the finish
    late.pop("through", None)
    e = {**e, "own": finished, "errors": [*e["errors"], late]}
    assert ending.KINDS[kind_of(e)].family != ending.FINISHED, verdict.decide(e)


@PROPS
@given(evidence, st.lists(texts, min_size=6, max_size=6))
def test_nothing_the_users_exception_text_says_makes_an_oom_or_a_stop(e, words):
    said = {**e, "errors": [{**x, "type": words[i % 6], "message": words[(i + 1) % 6]}
                            for i, x in enumerate(e["errors"])]}
    assert ending.KINDS[kind_of(said)].family == ending.KINDS[kind_of(e)].family
    if kind_of(said) == ending.OOM and verdict.decide(said) is not said["own"]:
        assert e["oom"] or any(x.get("oom") for x in e["errors"])


@PROPS
@given(evidence)
def test_a_transient_or_volume_kind_needs_its_cause_in_the_first_exception(e):
    out = verdict.decide(e)
    if out is e["own"]:
        return  # the trainer's own record, as it stored it
    errs = e["errors"]
    if e["own"] and ending.KINDS[e["own"]["by"]].family == ending.FINISHED:  # what the run went past is no cause
        # nor, after a finish, another rank's own exception (teardown noise: verdict.after_finish)
        errs = [x for x in errs if x["time"] > e["own"]["time"]
                and (x.get("rank", 0) in (0, None) or x.get("through") == "train")]
    first = min((x["time"] for x in errs), default=None)
    causes = [x for x in errs if x["time"] == first]  # the earliest (a tie: any of them)
    for kind, fact in ((ending.NETWORK, "transient"), (ending.VOLUME, "volume"), (ending.CHECKPOINT, "checkpoint")):
        if out["by"] == kind:
            assert any(x.get(fact) for x in causes), out


# The exception's own facts: by type and cause, never by text, never by what was being handled.
class HubError(ConnectionError):
    pass


chains = st.lists(st.sampled_from([ValueError, KeyError, FileNotFoundError, ConnectionRefusedError, TimeoutError,
                                   BrokenPipeError, HubError, RuntimeError, MemoryError]), min_size=1, max_size=4)


def build(kinds, links, message):
    exc = None
    for cls, link in zip(kinds, links, strict=False):
        new = cls(message)
        if exc is not None:
            if link:
                new.__cause__ = exc
            else:
                new.__context__ = exc
        exc = new
    return exc


@settings(max_examples=300, deadline=None)
@given(chains, st.lists(st.booleans(), min_size=4, max_size=4), texts)
def test_a_network_error_needs_a_network_cause_raised_from_not_one_being_handled(kinds, links, message):
    exc = build(kinds, links, message)
    caused = [exc]
    while caused[-1].__cause__ is not None:
        caused.append(caused[-1].__cause__)
    net = any(isinstance(x, (ConnectionError, TimeoutError)) and not isinstance(x, BrokenPipeError) for x in caused)
    if not net or isinstance(exc, BrokenPipeError):
        assert failure.transient(exc) == ""
    assert failure.oom_of(exc) in ("", "host") and (failure.oom_of(exc) == "host") == any(
        isinstance(x, MemoryError) for x in caused)


def test_every_kind_has_a_fix_in_the_words_of_where_the_trainer_runs(monkeypatch):
    for place in ("pod", "up", "rehearse"):
        monkeypatch.setenv(ending.PLACE_ENV, place)
        cfg = type("C", (), {"origin": lambda self, key: "defaults"})()
        for k in ending.KINDS.values():
            if k.family == ending.FINAL:
                assert k.fix or ending.fix_code(cfg), k.name
        for c in ending.COUNTS.values():
            assert ending.kind(c.final).family == ending.FINAL
