"""The judge's last confusions (issue 55): after a finish a failure is a failure, a killed program's own final
record decides its end, and each end is named by its evidence (the first rank to die, an OOM kill the run
stepped past, ...). Pure cases over verdict.decide's evidence, with a property for the finish's invariant; the
exceptions' facts over real exception classes (failure.classify)."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_verdict import PROPS, T0, err, ev, evidence, own

from podkit.judge import ending, verdict

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


@PROPS
@given(evidence)
def test_an_exception_with_no_rank_killed_and_no_oom_kill_since_the_last_step_is_never_out_of_memory(e):
    """Invariant: the program ended by itself, no rank died without a word, and the kernel's count did not rise
    since the last step: only an exception's own memory fact (its type) makes it out of memory."""
    errors = [{k: v for k, v in x.items() if k != "oom"} for x in e["errors"]]
    e = {**e, "rc": e["rc"] if e["rc"] is not None else 1, "own": None, "silent": [], "oom_late": "",
         "errors": errors}
    assert verdict.decide(e)["by"] != ending.OOM or not errors, verdict.decide(e)


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


# -- the bootstrap and podkit's hooks under AReaL's Python (no pod, no trainer steps) --------------------------------
CAUGHT = """import sys

try:
    open('data/missing.jsonl')
except FileNotFoundError as e:
    print('no data:', e)
    sys.exit(0)
"""
CONFIG_ON_FULL_VOLUME = """import getpass, os
from areal.api.cli_args import GRPOConfig, load_expr_config

fr = os.environ['FR']
logs = f"{fr}/logs/{getpass.getuser()}/e/t"
os.makedirs(logs, exist_ok=True)
os.symlink('/dev/full', logs + '/config.yaml')  # where AReaL saves the config: a full volume
load_expr_config(['--config', os.environ['YAML'], 'experiment_name=e', 'trial_name=t', f'cluster.fileroot={fr}',
                  f'recover.fileroot={fr}'], GRPOConfig)
"""
OOM_THEN_CLEANUP = """import torch
from podkit.areal import hooks

st = hooks.state()
st.training = True  # as train() does on entry; its wrapper records what leaves it (record_through_train)
try:
    try:
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
    except BaseException as e:
        hooks.record_through_train(st, e)
        raise
finally:
    raise RuntimeError('cleanup: the pool was closed already')
"""
WORKER_THREAD = """import json, os, signal, threading, time
from areal.trainer.rl_trainer import PPOTrainer
from podkit.areal import hooks


class Bare(PPOTrainer):
    def __init__(self):  # no model, no server: what train() does before AReaL's own code is what is checked
        pass

    def _requires_proxy_workflow(self, workflow):
        return False


out = {}


def run():
    try:
        Bare().train(workflow='areal.workflow.rlvr.RLVRWorkflow')
    except BaseException as e:
        out['raised'] = f'{type(e).__name__}: {e}'[:300]
    out['training'] = hooks.state().training


t = threading.Thread(target=run)
t.start()
t.join()
# A stop while the worker trains: the script's own SIGTERM handler (podkit could not take it back off the main
# thread) still flags the step in flight to end with its checkpoint.
signal.signal(signal.SIGTERM, lambda *_: None)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
out['flagged'] = hooks.state().sigterm.is_set()
json.dump(out, open(os.environ['OUT'], 'w'))
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("AREAL_PYTHON") and not os.environ.get("CI"),
                    reason="no AReaL environment: set AREAL_PYTHON=$(sh rehearse/env.sh)")
def test_before_training_each_end_is_named_by_its_cause_not_the_config_nor_never_trained(tmp_path):
    """Through the real bootstrap and AReaL's own loader, then the judge: a caught FileNotFoundError then
    sys.exit(0) is named with its type, file and line; ENOSPC while AReaL saves its config is the volume, not a
    config error; an OOM out of train() followed by a cleanup that raises stays the OOM; train() called from a
    worker thread gets past podkit's hook (signal.signal is the main thread's) and is not never-trained."""
    from areal_stack import JUDGED, areal_run
    from conftest import ROOT

    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    for name, text in (("caught.py", CAUGHT), ("cfgfull.py", CONFIG_ON_FULL_VOLUME), ("cleanup.py", OOM_THEN_CLEANUP),
                       ("thread.py", WORKER_THREAD)):
        (repo / name).write_text(text)
    out = tmp_path / "thread.json"
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_REPO_URL": "https://example.invalid/r.git", "PODKIT_RUN_DIR": str(tmp_path / "run"),
           "RANK": "0", "SRC": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "FR": str(tmp_path / "fr"),
           "YAML": str(ROOT / "configs" / "areal" / "grpo-cpu.yaml"), "OUT": str(out)}
    r = areal_run("-c", JUDGED, "caught.py", "cfgfull.py", "cleanup.py", "thread.py", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    caught, cfgfull, cleanup, thread = json.loads(r.stdout.strip().splitlines()[-1])
    assert caught["by"] == "config-error" and "FileNotFoundError" in caught["message"], caught
    assert f"{repo / 'caught.py'}:4" in caught["message"] and "exited 0" in caught["message"], caught
    assert cfgfull["by"] == "volume-error" and "ENOSPC" in cfgfull["message"], cfgfull
    assert cleanup["by"] == "out-of-memory" and "cleanup" in cleanup["message"], cleanup
    got = json.loads(out.read_text())
    assert got["training"] is True and "main thread" not in got.get("raised", "") and got["flagged"], got
    assert thread["by"] != "never-trained", thread


CUT_DOWNLOADS = """import json
import aiohttp
from aiohttp import http_exceptions
from podkit.judge import failure


def cut(cls, *args):
    try:
        try:
            raise http_exceptions.ContentLengthError('Not enough data to satisfy content length header.')
        except Exception as inner:
            raise cls(*args) from inner
    except Exception as e:
        return e


errors = [cut(aiohttp.ClientPayloadError, 'Response payload is not completed'), cut(aiohttp.ServerDisconnectedError),
          cut(aiohttp.ClientConnectionResetError, 'Cannot write to closing transport'),
          cut(ConnectionRefusedError, 111, 'Connection refused')]
print(json.dumps([failure.transient(e) for e in errors]))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.environ.get("AREAL_PYTHON") and not os.environ.get("CI"),
                    reason="no AReaL environment: set AREAL_PYTHON=$(sh rehearse/env.sh)")
def test_a_data_download_cut_mid_body_is_the_network_retried_like_a_refused_connection():
    """aiohttp's ClientPayloadError (a body cut short: the dataset's download) and its kin, the real classes in
    AReaL's environment, are a network error that may pass, as a refused connection is: retried, never the
    script's config."""
    from areal_stack import areal_run

    r = areal_run("-c", CUT_DOWNLOADS)
    assert r.returncode == 0, r.stderr[-3000:]
    payload, disconnected, reset, refused = json.loads(r.stdout.strip().splitlines()[-1])
    assert payload and disconnected and reset and refused, (payload, disconnected, reset, refused)


FIRST_TO_DIE = """import os, signal, time
import torch
import torch.distributed as dist

dist.init_process_group('gloo')
if dist.get_rank() == 1:
    time.sleep(2)
    os.kill(os.getpid(), signal.SIGKILL)  # the kernel's OOM killer, or someone's kill -9
dist.all_reduce(torch.zeros(1))  # rank 0 waits for its peer, which is gone
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("AREAL_PYTHON") and not os.environ.get("CI"),
                    reason="no AReaL environment: set AREAL_PYTHON=$(sh rehearse/env.sh)")
def test_rank_1_sigkilled_under_real_torchrun_is_the_cause_not_rank_0s_collective_error(tmp_path):
    """Real torchrun, two ranks through podkit's bootstrap: rank 1 is SIGKILLed while rank 0 waits for it in a
    collective. The end names rank 1's kill, not rank 0's "Connection closed by peer"."""
    from areal_stack import areal_run
    from conftest import ROOT, free_port
    from podkit import config

    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / "die.py").write_text(FIRST_TO_DIE)
    (tmp_path / "ws" / "logs").mkdir(parents=True)
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_REPO_URL": "https://example.invalid/r.git", "PODKIT_RUN_DIR": str(tmp_path / "run"),
           "HF_HUB_OFFLINE": "1", "PODKIT_TRAINER_ENTRY": "die.py"}
    cfg = config.load(ROOT / "configs" / "cpu-rehearsal.yaml", environ=env)
    started = time.time()
    r = areal_run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--master-port",
                  str(free_port()), str(ROOT / "src" / "podkit" / "areal" / "bootstrap.py"), "--config", "x.yaml",
                  env=env, cwd=tmp_path, timeout=200)
    (tmp_path / "ws" / "logs" / "trainer.log").write_text(r.stdout + r.stderr)
    end = verdict.decide(verdict.gather(cfg, r.returncode, started))
    assert r.returncode != 0 and end["by"] == ending.KILLED, (r.returncode, end, r.stderr[-3000:])
    assert "rank 1" in end["message"] and "SIGKILL" in end["message"], end


@pytest.mark.rehearsal
@pytest.mark.xdist_group("areal")
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("AREAL_PYTHON") and not os.environ.get("CI"),
                    reason="no AReaL environment: set AREAL_PYTHON=$(sh rehearse/env.sh)")
def test_a_second_stage_whose_train_raises_after_the_first_finished_is_a_failure_not_training_finished(
        rehearsal, tmp_path):
    """The real trainer: the script's stage 1 trains one step and finishes (its finish recorded), then its stage 2,
    a second PPOTrainer under the same names, raises. The end is that failure, after training finished, never
    "training finished" (which stops the pod as done)."""
    from areal_stack import EXAMPLE, example_remote, repo_env
    from conftest import wait_for

    two = (EXAMPLE / "train.py").read_text().replace(
        "\n\nif __name__", "\n    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:  # stage 2\n"
        "        trainer.train(workflow=workflow(config.gconfig))\n\n\nif __name__", 1)
    assert "# stage 2" in two
    remote = example_remote(tmp_path, **{"train.py": two})
    env = repo_env(remote, PODKIT_TRAINER_RESTART_DELAY_S="1")
    env["PODKIT_TRAINER_OVERRIDES"] += " total_train_steps=1"
    s = rehearsal(**env).start()
    since = time.time()
    end = wait_for(lambda: (st := (s.progress().get("stopped") or {})).get("time", 0) > since
                   and st.get("by") != ending.DONE and st, 480, interval=1, what="the end after stage 2")
    assert ending.KINDS[end["by"]].family != ending.FINISHED, end
    assert "after training finished" in end.get("message", ""), (end, s.log("trainer")[-4000:])
