"""One workspace, one pod: a lease on `<workspace>/.podkit/lease.json`.

Two pods that mount one volume (a RunPod network volume attached to two pods, two compose projects on
one host's volume) would run two trainers into one checkpoint directory. The boot takes the lease in
its preflight stage; a second pod waits in safe mode naming the holder (host, pid, since) and boots
by itself once the lease is free. While the pod runs, the log listener renews the lease once a minute
(supervisord's TICK_60) and releases it when supervisord shuts down.

Whether a holder is alive is decided only from what the reader itself can observe, never from two
machines' clocks (a live pod whose clock is 10 minutes off would otherwise be taken over at once):
- in the same pid namespace of the same boot (a boot that became supervisord, `podkit up`): its pid
  and start time;
- elsewhere on the same host (another container, or this container restarted after a crash): how long
  ago it last renewed, on this host's own boot clock;
- from another host: whether its renewal changes while the reader watches. A lease left unchanged for
  `guard.lease_s` of the reader's watch has lapsed, however old or new its dates say it is.
The hostname and the /etc/hostname mount do not tell containers apart (host networking shares the one,
a runtime without a mount of its own, or a Kubernetes pod's containers, share the other); the pid
namespace does, and two containers that cannot see each other's pids wait for renewals instead.

The lease is created with link(2), which fails when the name exists, also on NFS: two pods that
boot at once cannot both take it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path

from podkit import records
from podkit.host import proc

NAME = records.LEASE.name
# Test hook: shifts this process's wall clock as the lease sees it (the dates it writes), so a test can
# give each pod a clock of its own. Nothing decides liveness from the wall clock.
SKEW_ENV = "PODKIT_TEST_CLOCK_SKEW_S"


def _wall() -> float:
    try:  # a value that is not a finite number of seconds is no skew (the hook must not stop a boot or a renewal)
        skew = float(os.environ.get(SKEW_ENV) or 0)
    except ValueError:
        skew = 0.0
    return time.time() + (skew if _number(skew) else 0.0)


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _ns(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")  # e.g. "pid:[4026531836]": one namespace's identity
    except OSError:
        return ""


def me(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"host": os.uname().nodename, "boot_id": _boot_id(), "container": container(), "pidns": _ns("pid"),
            "timens": _ns("time"), "pid": pid, "start": proc.starttime(pid) or 0}


def container() -> str:
    """Where this container's /etc/hostname is bind-mounted from (/var/lib/docker/containers/<id>/hostname
    under Docker); '' without a mount of its own. Shown, not trusted: containers may share it."""
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:  # a mount path may be any bytes
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == "/etc/hostname":
                    return f"{fields[2]}:{fields[3]}".encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except OSError:
        pass
    return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def read(state_dir: Path) -> dict | None:
    """The lease, or None when there is none. A lease that cannot be read as one counts as lapsed: not a
    regular file (a FIFO would block the boot for ever, a directory or symlink is planted), not JSON."""
    return _read(state_dir / NAME)


def _read(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return {"unreadable": True}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {"unreadable": True}
        data = json.loads(os.read(fd, 1 << 16).decode())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {"unreadable": True}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {"unreadable": True}


def _same_boot(holder: dict) -> bool:
    mine = _boot_id()
    return bool(mine) and holder.get("boot_id") == mine


def same_container(holder: dict) -> bool:
    """Can this process check the holder's pid: the same boot and the same pid namespace. A lease
    without its pid namespace (an older podkit's) is never taken for one: its pid may be anyone's here."""
    pidns = holder.get("pidns")
    return _same_boot(holder) and isinstance(pidns, str) and bool(pidns) and pidns == _ns("pid")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


# What this process has seen of each lease: its content when first read, and when (this process's
# monotonic clock). A renewal changes the content; one unchanged for a lease's length has lapsed.
_seen: dict[str, float] = {}


def _key(holder: dict) -> str:
    return json.dumps(holder, sort_keys=True)


def _unchanged_for(holder: dict) -> float:
    key = _key(holder)
    now = time.monotonic()
    first = _seen.setdefault(key, now)
    if len(_seen) > 64:  # one entry per renewal seen: keep the newest
        for k in sorted(_seen, key=_seen.get)[:-64]:
            del _seen[k]
    return now - first


# The log listener renews a pod's lease on supervisord's TICK_60. A lease lapses no sooner than two of its
# holder's renewals (and a few seconds) have been missed: guard.lease_s may be set below one renewal (its
# minimum is 30), and a live holder would then lapse between two renewals.
RENEW_S = 60.0
MAX_RENEW_S = 600.0  # a planted renew_s holds the workspace no longer than this


def _lapse_s(holder: dict, ttl_s: float) -> float:
    every = holder.get("renew_s")
    return max(ttl_s, 2 * min(every, MAX_RENEW_S) + 5) if _number(every) and every > 0 else ttl_s


def live(holder: dict | None, ttl_s: float) -> bool:
    """Does `holder` still hold the workspace, as far as this process can tell? In doubt, it does."""
    if not holder or holder.get("unreadable"):
        return False
    ttl_s = _lapse_s(holder, ttl_s)
    if same_container(holder):
        pid, start = holder.get("pid"), holder.get("start")
        return isinstance(pid, int) and isinstance(start, int) and proc.same_process(pid, start)
    renewed = holder.get("boottime")
    if _same_boot(holder) and holder.get("timens") == _ns("time") and _number(renewed) \
            and renewed <= _boottime() + 1:  # one host, one boot clock; a date ahead of it is planted
        return _boottime() - renewed < ttl_s
    return _unchanged_for(holder) < ttl_s


def who(holder: dict) -> str:
    since = holder.get("since")  # the holder's clock: shown, never compared
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if _number(since) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}"


def describe(holder: dict, ttl_s: float) -> str:
    return f"{who(holder)}; it lapses after {_lapse_s(holder, ttl_s):.0f}s without a renewal"


def acquire(state_dir: Path, ttl_s: float, pid: int | None = None, renew_s: float | None = None) -> dict | None:
    """Take the lease for this process (or `pid`, the supervisord it becomes). Returns None when it is
    ours, else the live holder's lease. A waiting boot asks again in the same process: its watch of the
    holder's renewals goes on. `renew_s`: how often the holder will renew (a pod's listener: RENEW_S), in
    the lease for its readers."""
    path = state_dir / NAME
    for _ in range(3):
        holder = read(state_dir)
        if holder is not None and not _is(holder, pid) and live(holder, ttl_s):
            return holder
        if holder is not None:
            # Lapsed, gone, unreadable or ours from before an exec: set it aside (rename is atomic; a
            # second pod doing the same finds it gone and tries the create below).
            aside = path.with_name(f"{NAME}.old")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                aside = None
            except OSError:  # a directory there (or a .old one): set aside under a name of its own
                aside = path.with_name(f"{NAME}.aside-{os.urandom(4).hex()}")
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    aside = None
            moved = _read(aside) if aside else None
            if moved is not None and not moved.get("unreadable") and _key(moved) != _key(holder):
                # Not the lease judged a moment ago: another pod took the workspace in between (it set the
                # lapsed one aside first). Put its lease back, and wait behind it.
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                return read(state_dir) or moved
        now = _wall()
        lease = {**me(pid), "since": now, "renewed": now, "boottime": _boottime(), "beat": 0,
                 "token": os.urandom(8).hex(), **({"renew_s": renew_s} if renew_s else {})}
        if _create(path, lease):
            return None
    return read(state_dir) or {"host": "?", "pid": "?"}


def _is(holder: dict, pid: int | None) -> bool:
    mine = me(pid)
    return same_container(holder) and holder.get("pid") == mine["pid"] and holder.get("start") == mine["start"]


def _create(path: Path, lease: dict) -> bool:
    tmp = path.with_name(f".{NAME}.{lease['token']}")
    try:  # the temp file goes whatever fails (a full disk mid-write): none is left on the volume
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
            json.dump(lease, f)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def ours(state_dir: Path) -> dict | None:
    """The lease, when it is held by this process or one of its ancestors (the boot that became this
    pod's supervisord, or `podkit up`)."""
    holder = read(state_dir)
    if not holder or holder.get("unreadable") or not same_container(holder):
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid not in proc.protected_pids() or not proc.same_process(pid, holder.get("start")):
        return None
    return holder


def lost(state_dir: Path) -> str | None:
    """Who holds the workspace, when another pod took it from this one (this pod stalled past its lease,
    and its replacement booted): a trainer asks before it writes a checkpoint, and stops, writing nothing,
    rather than train on beside the replacement into one checkpoint directory. None while the lease is
    this pod's, absent (released at a stop) or unreadable: only a named other holder takes it away."""
    holder = read(state_dir)
    if not holder or holder.get("unreadable") or ours(state_dir) is not None:
        return None
    return who(holder)


def renew(state_dir: Path) -> bool:
    """Renew this pod's lease: a new count (what another host watches change), and the dates. False when
    it is no longer ours (then there is nothing to renew).

    Never over a lease another pod wrote meanwhile: a read, then a rename over the file, would put this pod's
    lease back over its replacement's taken a moment before (two pods on one workspace). So the lease is moved
    aside (atomic), kept only if the one moved is still this pod's (else put back), and the renewed one created
    where no other is (acquire's exclusive link): a taker in between wins, and this pod's trainer sees it lost."""
    holder = ours(state_dir)
    if holder is None:
        return False
    beat = holder.get("beat")
    renewed = {**holder, "renewed": _wall(), "boottime": _boottime(), "beat": beat + 1 if isinstance(beat, int) else 1}
    path, tag = state_dir / NAME, os.urandom(4).hex()
    new, aside = path.with_name(f".{NAME}.new-{tag}"), path.with_name(f".{NAME}.renew-{tag}")
    records.write_json(new, renewed)  # first, whole: a full volume fails here (the reserve given up) with the lease as it was
    try:
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        moved = _read(aside)
        if not moved or moved.get("token") != holder.get("token") or _key(moved) != _key(holder):
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)  # another pod's, taken in between: back where it was
            return False
        try:
            os.link(new, path)
        except FileExistsError:
            return False  # a taker created its own in the gap: it holds the workspace now
        except OSError:
            with contextlib.suppress(OSError):
                os.link(aside, path)  # the lease as it was, not none
            raise
        return True
    finally:
        aside.unlink(missing_ok=True)
        new.unlink(missing_ok=True)


def release(state_dir: Path) -> bool:
    if ours(state_dir) is None:
        return False
    (state_dir / NAME).unlink(missing_ok=True)
    return True
