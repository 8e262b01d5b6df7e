"""The reap stage: free the GPUs from processes of a previous run, exactly and provably.

Finds every holder of the device files by reading /proc (open fds and memory mappings; bounded,
never stats a mount, so a slow network volume cannot hang it), then SIGTERM -> grace -> SIGKILL,
each signal sent through a pidfd so a recycled pid is never hit. Never touches podkit itself,
its ancestors or PID 1. Also clears what a dead run leaves behind: supervisord's socket and pid
file, and AReaL's name_resolve records that would point a new trainer at a dead server.
No torch import and no CUDA context here: creating one is what broke SGLang's start in the seed.
"""

from __future__ import annotations

import errno
import glob as globmod
import json
import os
import signal
import sys
import time
from pathlib import Path

from podkit import log
from podkit.errors import StageError

_log = log.get("reap")


class Proc:
    """One line of /proc/<pid>/stat, the fields reap needs."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "state", "starttime", "name")

    def __init__(self, pid, ppid, pgid, sid, state, starttime, name) -> None:
        self.pid, self.ppid, self.pgid, self.sid = pid, ppid, pgid, sid
        self.state, self.starttime, self.name = state, starttime, name

    @property
    def gone(self) -> bool:
        return self.state in ("Z", "X")


class Holder:
    """A process to stop: it holds a device (`devices`, `how`: fd/mmap), or shares a holder's group."""

    FIELDS = ("pid", "name", "cmdline", "state", "pgid", "devices", "how", "reason", "starttime", "outcome",
              "signal", "seconds")

    def __init__(self, pid: int, name: str, cmdline: str, state: str, pgid: int, devices=None, how=None,
                 reason: str = "holder", starttime: int = 0) -> None:
        self.pid, self.name, self.cmdline, self.state, self.pgid = pid, name, cmdline, state, pgid
        self.devices: list[str] = devices or []
        self.how: list[str] = how or []
        self.reason, self.starttime = reason, starttime
        self.outcome = ""  # killed | survived | would-kill | vanished
        self.signal = ""
        self.seconds = 0.0

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}


class Report:
    def __init__(self, devices: list[str], dry_run: bool = False) -> None:
        self.devices = devices
        self.dry_run = dry_run
        self.holders: list[Holder] = []
        self.unreadable = 0
        self.scan_seconds = 0.0
        self.seconds = 0.0
        self.gpus: list[dict] = []

    @property
    def survivors(self) -> list[Holder]:
        return [h for h in self.holders if h.outcome == "survived"]

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ("devices", "unreadable", "scan_seconds", "seconds", "gpus", "dry_run")}
        d["holders"] = [h.to_dict() for h in self.holders]
        d["survivors"] = [h.pid for h in self.survivors]
        return json.dumps(d, indent=2)


def read_stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm may contain spaces and parens: split at the last ')'.
    lpar, rpar = raw.index(b"("), raw.rindex(b")")
    rest = raw[rpar + 2:].split()
    return Proc(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]), state=rest[0].decode(),
                starttime=int(rest[19]), name=raw[lpar + 1:rpar].decode(errors="replace"))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def protected_pids() -> set[int]:
    """podkit itself, its ancestors, and PID 1: never holders, never killed."""
    keep = {1, os.getpid()}
    pid = os.getpid()
    while pid > 1:
        st = read_stat(pid)
        if st is None:
            break
        pid = st.ppid
        keep.add(pid)
    return keep


def which(name: str) -> str | None:
    """shutil.which without importing shutil (which loads zlib, bz2 and lzma) on the boot path."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def match_devices(pattern: str) -> list[str]:
    return sorted({os.path.realpath(p) for p in globmod.glob(pattern)})


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def processes() -> list[Proc]:
    """Every process readable now (one /proc/<pid>/stat read each)."""
    return [p for p in map(read_stat, all_pids()) if p is not None]


def descendants(pid: int, procs: list[Proc] | None = None) -> list[int]:
    """Children, grandchildren...: the AReaL trainer is launcher -> torchrun -> one process per rank."""
    procs = processes() if procs is None else procs
    out, frontier = [], {pid}
    while frontier:
        kids = [p.pid for p in procs if p.ppid in frontier]
        out += kids
        frontier = set(kids)
    return out


def _read_all(path: str) -> bytes:
    return _read_all_fd(os.open(path, os.O_RDONLY))


def _read_all_fd(fd: int) -> bytes:
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 17):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _inspect(pid: int, wanted: set[str], needles: list[bytes]) -> tuple[dict[str, set[str]], bool]:
    """What of `wanted` this process holds, by fd and by mapping; (found, readable)."""
    found: dict[str, set[str]] = {}
    base = f"/proc/{pid}/"
    try:
        for fd in os.listdir(base + "fd"):
            try:
                target = os.readlink(base + "fd/" + fd)
            except OSError:
                continue
            if target in wanted:
                found.setdefault(target, set()).add("fd")
    except FileNotFoundError:
        return {}, True  # exited meanwhile
    except PermissionError:
        return {}, False
    try:
        maps = _read_all(base + "maps")
    except (FileNotFoundError, ProcessLookupError):
        return found, True
    except PermissionError:
        return found, False
    if any(n in maps for n in needles):
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6:
                path = parts[5].decode(errors="replace").removesuffix(" (deleted)")
                if path in wanted:
                    found.setdefault(path, set()).add("mmap")
    return found, True


def scan(devices: list[str], deadline_s: float = 10.0, workers: int = 2) -> tuple[list[Holder], int]:
    """Every process holding one of `devices` by fd or mapping. Returns (holders, unreadable count).
    Reading /proc/<pid>/maps is the cost (the kernel formats every mapping), so it is split with a
    forked helper when there are many processes."""
    if not devices:
        return [], 0
    wanted = set(devices)
    needles = [d.encode() for d in devices]
    keep = protected_pids()
    pids = [p for p in all_pids() if p not in keep]
    stop_at = time.monotonic() + deadline_s
    results: list[tuple[int, dict[str, set[str]]]] = []
    unreadable = [0]
    late = []

    def work(chunk: list[int]) -> None:
        for pid in chunk:
            if time.monotonic() > stop_at:
                late.append(pid)
                return
            found, readable = _inspect(pid, wanted, needles)
            if not readable:
                unreadable[0] += 1
            if found:
                results.append((pid, found))

    # Two cores' worth: a forked helper scans every other pid (threads would fight over the GIL at
    # every syscall). Results come back over a pipe as lines "pid path how".
    helper = None
    threads = sys.modules["threading"].active_count() if "threading" in sys.modules else 1
    if workers > 1 and len(pids) >= 256 and threads == 1:  # never fork beside other threads
        r, w = os.pipe()
        helper = os.fork()
        if helper == 0:
            os.close(r)
            out = []
            for pid in pids[1::2]:
                if time.monotonic() > stop_at:
                    out.append(f"{pid}\t\tlate")
                    break
                found, readable = _inspect(pid, wanted, needles)
                out += [f"{pid}\t{path}\t{how}" for path, hows in found.items() for how in hows]
                if not readable:
                    out.append(f"{pid}\t\tunreadable")
            os.write(w, ("\n".join(out) + "\n").encode())
            os._exit(0)
        os.close(w)
        work(pids[0::2])
        data = _read_all_fd(r)
        os.waitpid(helper, 0)
        merged: dict[int, dict[str, set[str]]] = {}
        for line in data.decode().splitlines():
            pid_s, path, how = line.split("\t")
            if how == "unreadable":
                unreadable[0] += 1
            elif how == "late":
                late.append(int(pid_s))
            else:
                merged.setdefault(int(pid_s), {}).setdefault(path, set()).add(how)
        results += merged.items()
    else:
        work(pids)
    if late:
        raise StageError("reap", f"scanning /proc took longer than {deadline_s:.0f}s",
                         "the machine is overloaded; run `podkit reap --dry-run` to retry")
    holders: list[Holder] = []
    for pid, found in sorted(results):
        st = read_stat(pid)
        if st is None or st.gone:
            continue
        holders.append(Holder(pid=pid, name=st.name, cmdline=cmdline(pid), state=st.state, pgid=st.pgid,
                              devices=sorted(found), how=sorted(set().union(*found.values())),
                              starttime=st.starttime))
    return holders, unreadable[0]


def _group_mates(holders: list[Holder]) -> list[Holder]:
    """Members of a holder's process group, when that group holds nothing else that must live:
    every member is a holder or a descendant of one, and none is protected."""
    if not holders:
        return []
    procs = {p.pid: p for p in processes()}
    keep = protected_pids()
    keep_groups = {procs[p].pgid for p in keep if p in procs}
    held = {h.pid for h in holders}

    def under_holder(pid: int) -> bool:
        seen = set()
        while pid in procs and pid not in seen:
            if pid in held:
                return True
            seen.add(pid)
            pid = procs[pid].ppid
        return False

    extra: list[Holder] = []
    for pgid in sorted({h.pgid for h in holders}):
        if pgid in keep_groups or pgid <= 1:
            continue
        members = [p for p in procs.values() if p.pgid == pgid and not p.gone]
        if any(m.pid in keep or not under_holder(m.pid) for m in members):
            continue
        leader = next((h.pid for h in holders if h.pgid == pgid), pgid)
        for m in members:
            if m.pid not in held:
                extra.append(Holder(pid=m.pid, name=m.name, cmdline=cmdline(m.pid), state=m.state, pgid=pgid,
                                    reason=f"group of {leader}", starttime=m.starttime))
    return extra


class _Target:
    """A process we may signal: a pidfd when the kernel has them, else pid + start-time check."""

    def __init__(self, h: Holder) -> None:
        self.h = h
        self.fd = None
        try:
            self.fd = os.pidfd_open(h.pid)
            st = read_stat(h.pid)
            if st is None or st.starttime != h.starttime:
                self.close()
                self.h.outcome = "vanished"
        except (AttributeError, OSError) as e:
            if isinstance(e, OSError) and e.errno == errno.ESRCH:
                self.h.outcome = "vanished"

    def alive(self) -> bool:
        st = read_stat(self.h.pid)
        return st is not None and st.starttime == self.h.starttime and not st.gone

    def send(self, sig: int) -> None:
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif self.alive():
                os.kill(self.h.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def collect_children() -> None:
    """As PID 1 (the container's entrypoint) every orphan is ours to wait for."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_gone(targets: list[_Target], timeout: float, t0: float, sig_name: str) -> None:
    until = time.monotonic() + timeout
    while True:
        collect_children()
        for t in targets:
            if not t.h.outcome and not t.alive():
                t.h.outcome, t.h.signal, t.h.seconds = "killed", sig_name, round(time.monotonic() - t0, 2)
        if all(t.h.outcome for t in targets) or time.monotonic() >= until:
            return
        time.sleep(0.02)


def stop(holders: list[Holder], grace_s: float, kill_wait_s: float) -> None:
    """SIGTERM each, wait up to the grace, SIGKILL what remains, wait until each is really gone."""
    targets = [_Target(h) for h in holders]
    live = [t for t in targets if not t.h.outcome]
    t0 = time.monotonic()
    for t in live:
        t.send(signal.SIGTERM)
    _wait_gone(live, grace_s, t0, "SIGTERM")
    rest = [t for t in live if not t.h.outcome]
    for t in rest:
        t.send(signal.SIGKILL)
    _wait_gone(rest, kill_wait_s, t0, "SIGKILL")
    for t in rest:
        if not t.h.outcome:
            st = read_stat(t.h.pid)
            t.h.outcome, t.h.state = "survived", (st.state if st else "?")
            t.h.seconds = round(time.monotonic() - t0, 2)
    for t in targets:
        t.close()


def gpu_state(timeout_s: float = 10.0) -> list[dict] | None:
    """Per-GPU used memory and compute mode from nvidia-smi, or None where there is no nvidia-smi."""
    exe = which("nvidia-smi")
    if not exe:
        return None
    import subprocess

    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.used,compute_mode", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        _log.warn(f"nvidia-smi failed ({e}); cannot verify that the GPUs are free")
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[1].isdigit():
            gpus.append({"index": int(parts[0]), "memory_used_mib": int(parts[1]), "compute_mode": parts[2]})
    return gpus


def wait_gpus_free(timeout_s: float, threshold_mib: int = 256) -> list[dict]:
    """Wait (bounded) until each GPU's used memory is near zero; returns the last reading."""
    until = time.monotonic() + timeout_s
    while True:
        gpus = gpu_state()
        if gpus is None:
            return []
        busy = [g for g in gpus if g["memory_used_mib"] > threshold_mib]
        if not busy or time.monotonic() >= until:
            for g in gpus:
                if g["compute_mode"].lower().startswith("exclusive"):
                    _log.warn(f"GPU {g['index']} is in compute mode {g['compute_mode']}: a second CUDA context "
                              "fails with 'busy or unavailable'; nothing of podkit's may touch it before SGLang")
            for g in busy:
                _log.warn(f"GPU {g['index']} still uses {g['memory_used_mib']} MiB after {timeout_s:.0f}s and no "
                          "holder is visible here: it is held outside this container's PID namespace. "
                          "Stop and start the pod (not just the container) to reset it")
            return gpus
        time.sleep(0.5)


def clear_supervisor_leftovers(run_dir: Path, stop_live: bool, grace_s: float) -> list[str]:
    """Remove a dead supervisord's socket and pid file; a live one is stopped only when `stop_live`."""
    done: list[str] = []
    sock, pidfile = run_dir / "supervisor.sock", run_dir / "supervisord.pid"
    pid = None
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        pass
    live = pid is not None and pid > 1 and "supervisord" in cmdline(pid)
    if live and pid not in protected_pids():
        if not stop_live:
            raise StageError("reap", f"a podkit supervisord is already running (pid {pid}, socket {sock})",
                             f"stop it first: supervisorctl -s unix://{sock} shutdown")
        st = read_stat(pid)
        h = Holder(pid=pid, name=st.name if st else "supervisord", cmdline=cmdline(pid), state="",
                   pgid=st.pgid if st else pid, reason="previous supervisord", starttime=st.starttime if st else 0)
        stop([h], grace_s, grace_s)
        done.append(f"stopped previous supervisord {pid} ({h.outcome})")
    if sock.exists():
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1.0)
        try:
            s.connect(str(sock))
            answered = True
        except OSError:
            answered = False
        finally:
            s.close()
        if answered and not stop_live:
            raise StageError("reap", f"something answers on {sock}", "another podkit runs on this workspace; "
                             f"stop it: supervisorctl -s unix://{sock} shutdown")
        if not answered:
            sock.unlink(missing_ok=True)
            done.append(f"removed stale socket {sock}")
    if pidfile.exists() and not (pid and "supervisord" in cmdline(pid)):
        pidfile.unlink(missing_ok=True)
        done.append(f"removed stale pid file {pidfile}")
    return done


def name_resolve_trial(root: str, experiment: str, trial: str) -> Path:
    """AReaL's name_resolve keys live at <root>/<user>/<experiment>/<trial>/ (areal.utils.names)."""
    import getpass

    return Path(root) / getpass.getuser() / experiment / trial


def clear_name_resolve(root: str, experiment: str, trial: str) -> list[str]:
    trial_dir = name_resolve_trial(root, experiment, trial)
    if not trial_dir.exists():
        return []
    import shutil

    # Discovery records only (server addresses of a dead run), never user data: safe to remove.
    shutil.rmtree(trial_dir, ignore_errors=True)
    return [f"cleared stale name_resolve records {trial_dir}"]


def enabled(setting: str) -> bool:
    """auto: only as the container's entrypoint (PID 1, or the direct child of an init such as tini)."""
    if setting in ("always", "never"):
        return setting == "always"
    if os.getpid() == 1:
        return True
    parent = read_stat(os.getppid())
    return os.getppid() == 1 and parent is not None and parent.name in ("tini", "docker-init", "dumb-init")


def describe(h: Holder) -> str:
    cmd = h.cmdline or h.name
    cmd = cmd if len(cmd) <= 40 else cmd[:39] + "…"
    held = f"held {', '.join(h.devices)}" if h.devices else f"in the {h.reason}"
    return f"{h.pid} ({cmd}, {held})"


def run(devices_glob: str, grace_s: float, kill_wait_s: float, dry_run: bool = False,
        gpu_timeout_s: float = 30.0) -> Report:
    """Find and stop every holder of the files matching `devices_glob`, then verify the GPUs."""
    t0 = time.monotonic()
    devices = match_devices(devices_glob)
    report = Report(devices=devices, dry_run=dry_run)
    holders, report.unreadable = scan(devices)
    report.scan_seconds = round(time.monotonic() - t0, 4)
    holders += _group_mates(holders)
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
            _log.info(f"would kill {describe(h)}")
    elif holders:
        stop(holders, grace_s, kill_wait_s)
        for h in holders:
            if h.outcome == "killed":
                _log.info(f"killed {describe(h)} after {h.signal}, {h.seconds}s")
            elif h.outcome == "survived":
                _log.error(f"{describe(h)} survived SIGKILL in state {h.state}: "
                           + ("uninterruptible sleep (D), usually a driver or I/O wait; it holds the GPU until "
                              "it returns. Restart the pod if it does not go away" if h.state == "D"
                              else "it may be outside this PID namespace; restart the pod"))
        if any(h.devices for h in holders) and not dry_run:
            report.gpus = wait_gpus_free(gpu_timeout_s)
    else:
        report.gpus = wait_gpus_free(gpu_timeout_s)
    report.seconds = round(time.monotonic() - t0, 3)
    return report
