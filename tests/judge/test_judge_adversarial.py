"""The judge of a trainer run's end (verdict.py, ending.py, failure.py, the bootstrap), tried the way a user whose pod
restart-loops at 3 a.m., or who is blamed for what was not their script's, would try it: records planted or left by
another run, events in every order, exceptions of every odd shape. Each test is named after its scenario; the ones
the judge already got right are in tests/judge/test_verdict.py's table."""

from __future__ import annotations

import time

import pytest
from test_ending import cfg_of
from test_verdict import T0, err, ev

from podkit import records
from podkit.judge import ending, failure, verdict

pytestmark = pytest.mark.timeout(60)


def judged(cfg, rc, started):
    return verdict.decide(verdict.gather(cfg, rc, started))


# -- records another run left, or someone planted ---------------------------------------------------------------
def test_an_exception_record_stamped_an_hour_ahead_is_not_every_later_runs_exception(tmp_path):
    """A rank's record from a clock an hour ahead (another node's, or one stepped back since; or planted) passes
    every run's `since`: the run that finished would be judged failed after its finish, and each run after it."""
    cfg = cfg_of(tmp_path)
    started = time.time()
    failure.write(cfg.run_path, 0, {"type": "ValueError", "message": "planted", "where": "x.py:1",
                                    "time": time.time() + 3600})
    records.PROGRESS.write(tmp_path, {"stopped": ending.record(ending.DONE, step=10)})
    assert judged(cfg, 0, started)["by"] == ending.DONE


def test_an_exception_record_of_another_trainer_program_is_not_this_runs(tmp_path, monkeypatch):
    """Two programs' runs overlap in time (a killed program's ranks outliving it, a second launcher): a rank's
    record names the program it ran under, and the judge of this program's run reads only its own."""
    cfg = cfg_of(tmp_path)
    started = time.time()
    monkeypatch.setenv(ending.PROGRAM_ENV, "99999")  # written by rank 0 of another program
    failure.write(cfg.run_path, 0, {"type": "KeyError", "message": "'question'", "where": "x.py:1",
                                    "time": time.time() + 1})
    monkeypatch.setenv(ending.PROGRAM_ENV, str(__import__("os").getpid()))
    records.PROGRESS.write(tmp_path, {"stopped": ending.record(ending.DONE, step=10)})
    assert judged(cfg, 0, started)["by"] == ending.DONE
    failure.write(cfg.run_path, 0, {"type": "KeyError", "message": "'answer'", "where": "x.py:2",
                                    "time": time.time() + 1})  # this program's rank 0, after the finish: its own
    assert judged(cfg, 1, started)["by"] == ending.FAILED


# -- events in every order --------------------------------------------------------------------------------------
def down(state, stop, asks=()):
    return {"state": state, "start": T0 - 100, "stop": T0 + stop, "asked": [{"by": by, "at": T0 + t} for by, t in asks]}


@pytest.mark.parametrize("state", ["EXITED", "BACKOFF", "FATAL", "STOPPED"])
def test_the_scripts_crash_before_inference_went_down_is_the_scripts_not_inferences(state):
    """The script raised at 10 s; inference crashed (or was stopped) at 90 s, while the trainer's ranks were still
    ending: down when the run is judged, but not when the rank raised. Blamed on inference, a bug in the script is
    retried three times as often (or, inference stopped, never counted at all)."""
    e = ev(errors=[err(10)], progress={"step": 4, "time": T0 + 5}, inference=down(state, 90))
    assert verdict.decide(e)["by"] == ending.FAILED, verdict.decide(e)


@pytest.mark.parametrize("state", ["EXITED", "BACKOFF", "FATAL"])
def test_the_scripts_error_as_inference_went_down_is_inferences(state):
    e = ev(errors=[err(90.5)], progress={"step": 4, "time": T0 + 5}, inference=down(state, 90))
    assert verdict.decide(e)["by"] == ending.INFERENCE, verdict.decide(e)


def test_an_error_while_inference_crash_loops_is_inferences_though_its_last_death_came_after():
    """SGLang died, was started again at 60 s and died again at 90 s (BACKOFF): the rank raised at 65 s, while the
    restarted server loaded. supervisord's stop time is the last death; the start during the run says the server
    the run had was gone by then."""
    e = ev(errors=[err(65)], progress={"step": 4, "time": T0 + 5},
           inference={"state": "BACKOFF", "start": T0 + 60, "stop": T0 + 90, "asked": []})
    assert verdict.decide(e)["by"] == ending.INFERENCE, verdict.decide(e)


def test_an_error_after_you_asked_for_inferences_stop_but_before_it_stopped_is_the_stops():
    """`podkit ctl stop sglang` at 80 s; SGLang took 10 s to shut down; the request in flight failed at 85 s."""
    e = ev(errors=[err(85)], inference=down("STOPPED", 90, asks=[("you (podkit ctl stop sglang)", 80)]))
    assert verdict.decide(e)["by"] == ending.INFERENCE_STOPPED, verdict.decide(e)


# -- the script's own ways out, through the bootstrap -----------------------------------------------------------
TRAINING = "from podkit.areal import hooks\n\nhooks.state().training = True  # as PPOTrainer.train sets it\n"
SCRIPTS = {
    "exit0_in_train.py": TRAINING + "import sys\nsys.exit(0)\n",
    "exit_in_train.py": TRAINING + "import sys\nsys.exit()\n",
    "exitmsg_in_train.py": TRAINING + "import sys\nsys.exit('giving up')\n",
    "caught_exit0.py": TRAINING + "import sys\n\ntry:\n    raise ValueError('a bad batch')\nexcept ValueError:\n"
                       "    sys.exit(0)  # the failure caught, and hidden behind an exit 0\n",
    "exit0_after_train.py": TRAINING + "from podkit.judge import ending\nhooks.state().returned = True\n"
                            "ending.write(hooks.state().cfg.state_dir, ending.DONE, step=10)\nimport sys\nsys.exit(0)\n",
    "ctrlc.py": "raise KeyboardInterrupt\n",
    "ctrlc_in_train.py": TRAINING + "raise KeyboardInterrupt('my own stop')\n",
    "sigint.py": "import os, signal, time\n\nos.kill(os.getpid(), signal.SIGINT)  # someone's kill -INT\ntime.sleep(5)\n",
    "surrogate.py": "rows = ['bad answer: ' + chr(0xD800)]  # a broken surrogate pair in a JSON row\n\n"
                    "raise ValueError(rows[0])\n",
    "strraises.py": "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n\n\nraise Odd(1)\n",
    "proxy.py": "class Remote(Exception):\n    def __getattr__(self, name):  # an error object that answers any attribute\n"
                "        return f'<remote {name}>'\n\n\nraise Remote('the reward server said no')\n",
    "hostile.py": "class Hostile(Exception):\n    def __getattr__(self, name):\n        raise RuntimeError(name)\n\n\n"
                  "raise Hostile('the reward server said no')\n",
    "myoom.py": "class OutOfMemoryError(RuntimeError):  # the script's own budget\n    pass\n\n\n"
                "raise OutOfMemoryError('CUDA out of memory: over my token budget')\n",
}


@pytest.fixture
def through_bootstrap(tmp_path, monkeypatch):
    """bootstrap.run on a script, as torchrun's rank runs it (AReaL's patches left out), then the judge."""
    import os
    import signal
    import sys
    from types import SimpleNamespace

    from podkit.areal import bootstrap, hooks

    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in SCRIPTS.items():
        (repo / name).write_text(text)
    real = signal.signal
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # as on a pod: an xdist worker may run with SIGINT ignored, and a rank's `kill -INT` would then do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(signal, "signal", signal.signal)
    monkeypatch.setattr(signal, "getsignal", signal.getsignal)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ending.PROGRAM_ENV, str(os.getpid()))
    monkeypatch.delenv("RANK", raising=False)

    def install(cfg, code=None):
        hooks._state = st = hooks.State(cfg, code)
        hooks.take_signals(st)
        return st

    monkeypatch.setattr(hooks, "install", install)
    monkeypatch.setattr(hooks, "_state", None)
    monkeypatch.setattr(bootstrap, "shadowed_areal", lambda paths: [])

    def run(entry):
        (tmp_path / entry).mkdir()
        cfg = cfg_of(tmp_path / entry)
        cfg.trainer.entry, cfg.repo, cfg.multi_node = entry, SimpleNamespace(dest=str(repo)), False
        started = time.time()
        ending.rank_alive(cfg.run_path, 0)
        try:
            rc = bootstrap.run(cfg, [])
        except BaseException:  # noqa: BLE001 - what the rank dies of
            rc = 1
        finally:
            ending.rank_exited(cfg.run_path, 0)
        return rc, judged(cfg, rc, started)

    yield run
    for s, h in handlers.items():
        real(s, h)


def test_sys_exit_0_in_the_middle_of_training_is_the_scripts_early_end_and_one_hiding_a_caught_failure_is_that(
        through_bootstrap):
    """sys.exit(0) (or sys.exit()) while train() ran: before, the judge found an exit 0 with nothing recorded
    ("no-record"): the trainer stayed stopped, the pod billing, nothing named. A plain one is the script's own end
    (an early stop): stopped for good, named at its line, never retried into a crash loop. One raised while the
    script handled an exception is that exception, caught and hidden: a failure, counted."""
    for entry in ("exit0_in_train.py", "exit_in_train.py"):
        rc, end = through_bootstrap(entry)
        assert rc == 0 and end["by"] == ending.ENDED_EARLY, (entry, end)
        assert "ended training with exit 0 inside PPOTrainer.train" in end["message"] and f"{entry}:5" in \
            end["message"], end
        assert ending.kind(end["by"]).family == ending.FINAL and ending.kind(end["by"]).counts is None
    rc, end = through_bootstrap("caught_exit0.py")
    assert rc == 0 and end["by"] == ending.FAILED and "a bad batch" in end["message"], end


def test_sys_exit_with_a_message_in_training_is_a_failure_and_sys_exit_0_after_it_is_finished(through_bootstrap):
    rc, end = through_bootstrap("exitmsg_in_train.py")
    assert rc == 1 and end["by"] == ending.FAILED and "giving up" in end["message"], end
    rc, end = through_bootstrap("exit0_after_train.py")
    assert rc == 0 and end["by"] == ending.DONE, end


def test_a_keyboardinterrupt_the_script_raises_itself_is_counted_not_a_stray_stop_restarted_for_ever(
        through_bootstrap):
    """A stray stop is never counted and restarts at once: a script that raises KeyboardInterrupt on every start
    (before training or in it) looped for ever. Someone's real SIGINT to a rank is still a stray stop: each rank
    notes it."""
    for entry in ("ctrlc.py", "ctrlc_in_train.py"):
        rc, end = through_bootstrap(entry)
        assert end["by"] == ending.FAILED and "no SIGINT came" in end["message"], (entry, end)
    rc, end = through_bootstrap("sigint.py")
    assert end["by"] == ending.STRAY and "SIGINT" in end["asked"], end


def test_an_exception_message_with_a_lone_surrogate_is_recorded_as_text_every_stream_takes(through_bootstrap):
    """A data row with a broken surrogate pair in the script's message: the record and the end's message must
    encode as UTF-8, or the launcher's log of the end (and `podkit status`) fails on it after the rank died."""
    rc, end = through_bootstrap("surrogate.py")
    assert end["by"] == ending.CONFIG_ERROR, end  # before training: the script's own, once
    (end["message"] + end.get("hint", "")).encode("utf-8")
    assert "bad answer: \\ud800" in end["message"], end


def test_an_exception_whose_str_raises_is_still_named(through_bootstrap):
    rc, end = through_bootstrap("strraises.py")
    assert end["by"] == ending.CONFIG_ERROR and "Odd" in end["message"], end


def test_the_scripts_own_class_named_outofmemoryerror_is_not_an_out_of_memory(through_bootstrap):
    rc, end = through_bootstrap("myoom.py")
    assert end["by"] == ending.FAILED and "over my token budget" in end["message"], end


# -- exceptions of every shape, classified -----------------------------------------------------------------------
def raised(make):
    try:
        make()
    except BaseException as e:  # noqa: BLE001
        return e


def test_exceptions_of_every_odd_shape_are_classified_by_type_and_cause():
    import errno

    def handling_a_network_error():
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionError:
            raise KeyError("answer")  # noqa: B904 - handled, not raised from: __context__ only

    ctx = raised(handling_a_network_error)
    assert ctx.__context__ is not None and ctx.__cause__ is None
    assert failure.classify(ctx, {}) == {}, "a network error being handled is not the cause"

    CheckpointException = type("CheckpointException", (BaseException,), {"__module__": "torch.distributed.checkpoint"
                                                                                      ".api"})
    full = CheckpointException("save failed")
    full.failures = {0: (OSError(errno.ENOSPC, "No space left on device"), None)}
    assert failure.classify(full, {}) == {"base": "CheckpointException", "volume": "ENOSPC"}

    assert failure.classify(raised(lambda: bytearray(1 << 62)), {}).get("oom") == "host"
    deep = raised(lambda: (f := lambda n: f(n + 1))(0))  # noqa: E731
    assert isinstance(deep, RecursionError) and failure.classify(deep, {}) == {}

    huge = failure.describe(ValueError("x" * 10_000_000), [])
    assert len(huge["message"]) == failure.MAX_MESSAGE


def test_only_torchs_outofmemoryerror_is_a_gpu_out_of_memory_not_a_class_of_that_name():
    torch_oom = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})  # torch.OutOfMemoryError's module
    assert failure.classify(torch_oom("CUDA out of memory."), {})["oom"] == "GPU"
    assert failure.classify(type("Sub", (torch_oom,), {})("x"), {})["oom"] == "GPU", "a subclass of torch's is"
    mine = type("OutOfMemoryError", (RuntimeError,), {"__module__": "__main__"})
    assert "oom" not in failure.classify(mine("CUDA out of memory."), {}), "a name alone is not torch's type"


def test_an_undecodable_file_name_in_a_message_is_recorded_as_utf8():
    odd = failure.describe(FileNotFoundError(b"data-\xff.jsonl".decode("utf-8", "surrogateescape")), [])
    odd["message"].encode("utf-8")
    assert "data-\\udcff.jsonl" in odd["message"], odd


def test_an_exception_that_answers_or_refuses_every_attribute_is_still_recorded_in_its_own_words(through_bootstrap):
    """A proxy's exception (every attribute answered, or every one raising): podkit's own mark on it (hooks.SEEN)
    read as its record, or raising in the handler, lost the script's words and its refusal."""
    for entry in ("proxy.py", "hostile.py"):
        rc, end = through_bootstrap(entry)
        assert rc == 2 and end["by"] == ending.CONFIG_ERROR and "the reward server said no" in end["message"], end


def test_a_checkpoint_load_that_ran_out_of_memory_is_out_of_memory_not_a_damaged_checkpoint(tmp_path):
    """torch's loader raises CheckpointException with each rank's own exception inside: a rank that ran out of memory
    reading a whole checkpoint (a small pod, a GPU SGLang took more of this time) was judged "the recover checkpoint
    cannot be loaded", stopped for good with `podkit start-over` as the fix: moving a whole checkpoint aside and
    training from step 0 for want of memory."""
    import importlib.util

    (tmp_path / "state_dict_loader.py").write_text(  # torch/distributed/checkpoint/state_dict_loader.py's name
        "class CheckpointException(BaseException):\n"
        "    def __init__(self, msg, failures):\n        super().__init__(msg)\n        self.failures = failures\n\n\n"
        "def load(inner):\n    raise CheckpointException('CheckpointException ranks:dict_keys([0])', {0: (inner, None)})\n")
    spec = importlib.util.spec_from_file_location("state_dict_loader", tmp_path / "state_dict_loader.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    oom = raised(lambda: loader.load(MemoryError()))
    assert failure.classify(oom, {}) == {"base": "CheckpointException", "oom": "host"}
    damaged = raised(lambda: loader.load(RuntimeError("unexpected EOF")))
    assert failure.classify(damaged, {}) == {"base": "CheckpointException", "checkpoint": True}
