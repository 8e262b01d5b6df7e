"""A checkpoint frozen for its upload: its files hard-linked, or copied, into a staging directory of the uploader's
own on the checkpoint's filesystem, so that the trainer's next saves change nothing of what goes up.

The fake trainer writes each step to a new file and prunes the older: a hard link keeps the bytes of the step
uploading however soon the trainer prunes it, at no copy. AReaL rewrites its recover checkpoint IN PLACE (the same
inodes): a link would change with it, so it is copied, while no save is in flight (records.SAVING_PREFIX markers in
the run dir, areal/hooks.py), and kept only if no save began meanwhile (its files' stamps and step unchanged from
before the copy to after it). A copy that would not leave room for the trainer's saves is not made.

Where it stages: <state dir>/.uploading/<pid>-<start>-<n>/ (hidden: the bug-report bundle skips it), or, where the
state dir is on another filesystem than the checkpoint, <the checkpoint root's parent>/.podkit-uploading/: never in a
checkpoint's own directory, and under no name that a checkpoint listing, a restore or `start-over` takes for a
checkpoint. Removed after each upload; one whose process is gone (a kill mid-upload) at the uploader's next start.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import shutil
import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.host import proc
from podkit.remote import mover

_log = log.get("remote")
HERE = ".uploading"  # under the state dir
BESIDE = ".podkit-uploading"  # beside the checkpoint root, where the state dir is on another filesystem
NAME = re.compile(r"^(\d+)-(\d+)-\d+$")  # <pid>-<start time>-<n>: the process that owns it, and its own count
TRIES = 3  # copies begun again after a save spoiled one, before a look gives up
LINK_TRIES = 5  # links tried again after the trainer pruned the step before it was linked (the newest then)
WAIT_S = 60.0  # how long a try after a spoiled copy waits for the save in flight to end
POLL_S = 0.05
MARGIN_B = 1 << 30  # what a copy leaves free on the volume, at least (the trainer's saves need it)...
MARGIN_SHARE = 0.05  # ...or this share of the volume, whichever is more
CHUNK = 64 << 20  # bytes copied between two looks at the stop's deadline
# link() refused: another filesystem, one without hard links, or protected_hardlinks: the files are copied.
NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES}
# copy_file_range refused (another filesystem on an older kernel, a filesystem without it): a plain copy.
NO_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}
_serial = itertools.count()


class Unfrozen(Exception):
    """The checkpoint could not be frozen whole for its upload: nothing of it is uploaded. `fast`: a save spoiled
    every try (the run saves faster than it can be uploaded: said once, recorded); else a save is in flight now and
    the next look takes it. `spent`: copies were made in vain (the uploader's cadence counts the look as an upload).
    `first`: the first of a row of such looks (the one to say)."""

    def __init__(self, why: str, fast: bool = False, spent: bool = False, first: bool = False) -> None:
        super().__init__(why)
        self.fast, self.spent, self.first = fast, spent, first


@dataclasses.dataclass
class Snapshot:
    """What goes up: `local` (a remote.Local) is `ckpt`'s files under `staging` when `frozen`, else `ckpt` itself
    (its upload checks the volume's files as they are). `ckpt` is the volume's checkpoint that was frozen: a newer one
    than the uploader looked at when that one went meanwhile. `note`: why it is not frozen, to say (once)."""

    ckpt: object
    local: object
    frozen: bool
    staging: Path | None = None
    note: str = ""

    def close(self) -> None:
        if self.staging is not None:
            _remove(self.staging)
            try:
                self.staging.parent.rmdir()  # the place too, once no upload stages there: no trace in .podkit/
            except OSError:
                pass

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class Freezer:
    """The uploader's snapshots of the run's checkpoint: `look()` is the volume's checkpoint now (remote.local)."""

    def __init__(self, cfg, look) -> None:
        self.cfg, self.look = cfg, look
        self.said: set[str] = set()  # what was said of a row of failures ("fast", "room"): said once a row
        self.cleared = False

    def saving(self) -> str:
        """Why the volume's checkpoint is being written now ("" when it is not)."""
        if self.cfg.trainer.kind == "areal" and any(Path(self.cfg.run_path).glob(records.SAVING_PREFIX + "*")):
            return "a save of the recover checkpoint is in flight"
        return ""

    def bases(self, root: Path) -> list[Path]:
        return [Path(self.cfg.state_dir) / HERE, Path(root).parent / BESIDE]

    def base(self, root: Path) -> Path:
        """Where to stage: the first place on the checkpoint's filesystem (links and reflinks work there)."""
        places = self.bases(root)
        try:
            dev = os.stat(root).st_dev
        except OSError:
            return places[0]
        return next((b for b in places if _device(b) == dev), places[0])

    def clear(self) -> list[Path]:
        """The staging dirs of uploaders that are gone (a kill mid-upload; by pid and start time, so a recycled pid
        is no owner) removed; a live process's kept. Returns those removed."""
        self.cleared = True
        try:
            places = self.bases(self.look().root)
        except Exception:  # noqa: BLE001 - the run's names not known yet: the state dir's place is the one
            places = [Path(self.cfg.state_dir) / HERE]
        removed = []
        for place in places:
            try:
                entries = list(place.iterdir())
            except OSError:
                continue
            for p in entries:
                m = NAME.match(p.name)
                if m and not p.is_symlink() and p.is_dir() and not proc.same_process(int(m[1]), int(m[2])):
                    _remove(p)
                    removed.append(p)
                    _log.info(f"removed {p}, the upload staging of an uploader that is gone")
        return removed

    def freeze(self, ckpt, final: bool = False, check=lambda: None, nice: int = 0) -> Snapshot:
        """`ckpt` (a remote.Local; the volume's newer one if that went meanwhile) frozen for its upload. The fake
        trainer's: linked (copied where links are refused); AReaL's: copied, whole. `final` (the trainer has exited:
        nothing rewrites it): never copied, uploaded as it is where it cannot be linked. Where a copy does not fit, the
        checkpoint as it is, with a note. `check()` raises at the stop's deadline; `nice`: the copy's priority.
        Raises Unfrozen when no whole snapshot could be taken."""
        if not self.cleared:
            self.clear()
        base = self.base(ckpt.root)
        staging = base / f"{os.getpid()}-{proc.starttime(os.getpid()) or 0}-{next(_serial)}"
        try:
            if ckpt.kind == "areal":
                snap = Snapshot(ckpt, ckpt, False) if final else self._copied(ckpt, staging, check, nice)
            else:
                snap = self._linked(ckpt, staging, final, check, nice)
        except BaseException:
            _remove(staging)
            raise
        if snap.frozen:
            self.said.clear()  # a row of failures ends
        return snap

    def _linked(self, ckpt, staging: Path, final: bool, check, nice: int) -> Snapshot:
        for _ in range(LINK_TRIES):
            _remove(staging)
            try:
                for rel in ckpt.files:
                    (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.link(ckpt.root / rel, staging / rel)
            except FileNotFoundError:  # pruned since the look: the newest now is taken
                newer = self.look()
                if newer.step is None:
                    raise Unfrozen(f"the checkpoint of step {ckpt.step} is no longer on the volume") from None
                ckpt = newer
                continue
            except OSError as e:
                if e.errno not in NO_LINK:
                    raise
                _remove(staging)
                return Snapshot(ckpt, ckpt, False) if final else self._copied(ckpt, staging, check, nice)
            return Snapshot(ckpt, dataclasses.replace(ckpt, root=staging), True, staging)
        raise self._fast(ckpt.step, f"step {ckpt.step} was pruned (trainer.keep_checkpoints) before it could be "
                                    f"linked for its upload, {LINK_TRIES} times in a row", spent=False)

    def _copied(self, ckpt, staging: Path, check, nice: int) -> Snapshot:
        from podkit.remote.remote import stamps  # remote imports this module

        took, spoiled = 0.0, ""
        for attempt in range(TRIES):
            if why := self._wait(check, WAIT_S if attempt else 0.0):
                if not attempt:
                    raise Unfrozen(why)  # as the uploader's look: the next one takes it whole
                spoiled = "a save was in flight"
                continue
            now = self.look()
            if now.step is None:
                raise Unfrozen("no checkpoint on the volume now")
            try:
                before = stamps(now.root, now.files)
            except FileNotFoundError:
                spoiled = "its files changed"
                continue
            if problem := room(staging.parent, sum(m[0] for m in before.values())):
                key = "room"
                note = "" if key in self.said else (
                    f"{problem}: step {now.step} goes up from the volume's files as they are, and a save during its "
                    "upload drops it (if the run saves faster than it uploads, nothing of it goes off the pod). "
                    "Free space on the volume, or make it larger")
                self.said.add(key)
                return Snapshot(now, now, False, note=note)
            t0 = time.monotonic()
            _remove(staging)
            try:
                _yielding(lambda n=now: _copy_all(n.root, n.files, staging, check), nice)
                # AReaL's next save rewrites these very files: it must not have begun (a newer step, whatever the
                # stamps' grain); the fake trainer's next one is a file of its own
                ok = not self.saving() and stamps(now.root, now.files) == before and (
                    now.kind != "areal" or _same(self.look(), now))
            except FileNotFoundError:  # a file replaced or removed by a save (or a prune) mid-copy
                ok = False
            took = time.monotonic() - t0
            if ok:
                return Snapshot(now, dataclasses.replace(now, root=staging), True, staging)
            ckpt, spoiled = now, "a save began"
            _remove(staging)
        raise self._fast(ckpt.step, f"{spoiled} during each of {TRIES} tries to copy step {ckpt.step} for its upload"
                         + (f", {took:.1f} s each" if took >= 0.1 else ""), spent=True)

    def _fast(self, step, what: str, spent: bool) -> Unfrozen:
        if self.cfg.trainer.kind == "areal":
            how = "save less often (AReaL's recover.freq_steps / freq_secs in the trainer's config)"
        else:
            how = "save less often (trainer.checkpoint_every) or keep more of them (trainer.keep_checkpoints)"
        first = "fast" not in self.said
        self.said.add("fast")
        return Unfrozen(f"the run saves checkpoints faster than they can be uploaded ({what}): nothing of it goes off "
                        f"the pod; {how}, or put the workspace on a faster volume", fast=True, spent=spent,
                        first=first)

    def _wait(self, check, within_s: float) -> str:
        """Why a save is in flight still after `within_s` ("" once none is)."""
        until = time.monotonic() + within_s
        while (why := self.saving()) and time.monotonic() < until:
            check()
            time.sleep(POLL_S)
        return why


def room(where: Path, need: int) -> str:
    """'' when a copy of `need` bytes on where's filesystem leaves the margin (MARGIN_B, MARGIN_SHARE) free for the
    trainer's saves; else why not, in the user's words."""
    usage = shutil.disk_usage(_existing(where))
    keep = max(MARGIN_B, int(usage.total * MARGIN_SHARE))
    if usage.free - need >= keep:
        return ""
    return (f"no room on the volume for a copy of the checkpoint to upload ({need / 1e9:.2f} GB; {usage.free / 1e9:.2f} "
            f"GB free, and a copy must leave {keep / 1e9:.2f} GB for the trainer's saves)")


def _same(a, b) -> bool:
    return a.step == b.step and a.files == b.files


def _copy_all(root: Path, files: list[str], into: Path, check) -> None:
    for rel in files:
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        copy_file(root / rel, into / rel, check)


def copy_file(src: Path, dst: Path, check=lambda: None) -> None:
    """One file's bytes: in the kernel (copy_file_range; a reflink where the filesystem shares blocks) in chunks, each
    followed by `check()` (a stop's deadline cuts it); a plain copy where the kernel refuses."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size = os.fstat(fi.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), min(CHUNK, size - done))
                if n == 0:
                    break  # truncated meanwhile: the stamps say so
                done += n
                check()
            return
        except OSError as e:
            if e.errno not in NO_RANGE:
                raise
        fi.seek(0)
        fo.seek(0)
        fo.truncate()
        while chunk := fi.read(8 << 20):
            fo.write(chunk)
            check()


def _yielding(fn, nice: int) -> None:
    """fn() on a thread of its own at the background uploads' priority (mover.yield_thread): the trainer first."""
    out: dict = {}

    def run() -> None:
        mover.yield_thread(nice)
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="podkit-remote-copy", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _device(path: Path) -> int | None:
    try:
        return os.stat(_existing(path)).st_dev
    except OSError:
        return None


def _remove(path: Path) -> None:
    """Our own staging dir, never a checkpoint (a link's removal leaves the checkpoint's own name whole)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
