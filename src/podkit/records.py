"""podkit's records: every file under `<workspace>/.podkit/` (and the two in the run dir), with its
name and its shape, written atomically and read as data, not truth.

A record may be truncated, empty, binary, huge, or valid JSON of the wrong shape or with absurd
numbers: an integer no float holds, a time far in the future or not finite (a killed writer, a full
disk, a person's edit, a planted file). Reading one that does not fit its shape returns the
record's empty value, as if it were missing, and moves the bad copy aside (`<name>.bad-<time>`, the
last few kept) so it can be looked at. Depends on nothing else in podkit but its log.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

from podkit import log

_log = log.get("records")
MAX_BYTES = 16 << 20  # no record of podkit's is near this; a bigger file is not one of ours
KEEP_BAD = 3
NUMBER = (int, float)  # a measure: NaN and infinity mean something (a diverged loss)
OPTIONAL = type(None)
INT_MAX = 2**63 - 1  # no integer podkit writes (a step, a pid, a port) is past it
# Another node's clock may run ahead, and this one's may be stepped back: a time a day on is not a time
# (readers that act on a time, the watchdog and health, also distrust one only minutes ahead).
FUTURE_SKEW_S = 86400.0


class TIME:
    """A wall-clock time in a record: finite, not negative, not past now + FUTURE_SKEW_S. A step stamped
    far in the future would silence the hang watchdog until the clock reached it."""


class Record:
    """One record file. `shape` is a dict of field -> type(s) for a JSON object (every field optional,
    None allowed), or a one-item list holding such a dict for a JSON array of objects."""

    def __init__(self, name: str, shape: dict | list) -> None:
        self.name, self.shape = name, shape

    def path(self, directory: Path) -> Path:
        return Path(directory) / self.name

    @property
    def empty(self):
        return [] if isinstance(self.shape, list) else {}

    def fits(self, data) -> bool:
        if isinstance(self.shape, list):
            return isinstance(data, list) and all(_fits(item, self.shape[0]) for item in data)
        return _fits(data, self.shape)

    def read(self, directory: Path):
        """The record, or its empty value when it is missing or does not fit its shape."""
        path = self.path(directory)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return self.empty
        except OSError as e:
            return self._bad(path, f"cannot be opened ({e.strerror})")
        try:
            raw = os.read(fd, MAX_BYTES + 1) if os.fstat(fd).st_size <= MAX_BYTES else b"x" * (MAX_BYTES + 1)
        except OSError as e:
            return self._bad(path, f"cannot be read ({e.strerror})")
        finally:
            os.close(fd)
        if len(raw) > MAX_BYTES:
            return self._bad(path, "is larger than any record podkit writes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return self._bad(path, "is not JSON (truncated, empty or binary)")
        if not self.fits(data):
            return self._bad(path, "is JSON of the wrong shape")
        return data

    def _bad(self, path: Path, why: str):
        aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            if os.path.islink(path) or path.is_file():
                os.replace(path, aside)
                _prune(path)
                _log.warn(f"{path} {why}: treated as missing, kept as {aside.name}")
            else:
                _log.warn(f"{path} {why}: treated as missing")
        except OSError:
            _log.warn(f"{path} {why}: treated as missing")
        return self.empty

    def write(self, directory: Path, data, mode: int = 0o644) -> None:
        write_json(self.path(directory), data, mode)

    def read_owned(self, directory: Path):
        """The record only if this user owns it and nobody else may write it (a cache that steers what
        podkit does); anything else is ignored, as missing, and left where it is."""
        try:
            fd = os.open(self.path(directory), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return self.empty
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode) \
                    or st.st_size > MAX_BYTES:
                return self.empty
            data = json.loads(os.read(fd, MAX_BYTES).decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return self.empty
        finally:
            os.close(fd)
        return data if self.fits(data) else self.empty


def _fits(data, shape: dict) -> bool:
    if not isinstance(data, dict):
        return False
    for key, want in shape.items():
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            return False  # a 400-digit integer: no float holds it, every reader would overflow
        if want is TIME:
            if not (isinstance(value, NUMBER) and not isinstance(value, bool)
                    and 0 <= value <= time.time() + FUTURE_SKEW_S):
                return False
        elif isinstance(want, dict):
            if not _fits(value, want):
                return False
        elif isinstance(want, list):
            if not isinstance(value, list) or not all(isinstance(v, tuple(want)) and not isinstance(v, bool)
                                                      and not (isinstance(v, int) and abs(v) > INT_MAX)
                                                      or v is None for v in value):
                return False
        elif want is bool:
            if not isinstance(value, bool):
                return False
        elif not isinstance(value, want) or (isinstance(value, bool) and want is not object):
            return False
    return True


def _prune(path: Path) -> None:
    bad = sorted(path.parent.glob(f"{path.name}.bad-*"))
    for old in bad[:-KEEP_BAD]:
        old.unlink(missing_ok=True)


def write_json(path: Path, data: object, mode: int = 0o644) -> None:
    """temp file + fsync + rename: a reader sees the old record or the new one, never half of one. On a full
    volume, the reserve podkit keeps there (keep_reserve) is given up and the write tried once more: the records
    a stop depends on (the loop bound's count, the trainer's end) get the last room there is."""
    try:
        _write_json(path, data, mode)
    except OSError as e:
        if e.errno != errno.ENOSPC or not release_reserve(Path(path).parent):
            raise
        _write_json(path, data, mode)


def _write_json(path: Path, data: object, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"  # two writing threads: two files
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- the records ------------------------------------------------------------------------------------------
# How the trainer's last run ended (ending.py: the kinds, the one writer and reader). `program` is the trainer
# program's pid (which run it ends); `asked` who asked for a stop; `where` the user's frame; `evidence` what the
# kind was decided on; `cut` a stop whose step in flight was cut; `last` the last end before a final stop.
STOPPED = {"by": str, "time": TIME, "step": int, "message": str, "hint": str, "program": int, "asked": str,
           "where": str, "evidence": [str], "cut": bool, "last": str, "rc": int, "signal": str, "started": TIME}


def at_step(step) -> str:
    """A record's step in words: "at step 3", or "before its first step" for a run that recorded none
    (a step is data: anything but a count reads as none)."""
    return f"at step {step}" if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else \
        "before its first step"


def checkpoint_at(step) -> str:
    return f"last checkpoint at step {step}" if isinstance(step, int) and not isinstance(step, bool) and step > 0 \
        else "no checkpoint"
# A rank's exception, in the user's words (failure.py): one per rank in the run dir, the first kept below.
# `transient`: a network error that may pass (what it could not reach); `oom`: "GPU" or "host"; `unreachable`:
# inference, not answering the rollouts (areal/episodes.py's trip).
# `volume`: the errno of a volume that is full or failing; `checkpoint`: torch could not read a checkpoint;
# `base`: a BaseException's type; `through`: "train" when podkit's train() saw it (the script may catch it);
# `alloc_bytes`/`memory_bytes`: what a MemoryError asked for, and the machine's memory.
ERROR = {"type": str, "message": str, "where": str, "code": str, "traceback": str, "hint": str, "rank": int,
         "time": TIME, "transient": str, "oom": str, "unreachable": str, "volume": str, "checkpoint": bool,
         "base": str, "through": str, "alloc_bytes": int, "memory_bytes": int}
# Written by podkit boot (one item per boot; guard.py).
BOOTS = Record("boots.json", [{"time": TIME, "pid": int, "stages": dict, "outcome": str, "last_stop": str,
                               "reason": str, "traceback": str, "took_s": dict}])
# Written by the trainer (both kinds, through Progress below); read by status, health, watchdog, doctor.
PROGRESS = Record("progress.json", {"kind": str, "step": int, "time": TIME, "loss": NUMBER, "reward": NUMBER,
                                    "pid": int, "checkpoint_step": int, "weight_version": str,
                                    "checkpoint_time": TIME, "weight_update_s": NUMBER,
                                    "resumed_from": str, "resumed_at": int, "run": str, "stopped": STOPPED,
                                    "eval_reward": NUMBER, "eval_step": int,
                                    # AReaL: inference's log-probs against the trainer's (hooks.logp_gap)
                                    "logp_gap": {"max_abs": NUMBER, "avg": NUMBER},
                                    "on_policy_logp_gap": {"max_abs": NUMBER, "avg": NUMBER},
                                    # what trains: trainer.entry, the synced commit and whether the tree was dirty
                                    "code": {"entry": str, "commit": str, "dirty": bool},
                                    "first_step_time": TIME,
                                    # AReaL: rollout episodes that failed in the user's workflow (areal/episodes.py)
                                    "episodes": {"failed": int, "succeeded": int, "in_a_row": int, "limit": int,
                                                 "tripped": bool, "time": TIME,
                                                 "last": {"type": str, "message": str, "where": str, "code": str,
                                                          "hint": str},
                                                 # of them, AReaL's requests that never reached inference
                                                 "unreachable": str, "unreachable_failed": int,
                                                 "unreachable_in_a_row": int},
                                    # AReaL: inference restarts the trainer went on through (areal/reattach.py)
                                    "reattach": {"count": int, "fell_back": int,
                                                 "last": {"time": TIME, "outcome": str, "version": int,
                                                          "took_s": NUMBER, "why": str}}})
# Written by boot just before supervisord starts: where this pod's supervisord listens.
CURRENT = Record("current.json", {"run_dir": str, "socket": str, "supervisord_pid": int, "started": TIME,
                                  "inference": {"host": str, "port": int}})
SAFE_MODE = Record("safe-mode.json", {"stage": str, "message": str, "hint": str, "since": TIME, "pid": int,
                                      "traceback": str})
SYNC = Record("sync.json", {"changed": bool, "old": str, "new": str, "mode": str, "notes": [str], "time": TIME})
# The setup stage's environment for the trainer (setup.py), and in <workspace>/envs the last one built.
SETUP = Record("setup.json", {"key": str, "python": str, "command": str, "commit": str, "time": TIME,
                              "fallback": bool})
LAST_GOOD_SETUP = Record("last-good.json", {"env": str, "time": TIME})
RESUME = Record("resume.json", {"time": TIME})
# The trainer's loop bound (loopbound.py): its ends in a row without a new step, in this boot, one count per
# ending.COUNTS (failures: the script's; hangs; ooms; outside: not the script's); the run in flight (`running`
# since, by `program`, the OOM kill count then); every start's time and the last ends, for status and doctor.
TRAINER_LOOP = Record("trainer-loop.json", {"boot": NUMBER, "failures": int, "best_step": int, "last_failure": TIME,
                                            "outside": int, "hangs": int, "ooms": int, "running": TIME,
                                            "program": int, "oom_kills": int, "gave_up": bool, "error": ERROR,
                                            "starts": int, "backoff_until": TIME, "started": [NUMBER],
                                            "phase": str, "ended_at": TIME,
                                            "ends": [dict], "told_restarts": bool, "volume": int,
                                            "resumed": TIME, "seq": int})
# A cluster node's `ray` program (areal/ray_node.py): starts in a row that did not join the head, in this boot.
RAY_LOOP = Record("ray-loop.json", {"boot": NUMBER, "failures": int, "last_failure": TIME, "gave_up": bool,
                                    "head": str, "why": str, "joined": TIME, "starts": int})
# `where`, `function`, `code`: a hang's frame in the user's code (stacks.user_frame), else the main thread's.
WATCHDOG = Record("watchdog.json", [{"time": TIME, "action": str, "program": str, "reason": str, "dump": str,
                                     "where": str, "function": str, "code": str}])
# In the run dir (local disk): the log listener's view of supervisord's programs, and the AReaL
# launcher's process groups.
PROGRAMS = Record("programs.json", {"_supervisord": int})
TORCHRUN = Record("torchrun.json", {"groups": list})  # [[pgid, start time], ...]; read with read_owned
# In the run dir while a rank writes a recover checkpoint (AReaL writes it in place): the launcher does not
# cut a stop's overrun then (areal/launch.py), or the last good checkpoint would be left half-written.
SAVING_PREFIX = "recover-saving-"
# Who belongs to this run, for the next boot to stop what a killed supervisord left running: the
# supervisord (boot writes it before the exec, which keeps pid and start time) and each program's
# process group (supervisord gives every program its own). Read with read_owned: they steer kills.
RAY_NODE = Record("ray-node.json", {"groups": list})  # this node's Ray workers' groups; read with read_owned
RUN = Record("run.json", {"supervisord": [int], "started": TIME})
GROUP_SHAPE = {"program": str, "pgid": int, "start": int}


def group(program: str) -> Record:
    return Record(f"group-{program}.json", GROUP_SHAPE)
# One workspace, one pod (lease.py writes it with link(2), not through Record.write).
# Its times stay plain numbers: another pod's clock is the lease's own question (lease.py), and a lease
# moved aside as bad would let a second pod in.
LEASE = Record("lease.json", {"host": str, "boot_id": str, "container": str, "pidns": str, "timens": str, "pid": int,
                              "start": int, "since": NUMBER, "renewed": NUMBER, "boottime": NUMBER, "beat": int,
                              "token": str})
# podkit's own parse of the pod config (config.py): trusted only when owned by this user (read_owned).
CONFIG_CACHE = Record("config-cache.json", {"key": list, "data": dict})
# A webhook that does not take notifications (notify.py): logged once, by whichever program saw it first.
NOTIFY = Record("notify.json", {"failing_since": TIME, "error": str})
# A multi-node run, as rank 0's launcher sees it: state, the nodes missing (rank, addr, since), restarts.
CLUSTER = Record("cluster.json", {"state": str, "since": TIME, "time": TIME, "why": str, "missing": list,
                                  "nodes": list, "run": str, "restarts": int})
CLUSTER_STOP = Record("cluster-stop.json", {"run": str, "time": TIME})  # every rank stops after its step
RANK_SHAPE = {"rank": int, "pid": int, "start": int, "host": str, "node": str, "run": str, "time": TIME}
# What this RunPod pod costs: the spend ledger (spend.advance; costguard.Meter writes it every guard.cost_every_s,
# ledger.cost() reads it checked): USD per hour and where that price came from, USD spent (None: unknown) and how
# sure ("billed" | "read" | "estimated" | "unknown", with why and since when), when the pod started, when this was
# looked, USD to the run's end at the trainer's pace, the pod and its run, USD its earlier starts spent, USD the
# run's earlier pods spent (a replacement carries them), the last bill, the last good read.
# `carried`: the earlier pods' parts, by pod; `total`: the run's spend across its pods (spend.run_total).
COST = Record("cost.json", {"per_hour": NUMBER, "spent": NUMBER, "source": str, "started": TIME, "time": TIME,
                            "projected": NUMBER, "pod": str, "before": NUMBER, "run": str, "run_before": NUMBER,
                            "carried_from": str, "bill": NUMBER, "read_at": TIME, "price_from": str, "why": str,
                            "since": TIME, "carried": dict,
                            # the last look's time on RunPod's clock, and whether the start is RunPod's or the boot's
                            "looked": NUMBER, "start_from": str,
                            "total": {"spent": NUMBER, "source": str, "why": str, "since": TIME, "per_hour": NUMBER,
                                      "pods": int, "parts": [dict], "time": TIME}})
# The log phases of this boot's first run of inference, kept once seen (startup.keep): the boot's timeline.
STARTUP = Record("startup.json", {"boot": TIME, "phases": dict})
STATE_RECORDS = (BOOTS, PROGRESS, CURRENT, SAFE_MODE, SYNC, RESUME, WATCHDOG, NOTIFY, CLUSTER, TRAINER_LOOP,
                 RAY_LOOP, COST, STARTUP)


class Progress:
    """The trainer's progress record (`progress.json`): the fake trainer and rank 0 of the AReaL
    trainer both write it through this, so status, health, the watchdog and the guard read one shape.
    `time` is the time of the last step; a write that fails (a full or read-only volume) is logged
    once and training goes on."""

    def __init__(self, state_dir: Path, kind: str) -> None:
        self.state_dir = Path(state_dir)
        self.data: dict = {"kind": kind, "pid": os.getpid()}
        before = PROGRESS.read(self.state_dir)
        if isinstance(before.get("stopped"), dict):
            self.data["stopped"] = before["stopped"]  # the last run's end stays on record (ending.py reads it)
        # The start-up timeline ends at this boot's first step, not at each trainer restart's.
        first = before.get("first_step_time")
        booted = CURRENT.read(self.state_dir).get("started")
        if isinstance(first, (int, float)) and isinstance(booted, (int, float)) and first >= booted:
            self.data["first_step_time"] = first
        self.failed = False
        self.lock = threading.RLock()  # rank 0's step hook and its re-attacher (areal/reattach.py) both write


    def update(self, **fields) -> bool:
        with self.lock:
            return self._update(fields)

    def _update(self, fields: dict) -> bool:
        if "step" in fields:
            fields.setdefault("time", time.time())
        if fields.get("checkpoint_step") is not None and fields["checkpoint_step"] != self.data.get("checkpoint_step"):
            fields.setdefault("checkpoint_time", time.time())  # written, or loaded by this process
        self.data.update(fields)
        try:
            PROGRESS.write(self.state_dir, self.data)
        except OSError as e:
            if not self.failed:
                log.get("trainer").error(f"cannot record progress ({e.strerror}); training goes on")
            self.failed = True
            return False
        self.failed = False
        return True

    def trained(self, **fields) -> bool:
        """A step this process trained (not one it resumed at): the first one ends the start-up timeline."""
        self.data.setdefault("first_step_time", time.time())
        return self.update(**fields)


# -- the trainer's per-step history (the page's pictures: page.py) -------------------------------------------------
class History:
    """`history.jsonl`: one JSON line per step, {"step", "time", "reward", "loss"}, appended by the trainer after
    each step (the fake trainer; rank 0 of AReaL's, areal/hooks.py) and read by the page.

    Bounded: at most MAX_LINES lines (~750 KB). Past that, the writer compacts the file (temp + rename, so a
    reader sees the old file or the new one): the older lines keep every other step of what they held, the newest
    quarter stays whole (_compact). A run of any length fits, evenly along its steps, with its last steps one by
    one. Read like every other record: at most the last READ_BYTES, a partial or bad line skipped. An append that
    fails (a full or read-only volume) is logged once and training goes on."""

    name = "history.jsonl"
    MAX_LINES = 10_000
    READ_BYTES = 2 << 20  # twice what MAX_LINES lines take: a file past it was not written by History alone
    MAX_LINE = 512  # a line of ours is ~75 bytes

    def __init__(self) -> None:
        self.lines: dict[Path, int] = {}  # this process's count of each file's lines, read once
        self.failed = False
        self.lock = threading.Lock()  # rank 0's step hook is the one writer; the count must not tear

    def path(self, directory: Path) -> Path:
        return Path(directory) / self.name

    def append(self, directory: Path, step, reward=None, loss=None, now: float | None = None) -> bool:
        """One step's line; never raises for a value (what is not a number is written as null)."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= INT_MAX:
            return False
        line = json.dumps({"step": step, "time": round(time.time() if now is None else now, 3),
                           "reward": measure(reward), "loss": measure(loss)}, allow_nan=True) + "\n"
        path = self.path(directory)
        try:
            with self.lock:
                if path not in self.lines:
                    size, data = tail(path, self.READ_BYTES)
                    self.lines[path] = self.MAX_LINES + 1 if size > self.READ_BYTES else data.count(b"\n")
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
                self.lines[path] += 1
                if self.lines[path] > self.MAX_LINES:
                    self.lines[path] = self._compact(path)
        except OSError as e:
            if not self.failed:
                log.get("trainer").error(f"cannot append to {path} ({e.strerror}): the page's pictures miss these "
                                         "steps; training goes on")
            self.failed = True
            if self.lines.get(path, 0) > self.MAX_LINES:  # a compaction that failed is tried again a quarter later,
                self.lines[path] = self.MAX_LINES * 3 // 4  # not at every step
            return False
        return True

    def _compact(self, path: Path) -> int:
        """The older lines thinned to every other step of what they held (steps at a stride S, doubled until they
        fit in half the bound), the newest quarter whole, the first line kept: the picture of a whole run stays
        even along its steps, and its last steps stay one by one."""
        lines = whole_lines(tail(path, self.READ_BYTES)[1], self.MAX_LINE)
        recent = self.MAX_LINES // 4
        old, new = lines[:-recent], lines[-recent:]
        steps = [int(m.group(1)) if (m := _STEP.match(ln)) else -1 for ln in old]
        stride, top = 2, max(steps, default=0)
        # Step 0 (or a repeated step) is kept at every stride: the doubling ends once the stride passes the last step.
        while stride <= top and sum(1 for s in steps if s >= 0 and s % stride == 0) > self.MAX_LINES // 2:
            stride *= 2
        kept = old[:1] + [ln for ln, s in zip(old[1:], steps[1:], strict=True) if s >= 0 and s % stride == 0] + new
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(ln + b"\n" for ln in kept))
            os.replace(tmp, path)  # a line appended meanwhile would be lost: there is one writer, this one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return len(kept)

    def read(self, directory: Path) -> list[tuple[int, float, float | None, float | None]]:
        """The steps on record, as (step, time, reward, loss) in file order; a line that is not one is skipped."""
        return parse_history(tail(self.path(directory), self.READ_BYTES)[1], self.MAX_LINE)


_STEP = re.compile(rb'^\{"step": (\d{1,19})[,}]')


def read_end(path: Path, max_bytes: int, offset: int = 0, follow: bool = False) -> tuple[int, int, bytes]:
    """(where the bytes start, the file's size, its bytes from `offset` on, at most the last max_bytes of them).
    Only a regular file is read (a pipe or /dev/zero put in its place would block or fill memory), never through
    a link unless `follow`; (0, 0, b"") when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError:
        return 0, 0, b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0, 0, b""
        start = os.lseek(fd, max(offset, st.st_size - max_bytes), os.SEEK_SET)
        data = b""
        while len(data) < max_bytes and (chunk := os.read(fd, max_bytes - len(data))):
            data += chunk
        return start, st.st_size, data
    except OSError:
        return 0, 0, b""
    finally:
        os.close(fd)


def tail(path: Path, max_bytes: int, offset: int = 0) -> tuple[int, bytes]:
    """(the file's size, its bytes from `offset` on, at most the last max_bytes of them, from a whole line): a
    regular file only, never followed through a link; (0, b"") when there is none."""
    start, size, data = read_end(path, max_bytes, offset)
    if start > offset:  # cut inside the file: its first line is a part of one
        data = data.split(b"\n", 1)[1] if b"\n" in data else b""
    return size, data


def whole_lines(data: bytes, max_line: int) -> list[bytes]:
    """The lines that may be ours: ended by a newline (the last, unended, may still be being written), one
    JSON object each, not too long."""
    return [ln for ln in data.split(b"\n")[:-1] if 2 <= len(ln) <= max_line and ln[:1] == b"{" and ln[-1:] == b"}"]


_NUMBER = rb"(-?[0-9][0-9.eE+-]{0,30}|null|NaN|-?Infinity)"
_LINE = re.compile(rb'\{"step": ([0-9]{1,19}), "time": ([0-9][0-9.eE+-]{0,30}), "reward": ' + _NUMBER +
                   rb', "loss": ' + _NUMBER + rb"\}")  # the appender's own form: read without json's cost


def parse_history(data: bytes, max_line: int = History.MAX_LINE) -> list:
    """(step, time, reward, loss) of each line of `data` that is a step; any other line is skipped."""
    out = []
    future = time.time() + FUTURE_SKEW_S
    for ln in whole_lines(data, max_line):
        m = _LINE.fullmatch(ln)
        try:
            if m:
                step, t = int(m.group(1)), float(m.group(2))
                reward, loss = (None if v == b"null" else float(v) for v in m.group(3, 4))
            else:
                d = json.loads(ln)
                if not isinstance(d, dict):
                    continue
                step, t, reward, loss = d.get("step"), d.get("time"), measure(d.get("reward")), measure(d.get("loss"))
        except (ValueError, RecursionError):
            continue
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= INT_MAX \
                or not isinstance(t, NUMBER) or isinstance(t, bool) or not 0 <= t <= future:
            continue
        out.append((step, float(t), reward, loss))
    return out


def measure(v) -> float | None:
    """A reward or a loss as the history keeps it: a float to 6 significant digits (NaN and infinity kept: a
    diverged loss), or None for what is not a number."""
    if v is None or isinstance(v, (bool, str, bytes)):
        return None
    try:
        return float(f"{float(v):.6g}")
    except Exception:  # noqa: BLE001 - a value of any type (a tensor of many elements): never what stops training
        return None


HISTORY = History()
# The checkpoint remote (remote.py): the last upload's outcome, and the last whole one's.
_UPLOAD = {"outcome": str, "step": int, "why": str, "time": TIME, "bytes": int, "took_s": NUMBER, "where": str,
           "lineage": str}
# "final": the last checkpoint at the pod's stop (outcome uploaded, failed, none; uploading: cut by the stop's kill);
# "lease": this pod's hold on the run's lease on the remote (held; blocked: another pod holds it, `why` names it).
# "lineage": the run's lineage this pod uploads into and restores from (runrecord.py: `count` lineages in all).
# "restore": the boot's restore (restoring, restored, failed, refused, none), with its bytes `done` of `total`.
# "ahead": the remote holds a newer whole generation of this lineage than the trainer started from.
REMOTE = Record("remote.json", {"last": _UPLOAD, "uploaded": _UPLOAD, "final": _UPLOAD,
                                "lease": {"outcome": str, "why": str, "time": TIME},
                                "restore": {"outcome": str, "step": int, "why": str, "time": TIME, "where": str,
                                            "got": int, "total": int, "began": TIME},
                                "lineage": {"id": str, "why": str, "since": TIME, "count": int},
                                "ahead": {"step": int, "where": str, "time": TIME, "from": int},
                                "run": str})  # the run (experiment/trial) the record is of


# -- room for podkit's own records on a full volume ------------------------------------------------------------------
# A file of zeros in the state dir, given up (removed) the moment one of podkit's records cannot be written for want
# of space, and made again (keep_reserve, each minute by the log listener and at each boot) once the volume has room.
RESERVE = ".podkit-reserve"
RESERVE_BYTES = 4 << 20


def release_reserve(directory: Path, levels: int = 3) -> bool:
    """Give up the reserve of the state dir `directory` is in (itself or up to `levels` above it); True when there
    was one to give up."""
    here = Path(directory)
    for _ in range(levels + 1):
        try:
            os.unlink(here / RESERVE)
        except FileNotFoundError:
            here = here.parent
            continue
        except OSError:
            return False
        _log.warn(f"the volume is full: podkit gave up its reserve ({here / RESERVE}) for its own records")
        return True
    return False


def keep_reserve(state_dir: Path, size: int = RESERVE_BYTES) -> bool:
    """Make the reserve when it is missing and the volume has room for it and as much again; True when there is one.
    Never raises: a reserve is a help, not a need."""
    path = Path(state_dir) / RESERVE
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size >= size:
            return True
        if not stat.S_ISREG(st.st_mode):
            return False  # something else put there: not ours to replace
    except FileNotFoundError:
        pass
    except OSError:
        return False
    tmp = path.with_name(f".{RESERVE}.{os.getpid()}.tmp")
    try:
        fs = os.statvfs(state_dir)
        if fs.f_bavail * fs.f_frsize < 2 * size:
            return False
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, bytes(size))  # written, not sparse: the room is taken now
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def kept(record: Record, state_dir: Path, run_dir: Path | None):
    """`record` as the newest of the volume's copy and the one kept in the run dir (local disk) while the volume could
    not take it (a full volume): by their write count `seq`."""
    vol = record.read(state_dir)
    if run_dir is None:
        return vol
    local = record.read(run_dir)
    n = lambda r: r.get("seq") if isinstance(r.get("seq"), int) and not isinstance(r.get("seq"), bool) else -1  # noqa
    return local if local and n(local) > n(vol) else vol
