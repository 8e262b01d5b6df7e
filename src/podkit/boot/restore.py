"""The restore stage: a volume without this run's checkpoint, or with an older one than the newest whole generation
of the run's current lineage on the remote (remote.py, runrecord.py), gets that generation before the trainer starts.

The generation is downloaded to a temp directory beside the checkpoint, checked file by file against its
manifest (size and sha256), then renamed into place: a restore cut at any point leaves no half checkpoint.
Another run's generation (its identity differs: identity.differences) is never restored, nor one of a lineage the
run left (`podkit start-over`). The stage does not give up at the first fault, and does not hang:

- every read of the remote (the run's record, a listing, a manifest) is bounded by CALL_S, and one that fails is
  tried again with back-off until `checkpoint.restore_timeout_s` has passed since the stage began;
- a download is bounded by its progress (no byte for STALL_S: cut, tried again) and by checkpoint.remote_timeout_s;
- a generation removed while it is downloaded (the old pod's prune) sends the restore back to a new listing, for the
  newest whole generation then;
- while it downloads, remote.json says "restoring step N from <where> (x of y MB)" for `podkit status` and the page.

A restore that fails never stops the boot: the trainer starts from what the volume has, and the run says it did so
without the remote's newest (remote.json "restore", the run's record "restores"). Only a `checkpoint.remote` that
is not a remote at all is a config error.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from podkit import log
from podkit.errors import ConfigError

_log = log.get("restore")
CALL_S = 60.0  # one read of the remote: a hung endpoint costs this, not checkpoint.remote_timeout_s
STALL_S = 60.0  # a download that moves no byte for this long is cut and tried again
BACKOFF_S = (2.0, 4.0, 8.0, 15.0, 30.0)  # between two tries of a read that failed (the last one repeats)
GONE_MAX = 5  # generations removed under a download, in a row, before the restore gives up
PROGRESS_S = 2.0  # remote.json's progress is written this often during a download
TEMP = re.compile(r"^\.(.+)\.restore-gen-\d+-(\d+)$")


class Gone(Exception):
    """The generation being read was removed meanwhile (another pod of the run pruned it)."""


def run(cfg) -> int | None:
    """The stage: the step restored, or None (nothing to restore, or a failure said in the log)."""
    if not cfg.checkpoint.remote:
        return None
    # rclone, hashing and temp dirs: only for a pod with a remote (the boot path's imports are pinned)
    from podkit.remote import remote

    try:
        remote.parse(cfg.checkpoint.remote)
    except ValueError as e:
        raise ConfigError(cfg.origin("checkpoint.remote"), "checkpoint.remote", str(e),
                          hint="s3://bucket/prefix (credentials in AWS_*), an rclone remote name:path configured by "
                               "RCLONE_CONFIG_<NAME>_* env vars, or rclone's connection string "
                               ":backend,option=value:path; empty: no remote") from None
    if cfg.multi_node and cfg.cluster.rank != 0:
        _log.info(f"node rank {cfg.cluster.rank}: rank 0's boot restores the run's checkpoint")
        return None
    run_id = remote.run_id(cfg)
    if not run_id:
        _log.warn("the run's names are AReaL's to tell (a Hydra default or an interpolation) and no trainer has said "
                  "them on this volume yet: nothing restored; set trainer.experiment and trainer.trial to restore "
                  "from checkpoint.remote")
        return None
    return Restore(cfg, remote.Remote(cfg.checkpoint.remote, run_id, cfg.checkpoint.remote_timeout_s)).run()


class Restore:
    """One restore at boot, from `rem` (the run's remote, any lineage: the run's record says which is current)."""

    def __init__(self, cfg, rem, clock=time.monotonic, sleep=time.sleep) -> None:
        from podkit.remote import remote

        self.cfg, self.rem, self.clock, self.sleep = cfg, rem, clock, sleep
        self.book = remote.book(cfg, rem)
        self.begun = clock()
        self.until = self.begun + cfg.checkpoint.restore_timeout_s
        self.here = remote.local(cfg)
        self.mine = remote.mine(cfg)
        self.lineage = ""
        self.gone = 0

    def call_s(self) -> float:
        return max(1.0, min(CALL_S, self.until - self.clock()))

    def run(self) -> int | None:
        # rclone's module, shutil, threading: only with a remote (the boot path's imports are pinned)
        from podkit.remote import remote
        from podkit.remote.mover import RemoteError

        here = self.here
        if here.step is None and here.kind == "areal" and remote.identity.has_checkpoint(here.root):
            _log.info(f"{here.root} holds a recover checkpoint whose step podkit cannot read: kept, nothing restored")
            return None
        for p in clear_dead_temps(here.root):
            _log.info(f"removed {p}, the half download of an earlier boot's restore that was killed")
        tries, last = 0, ""
        while True:
            try:
                return self._once()
            except KeyboardInterrupt:  # `podkit restore`'s Ctrl-C: never left saying "restoring"
                self._say("failed", None, why="interrupted (Ctrl-C)")
                raise
            except Gone as e:
                self.gone += 1
                last = str(e)
                if self.gone < GONE_MAX:
                    _log.info(f"{e}: listing the remote again for its newest whole generation")
                    continue
                last += f" ({self.gone} times in a row: another pod of the run prunes faster than this pod downloads)"
            except NoRoom as e:
                return self._gave_up(str(e), tries=None)
            except (RemoteError, OSError) as e:
                last = str(e) if isinstance(e, RemoteError) else f"{e.strerror or e}"
                wait = BACKOFF_S[min(tries, len(BACKOFF_S) - 1)]
                left = self.until - self.clock()
                if left > wait and not getattr(e, "lasting", False):
                    tries += 1
                    _log.warn(f"the remote could not be read ({last}): trying again in {wait:g} s "
                              f"({left:.0f} s left of checkpoint.restore_timeout_s)")
                    self._say("retrying", None, why=last)
                    self.sleep(wait)
                    continue
            return self._gave_up(last, tries)

    def _once(self) -> int | None:
        from podkit.remote import remote, runrecord
        from podkit.remote.mover import RemoteError

        if self.book is not None and not self.book.sync(self.call_s()):
            raise RemoteError(self.book.problem, lasting=self.book.lasting)
        self.lineage, entry = runrecord.decide(self.book, self.mine, self.here.root, self._first_identity,
                                               say=_log.warn) if self.book is not None else ("", None)
        rem = self.rem.of_lineage(self.lineage)
        count = runrecord.ours_count(self.book.entries("lineage"), self.mine, self.here.root) if self.book else 1
        remote.note(self.cfg, lineage={"id": self.lineage, "why": (entry or {}).get("why") or "first",
                                         "since": (entry or {}).get("time"), "count": count})
        here = self.here
        was = remote.lineage_of(here) if here.step is not None else None
        if was is not None and was != self.lineage:  # a lineage the run left (a start-over on another pod)
            self.here = here = self._set_aside(here, was)
        listing = rem.listing(timeout=self.call_s())
        for step in sorted(listing, reverse=True):
            where = rem.where(remote.gen(step))
            if here.step is not None and step <= here.step:
                _log.info(f"the volume has the checkpoint of step {here.step}; the remote's newest is step {step}: "
                          "nothing to restore")
                self._say("none", None)
                return None
            if not listing[step]:
                _log.warn(f"{where} has no manifest (an upload that did not finish): not a checkpoint, skipped")
                continue
            manifest = rem.manifest(step, strict=True, timeout=self.call_s())
            if manifest is None:
                if not rem.listing(timeout=self.call_s()).get(step):
                    raise Gone(f"{where} was removed while it was read")
                _log.warn(f"{where} has a manifest podkit cannot read: not a checkpoint, skipped")
                continue
            if manifest.get("kind") != here.kind:
                _log.warn(f"{where} is a {manifest.get('kind')} trainer's checkpoint, this run's trainer is "
                          f"{here.kind}: not restored")
                continue
            theirs = manifest.get("identity")
            diffs = remote.identity.differences(self.mine, theirs, here.root) if remote.identity.is_record(theirs) \
                else ["its manifest does not say which run trained it"]
            if diffs:
                _log.warn(f"{where} is another run's checkpoint ({'; '.join(diffs)}): not restored; {remote.WAYS_ON}")
                self._say("refused", step, why="; ".join(diffs), where=where)
                continue
            if self._fetch(rem, step, manifest):
                return step
        if here.step is None:
            _log.info(f"no whole generation of this run on {rem.where()}: the trainer starts from step 0")
        self._say("none", None)
        return None

    def _set_aside(self, here, was: str):
        """The volume's checkpoint is of a lineage the run left: moved aside (kept, never deleted), as start-over
        moves it, and the volume taken as holding none."""
        from podkit.remote import remote

        aside = here.root.with_name(f"{here.root.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(here.root, aside)
        _log.warn(f"the checkpoint on the volume (step {here.step}) is of the lineage {was or 'the first'}, which the "
                  f"run left (a start-over or adopt since, on this pod or another): moved aside to {aside} (kept: "
                  "move it back and `podkit adopt` to make its line the run's); the run's lineage is "
                  f"{self.lineage or 'the first'}")
        return remote.local(self.cfg)

    def _first_identity(self) -> dict | None:
        """Who trained the newest whole generation at the top of the names' prefix (the first lineage), or None."""
        top = self.rem.of_lineage("")
        for step, whole in sorted(top.listing(timeout=self.call_s()).items(), reverse=True):
            m = top.manifest(step, strict=True, timeout=self.call_s()) if whole else None
            if m is not None:
                from podkit.areal import identity

                return m.get("identity") if identity.is_record(m.get("identity")) else None
        return None

    def _fetch(self, rem, step: int, manifest: dict) -> bool:
        import shutil
        import threading

        from podkit.remote import remote
        from podkit.remote.mover import RemoteError

        here, where = self.here, rem.where(remote.gen(step))
        total = sum(f["size"] for f in manifest["files"].values())
        tmp = temp_beside(here.root, step)
        free = shutil.disk_usage(tmp.parent).free
        if free < total:
            raise NoRoom(f"the volume has no room for the checkpoint of step {step} ({total / 1e6:.1f} MB, "
                         f"{free / 1e6:.1f} MB free at {tmp.parent}): free space on the volume, or give the pod a "
                         "larger one")
        t0, began = self.clock(), time.time()
        self._say("restoring", step, where=where, got=0, total=total, began=began)
        stop = threading.Event()

        def watch() -> None:  # progress for status, and a download that stalls is cut
            moved, last, said = self.clock(), -1, 0.0
            while not stop.wait(0.5):
                done = _size(tmp)
                if done != last:
                    moved, last = self.clock(), done
                if self.clock() - said >= PROGRESS_S:
                    said = self.clock()
                    self._say("restoring", step, where=where, got=done, total=total, began=began)
                if self.clock() - moved > STALL_S:
                    rem.cut(time.monotonic(), f"the download of {where} stalled: no byte in {STALL_S:g} s")
                    return
        watcher = threading.Thread(target=watch, name="podkit-restore-progress", daemon=True)
        watcher.start()
        try:
            try:
                rem.download(step, tmp)
            except RemoteError:
                stop.set()
                rem.cut(None)
                if shutil.disk_usage(tmp.parent).free < max(0, total - _size(tmp)) + (1 << 20):
                    raise NoRoom(f"the volume filled during the restore of step {step} ({total / 1e6:.1f} MB): "
                                 "free space on the volume, or give the pod a larger one") from None
                if not rem.listing(timeout=self.call_s()).get(step):
                    raise Gone(f"{where} was removed while it was downloaded") from None
                raise
            finally:
                stop.set()
                watcher.join()
                rem.cut(None)
            problem = verify(tmp, manifest)
            if problem:
                if not rem.listing(timeout=self.call_s()).get(step):
                    raise Gone(f"{where} was removed while it was downloaded")
                _log.warn(f"{where} refused: {problem}; trying an older generation")
                self._say("refused", step, why=problem, where=where)
                return False
            _place(here, tmp, manifest)
            remote.mark_lineage(here, self.lineage)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # what is left of our own download, never the checkpoint
        _log.info(f"restored the checkpoint of step {step} from {where} ({total / 1e6:.1f} MB in "
                  f"{self.clock() - t0:.1f} s): the trainer resumes from it")
        self._say("restored", step, where=where, got=total, total=total, began=began)
        return True

    def _gave_up(self, why: str, tries: int | None) -> None:

        here = f"the checkpoint of step {self.here.step} on the volume" if self.here.step is not None else "step 0"
        took = f" after {self.clock() - self.begun:.0f} s and {tries + 1} tries (checkpoint.restore_timeout_s " \
            f"{self.cfg.checkpoint.restore_timeout_s:g} s)" if tries is not None else ""
        _log.warn(f"no checkpoint restored from {self.rem.where(root=True)}{took}: {why}. The trainer starts from "
                  f"{here}, WITHOUT the remote's newest: status says so until the remote is read again")
        self._say("failed", None, why=why)
        return None

    def _say(self, outcome: str, step: int | None, why: str = "", **more) -> None:
        """remote.json's restore, for status and the page; the run's record gets each restore's outcome."""
        from podkit.remote import remote

        fields = {"outcome": outcome, "step": step, "why": why[:600], "time": time.time(), **more}
        remote.note(self.cfg, restore=fields)
        if outcome in ("restored", "failed") and self.book is not None:
            try:
                self.book.add("restores", {"outcome": outcome, "step": step, "why": why[:600],
                                           "lineage": self.lineage, "from": self.here.step,
                                           "where": more.get("where") or ""}, push_s=min(10.0, self.call_s()))
            except OSError:
                pass  # the volume: remote.json says it, if anything can


class NoRoom(Exception):
    """The volume has no room for the generation: not the remote's fault, and no try again helps."""


def _size(root: Path) -> int:
    total = 0
    for top, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return total


def temp_beside(target: Path, step: int) -> Path:
    import shutil

    from podkit.remote import remote

    tmp = target.parent / f".{target.name}.restore-{remote.gen(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # our own temp of an earlier boot with this pid: never a checkpoint
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def clear_dead_temps(target: Path) -> list[Path]:
    """The half downloads of earlier boots' restores (their temp beside the checkpoint, named by their pid) whose
    process is gone: each the size of a checkpoint, never one (a restore renames only a whole one into place)."""
    import shutil

    from podkit.remote.checkpoint import _pid_alive

    out = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return out
    for n in names:
        m = TEMP.match(n)
        p = target.parent / n
        if m and m.group(1) == target.name and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))) \
                and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            out.append(p)
    return out


def verify(root: Path, manifest: dict) -> str:
    """'' when every file the manifest names is under root with its size and sha256; else what is not."""
    from podkit.remote.remote import sha256

    for rel, want in manifest["files"].items():
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"{rel} has {p.stat().st_size} bytes, its manifest {want['size']}"
        if sha256(p) != want["sha256"]:
            return f"{rel} does not match its manifest's sha256 (corrupt on the remote or in transit)"
    return ""


def _place(here, tmp: Path, manifest: dict) -> None:
    """Renames only, on the volume's own filesystem: the checkpoint is there whole, or not at all."""
    if here.kind == "fake":
        here.root.mkdir(parents=True, exist_ok=True)
        for rel in manifest["files"]:
            os.replace(tmp / rel, here.root / rel)
        name = next(iter(manifest["files"]))
        pointer = here.root / f".latest.tmp-{os.getpid()}"
        pointer.write_text(name + "\n")
        os.replace(pointer, here.root / "latest")
        return
    if here.root.exists():  # an older checkpoint of this run: kept beside, never deleted
        aside = here.root.with_name(f"{here.root.name}.before-restore-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(here.root, aside)
        _log.info(f"the older checkpoint (step {here.step}) moved aside to {aside}")
    os.rename(tmp, here.root)
