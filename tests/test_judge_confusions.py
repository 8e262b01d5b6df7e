"""The judge's last confusions (issue 55): after a finish a failure is a failure, a killed program's own final
record decides its end, and each end is named by its evidence (the first rank to die, an OOM kill the run
stepped past, ...). Pure cases over verdict.decide's evidence, with a property for the finish's invariant; the
exceptions' facts over real exception classes (failure.classify)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podkit import ending, verdict
from test_verdict import PROPS, T0, err, ev, evidence, own

pytestmark = pytest.mark.timeout(120)

OOM = "the kernel's OOM killer killed 1 process(es) in this container (memory.events: oom_kill 3 -> 4)"


def decide(**kw):
    return verdict.decide(ev(**kw))


# -- after a finish, a failure is a failure ------------------------------------------------------------------------
def test_a_second_train_call_that_raises_after_the_finish_is_a_failure_not_training_finished():
    """AReaL's NameEntryExistsError out of the script's second train(): recorded `through: train` after the
    finish."""
    out = decide(rc=1, own=own(ending.DONE, 60, step=1),
                 errors=[err(70, "NameEntryExistsError", "name exists", through="train")])
    assert out["by"] == ending.FAILED and "after training finished" in out["message"], out
    assert "NameEntryExistsError" in out["message"], out


def test_another_ranks_exception_out_of_a_later_train_call_is_a_failure_too():
    out = decide(rc=1, own=own(ending.DONE, 60, step=1),
                 errors=[err(70, "NameEntryExistsError", "name exists", rank=1, through="train")])
    assert out["by"] == ending.FAILED, out


@pytest.mark.parametrize("silent, kind", [
    ({"rank": 0, "pid": 7, "signal": "SIGKILL"}, ending.KILLED),
    ({"rank": 0, "pid": 7, "signal": "SIGSEGV"}, ending.FAILED),
    ({"rank": 0, "pid": 7, "signal": None, "exit": 1}, ending.FAILED),
], ids=["sigkill", "segfault", "os-exit-1"])
def test_a_ranks_death_after_the_finish_is_a_failure_not_done(silent, kind):
    out = decide(rc=1, own=own(ending.DONE, 60, step=10), silent=[silent])
    assert out["by"] == kind and "after training finished" in out["message"], out


def test_an_oom_kill_of_rank_0_after_the_finish_is_out_of_memory():
    out = decide(rc=1, own=own(ending.DONE, 60, step=10), oom=OOM, oom_late=OOM,
                 silent=[{"rank": 0, "pid": 7, "signal": "SIGKILL"}])
    assert out["by"] == ending.OOM, out


def test_a_killed_program_with_an_oom_kill_since_the_finish_is_out_of_memory():
    out = decide(rc=None, own=own(ending.DONE, 60, step=10), oom=OOM, oom_late=OOM)
    assert out["by"] == ending.OOM, out


def test_an_oom_kill_the_run_stepped_past_before_its_finish_leaves_it_finished():
    """The kill was counted before the finish's note (oom_late empty): another process's, long before."""
    assert decide(rc=0, own=own(ending.DONE, 60, step=10), oom=OOM, oom_late="")["by"] == ending.DONE


def test_a_non_zero_exit_after_the_finish_with_nothing_recorded_is_a_failure():
    out = decide(rc=3, own=own(ending.DONE, 60, step=10))
    assert out["by"] == ending.FAILED and "exited 3" in out["message"], out


deaths = st.sampled_from([
    {"silent": [{"rank": 0, "pid": 7, "signal": "SIGKILL"}]}, {"silent": [{"rank": 1, "pid": 8, "signal": "SIGSEGV"}]},
    {"silent": [{"rank": 0, "pid": 7, "signal": None, "exit": 1}]}, {"rc": 1},
    {"oom_late": OOM, "rc": 137}, {"late": "through"}, {"late": "rank0"}])


@PROPS
@given(evidence, st.sampled_from(ending.FINISHED_KINDS), st.floats(0, 100), deaths)
def test_after_a_finish_a_later_failure_is_never_finished(e, by, t, death):
    """Invariant: a finished record, then (with no stop asked) rank 0's exception or any rank's out of a later
    train(), a rank's death (a signal, os._exit(n)), an OOM kill since the finish that ended the program, or a
    non-zero exit: never a finished end."""
    fin = {"by": by, "time": T0 + t, "step": 10, "program": 4242}
    e = {**e, "own": fin, "asked": None, "signalled": [], "errors": [x for x in e["errors"] if x["time"] <= fin["time"]]}
    death = dict(death)
    late = death.pop("late", None)
    if late:
        e["errors"].append({"time": fin["time"] + 1, "type": "RuntimeError", "message": "x",
                            "rank": 3 if late == "through" else 0, **({"through": "train"} if late == "through" else {})})
    e.update(death)
    if "rc" in death and not late:
        e["silent"] = []
    assert ending.KINDS[verdict.decide(e)["by"]].family != ending.FINISHED, verdict.decide(e)


# -- a killed program's own final record decides its end -----------------------------------------------------------
@pytest.mark.parametrize("final", [ending.NEVER_TRAINED, ending.CONFIG_ERROR])
def test_a_killed_programs_own_stop_for_good_stays_its_end_whatever_the_watchdog_did(final):
    """A script that never called train() but whose non-daemon thread kept it alive: it recorded its stop for good,
    then the watchdog restarted it as a hang. Its own record decides (judged at the next start): stopped for
    good, not a hang that starts it again."""
    out = decide(rc=None, own=own(final, 5), hang={"time": T0 + 600, "reason": "no step for 600s", "where": None},
                 oom=OOM, errors=[err(3)])
    assert out["by"] == final, out


# -- the first rank to die is the cause ----------------------------------------------------------------------------
def test_rank_1_sigkilled_under_torchrun_is_the_cause_not_rank_0s_connection_closed_by_peer():
    out = decide(rc=1, errors=[err(30, "RuntimeError", "Connection closed by peer [127.0.0.1]:29500")],
                 silent=[{"rank": 1, "pid": 8, "signal": "SIGKILL"}])
    assert out["by"] == ending.KILLED and "rank 1" in out["message"], out
    assert any("Connection closed by peer" in x and "fallout" in x for x in out["evidence"]), out


def test_rank_1_oom_killed_under_torchrun_is_out_of_memory_not_rank_0s_error():
    out = decide(rc=1, errors=[err(30, "RuntimeError", "Connection closed by peer")], oom=OOM, oom_late=OOM,
                 silent=[{"rank": 1, "pid": 8, "signal": "SIGKILL"}])
    assert out["by"] == ending.OOM and "rank 1" in out["message"], out


def test_a_rank_torchrun_stopped_after_another_ranks_failure_is_not_the_cause():
    """torchrun's teardown: rank 0 raised; rank 1 noted the SIGTERM, then was killed after the grace."""
    out = decide(rc=1, errors=[err(30, "KeyError", "'question'")],
                 signalled=[{"rank": 1, "signal": "SIGTERM", "at": T0 + 31, "forwarded": False}],
                 silent=[{"rank": 1, "pid": 8, "signal": "SIGKILL"}])
    assert out["by"] == ending.FAILED and "KeyError" in out["message"], out


# -- an OOM kill is the cause only when it came during what it ended -----------------------------------------------
def test_another_processs_oom_kill_the_run_stepped_past_leaves_the_scripts_keyerror_its_own():
    """The kernel's count rose 38 minutes before the KeyError, and the run stepped past it (rank 0's note at its
    last step already had it): no rank was killed, so the KeyError is the script's, not out of memory."""
    out = decide(rc=1, errors=[err(2400, "KeyError", "'answer'")], oom=OOM, oom_late="")
    assert out["by"] == ending.FAILED and "KeyError" in out["message"], out


def test_an_oom_kill_since_the_last_step_with_an_exception_is_still_out_of_memory():
    """A dataloader worker killed by the kernel since the last step: the rank's error is its fallout."""
    out = decide(rc=1, errors=[err(40, "RuntimeError", "DataLoader worker (pid 99) is killed by signal: Killed.")],
                 oom=OOM, oom_late=OOM)
    assert out["by"] == ending.OOM, out


# -- the training data's fingerprint: every file, whatever its links ------------------------------------------------
def test_a_data_directory_with_a_dangling_link_still_fingerprints_as_its_files(tmp_path):
    """One link to nothing among the rows: the directory is still told apart from another dataset (a fingerprint
    of "" is compared with nothing, and another dataset resumed silently)."""
    from podkit.areal import identity

    a, b = tmp_path / "a", tmp_path / "b"
    for d, rows in ((a, "1+1"), (b, "2+2")):
        d.mkdir()
        (d / "train.jsonl").write_text(f'{{"q": "{rows}"}}\n' * 100)
        (d / "extra.jsonl").symlink_to(tmp_path / "gone.jsonl")
    fa, fb = identity.data_fingerprint(str(a)), identity.data_fingerprint(str(b))
    assert fa and fb and fa != fb and not fa.startswith("id:"), (fa, fb)
    assert identity.data_fingerprint(str(a)) == fa, "the same directory, another fingerprint"


def test_a_change_in_a_file_past_the_256th_changes_the_fingerprint_and_its_reading_stays_bounded(tmp_path, monkeypatch):
    """Files past the 256th in name order are looked at: every file's name and size, and the contents of an even
    sample over all of them; what is read stays within DATA_FILES files' first and last 64 KiB."""
    import builtins

    from podkit.areal import identity

    d = tmp_path / "shards"
    d.mkdir()
    for i in range(600):
        (d / f"part-{i:04d}.jsonl").write_text(f'{{"row": {i}}}\n')
    before = identity.data_fingerprint(str(d))
    (d / "part-0599.jsonl").write_text('{"row": "other, longer"}\n')  # another size, the last file
    resized = identity.data_fingerprint(str(d))
    (d / "part-0599.jsonl").write_text('{"row": 599}\n')
    sample = sorted(int(i * 600 / identity.DATA_FILES) for i in range(identity.DATA_FILES))
    late = sample[-1]  # a file past the 256th whose contents are read: same size, other contents
    (d / f"part-{late:04d}.jsonl").write_text(f'{{"row": {late + 1}}}\n'[:len(f'{{"row": {late}}}\n')])
    edited = identity.data_fingerprint(str(d))
    assert len({before, resized, edited}) == 3, (before, resized, edited)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
    identity.data_fingerprint(str(d))
    assert len(opened) == identity.DATA_FILES, len(opened)
