"""The container's whole boot. Each stage is idempotent; none may exit the container in a loop."""

from __future__ import annotations

import os
import signal
import time

from podkit import config, guard, log, preflight, reap, render, safemode
from podkit.errors import PodkitError, StageError
from podkit.state import read_json, write_json

_log = log.get("boot")


def run_stages(cfg, record: guard.Boot | None = None) -> dict[str, str]:
    """preflight -> reap -> sync -> render; returns supervisord's environment."""
    if cfg.state_dir.exists():
        safemode.clear(cfg.state_dir)

    def stage(name, fn, *args):
        try:
            result = fn(*args)
        except PodkitError:
            if record:
                record.stage(name, "failed")
            raise
        if record:
            record.stage(name, "ok")
        return result

    stage("preflight", preflight.check, cfg)     # workspace writable, run dir, supervisord present
    stage("reap", reap_stage, cfg)               # TERM -> grace -> KILL every GPU holder; stale sockets
    stage("sync", sync_stage, cfg)               # clone or fetch; never rm -rf; offline -> last checkout
    return stage("render", render.write, cfg)    # supervisord's env from the validated config


def reap_stage(cfg) -> None:
    live_ok = reap.enabled(cfg.reap.enabled)
    t = cfg.trainer
    # No supervisord of this pod runs past this point, so its discovery records are stale.
    for line in [*reap.clear_supervisor_leftovers(cfg.run_path, stop_live=live_ok, grace_s=cfg.reap.grace_s),
                 *reap.clear_name_resolve(t.name_resolve_root, t.experiment, t.trial)]:
        log.get("reap").info(line)
    if not live_ok:
        why = ("reap.enabled is never" if cfg.reap.enabled == "never" else
               "podkit is not the container's entrypoint (PODKIT_REAP_ENABLED=always to free the GPUs anyway)")
        log.get("reap").info(f"skipped: {why}")
        return
    report = reap.run(cfg.devices, cfg.reap.grace_s, cfg.reap.kill_wait_s, gpu_timeout_s=cfg.reap.gpu_free_timeout_s)
    survivors = report.survivors
    if survivors and cfg.reap.on_failure == "safe-mode":
        raise StageError("reap", "GPU still held by " + ", ".join(reap.describe(h) for h in survivors),
                         "restart the pod (not only the container); or PODKIT_REAP_ON_FAILURE=continue")


def sync_stage(cfg) -> None:
    r = cfg.repo
    if not r.url:
        log.get("sync").info("no repo configured (PODKIT_REPO_URL): nothing to sync")
        return
    from podkit import sync  # git plumbing loads only when there is a repo to sync

    result = sync.update(r.url, r.ref, r.dest, depth=r.depth, timeout_s=r.timeout_s, retries=r.retries,
                         lock_timeout_s=r.lock_timeout_s)
    write_json(cfg.state_dir / "sync.json", {"changed": result.changed, "old": result.old, "new": result.new,
                                             "mode": result.mode, "notes": result.notes, "time": time.time()})


def _record_current(cfg, pid: int) -> None:
    write_json(cfg.state_dir / "current.json", {"run_dir": str(cfg.run_path), "socket": str(cfg.socket_path),
                                                "supervisord_pid": pid, "started": time.time(),
                                                "inference": {"host": cfg.inference.host,
                                                              "port": cfg.inference.port}})


def supervisord_argv(env: dict[str, str]) -> list[str]:
    return [preflight.supervisord_path() or "supervisord", "-n", "-c", str(config.packaged("supervisord.conf"))]


def exec_supervisord(cfg, env: dict[str, str]):
    """PID 1 from here on: supervisord receives the container's stop signal."""
    _record_current(cfg, os.getpid())
    _log.info("exec supervisord")
    argv = supervisord_argv(env)
    os.execve(argv[0], argv, env)


def boot(cfg) -> int:
    """`podkit boot`: never a fast exit. A failed stage, or boots coming too fast, wait in safe mode."""
    record = None
    try:
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        record = guard.Boot(cfg.state_dir)
        _log.info(f"last stop: {record.rec['last_stop']}")
    except OSError:
        pass  # an unwritable workspace: preflight explains it
    storm = guard.storm(cfg.state_dir, cfg.guard.max_boots, cfg.guard.window_s) if record else None
    try:
        if storm:
            raise StageError("guard", storm, "find the cause in the logs above or `podkit status`; then run "
                             "`podkit resume` in the container (or fix and restart it)")
        env = run_stages(cfg, record)
    except PodkitError as e:
        stage = getattr(e, "stage", "boot")
        if record:
            record.rec["reason"] = e.message
            record.done("safe-mode")
        return safemode.wait(cfg.state_dir, stage, e.message, e.hint)
    if record:
        record.done("supervisord")
    exec_supervisord(cfg, env)
    return 0  # not reached


def up(cfg, steps: int | None = None) -> int:
    """`podkit up`: the same stages, then supervisord as a child in the foreground; with `steps`,
    stop everything cleanly once the trainer has reached that step."""
    import subprocess

    env = run_stages(cfg)
    proc = subprocess.Popen(supervisord_argv(env), env=env)
    _record_current(cfg, proc.pid)
    stopping: list[int] = []

    def forward(signum, _frame):
        stopping.append(signum)
        proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    progress = cfg.state_dir / "progress.json"
    started = time.time()
    while proc.poll() is None:
        time.sleep(0.2)
        rec = read_json(progress, {}) or {}
        # Only progress made since this start counts: a workspace may already be past the step.
        if steps and not stopping and rec.get("time", 0) > started and rec.get("step", 0) >= steps:
            _log.info(f"trainer reached step {rec['step']} (--steps {steps}): stopping everything")
            stopping.append(0)
            proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    final = read_json(progress, {}) or {}
    _log.info(f"supervisord exited {code}; trainer at step {final.get('step', 0)}, "
              f"last checkpoint at step {final.get('checkpoint_step', 0)}")
    return code
