"""One workspace, one pod: a lease on `<workspace>/.podkit/lease.json`.

Two pods that mount one volume (a RunPod network volume attached to two pods, two compose projects on
one host's volume) would run two trainers into one checkpoint directory. The boot takes the lease in
its preflight stage; a second pod waits in safe mode naming the holder (host, pid, since) and boots
by itself once the lease is free. A holder that is gone is detected: in the same container by its
pid and start time (a restarted container), from anywhere else when its lease lapses,
`guard.lease_s` after the last renewal. While the pod runs, the log listener renews the lease once a
minute (supervisord's TICK_60) and releases it when supervisord shuts down.

The lease is created with link(2), which fails when the name exists, also on NFS: two pods that
boot at once cannot both take it. "The same container" is the same host, boot and container (where
its /etc/hostname comes from): two containers on host networking share a hostname.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path

from podkit import proc, records

NAME = records.LEASE.name


def me(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"host": os.uname().nodename, "boot_id": _boot_id(), "container": container(), "pid": pid,
            "start": proc.starttime(pid) or 0}


def container() -> str:
    """Which container this is, as the host knows it: where its /etc/hostname is bind-mounted from
    (/var/lib/docker/containers/<id>/hostname under Docker), the same across restarts of one container
    and different for any other; '' outside one. Two containers on host networking share the hostname
    and the boot id, and each sees only its own pids: a pid check is this container's to make alone."""
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
    try:
        fd = os.open(state_dir / NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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


def same_container(holder: dict) -> bool:
    mine = me()
    return (holder.get("host") == mine["host"] and holder.get("boot_id") == mine["boot_id"]
            and holder.get("container", "") == mine["container"])


def live(holder: dict | None, ttl_s: float, now: float | None = None) -> bool:
    """Does `holder` still hold the workspace?"""
    if not holder or holder.get("unreadable"):
        return False
    if same_container(holder):
        pid, start = holder.get("pid"), holder.get("start")
        return isinstance(pid, int) and isinstance(start, int) and proc.same_process(pid, start)
    renewed = holder.get("renewed")
    now = time.time() if now is None else now
    # A renewal further ahead than one lease (or not a finite time) is no renewal: a planted or badly
    # skewed lease would hold the workspace until its date, or for ever.
    return (isinstance(renewed, (int, float)) and not isinstance(renewed, bool) and math.isfinite(renewed)
            and -ttl_s < now - renewed < ttl_s)


def describe(holder: dict, ttl_s: float) -> str:
    since = holder.get("since")
    renewed = holder.get("renewed")
    age = f", renewed {time.time() - renewed:.0f}s ago (lapses after {ttl_s:.0f}s)" \
        if isinstance(renewed, (int, float)) else ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}{age}"


def acquire(state_dir: Path, ttl_s: float, pid: int | None = None) -> dict | None:
    """Take the lease for this process (or `pid`, the supervisord it becomes). Returns None when it is
    ours, else the live holder's lease."""
    path = state_dir / NAME
    for _ in range(3):
        holder = read(state_dir)
        if holder is not None and live(holder, ttl_s) and not _is(holder, pid):
            return holder
        if holder is not None:
            # Lapsed, gone, unreadable or ours from before an exec: set it aside (rename is atomic; a
            # second pod doing the same finds it gone and tries the create below).
            try:
                os.rename(path, path.with_name(f"{NAME}.old"))
            except FileNotFoundError:
                pass
            except OSError:  # a directory there (or a .old one): set aside under a name of its own
                try:
                    os.rename(path, path.with_name(f"{NAME}.aside-{os.urandom(4).hex()}"))
                except FileNotFoundError:
                    pass
        lease = {**me(pid), "since": time.time(), "renewed": time.time(), "token": os.urandom(8).hex()}
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
    return describe(holder, 0).split(", renewed")[0]


def renew(state_dir: Path) -> bool:
    """Renew this pod's lease. False when it is no longer ours (then there is nothing to renew)."""
    holder = ours(state_dir)
    if holder is None:
        return False
    holder["renewed"] = time.time()
    records.write_json(state_dir / NAME, holder)  # temp file and rename; the temp file goes if it fails
    return True


def release(state_dir: Path) -> bool:
    if ours(state_dir) is None:
        return False
    (state_dir / NAME).unlink(missing_ok=True)
    return True
