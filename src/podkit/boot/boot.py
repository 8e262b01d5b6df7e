"""The container's whole boot. Each stage is idempotent; none may exit the container in a loop.

`main` is total: whatever happens, the process ends up as supervisord or waiting in safe mode, and
every boot is in the boot history. A config error, a failed stage, a boot storm and a bug in podkit
(any exception, with its traceback) all wait in safe mode, explained; only a stop signal ends it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from podkit import config, log, records, settings
from podkit.areal import checks
from podkit.boot import guard, preflight, reap, render, restore, safemode
from podkit.errors import ConfigError, PodkitError, StageError
from podkit.host import proc
from podkit.judge import ending

_log = log.get("boot")


def run_stages(cfg, record: guard.Boot | None = None) -> dict[str, str]:
    """preflight -> reap -> sync -> setup -> restore -> render; returns supervisord's environment."""
    if cfg.state_dir.exists():
        safemode.clear(cfg.state_dir)

    def stage(name, fn, *args):
        t0 = time.monotonic()
        try:
            result = fn(*args)
        except PodkitError:
            if record:
                record.stage(name, "failed", time.monotonic() - t0)
            raise
        if record:
            record.stage(name, "ok", time.monotonic() - t0)
        return result

    stage("preflight", preflight.run, cfg)   # workspace writable, run dir, supervisord, a config that can train
    stage("reap", reap.run, cfg)             # TERM -> grace -> KILL every GPU holder; a dead run's leftovers
    stage("sync", sync_stage, cfg)           # clone or fetch; never rm -rf; offline -> the last checkout
    stage("setup", setup_stage, cfg)         # the repo's requirements, once per change, in a venv on the volume
    stage("restore", restore.run, cfg)       # checkpoint.remote's newest whole checkpoint, if the volume's is older
    return stage("render", render.run, cfg)  # supervisord's env from the validated config


def sync_stage(cfg) -> None:
    if not cfg.repo.url:
        log.get("sync").info("no repo configured (PODKIT_REPO_URL): nothing to sync")
        return
    if cfg.multi_node and cfg.cluster.rank > 0 and _shared_checkout(cfg):
        # One commit for the whole run: the ranks on every node run rank 0's config, so its checkout on the
        # shared volume. Fetching here could move it under a run that is training (a branch that moved).
        log.get("sync").info(f"node rank {cfg.cluster.rank}: the run trains rank 0's checkout {cfg.repo.dest} on the "
                             "shared volume, synced by rank 0's boot; not synced here, so every node runs one commit")
        return
    from podkit.boot import sync  # git plumbing (subprocess, tempfile, dataclasses) only when there is a repo

    ref = None
    if cfg.multi_node and cfg.cluster.rank > 0:  # a checkout of this node's own: rank 0's commit, not the ref's tip
        ref = records.SYNC.read(cfg.workspace_path / ".podkit").get("new")
        if ref:
            log.get("sync").info(f"node rank {cfg.cluster.rank}: syncing rank 0's commit {ref[:12]}, not {cfg.repo.ref}")
    sync.run(cfg, ref=ref)
    # What preflight could not look for before the checkout was there: trainer.entry and a YAML in it.
    if cfg.trainer.kind == "areal" and cfg.trainer.entry:
        problems = checks.programs(cfg, synced=True)
        if problems:
            raise checks.config_error(cfg, problems)


def _shared_checkout(cfg) -> bool:
    dest, ws = os.path.realpath(cfg.repo.dest), os.path.realpath(cfg.workspace_path)
    return dest.startswith(ws + os.sep)


def setup_stage(cfg) -> None:
    if not cfg.repo.setup.strip():
        records.SETUP.path(cfg.state_dir).unlink(missing_ok=True)  # the trainer runs the image's Python
        return
    from podkit.boot import setup  # hashing and venvs only when there is a setup command

    setup.run(cfg)


def _record_current(cfg, pid: int) -> None:
    # The run dir's record steers the next boot's kills (local, 0700, ours); current.json is for people.
    records.RUN.write(cfg.run_path, {"supervisord": [pid, proc.starttime(pid) or 0], "started": time.time()},
                      mode=0o600)
    records.CURRENT.write(cfg.state_dir, {"run_dir": str(cfg.run_path), "socket": str(cfg.socket_path),
                                          "supervisord_pid": pid, "started": time.time(),
                                          "inference": {"host": cfg.inference.host, "port": cfg.inference.port}})
    records.keep_reserve(cfg.state_dir)  # room for podkit's own records should the volume fill (records.write_json)


def supervisord_argv(env: dict[str, str]) -> list[str]:
    # supervisord through pid1: its loop wakes on signals and keeps the stop's deadline (pid1.patch_supervisord).
    return [sys.executable, "-m", "podkit.host.pid1", preflight.supervisord_path() or "supervisord", "-n", "-c",
            str(config.packaged("supervisord.conf"))]


def exec_supervisord(cfg, env: dict[str, str]):
    """PID 1 from here on: supervisord receives the container's stop signal."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # supervisord installs its own; nothing inherits ours
    _record_current(cfg, os.getpid())
    _log.info("exec supervisord")
    argv = supervisord_argv(env)
    os.execve(argv[0], argv, env)


def main(path: str | None = None) -> int:
    """`podkit boot`: supervisord, or safe mode; never a fast exit (that is a restart loop)."""
    # PID 1 has no default action for SIGTERM: without this, a stop during a long clone waits for SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    record, state_dir, cfg = None, None, None
    try:
        try:
            cfg = config.load(path)
        except ConfigError as e:
            state_dir = _fallback_state_dir()
            record = _start_record(state_dir)
            return _safe_mode(record, _why(None, state_dir, "config", e.message, e.hint))
        log.set_level(cfg.log_level)
        state_dir = cfg.state_dir
        record = _start_record(state_dir)
        storm = guard.storm(state_dir, cfg.guard.max_boots, cfg.guard.window_s) if record else None
        try:
            if storm:
                raise StageError("guard", storm, "find the cause in the logs above or `podkit status`; then run "
                                 "`podkit resume` in the container (or fix and restart it)")
            env = run_stages(cfg, record)
            if record:
                record.done("supervisord")
            exec_supervisord(cfg, env)
        except PodkitError as e:
            return _safe_mode(record, _why(cfg, state_dir, getattr(e, "stage", "boot"), e.message, e.hint,
                                           retry=getattr(e, "retry", None)))
        return 0  # not reached: exec_supervisord replaced this process
    except Exception as e:  # noqa: BLE001 - total: a bug in podkit must not restart-loop the container
        import traceback

        tb = traceback.format_exc()
        _log.error(f"unexpected {type(e).__name__} during boot:\n{tb}")
        return _safe_mode(record, _why(cfg, state_dir, "boot", f"podkit failed with {type(e).__name__}: {e}",
                                       "this is a bug in podkit: the traceback is in the log and `podkit status`; "
                                       "report it with `podkit doctor --bundle` output, then `podkit resume` or "
                                       "restart", traceback=tb))


def _fallback_state_dir() -> Path | None:
    """Where a boot whose config did not load records itself: PODKIT_WORKSPACE's records, if it exists."""
    ws = Path(os.environ.get("PODKIT_WORKSPACE") or "/workspace")
    return ws / ".podkit" if ws.is_dir() else None


def _start_record(state_dir: Path | None, via: str = "boot") -> guard.Boot | None:
    if state_dir is None:
        return None
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        record = guard.Boot(state_dir, via)
    except OSError:
        return None  # an unwritable workspace: preflight explains it
    _log.info(f"last stop: {record.rec['last_stop']}")
    return record


def _metrics(cfg, state_dir: Path | None) -> dict | None:
    """Where safe mode serves /metrics: the config's endpoint, or under a config error loopback on
    PODKIT_METRICS_PORT if that alone reads as a port, else the default one."""
    from podkit.areal.checks import METRICS_KEY_ENV

    if state_dir is None:
        return None
    if cfg is not None:
        host, port, window = cfg.metrics.host, cfg.metrics.port, cfg.guard.window_s
    else:
        host, window = "127.0.0.1", settings.SCHEMA["guard"]["window_s"].default
        port = int(_lenient_env("metrics", "port", lambda v: 0 <= int(v) <= 65535))
    return {"host": host, "port": port, "workspace": cfg.workspace_path if cfg is not None else state_dir.parent,
            "window_s": window, "key": os.environ.get(METRICS_KEY_ENV, ""), "state_dir": state_dir}


def _guard_settings(cfg) -> dict:
    """The cost guards' settings. Under a config error each is read from its env twin if that alone reads
    as a number, else the default: a pod whose config is broken is the one most likely to wait for nobody."""
    if cfg is not None:
        return {k: getattr(cfg.guard, k) for k in ("stop_pod_after_s", "stop_pod_at", "stop_pod_when_finished")}
    finite = lambda v: 0 <= float(v) < float("inf")  # noqa: E731
    return {"stop_pod_after_s": float(_lenient_env("guard", "stop_pod_after_s", finite)),
            "stop_pod_at": float(_lenient_env("guard", "stop_pod_at",
                                              lambda v: float(v) == 0 or config.is_stop_time(float(v)))),
            "stop_pod_when_finished": settings.SCHEMA["guard"]["stop_pod_when_finished"].default}


def _lenient_env(section: str, key: str, ok):
    """Under a config error: one setting's env twin if it passes `ok` and its range on its own, else its
    default."""
    raw, spec = os.environ.get(config.env_name(section, key)), settings.SCHEMA[section][key]
    try:
        if raw is not None and ok(raw) and (spec.minimum or 0) <= float(raw) <= spec.maximum:
            return raw
    except ValueError:
        pass
    return settings.SCHEMA[section][key].default


def _why(cfg, state_dir: Path | None, stage: str, message: str, hint: str, traceback: str = "",
         retry=None) -> safemode.Why:
    """What safe mode is told: the failure, and from the config (or, under a config error, the env twins)
    where the waiting pod reports and what its cost guard goes by."""
    workspace = cfg.workspace_path if cfg is not None else state_dir.parent if state_dir is not None else None
    return safemode.Why(stage, message, hint, traceback=traceback, retry=retry, state_dir=state_dir,
                        workspace=workspace, guards=_guard_settings(cfg), metrics=_metrics(cfg, state_dir),
                        page=cfg if cfg is not None else _page_defaults(workspace))


def _page_defaults(workspace: Path | None):
    """Under a config error, the config the page is served with in safe mode: the defaults on this workspace,
    with page.host and page.port from their env twins where each alone reads as one; None when even that fails."""
    if workspace is None:
        return None
    host = config.env_name("page", "host")
    env = {"PODKIT_WORKSPACE": str(workspace),
           config.env_name("page", "port"): str(_lenient_env("page", "port", lambda v: 0 <= int(v) <= 65535))}
    if os.environ.get(host, "").strip():
        env[host] = os.environ[host].strip()
    try:
        return config.load(None, environ=env)
    except Exception:  # noqa: BLE001 - the page is a courtesy of safe mode, never a reason for it
        return None


def _safe_mode(record: guard.Boot | None, why: safemode.Why) -> int:
    if record:
        record.rec["reason"] = why.message
        if why.traceback:
            record.rec["traceback"] = why.traceback
        record.stage(why.stage, "failed")
        record.done("safe-mode")
    return safemode.wait(why)


def up(cfg, steps: int | None = None) -> int:
    """`podkit up`: the same stages, then supervisord as a child in the foreground; with `steps`,
    stop everything cleanly once the trainer has reached that step. A run that can no longer train (a
    program FATAL, the trainer stopped by a config error) or that finished ends too: a local run is
    never left waiting for steps that will not come. Exit 0 at the step or when finished, 1 with
    doctor's findings when it failed. Its boot is recorded as `podkit boot`'s is (the start-up timeline
    of status, metrics, the bundle and doctor), marked as `up`'s: the crash-loop guard does not count it."""
    import subprocess  # `up` only: the entrypoint's `boot` execs supervisord and never pays for it

    record = _start_record(cfg.state_dir, via="up")
    try:
        env = run_stages(cfg, record)
    except PodkitError as e:  # an error here, as before; the record says which stage and why
        if record:
            record.rec["reason"], record.rec["hint"] = e.message, e.hint
            record.done("failed")
        raise
    env[ending.PLACE_ENV] = ending.place(cfg) if ending.place(cfg) != "pod" else "up"  # fixes say `podkit up` here
    proc = subprocess.Popen(supervisord_argv(env), env=env)
    _record_current(cfg, proc.pid)
    if cfg.page.port:  # `make run` says where to look
        host = "127.0.0.1" if cfg.page.host in ("0.0.0.0", "::") else cfg.page.host
        host = f"[{host}]" if ":" in host else host
        _log.info(f"the run at a glance: http://{host}:{cfg.page.port}/ (page.port; 0: off)")
    if record:
        record.done("supervisord")
    stopping: list[int] = []
    failed: list[str] = []

    def forward(signum, _frame):
        stopping.append(signum)
        ending.ask(cfg.run_path, ["all"], f"you (podkit up got {signal.Signals(signum).name})")
        proc.send_signal(signal.SIGTERM)

    def stop(why: str) -> None:
        _log.info(f"{why}: stopping everything")
        ending.ask(cfg.run_path, ["all"], f"podkit up: {why}")
        stopping.append(0)
        proc.send_signal(signal.SIGTERM)

    # A closed terminal (SIGHUP) stops the stack too: it must not leave supervisord without its owner.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    started = time.time()
    asked = 0.0
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if stopping:
                continue
            rec = records.PROGRESS.read(cfg.state_dir)
            # Only progress made since this start counts: a workspace may already be past the step.
            if steps and (rec.get("time") or 0) > started and (rec.get("step") or 0) >= steps:
                stop(f"trainer reached step {rec['step']} (--steps {steps})")
            elif time.monotonic() - asked >= 1:
                asked = time.monotonic()
                ended = _run_ended(cfg, started)
                if ended and ended[0] == "finished":
                    stop(ended[1])
                elif ended:
                    failed.append(ended[1])
                    _log.error(f"{ended[1]}: the run cannot go on")
                    _print_findings(cfg)
                    stop("the run failed")
    finally:
        if proc.poll() is None and not stopping:  # anything raised above: never leave supervisord behind
            stop("podkit up failed")
    code = proc.wait()
    final = records.PROGRESS.read(cfg.state_dir)
    _log.info(f"supervisord exited {code}; trainer {records.at_step(final.get('step'))}, "
              f"{records.checkpoint_at(final.get('checkpoint_step'))}")
    upload = records.REMOTE.read(cfg.state_dir).get("final") or {} if cfg.checkpoint.remote else {}
    if upload.get("outcome") == "uploading" and (upload.get("time") or 0) > started:  # killed before it could say
        _log.warn(f"the last checkpoint (step {upload.get('step')}) was still uploading when the stop's deadline "
                  "killed the log listener: it is not on the remote; the next start uploads it (stop_timeout_s "
                  "gives the stop longer)")
    if failed:
        _log.error(f"{failed[0]}; `podkit doctor --workspace {cfg.workspace_path}` says the same after the fact. "
                   "This run has stopped everything: fix it, then run the same command again (it resumes from the "
                   "last checkpoint; `podkit ctl start trainer` is for a pod that is still running)")
        return 1
    return code


def _run_ended(cfg, started: float) -> tuple[str, str] | None:
    """("finished" | "failed", what happened) once supervisord will not start the trainer again by
    itself; None while the run goes on. Only what happened since this start counts."""
    from podkit.host import supervisord

    for name in ("sglang", "trainer"):
        info = supervisord.process_info(cfg.socket_path, name) or {}
        if info.get("statename") == supervisord.FATAL:
            return "failed", f"{name} is FATAL: supervisord gave up restarting it"
    info = supervisord.process_info(cfg.socket_path, "trainer") or {}
    # STOPPED: a finished trainer that did not exit, stopped by the watchdog (or a person).
    state = info.get("statename")
    if state != supervisord.STOPPED and (state != supervisord.EXITED or info.get("exitstatus") != 0):
        return None  # any other exit code is restarted (exitcodes=0)
    end = ending.read(cfg.state_dir, since=started)
    if end is None:
        return None
    if end.family == ending.FINISHED:
        if cfg.multi_node:
            return None  # a cluster's nodes share the run's end: their operator stops each one
        return "finished", f"training finished ({end.kind.name}) {records.at_step(end.step)}"
    if state == supervisord.STOPPED or end.family != ending.FINAL:
        return None  # stopped mid-run by a person (`podkit ctl stop`): theirs to start again
    at = records.at_step(end.step)
    return "failed", f"the trainer stopped for good ({end.kind.name}) {at}" + (f": {end.first()}" if end.first() else "")


def live_supervisord(cfg) -> bool:
    """A pod that runs (its supervisord answers) and does not wait in safe mode."""
    from podkit.host import supervisord

    if records.SAFE_MODE.read(cfg.state_dir).get("pid"):
        return False
    return supervisord.process_info(cfg.socket_path, "trainer") is not None


def resume_trainer(cfg, say=print) -> int:
    """`podkit resume` on a running pod: once the trainer has stopped (for good, or by a person), or while it runs
    but fails (ends in a row without a new step, or failures after new steps in the last hour: what podkit's own
    fix says to `podkit resume` for), the fix the user pushed reaches it: a failing trainer stopped first, the repo
    synced and set up as at boot, then the trainer (and the watchdog, if it was stopped with it) started; the loop
    bound counts from zero. Nothing is started after a failed stage."""
    from podkit.host import supervisord

    rpc = supervisord.rpc(cfg.socket_path).supervisor
    info = supervisord.process_info(cfg.socket_path, "trainer") or {}
    failing = ""
    if info.get("statename") not in supervisord.STOPPED_STATES:
        failing = failing_now(cfg)
        if not failing:
            say(f"the trainer is {info.get('statename', 'not known to supervisord')}: nothing to resume "
                "(`podkit status` says how it is doing)")
            return 0
        say(f"the trainer is {info.get('statename')} but failing ({failing}): it is stopped, the fix synced, and it "
            "starts on it")
    # the cost guard holds the pod while the fix is synced and set up (standing.resuming)
    ending.ask(cfg.run_path, ["trainer"], "you (podkit resume)", kind="resume")
    if failing:  # stopped before the sync: its ranks must not import the checkout while it changes under them
        try:
            rpc.stopProcess("trainer", True)
        except Exception as e:  # noqa: BLE001 - xmlrpc faults (NOT_RUNNING: it ended meanwhile) and socket errors
            if "NOT_RUNNING" not in str(e):
                say(f"could not stop the trainer ({e}): `podkit ctl restart trainer`")
                return 1
    end = ending.read(cfg.state_dir)
    if end is not None:
        say(f"the trainer's last run: {end.said()}")
    try:
        if cfg.repo.url:
            before = records.SYNC.read(cfg.state_dir).get("new")
            sync_stage(cfg)
            after = records.SYNC.read(cfg.state_dir).get("new")
            say(f"synced {cfg.repo.url} ({cfg.repo.ref}): " + (f"{(before or '?')[:12]} -> {after[:12]}"
                                                               if after and after != before else
                                                               f"no new commit ({(after or '?')[:12]})"))
        setup_stage(cfg)
    except PodkitError as e:
        say(f"podkit: error: {e}")
        say("the trainer was not started: fix what is named above, then `podkit resume` again")
        return 1
    try:  # the loop bound counts from zero: the code it counted the failures of has changed
        loop = records.TRAINER_LOOP.read(cfg.state_dir)
        if loop:
            records.TRAINER_LOOP.write(cfg.state_dir, {**loop, "resumed": time.time()})
    except OSError as e:
        say(f"could not reset the loop bound ({e.strerror}): it counts on from where it was")
    started = []
    for name in ("watchdog", "trainer"):
        state = (supervisord.process_info(cfg.socket_path, name) or {}).get("statename")
        if state in supervisord.STOPPED_STATES:
            try:
                rpc.startProcess(name, False)
                started.append(name)
            except Exception as e:  # noqa: BLE001 - xmlrpc faults and socket errors alike
                say(f"could not start {name} ({e}): `podkit ctl start {name}`")
                return 1
    say(f"started {' and '.join(started) or 'nothing'}: the trainer resumes from its last checkpoint "
        "(`podkit status` follows it)")
    return 0


def failing_now(cfg) -> str:
    """Why a trainer that supervisord runs is failing, in words ("2 failures in a row without a new step", "backing
    off", "5 failures after new steps in the last hour"), or "" when it is not: what `podkit resume` restarts."""
    from podkit.judge import loopbound

    loop = records.TRAINER_LOOP.read(cfg.state_dir)
    if not loop or loop.get("boot") != records.CURRENT.read(cfg.state_dir).get("started"):
        return ""
    counts = sum(n for c in ending.COUNTS.values() if isinstance(n := loop.get(c.key), int) and 0 < n < 10**6)
    often = len(loopbound.failing_with_progress(loop))
    if counts:
        return f"{counts} end(s) in a row without a new step" + (", backing off" if loop.get("phase") == "backoff"
                                                                 else "")
    if often:
        return f"{often} failure(s) after new steps in the last hour"
    return ""


def _print_findings(cfg) -> None:
    """doctor's findings, while supervisord still answers: what a pod's safe mode would explain."""
    from podkit.views import doctor

    try:
        findings = doctor.examine(cfg, cfg.workspace_path)
    except Exception as e:  # noqa: BLE001 - the stop that follows matters more than the diagnosis
        _log.warn(f"doctor could not examine the pod ({type(e).__name__}: {e}); run `podkit doctor` later")
        return
    for f in findings:
        if f.severity == "problem":
            print(f"[podkit:doctor] PROBLEM: {f.title}", flush=True)
            for e in f.evidence:
                print(f"[podkit:doctor]   - {e}", flush=True)
            print(f"[podkit:doctor]   fix: {f.fix}", flush=True)
