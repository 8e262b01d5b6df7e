"""`podkit run trainer` with trainer.kind areal: AReaL's GRPO trainer under torchrun, in SPMD mode.

The launcher stays torchrun's parent (see `supervise`) instead of exec'ing it: stops and leftovers
need someone between supervisord and torchrun's ranks.

SPMD mode is AReaL's way to use inference servers it did not start: torchrun runs the bootstrap
(bootstrap.py, which runs trainer.entry or podkit's GSM8K example) with AREAL_SPMD_MODE=1 and AREAL_LLM_SERVER_ADDRS. AReaL asks its
name_resolve store first and the env var only after, so a record left by a previous run would send it
to a dead server; this clears the trial's records before it starts, as the reap stage does at boot.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from podkit import log, records
from podkit.areal import checks, cluster, identity
from podkit.areal.command import clear_leftovers, command, environment, set_pdeathsig
from podkit.boot import setup
from podkit.host import proc, supervisord
from podkit.judge import ending, failure, health
from podkit.programs import refused

_log = log.get("trainer")


def main(cfg) -> int:
    """The trainer's run: torchrun's exit code (the loop bound judges the end, verdict.judge), or 0/1 with the
    end recorded here when torchrun never started."""
    if cfg.multi_node:  # rank 0 of a cluster (the others idle): AReaL's own Ray launcher
        return cluster.main(cfg)
    problems = checks.areal(cfg)
    if refused(cfg, problems, _log):  # what the boot checks, changed since (an env edited under a running pod)
        ending.write(cfg.state_dir, ending.CONFIG_ERROR, "; ".join(f"{cfg.origin(k)}: {k}: {w}" for k, w, _ in problems),
                     "; ".join(h for _, _, h in problems[:1]) + "; " + ending.fix_setting(cfg))
        return 0
    # First: a rank left by a killed launcher trains on (and writes progress) until it is stopped.
    for pid in clear_leftovers(cfg.run_path):
        _log.warn(f"killed pid {pid}, left by a previous torchrun whose launcher was killed")
    python, why = setup.python_for(cfg)
    if why:
        _log.warn(f"{why}: running the image's Python")
    env = environment(cfg)
    if precheck(cfg, python, env):  # before the wait: an import error is named now, not after SGLang's start
        return 0
    why = health.wait_for_inference(cfg, health.sglang_state(cfg), logger=_log)
    if why:
        _log.error(why)
        ending.write(cfg.state_dir, ending.INFERENCE, why, "logs/sglang.log says why inference did not start")
        return 1
    changed = checks.settings(cfg)[0]
    if changed:  # AReaL's own example YAMLs run as they are: what podkit set over them, and why
        _log.info(f"podkit sets over {cfg.trainer.areal_config}: " + "; ".join(map(str, changed)))
    run = identity.names(cfg)
    _log.info(f"run {run} (experiment_name from {run.origins['experiment'][0]}, trial_name from {run.origins['trial'][0]})")
    for line in identity.clear_discovery(cfg, run):
        _log.info(line)
    unpause(cfg)
    argv = command(cfg, python)
    _log.info(f"starting {shlex.join(argv)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}, "
              f"AREAL_LLM_SERVER_ADDRS={env['AREAL_LLM_SERVER_ADDRS']})")
    return supervise(argv, env, cfg.run_path, grace_s=cfg.trainer.stop_grace_s,
                     stopping=lambda: supervisord.stop_requested(cfg.socket_path, "trainer"))


def precheck(cfg, python: str | None, env: dict[str, str]) -> bool:
    """True when trainer.entry cannot import (recorded as the script's own error, the trainer stopped once)."""
    if not cfg.trainer.entry:
        return False  # podkit's own example
    script = str(Path(__file__).with_name("precheck.py"))
    try:
        r = subprocess.run([python or sys.executable, script, cfg.trainer.entry, cfg.repo.dest], env=env,
                           capture_output=True, text=True, timeout=60)
        err = json.loads(r.stdout or "{}") if r.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        err = {}  # the check could not run: the run itself will say
    if not isinstance(err, dict) or not err.get("type"):
        return False
    err = failure.clean({k: str(v) for k, v in err.items()}, cfg)
    ending.write(cfg.state_dir, ending.CONFIG_ERROR,
                 f"the training script failed before training started, at {err.get('where')}: "
                 f"{err['type']}: {err.get('message')}" + (f"\n{err['code']}" if err.get("code") else ""),
                 (failure.hint_for_import() + "; " if "Import" in err["type"] else "") + ending.fix_code(cfg))
    _log.error(f"{err['type']}: {err.get('message')} at {err.get('where')}: the trainer stays stopped (found before "
               "waiting for inference)")
    return True


def unpause(cfg) -> None:
    """AReaL pauses generation for each weight update and resumes it after; a trainer that died in
    between left inference paused, and every rollout of the next run would wait forever."""
    inf = cfg.inference
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::") else inf.host
    key = os.environ.get(checks.API_KEY_ENV, "")
    req = urllib.request.Request(f"http://{host}:{inf.port}/continue_generation", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        urllib.request.urlopen(req, timeout=10).close()
    except (OSError, ValueError) as e:
        _log.warn(f"could not ask inference to continue generating ({e}); a server left paused by a dead trainer "
                  "would stall the rollouts")


CUT_BEFORE_S = 0.5  # the launcher kills the ranks this long before supervisord's SIGKILL would reach it


def supervise(argv: list[str], env: dict[str, str], run_dir: Path, grace_s: float | None = None,
              stopping=None) -> int:
    """Run torchrun in a process group of its own and stand between it and supervisord's signals.

    supervisord stops the trainer's process group; had torchrun been in it, its elastic agent would
    answer SIGTERM by giving the ranks 30 s (hard-coded before torch 2.12) and then SIGKILL, cutting a
    step's end and its recover checkpoint short. Here SIGTERM goes to the ranks only: they finish the
    step, checkpoint and exit 0, and torchrun with them. SIGUSR2 (the watchdog's stack dump) is passed
    on too. torchrun's group and each rank's own group are recorded as they appear, and whatever is
    left of them when torchrun ends, or after this launcher was killed, is killed. A step that does not end
    within `grace_s` of the SIGTERM (supervisord's stopwaitsecs: it SIGKILLs this launcher then, and the ranks,
    in sessions of their own, would outlive it holding their GPUs) is cut here just before: the ranks and
    torchrun are killed, and this launcher exits by itself. Not while a rank writes its recover checkpoint
    (AReaL writes it in place: cut, the last good one would be lost; the rank ends after it), and not after a
    SIGTERM supervisord did not send (`stopping()` False: nothing will SIGKILL, the step ends in its time)."""
    for marker in run_dir.glob(records.SAVING_PREFIX + "*"):  # a killed rank's: its save is long over
        marker.unlink(missing_ok=True)
    ending.clear_ranks(run_dir)
    program = ending.SIGNALS.cfg is not None  # in the trainer program, whose stop signal ending.SIGNALS notes
    if program:
        ending.SIGNALS.forward = lambda *_: None  # noted, not raised, while torchrun starts: passed on below
    child = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=set_pdeathsig)  # noqa: PLW1509
    groups = {child.pid: proc.starttime(child.pid) or 0}
    done = threading.Event()

    def track() -> None:
        interval = 0.5
        while not done.wait(interval):
            procs = proc.processes()
            # torchrun's ranks, and what was re-parented here (this program is a subreaper) in a session of its own
            fresh = {c.pid: c.starttime for c in procs if c.pid not in groups and c.pgid == c.pid
                     and (c.ppid == child.pid or c.ppid == os.getpid() and c.pid != child.pid)}
            if fresh:
                groups.update(fresh)
                records.TORCHRUN.write(run_dir, {"groups": [[g, t] for g, t in groups.items()]}, mode=0o600)
            proc.reap_orphans(keep={child.pid})  # torchrun's exit status is Popen's to read
            interval = min(10.0, interval * 1.5)

    records.TORCHRUN.write(run_dir, {"groups": [[g, t] for g, t in groups.items()]}, mode=0o600)
    threading.Thread(target=track, daemon=True).start()

    def cut() -> None:
        if done.is_set():
            return
        if stopping is not None and not stopping():
            _log.info(f"the step in flight has not ended {grace_s:g} s after a SIGTERM that supervisord did not send "
                      "(no stop is under way): letting it end")
            return
        if any(run_dir.glob(records.SAVING_PREFIX + "*")):
            _log.warn("the stop's grace is running out while a rank writes its recover checkpoint: not cutting it "
                      "(the last good checkpoint would be lost); the rank ends when it is written")
            return
        if ending.training(run_dir):
            _log.warn(f"the step in flight did not end within trainer.stop_grace_s ({grace_s:g} s) of the SIGTERM: "
                      "killing the ranks so that none outlives the trainer (this step has no recover checkpoint; the "
                      "run resumes from the one before)")
        else:
            _log.warn(f"the script was still in its own code before train() {grace_s:g} s after the SIGTERM (blocked "
                      "where Python's signal handling cannot reach it): killing the ranks; there was no step in "
                      "flight, nothing is lost")
        ending.SIGNALS.cut = True
        proc.kill_groups(list(groups.items()))

    def forward(sig, _frame):
        if done.is_set():  # torchrun was reaped (the program is cleaning up): its pid may be anyone's now
            return
        ranks = [c.pid for c in proc.children(child.pid)]
        if sig in (signal.SIGTERM, signal.SIGINT):
            _log.info(f"{signal.Signals(sig).name}: passing it to the {len(ranks)} worker process(es), not "
                      "torchrun, so the step in flight ends with a recover checkpoint")
            sig = signal.SIGTERM
            try:  # the ranks tell this stop from torchrun's own SIGTERM (its teardown after a rank failed)
                ending.FORWARDED.write(run_dir, {"time": time.time()}, mode=0o600)
            except OSError:
                pass
            if grace_s and not timers:  # the first stop signal starts the countdown; later ones do not move it
                timers.append(threading.Timer(max(0.5, grace_s - CUT_BEFORE_S), cut))
                timers[0].daemon = True
                timers[0].start()
        for pid in ranks or [child.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    timers: list[threading.Timer] = []
    signal.signal(signal.SIGUSR2, forward)
    if program:
        ending.SIGNALS.forward = forward
        if ending.SIGNALS.at is not None:  # asked while torchrun started: pass it on now
            forward(signal.SIGTERM, None)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
    try:
        rc = child.wait()
    finally:
        done.set()
        if ending.SIGNALS.forward is forward:
            ending.SIGNALS.forward = lambda *_: None  # torchrun is gone: a late stop is noted, nothing to pass on
        for t in timers:
            t.cancel()
        proc.kill_groups(list(groups.items()))
        records.TORCHRUN.path(run_dir).unlink(missing_ok=True)
    _log.info(f"torchrun exited with {rc}")
    return rc if rc >= 0 else 128 - rc
