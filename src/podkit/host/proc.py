"""The process table, read from /proc: a process's stat, command line and start time, its parents and
descendants, the pids podkit must never touch, the processes carrying a program's mark in their environment,
and stopping a set of processes TERM -> grace -> KILL.

A pid alone names nobody for long: every process here carries its start time (field 22 of
/proc/<pid>/stat), and a signal goes through a pidfd, or to a pid whose start time still matches, so a
recycled pid is never hit. Depends on nothing else in podkit.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time


class Proc:
    """One line of /proc/<pid>/stat, the fields podkit needs."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "state", "starttime", "name")

    def __init__(self, pid, ppid, pgid, sid, state, starttime, name) -> None:
        self.pid, self.ppid, self.pgid, self.sid = pid, ppid, pgid, sid
        self.state, self.starttime, self.name = state, starttime, name

    @property
    def gone(self) -> bool:
        return self.state in ("Z", "X")


def read_stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        # comm may contain spaces and parens: split at the last ')'.
        lpar, rpar = raw.index(b"("), raw.rindex(b")")
        rest = raw[rpar + 2:].split()
        return Proc(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]), state=rest[0].decode(),
                    starttime=int(rest[19]), name=raw[lpar + 1:rpar].decode(errors="replace"))
    except (ValueError, IndexError):
        return None  # a pid that is exiting can read back empty


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def name(pid: int) -> str:
    st = read_stat(pid)
    return st.name if st else "?"


def starttime(pid: int) -> int | None:
    st = read_stat(pid)
    return None if st is None or st.gone else st.starttime


def same_process(pid: int, start: int) -> bool:
    """Is `pid` still the process that started at `start`? A pid recorded by a dead run may since
    belong to anyone."""
    return pid > 0 and start is not None and starttime(pid) == start


def protected_pids() -> set[int]:
    """podkit itself, its ancestors, and PID 1: never stopped."""
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


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def processes() -> list[Proc]:
    """Every process readable now (one /proc/<pid>/stat read each)."""
    return [p for p in map(read_stat, all_pids()) if p is not None]


def children(pid: int, procs: list[Proc] | None = None) -> list[Proc]:
    return [p for p in (processes() if procs is None else procs) if p.ppid == pid]


def descendants(pid: int, procs: list[Proc] | None = None) -> list[int]:
    """Children, grandchildren...: the AReaL trainer is launcher -> torchrun -> one process per rank."""
    procs = processes() if procs is None else procs
    out, frontier = [], {pid}
    while frontier:
        kids = [p.pid for p in procs if p.ppid in frontier]
        out += kids
        frontier = set(kids)
    return out


def group_members(pgid: int, not_before: int = 0) -> list[Proc]:
    """Live members of process group `pgid` that started at or after `not_before` (a younger group
    that reuses the number is not the one recorded), never podkit itself."""
    me = os.getpid()
    return [p for p in processes() if p.pgid == pgid and p.starttime >= not_before and p.pid != me and not p.gone]


def read_all(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    return read_all_fd(fd)


def read_all_fd(fd: int) -> bytes:
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
        maps = read_all(base + "maps")
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


def holding(paths: list[str], deadline_s: float = 10.0, workers: int = 2) -> tuple[dict[int, dict[str, set[str]]], int]:
    """Every process holding one of `paths` by fd or mapping: ({pid: {path: {"fd", "mmap"}}}, unreadable
    count). Raises TimeoutError when /proc cannot be read within `deadline_s` (an overloaded machine).
    Reading /proc/<pid>/maps is the cost (the kernel formats every mapping), so it is split with a
    forked helper when there are many processes."""
    if not paths:
        return {}, 0
    wanted = set(paths)
    needles = [p.encode() for p in paths]
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
        data = read_all_fd(r)
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
        raise TimeoutError(f"scanning /proc took longer than {deadline_s:.0f}s")
    return dict(results), unreadable[0]


class Target:
    """A process to stop, identified by pid and start time. `reason` says why it is stopped;
    `outcome` (killed | survived | would-kill | vanished), `signal` and `seconds` say how it went."""

    FIELDS = ("pid", "name", "cmdline", "state", "pgid", "reason", "starttime", "outcome", "signal", "seconds")

    def __init__(self, pid: int, name: str = "", cmdline: str = "", state: str = "", pgid: int = 0,
                 reason: str = "", starttime: int = 0) -> None:
        self.pid, self.name, self.cmdline, self.state, self.pgid = pid, name, cmdline, state, pgid
        self.reason, self.starttime = reason, starttime
        self.outcome = ""
        self.signal = ""
        self.seconds = 0.0

    @classmethod
    def of(cls, p: Proc, reason: str = "", **extra) -> Target:
        return cls(pid=p.pid, name=p.name, cmdline=cmdline(p.pid), state=p.state, pgid=p.pgid, reason=reason,
                   starttime=p.starttime, **extra)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}

    def describe(self) -> str:
        cmd = self.cmdline or self.name
        cmd = cmd if len(cmd) <= 40 else cmd[:39] + "…"
        return f"{self.pid} ({cmd}, {self.reason})" if self.reason else f"{self.pid} ({cmd})"


class _Handle:
    """A pidfd where the kernel has them, else the pid with a start-time check before each signal."""

    def __init__(self, t: Target) -> None:
        self.t = t
        self.fd = None
        try:
            self.fd = os.pidfd_open(t.pid)
            if not self.alive():
                self.close()
                t.outcome = "vanished"
        except (AttributeError, OSError) as e:
            if isinstance(e, OSError) and e.errno == errno.ESRCH:
                t.outcome = "vanished"

    def alive(self) -> bool:
        st = read_stat(self.t.pid)
        return st is not None and st.starttime == self.t.starttime and not st.gone

    def send(self, sig: int) -> None:
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif self.alive():
                os.kill(self.t.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _wait_gone(handles: list[_Handle], timeout: float, t0: float, sig_name: str, reap_children) -> None:
    until = time.monotonic() + timeout
    while True:
        reap_children()
        for h in handles:
            if not h.t.outcome and not h.alive():
                h.t.outcome, h.t.signal, h.t.seconds = "killed", sig_name, round(time.monotonic() - t0, 2)
        if all(h.t.outcome for h in handles) or time.monotonic() >= until:
            return
        time.sleep(0.02)


def _no_children() -> None:
    pass


def stop(targets: list[Target], grace_s: float, kill_wait_s: float, reap_children=_no_children) -> None:
    """SIGTERM (and SIGCONT) each, wait up to the grace, SIGKILL what remains, wait until each is really gone.
    `reap_children` collects exited children meanwhile (PID 1 must, or they stay zombies)."""
    keep = protected_pids()
    for t in targets:
        if t.pid in keep:
            t.outcome = "protected"
    handles = [_Handle(t) for t in targets if not t.outcome]
    live = [h for h in handles if not h.t.outcome]
    t0 = time.monotonic()
    for h in live:
        h.send(signal.SIGTERM)
        h.send(signal.SIGCONT)  # a stopped process (^Z, a debugger, SIGSTOP) acts on SIGTERM only once continued
    _wait_gone(live, grace_s, t0, "SIGTERM", reap_children)
    rest = [h for h in live if not h.t.outcome]
    for h in rest:
        h.send(signal.SIGKILL)
    _wait_gone(rest, kill_wait_s, t0, "SIGKILL", reap_children)
    for h in rest:
        if not h.t.outcome:
            st = read_stat(h.t.pid)
            h.t.outcome, h.t.state = "survived", (st.state if st else "?")
            h.t.seconds = round(time.monotonic() - t0, 2)
    for h in handles:
        h.close()


# Inherited by everything the trainer program and the setup command start, whatever session or group it
# moves to: how their leftovers are found. Not PODKIT_-prefixed: config would warn of an unknown setting.
OWNER_ENV = "_PODKIT_OWNER"


def owner_mark(state_dir, program: str) -> str:
    """OWNER_ENV's value for `program` ("trainer", "setup") of one pod: its state dir, one per workspace
    and cluster node. Another workspace's processes on this machine (tests run many side by side), or
    another simulated node's, carry another."""
    return f"{program}@{os.path.realpath(state_dir)}"


def marked(state_dir, reasons: dict[str, str]) -> list[Target]:
    """Live processes of this user whose environment carries the mark of one of `reasons`' programs
    for `state_dir` (program -> why it is stopped), never podkit itself or its ancestors (the trainer's
    launcher carries the mark). An environment that cannot be read is skipped."""
    want = {f"{OWNER_ENV}={owner_mark(state_dir, prog)}".encode(): why for prog, why in reasons.items()}
    key, uid, keep = OWNER_ENV.encode() + b"=", os.getuid(), protected_pids()
    found = []
    for pid in all_pids():
        if pid in keep:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            env = read_all(f"/proc/{pid}/environ")
        except OSError:
            continue
        if key not in env:
            continue
        why = next((want[e] for e in env.split(b"\0") if e in want), None)
        st = read_stat(pid) if why else None
        if st and not st.gone:
            found.append(Target.of(st, reason=why))
    return found


def stop_marked(state_dir, reasons: dict[str, str], grace_s: float = 2.0, kill_wait_s: float = 1.0,
                reap_children=_no_children) -> list[Target]:
    """Stop (TERM, grace, KILL) what `marked` finds; returns them with their outcomes. The default grace
    fits in the trainer's stop grace after its own shutdown."""
    targets = marked(state_dir, reasons)
    if targets:
        stop(targets, grace_s, kill_wait_s, reap_children)
    return targets


def told(t: Target) -> str:
    """The log line for a leftover `stop_marked` dealt with: its pid, command line and why."""
    cmd = t.cmdline or t.name
    cmd = cmd if len(cmd) <= 200 else cmd[:199] + "…"
    if t.outcome == "survived":
        return f"pid {t.pid} ({cmd}), {t.reason}, survived SIGKILL (state {t.state})"
    if t.outcome == "vanished":
        return f"pid {t.pid} ({cmd}), {t.reason}, exited before it was stopped"
    return f"stopped pid {t.pid} ({cmd}), {t.reason}" + (f", with {t.signal}" if t.signal else "")


def tell(targets: list[Target], logger) -> None:
    """Warn of each leftover stopped (or that survived); one that exited by itself is not news."""
    for t in targets:
        if t.outcome != "vanished":
            logger.warn(told(t))


def kill_groups(groups: list) -> list[int]:
    """SIGKILL every process still in the recorded [pgid, start time] groups; a pid reused by a
    younger process is not theirs and is left alone. Returns the pids signalled."""
    killed = []
    keep = protected_pids()
    for pgid, since in groups:
        for p in group_members(int(pgid), int(since)):
            if p.pid in keep:
                continue
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            except ProcessLookupError:
                pass
    return killed


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process a child subreaper (prctl): an orphan below it (a daemon that forked twice, in a session
    and an environment of its own) is re-parented here instead of to PID 1, so that it is found by ancestry.
    False where the kernel refuses."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(keep=()) -> None:
    """Wait for the children of this process that have exited, except `keep` (a child a subprocess.Popen waits
    for itself: reaped here, its exit status would be lost). A subreaper's re-parented orphans are reaped only
    so."""
    me = os.getpid()
    for p in processes():
        if p.ppid == me and p.gone and p.pid not in keep:
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def stop_descendants(reason: str, grace_s: float = 2.0, kill_wait_s: float = 1.0, rounds: int = 3) -> list[Target]:
    """Stop (TERM, grace, KILL) every process below this one, never this one or its ancestors; what a stopped
    parent leaves is re-parented here (a subreaper) and stopped in the next round. Returns them with their
    outcomes."""
    done: list[Target] = []
    me = os.getpid()
    for _ in range(rounds):
        reap_orphans()
        procs = processes()
        below = set(descendants(me, procs))
        targets = [Target.of(p, reason=reason) for p in procs if p.pid in below and not p.gone]
        if not targets:
            break
        stop(targets, grace_s, kill_wait_s, reap_children=reap_orphans)
        done += targets
    reap_orphans()
    return done
