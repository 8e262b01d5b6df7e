"""The real trainer in CI: AReaL 1.0.4's GRPO (podkit's launcher, torchrun, its bootstrap and GSM8K example, PPOTrainer) on CPU,
under the real supervisord booted by `podkit boot`, against podkit's generating STAND-IN for SGLang (a
tiny causal LM; not SGLang). The AReaL environment (rehearse/env.sh, built and cached by `make test`)
runs the stack, found through $AREAL_PYTHON; the tiny model and data are built once per session by
rehearse/assets.py. What runs is configs/cpu-rehearsal.yaml, as `make rehearse` runs it; checkpoint.remote points at
a real S3 endpoint on loopback (tests/s3server.py) where a test says so."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from areal_stack import CPU_OVERRIDES, PYTHON, areal_run, example_remote, repo_env
from conftest import PODKIT, ROOT, alive, free_port, wait_for
from podkit.remote import remote
from s3server import Server

pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("areal"), pytest.mark.timeout(420),
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(sh rehearse/env.sh))")]


@pytest.fixture
def s3(tmp_path):
    """A real S3 endpoint on loopback for checkpoint.remote (before `rehearsal` in a test's arguments: the stacks'
    stops, in the fixtures' teardown, still reach it)."""
    server = Server(tmp_path / "s3", ["ckpt"]).start()
    yield server
    server.kill()


def test_the_real_trainer_trains_pushes_each_version_evaluates_resumes_from_the_remote_on_a_new_volume_after_sigterm(
        s3, rehearsal):
    """Three real steps with checkpoint.remote; the SIGTERM's checkpoint goes up at the stop; the volume is deleted,
    and a pod on an empty one restores that checkpoint at its boot, saying so, and resumes at the next step; then a
    hung rank is restarted by the watchdog and a lost lease stops the trainer."""
    # No recover checkpoint before the stop (every 1000 steps): the one SIGTERM forces is what resumes.
    s = rehearsal(PODKIT_TRAINER_OVERRIDES="+evaluator.freq_steps=2 recover.freq_steps=1000",
                  **s3.env("ckpt")).start()
    served = set()
    # Each step's push is served: sample while it trains (rollouts are paused around each update).
    wait_for(lambda: (served.add((s.progress().get("weight_version"), s.served())) or
                      s.progress().get("step", 0) >= 3), 240, interval=0.3, what="three real GRPO steps")
    p = s.progress()
    assert p["kind"] == "areal" and p["resumed_from"] is None
    assert {v for v, srv in served if v is not None and v == srv} >= {"1", "2"}, served
    assert s.served() in (p["weight_version"], str(int(p["weight_version"]) + 1))
    # Trainer and inference agree on the log-probs of the same tokens under the same weights (AReaL's
    # packed micro-batches with sdpa were 0.15 nats off before podkit's patch).
    gap = p["on_policy_logp_gap"]
    assert gap is not None and gap["max_abs"] < 1e-4, gap
    assert p["checkpoint_step"] is None, p
    # AReaL's evaluation ran (the eval workflow and its own sampling settings, eval_gconfig) at step 2.
    assert p.get("eval_step") == 2 and p.get("eval_reward") is not None, p
    # podkit's own CLI reads the real trainer's records.
    st = json.loads(s.podkit("status", "--json").stdout)
    assert st["trainer"]["step"] >= 3 and st["trainer"]["kind"] == "areal", st
    assert st["programs"]["trainer"]["state"] == st["programs"]["sglang"]["state"] == "RUNNING", st
    doc = s.podkit("doctor")
    assert doc.returncode == 0 and "weight_update_slow" not in doc.stdout, doc.stdout + doc.stderr

    assert s.stop() == 0
    p = s.progress()
    assert p["stopped"]["by"] == "SIGTERM" and p["checkpoint_step"] == p["step"], p  # forced at the stop
    assert "SIGTERM: stopping after step" in s.log("trainer") and "with its recover checkpoint" in s.log("trainer")
    assert "Training failed" not in s.log("trainer")
    assert "inference was restarted" not in s.log("trainer"), "a pod stop is not an inference restart"
    stopped_at = p["step"]
    gens = s3.root / "ckpt" / "runs" / "podkit" / "run"  # <remote>/<experiment>/<trial>/gen-<step>/
    assert (gens / remote.gen(stopped_at) / remote.MANIFEST).is_file(), sorted(gens.rglob("*"))

    # The pod and its volume are gone: a new pod on a new, empty volume at the same mount point (with a watchdog
    # quick enough to test) restores the SIGTERM's checkpoint from the remote at its boot and resumes from it.
    shutil.rmtree(s.workspace)
    said = len(s.stdout())
    # Its uploader looks no more (an upload per step would load the lane's two cores): the restore is under test.
    s2 = rehearsal(PODKIT_WATCHDOG_TRAINER_STALL_S="40", PODKIT_WATCHDOG_INTERVAL_S="2",
                   PODKIT_TRAINER_STOP_GRACE_S="10", PODKIT_CHECKPOINT_REMOTE_POLL_S="3600", **s3.env("ckpt")).start()
    t1 = time.time()
    boot = s2.stdout()[said:]
    assert f"restored the checkpoint of step {stopped_at} from s3://ckpt/runs/podkit/run/" in boot, \
        [ln for ln in boot.splitlines() if "restore" in ln or "remote" in ln]
    p = s2.wait_fresh_step(stopped_at + 1, t1)
    assert p["resumed_at"] == stopped_at and p["resumed_from"], p
    assert "Recovering from StepInfo" in s2.log("trainer")
    wait_for(lambda: s2.served() == s2.progress().get("weight_version"), 60, what="the resumed push served")

    # A hung rank (SIGSTOP: no step, no answer, still holding its memory) is dumped and restarted by the
    # watchdog, and the run resumes.
    launcher = s2.pid("trainer")
    rank0 = _rank0(launcher)
    os.kill(rank0, signal.SIGSTOP)
    try:
        wait_for(lambda: s2.pid("trainer") not in (0, launcher), 180, interval=1,
                 what="the watchdog to restart the stalled trainer")
    finally:
        if alive(rank0):  # a resumed stopped rank would train on beside the new one until cleared
            os.kill(rank0, signal.SIGKILL)
    events = json.loads((s2.workspace / ".podkit" / "watchdog.json").read_text())
    restarts = [e for e in events if e["program"] == "trainer" and e["action"].startswith("restart")]
    assert restarts, events
    dumps = [Path(e["dump"]).read_text() for e in events if e.get("dump") and Path(e["dump"]).exists()]
    # The hung rank's own Python stack (py-spy reads a stopped process without suspending it).
    sections = [d.split(f"## pid {rank0}\n", 1)[1].split("\n## pid ", 1)[0] for d in dumps if f"## pid {rank0}\n" in d]
    assert any(re.search(r"\(\S*(gsm8k_grpo|bootstrap|hooks)\.py:\d+\)", sec) for sec in sections), sections
    p = s2.wait_fresh_step(1, time.time())
    assert p["resumed_at"], p
    assert not alive(rank0)

    # This pod stalls past its lease and a pod on another host takes the workspace: the real trainer
    # writes no recover checkpoint from then on (on every rank alike) and stops after the step.
    ckpt_files = sorted(str(f) for f in s2.workspace.rglob("*") if "recover" in str(f) and f.is_file())
    last_end = s2.progress().get("stopped")  # the hang's, judged at the restart
    other = {"host": "replacement-pod", "boot_id": "x", "pid": 4242, "start": 1, "since": time.time(),
             "renewed": time.time(), "token": "abc"}
    (s2.workspace / ".podkit" / "lease.json").write_text(json.dumps(other))
    wait_for(lambda: "lost the workspace to host replacement-pod, pid 4242" in s2.log("trainer"), 180,
             what="the lease-lost stop")
    frozen = s2.progress()
    assert frozen.get("stopped") == last_end, "the holder's progress record is not this pod's to write"
    assert sorted(str(f) for f in s2.workspace.rglob("*") if "recover" in str(f) and f.is_file()) == ckpt_files
    wait_for(lambda: s2.status()["programs"]["trainer"]["state"] == "EXITED", 60, what="the trainer's exit, 0")
    assert s2.progress() == frozen


def test_start_over_with_a_remote_trains_from_step_0_and_no_pod_restores_the_lineage_it_left(s3, rehearsal,
                                                                                                monkeypatch):
    """The real trainer with checkpoint.remote: its recover checkpoints go up; `podkit start-over` (the trainer
    stopped first) begins a new lineage of the run: the trainer trains from step 0, its new checkpoints go up
    although older than the ones it left (kept on the remote), status names the lineage, and a pod on an empty
    volume restores the new lineage's checkpoint, never the one the run left."""
    env = {**s3.env("ckpt"), "PODKIT_CHECKPOINT_REMOTE_POLL_S": "1", "PODKIT_CHECKPOINT_REMOTE_EVERY_S": "0"}
    s = rehearsal(**env).start()
    top = s3.root / "ckpt" / "runs" / "podkit" / "run"  # <remote>/<experiment>/<trial>: the first lineage

    def steps(where: Path) -> set[int]:
        return {int(p.parent.name[4:]) for p in where.glob(f"gen-*/{remote.MANIFEST}")}
    wait_for(lambda: steps(top) and s.progress().get("step", 0) >= 2, 240, interval=0.5,
             what="two real steps and a generation uploaded")
    ctl = subprocess.run([*PODKIT, "ctl", "stop", "trainer"], capture_output=True, text=True, env=s.env, timeout=120)
    assert ctl.returncode == 0, ctl.stdout + ctl.stderr  # (ctl takes the rest of its line: the env names the pod)
    # What the run leaves: its stop's checkpoint (step 2 or later), once uploaded. Read before that, `left` could be
    # step 1 while the new lineage's first upload is its step 2 (suite run 77: a trainer without AReaL's compile
    # steps faster than the uploader's first look), and the comparison below would show nothing.
    stopped_at = s.progress().get("checkpoint_step") or 0
    assert stopped_at >= 2, s.progress()  # the stop's own checkpoint, after two steps
    left = wait_for(lambda: (m := max(steps(top))) >= stopped_at and m, 120, interval=0.5,
                    what="the stop's checkpoint on the remote")
    r = s.podkit("start-over")
    assert r.returncode == 0 and "begin a new lineage" in r.stdout, r.stdout + r.stderr
    p = s.wait_fresh_step(1, time.time())
    assert p["resumed_from"] is None, p  # from step 0, not from the remote's checkpoint it left
    new = wait_for(lambda: [d for d in (top / remote.LINEAGES).glob("*") if steps(d)], 180, interval=0.5,
                   what="a generation of the new lineage")[0]
    assert min(steps(new)) <= left, (steps(new), left)  # not skipped as older than the one left
    assert left in steps(top)  # the lineage it left is kept on the remote
    st = json.loads(s.podkit("status", "--json").stdout)
    assert st["durable"]["lineage"]["count"] == 2 and st["durable"]["lineage"]["id"] == new.name, st["durable"]
    assert s.stop() == 0

    # A pod on an empty volume (the tiny model copied to it: the same weights at a new place) restores the new
    # lineage's newest, never the lineage the run left.
    from podkit import config, records
    from podkit.boot import restore

    empty = rehearsal("empty", **env)
    for k, v in empty.env.items():  # rclone's credentials reach it through the environment only
        monkeypatch.setenv(k, v)
    cfg = config.load(environ=empty.env)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    step = restore.run(cfg)
    assert step == max(steps(new)), (step, steps(new), left)
    assert records.REMOTE.read(cfg.state_dir)["lineage"]["id"] == new.name


def test_a_killed_trainer_resumes_and_a_restarted_inference_costs_your_repo_no_trainer_restart_unless_it_stays_down(
        rehearsal, tmp_path):
    """The user's repo (examples/my-repo as trainer.entry, synced from a bare remote) through both
    recoveries (podkit's example takes the same hooks and recover path: its own test resumes after SIGTERM;
    `make bench` times both recoveries on it with bench/rehearse.py)."""
    # No generation ahead of the trainer (max_head_offpolicyness 0): every step's rollouts come from the weights
    # the trainer holds, so each step's log-prob gap is float error unless an answer from other weights (the
    # base weights of a restarted server) was trained on. Inference may stay down 40 s before the fallback.
    s = rehearsal(PODKIT_INFERENCE_READY_TIMEOUT_S="40", **repo_env(
        example_remote(tmp_path / "remote"),
        PODKIT_TRAINER_OVERRIDES=f"{CPU_OVERRIDES} ++rollout.max_head_offpolicyness=0")).start()
    assert s.wait_step(2, timeout=240)["code"]["entry"] == "train.py"
    launcher = s.pid("trainer")
    ranks = _descendants(launcher)
    old_rank = s.progress()["pid"]
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    # supervisord restarts the trainer; the new launcher stops what torchrun left, and AReaL resumes.
    p = wait_for(lambda: (p := s.progress()).get("pid") != old_rank and p.get("resumed_at")
                 and (p.get("time") or 0) > killed and p.get("step", 0) > p["resumed_at"] and p,
                 240, interval=0.5, what="a resumed trainer's step after kill -9")
    assert p["resumed_at"] >= 2, p
    assert not [r for r in ranks if alive(r)], "a rank of the killed trainer is still running"
    assert s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "RUNNING"

    # Inference restarted alone (`podkit ctl restart sglang`, then kill -9 of the server, which supervisord
    # restarts) serves the base weights; the trainer's process goes on (areal/reattach.py): rank 0 pushes
    # its latest weights, generation waits for them, and no answer from the base weights is trained on.
    launcher, rank = s.pid("trainer"), s.progress()["pid"]
    trainer_starts = s.status()["programs"]["trainer"]["restarts"]
    gaps: dict[int, float] = {}

    def step_past(n: int, what: str) -> dict:
        def seen():
            p = s.progress()
            if p.get("logp_gap") and p.get("step"):
                gaps.setdefault(p["step"], p["logp_gap"]["max_abs"])
            return p.get("step", 0) >= n and p
        return wait_for(seen, 240, interval=0.3, what=what)

    at = step_past(max(3, p["step"] + 1), "step 3")["step"]
    assert gaps and max(gaps.values()) < 1e-4, gaps  # on-policy: float error
    r = subprocess.run([*PODKIT, "ctl", "restart", "sglang"], capture_output=True, text=True, env=s.env, timeout=60)
    assert r.returncode == 0 and "sglang: started" in r.stdout, r.stdout + r.stderr  # the workspace: from env
    p = step_past(at + 4, "4 steps past the inference restart")
    assert p["pid"] == rank and s.pid("trainer") == launcher, "the trainer was restarted"
    assert (p.get("reattach") or {}).get("count") == 1 and p["reattach"]["last"]["outcome"] == "re-attached", p
    wait_for(lambda: s.served() == s.progress().get("weight_version"), 60, what="the served version to catch up")
    # The trainer's and inference's log-probs of the same tokens still agree to float error: an answer from
    # the base weights (several steps behind) trained on would be 0.01 nats off or more.
    assert any(k > at for k in gaps) and max(gaps.values()) < 1e-4, gaps

    at = p["step"]
    os.kill(s.pid("sglang"), signal.SIGKILL)
    p = step_past(at + 2, "2 steps past kill -9 of inference")
    assert p["pid"] == rank and s.pid("trainer") == launcher and p["reattach"]["count"] == 2, p
    assert max(gaps.values()) < 1e-4, gaps
    assert s.status()["programs"]["trainer"]["restarts"] == trainer_starts
    assert "stale-weights" not in s.log("trainer") and "Training failed" not in s.log("trainer")
    st = json.loads(s.podkit("status", "--json").stdout)
    assert st["trainer"]["reattach"]["count"] == 2, st["trainer"]

    # A server that stays down past inference.ready_timeout_s (40 s here): the fallback, once. The trainer
    # stops after its step with its checkpoint, is restarted, resumes and pushes its weights again.
    s.rpc().supervisor.stopProcess("sglang")
    wait_for(lambda: (s.progress().get("reattach") or {}).get("fell_back") == 1, 120, interval=0.5,
             what="the fallback")
    s.rpc().supervisor.startProcess("sglang")
    restarted = time.time()
    wait_for(lambda: "stale-weights: stopping after step" in s.log("trainer"), 180, interval=0.5,
             what="the trainer to stop for stale weights")
    p = wait_for(lambda: (p := s.progress()).get("pid") != rank and p.get("resumed_at")
                 and (p.get("time") or 0) > restarted and p.get("step", 0) > p["resumed_at"] and p,
                 240, interval=0.5, what="a resumed trainer's step")
    wait_for(lambda: s.served() not in (None, "default") and s.served() == s.progress().get("weight_version"), 120,
             what="inference serving the trainer's version again")
    assert s.status()["programs"]["trainer"]["restarts"] == trainer_starts + 1, "the fallback restarts once"
    assert p["reattach"]["fell_back"] == 1 and "did not answer within" in p["reattach"]["last"]["why"], p
    doc = s.podkit("doctor")
    assert "the trainer could not re-attach" in doc.stdout and "did not answer within" in doc.stdout, doc.stdout
    assert s.stop() == 0


def _rank0(launcher: int) -> int:
    from podkit.host import proc

    torchrun = wait_for(lambda: [c.pid for c in proc.children(launcher)], 30, what="torchrun")[0]
    return wait_for(lambda: sorted(c.pid for c in proc.children(torchrun)), 60, what="a rank")[0]


def _descendants(pid: int) -> list[int]:
    from podkit.host import proc

    return list(proc.descendants(pid))


def test_the_generating_stand_in_answers_as_sglang_does_and_demands_the_api_key(procs, tmp_path, assets):
    port, key = free_port(), "k3y-for-the-test"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SGLANG_API_KEY": key}
    server = procs.spawn([PYTHON, "-m", "podkit.programs.standin_lm", "--model", str(assets / "model"),
                          "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: _health(port), 120, what="the stand-in to listen")
    r = areal_run(str(ROOT / "tests" / "rehearsal" / "standin_check.py"), str(port), str(assets / "model"), key,
                  str(tmp_path))
    server.send_signal(signal.SIGTERM)
    banner = server.communicate(timeout=30)[0].decode()
    assert "stand-in" in banner and "not SGLang" in banner
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["health_without_key"], got["generate_without_key"], got["model_info_without_key"]) == (200, 401, 401)
    assert max(got["gaps"].values()) < 1e-5, got["gaps"]  # temperature-scaled, as SGLang's sampler returns
    assert got["finish"]["type"] == "stop" and got["last_token"] == got["eos"]
    assert got["pause"] == 200 and all(t == "abort" and 0 < n < 2000 for t, n in got["aborted"]), got["aborted"]
    assert got["waits_while_paused"] and got["waited_version"] == "7"
    assert got["update"]["success"] and got["missing_update"] == 400
    assert (got["version_before"], got["version_after"]) == ("default", "7")
    assert got["gap_new_weights"] < 1e-4 < got["gap_old_weights"]
    fl = got["in_flight"]
    # All 300 tokens from version 7's weights: float error (1e-4 over 300 tokens, run 27), not the base's.
    assert fl["version"] == "7" and fl["tokens"] == 300 and fl["gap"] < 1e-3 < fl["gap_base"], fl
    assert fl["update_after_it"], fl
    assert fl["served"] == "9", fl
    assert "401" in got["areal_without_patch"] and got["areal_with_patch"] == "ok", got


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_an_override_areal_refuses_stops_the_trainer_once_and_doctor_names_it(rehearsal):
    """A typo in trainer.overrides fails inside AReaL's loader, ~20 s after each start (the torch
    import): supervisord would restart it forever. It stops once, and doctor shows AReaL's words."""
    s = rehearsal(PODKIT_TRAINER_OVERRIDES="actor.no_such_key=1").start()
    wait_for(lambda: (s.progress().get("stopped") or {}).get("by") == "config-error", 180, interval=0.5,
             what="the trainer to record AReaL's refusal")
    wait_for(lambda: s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 60,
             what="the trainer to stay stopped")
    time.sleep(5)
    info = s.rpc().supervisor.getProcessInfo("trainer")
    assert info["statename"] == "EXITED" and info["exitstatus"] == 0, info
    assert s.log("trainer").count("[podkit:run] starting trainer") == 1  # started once: no loop
    doc = json.loads(s.podkit("doctor", "--json").stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "trainer_config_error")
    assert any("no_such_key" in e for e in finding["evidence"]), finding
    assert s.podkit("status", "--health").returncode != 0
    assert s.stop() == 0
