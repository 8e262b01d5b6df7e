"""The reap stage: free the GPUs from processes of a previous run, exactly and provably.

Every process holding the device files (fd or mapping, found by gpu.holders) is stopped TERM ->
grace -> KILL through a pidfd (proc.stop), with its process group when nothing else lives there;
podkit itself, its ancestors and PID 1 are never touched. Then nvidia-smi must show the memory freed.
The stage also stops what the previous run of this pod left running (recorded process groups, and
whatever carries the trainer's or setup command's mark for this workspace: proc.marked; even where
GPU reaping is off), clears its supervisord's socket and pid file, and AReaL's discovery
records of this trial, which would point a new trainer at a dead server.

`podkit reap` runs the same stage; called by a person it is an explicit request (reap.enabled
always), and `--dry-run` reports what it would stop without touching anything.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from podkit import log, records
from podkit.errors import StageError
from podkit.host import gpu, pid1, proc

_log = log.get("reap")
# The programs whose mark (proc.OWNER_ENV) a leftover carries, and what is said of it.
LEFT_BY = {"trainer": "left running by the previous run's trainer", "setup": "left running by a previous repo.setup"}


class Report:
    def __init__(self, devices: list[str], dry_run: bool = False) -> None:
        self.devices = devices
        self.dry_run = dry_run
        self.skipped = ""
        self.holders: list[gpu.Holder] = []
        self.unreadable = 0
        self.scan_seconds = 0.0
        self.seconds = 0.0
        self.gpus: list[dict] = []
        self.leftovers: list[proc.Target] = []  # what carried this workspace's trainer or setup mark

    @property
    def survivors(self) -> list[gpu.Holder]:
        return [h for h in self.holders if h.outcome == "survived"]

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ("devices", "unreadable", "scan_seconds", "seconds", "gpus", "dry_run",
                                           "skipped")}
        d["holders"] = [h.to_dict() for h in self.holders]
        d["survivors"] = [h.pid for h in self.survivors]
        d["leftovers"] = [t.to_dict() for t in self.leftovers]
        return json.dumps(d, indent=2)


class ReapFailed(StageError):
    def __init__(self, message: str, hint: str, report: Report) -> None:
        super().__init__("reap", message, hint)
        self.report = report


def enabled(setting: str) -> bool:
    """auto: only as the container's entrypoint (never kill a workstation's processes)."""
    if setting in ("always", "never"):
        return setting == "always"
    return pid1.is_entrypoint()


def _clear_discovery(cfg) -> list[str]:
    """The run's discovery records, by its names as the last checkout's AReaL YAML gives them (the sync
    stage comes after)."""
    from podkit.areal import identity

    return identity.clear_discovery(cfg, identity.names(cfg))


def run(cfg, dry_run: bool = False) -> Report:
    """The stage: leftovers of a dead supervisord and AReaL's discovery records, then the GPUs."""
    live_ok = enabled(cfg.reap.enabled)
    marked = proc.marked(cfg.state_dir, LEFT_BY)
    if not dry_run:
        # No supervisord of this pod runs past this point, so its discovery records are stale.
        for line in [*previous_run(cfg.run_path, stop_live=live_ok, grace_s=cfg.reap.grace_s,
                                   kill_wait_s=cfg.reap.kill_wait_s, marked=marked),
                     *_clear_discovery(cfg)]:
            _log.info(line)
    for m in marked if dry_run else ():
        m.outcome = "would-kill"
        _log.info(f"would stop pid {m.pid} ({m.cmdline or m.name}), {m.reason}")
    if not live_ok:
        report = Report(devices=[], dry_run=dry_run)
        report.skipped = ("reap.enabled is never" if cfg.reap.enabled == "never" else
                          "podkit is not the container's entrypoint (PODKIT_REAP_ENABLED=always to free the GPUs "
                          "anyway)")
        _log.info(f"skipped: {report.skipped}")
        report.leftovers = marked
        return report
    report = free_gpus(cfg.devices, cfg.reap.grace_s, cfg.reap.kill_wait_s, dry_run=dry_run,
                       gpu_timeout_s=cfg.reap.gpu_free_timeout_s)
    report.leftovers = marked
    if report.survivors and cfg.reap.on_failure == "safe-mode":
        raise ReapFailed("GPU still held by " + ", ".join(h.describe() for h in report.survivors),
                         "restart the pod (not only the container); or PODKIT_REAP_ON_FAILURE=continue", report)
    return report


def free_gpus(devices_glob: str, grace_s: float, kill_wait_s: float, dry_run: bool = False,
              gpu_timeout_s: float = 30.0) -> Report:
    """Find and stop every holder of the files matching `devices_glob`, then verify the GPUs."""
    t0 = time.monotonic()
    devices = gpu.match_devices(devices_glob)
    report = Report(devices=devices, dry_run=dry_run)
    holders, report.unreadable = gpu.holders(devices)
    report.scan_seconds = round(time.monotonic() - t0, 4)
    holders += gpu.group_mates(holders)
    report.holders = holders
    if not devices:
        _log.info(f"no device files match {devices_glob}: nothing to free")
    elif not holders:
        _log.info(f"{len(devices)} device file(s) free, no holders ({report.scan_seconds * 1000:.0f} ms)")
    if report.unreadable:
        _log.warn(f"{report.unreadable} process(es) could not be inspected (permission); run as root to see all")
    if dry_run:
        for h in holders:
            h.outcome = "would-kill"
            _log.info(f"would kill {h.describe()}")
    elif holders:
        proc.stop(holders, grace_s, kill_wait_s, reap_children=pid1.collect_children)
        for h in holders:
            if h.outcome == "killed":
                _log.info(f"killed {h.describe()} after {h.signal}, {h.seconds}s")
            elif h.outcome == "survived":
                _log.error(f"{h.describe()} survived SIGKILL in state {h.state}: "
                           + ("uninterruptible sleep (D), usually a driver or I/O wait; it holds the GPU until "
                              "it returns. Restart the pod if it does not go away" if h.state == "D"
                              else "it may be outside this PID namespace; restart the pod"))
        if any(h.devices for h in holders):
            report.gpus = gpu.wait_free(gpu_timeout_s)
    elif devices:
        report.gpus = gpu.wait_free(gpu_timeout_s)
    report.seconds = round(time.monotonic() - t0, 3)
    return report


def previous_run(run_dir: Path, stop_live: bool, grace_s: float, kill_wait_s: float,
                 marked: list[proc.Target] = ()) -> list[str]:
    """Stop what the previous run of this pod left running, by what it recorded in the run dir (its
    supervisord's pid and start time, each program's process group, the torchrun ranks' groups) and
    `marked`, what carries the mark of its trainer or setup command (proc.marked; logged as warnings:
    the user's own processes), never by name; then clear its control socket and pid file. A pid
    recorded by a dead run that now belongs to another process is not stopped: its start time differs. A live supervisord of
    this run dir is another podkit on this workspace: refused, or stopped when `stop_live`."""
    done: list[str] = []
    sup = records.RUN.read_owned(run_dir).get("supervisord") or []
    keep = proc.protected_pids()
    if len(sup) == 2 and proc.same_process(*sup) and sup[0] not in keep:
        sock = run_dir / "supervisor.sock"
        if not stop_live:
            raise StageError("reap", f"a podkit supervisord is already running (pid {sup[0]}, socket {sock})",
                             f"stop it first: supervisorctl -s unix://{sock} shutdown")
        st = proc.read_stat(sup[0])
        if st:
            t = proc.Target.of(st, reason="previous supervisord")
            proc.stop([t], grace_s, kill_wait_s, reap_children=pid1.collect_children)
            done.append(f"stopped previous supervisord {t.pid} ({t.outcome})")
    targets = []
    for rec_path in sorted(run_dir.glob("group-*.json")):
        g = records.Record(rec_path.name, records.GROUP_SHAPE).read_owned(run_dir)
        if isinstance(g.get("pgid"), int) and isinstance(g.get("start"), int) and g["pgid"] > 1:
            targets += [proc.Target.of(p, reason=f"left running by the previous run's {g.get('program', '?')}")
                        for p in proc.group_members(g["pgid"], g["start"]) if p.pid not in keep]
        rec_path.unlink(missing_ok=True)
    for rec, what in ((records.TORCHRUN, "a torchrun rank"), (records.RAY_NODE, "a Ray worker")):
        for pgid, start in _pairs(rec.read_owned(run_dir).get("groups")):
            targets += [proc.Target.of(p, reason=f"{what} left by the previous run")
                        for p in proc.group_members(pgid, start) if p.pid not in keep]
        rec.path(run_dir).unlink(missing_ok=True)
    unique = list({t.pid: t for t in [*targets, *marked]}.values())
    if unique:
        proc.stop(unique, grace_s, kill_wait_s, reap_children=pid1.collect_children)
        ours = {m.pid for m in marked}
        proc.tell([t for t in unique if t.pid in ours], _log)
        done += [f"stopped {t.describe()} after {t.signal or t.outcome}" for t in unique if t.pid not in ours]
    done += _clear_socket_and_pidfile(run_dir, stop_live)
    return done


def _pairs(value) -> list[tuple[int, int]]:
    return [(a, b) for a, b in (x for x in value or [] if isinstance(x, list) and len(x) == 2)
            if isinstance(a, int) and isinstance(b, int) and a > 1]


def _clear_socket_and_pidfile(run_dir: Path, stop_live: bool) -> list[str]:
    done = []
    sock, pidfile = run_dir / "supervisor.sock", run_dir / "supervisord.pid"
    if sock.exists() or sock.is_symlink():
        import socket  # only when a socket was left behind: most boots find none

        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1.0)
        try:
            s.connect(str(sock))
            answered = True
        except OSError:
            answered = False
        finally:
            s.close()
        if answered:
            raise StageError("reap", f"something answers on {sock}, and it is not a supervisord this run dir "
                             "recorded", "another podkit runs on this workspace; stop it: supervisorctl -s "
                             f"unix://{sock} shutdown")
        sock.unlink(missing_ok=True)
        done.append(f"removed stale socket {sock}")
    if pidfile.exists() or pidfile.is_symlink():
        # Never trusted: the pid in it may belong to anyone by now. What was ours is in run.json.
        pidfile.unlink(missing_ok=True)
        done.append(f"removed stale pid file {pidfile}")
    return done
