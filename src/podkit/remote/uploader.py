"""The uploader: a thread of the log listener (programs/logs.py) that puts each new whole checkpoint of the run
onto the remote (remote.py) as a generation of the run's current lineage (runrecord.py), holds the run's lease
there (remotelease.py), and puts the last checkpoint up when the pod stops (Uploader.final), claiming only what it
verified."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.areal import identity
from podkit.remote import mover, runrecord, snapshot
from podkit.remote.remote import (
    Local,
    Remote,
    RemoteError,
    book,
    gen,
    lineage_of,
    local,
    mark_lineage,
    mine,
    names,
    note,
    ours,
    run_id,
)

_log = log.get("remote")
RETRY_S = 300.0  # a failed step is tried again after this, or as soon as a newer one is saved
# The lease seen ours this recently is not read again before a copy (the read before the manifest is the one that
# keeps two pods out of one generation): an rclone start less per upload beside the trainer.
FRESH_S = 10.0
SYNC_S = 300.0  # the run's record is synced this often while uploading (another pod's start-over, this pod's entries)
PUSH_S = 30.0  # this pod's entries that did not reach the remote are tried again this often (an rclone start each)


class Uploader:
    """Uploads each new whole checkpoint, one at a time, newest first: it looks at progress.json's
    checkpoint_step (written by the trainer once a checkpoint is whole) every `poll_s`, and uploads what the
    volume holds then, so the steps saved during an upload are skipped for the newest. The trainer never waits
    on it. Runs in the log listener (programs/logs.py), the long-lived program that outlives trainer restarts
    and stops last. It uploads only while it holds the run's lease on the remote (remotelease.py): a second pod
    of the run uploads nothing meanwhile. `final` puts the last checkpoint up when the pod stops."""

    def __init__(self, cfg, say=None) -> None:
        from podkit.remote import remotelease

        self.cfg = cfg
        self.say = say or (lambda line: _log.info(line.removeprefix("[podkit:remote] ")))
        self.remote = Remote(cfg.checkpoint.remote, run_id(cfg), cfg.checkpoint.remote_timeout_s)
        self.lease = remotelease.RemoteLease(self.remote, cfg.guard.lease_s)
        self.done: int | None = None  # the newest step whole on the remote, as far as this process knows
        self.stopped = threading.Event()
        self.failed: tuple[int, float] | None = None  # (step, when) of the last failed upload
        self.lock = threading.Lock()  # one upload at a time: the loop's, or the final one
        self.inflight: int | None = None  # the step uploading now
        self.why = ""  # why the last look uploaded nothing, when it had a checkpoint to upload
        self.blocked = ""  # who holds the run's lease, while another pod does: said once per holder
        self.began = -float("inf")  # time.monotonic() of the last upload's start (checkpoint.remote_every_s)
        self.book = None  # the run's record (runrecord.py), once the run's names are known
        self.lineage: str | None = None  # the lineage uploaded into (runrecord.decide), once decided
        self.verified: set[int] = set()  # the steps whose whole generation of this lineage is there, read or written
        self.ahead: int | None = None  # the lineage's newest on the remote, while newer than this pod's checkpoint
        self.unread = ""  # why the remote could not be read: said once per reason
        self.nice = 0  # the priority of this look's rclone calls (mover.NICE beside a training trainer)
        self.pushed = -float("inf")  # time.monotonic() of the last push of entries the remote missed
        self.freezer = snapshot.Freezer(cfg, lambda: local(cfg))  # what goes up: a snapshot, whole whatever saves

    def start(self) -> Uploader:
        try:
            self.freezer.clear()  # a killed uploader's staging
        except OSError as e:
            self.say(f"[podkit:remote] an earlier upload's staging could not be removed ({e})")
        threading.Thread(target=self.loop, name="podkit-remote", daemon=True).start()
        return self

    def loop(self) -> None:
        while not self.stopped.wait(self.cfg.checkpoint.remote_poll_s):
            try:
                if time.monotonic() - self.began >= self.cfg.checkpoint.remote_every_s:
                    self.once()
                self.renew()
            except Exception as e:  # noqa: BLE001 - the uploader never takes the listener down
                self.say(f"[podkit:remote] upload failed: {e}; trying again at the next checkpoint")

    def renew(self) -> None:
        """The run's lease renewed when due while this uploader holds it: another pod sees it change, so live."""
        if self.lease.token and time.monotonic() - self.lease.renewed >= self.lease.renew_s:
            with self.lock:
                if not self.stopped.is_set() and (who := self.lease.hold()):
                    self._blocked(who)

    # -- which run, which lineage -----------------------------------------------------------------------------------
    def _bind(self) -> bool:
        """The remote and the lease of the run's current lineage: the names AReaL resolved (remote.names), the
        lineage the run's record says (a start-over on this pod or another one moves the uploads to the new
        lineage at the next look). False, with `why`, while there is nothing to upload into yet."""
        found = names(self.cfg)
        if found is None:
            self.why = ("the run's names are not known yet: AReaL tells them when the trainer starts (checkpoints go "
                        "up from then)")
            return False
        if self.book is None or self.book.names != found:
            cut = self.remote._cut  # the stop's deadline, set before this look
            self.remote = Remote(self.cfg.checkpoint.remote, "/".join(found), self.cfg.checkpoint.remote_timeout_s)
            self.remote._cut, self.remote.nice = cut, self.nice
            self.book, self.lineage = book(self.cfg, self.remote), None
        here = local(self.cfg)
        mine_ = here.record or mine(self.cfg)
        if self.lineage is None:
            if not self.book.sync():
                self._unreadable(self.book.problem)
                return False
            try:
                lineage, _ = runrecord.decide(self.book, mine_, here.root, self._first_identity,
                                              say=lambda m: self.say(f"[podkit:remote] {m}"))
            except (RemoteError, OSError) as e:
                self.why = f"the run's lineage could not be told ({e})"
                return False
            if self.book.unpushed:  # the lineage just claimed (or begun): up now, not at a later look's cost
                self.pushed = time.monotonic()
                self.book.push()
        else:
            cur = runrecord.current(self.book.entries("lineage"), mine_, here.root)
            lineage = cur["id"] if cur is not None else self.lineage
            now = time.monotonic()
            if now - self.book.synced >= SYNC_S:  # another pod's start-over; this pod's entries up
                self.book.sync()
                self.book.synced = now  # failed or not: not again before SYNC_S
            elif self.book.unpushed and now - self.pushed >= PUSH_S:  # a start-over the remote missed, at once
                self.pushed = now
                self.book.push()
        if lineage != self.lineage:
            self._rebind(lineage, here.root, mine_)
        if self.book.remote is not None and "lineage" in self.book.unpushed_kinds() and not self.book.push():
            # a lineage entry only this volume has (a start-over while the remote was down): a generation uploaded
            # into it, and claimed at the stop, would be one no pod without this volume finds
            self.why = (f"the run's lineage {self.lineage or 'the first'} is not on the remote yet "
                        f"({self.book.problem}): nothing is uploaded into it until it is")
            if self.why != self.unread:
                self.unread = self.why
                self.say(f"[podkit:remote] {self.why}")
            return False
        return True

    def _rebind(self, lineage: str, root: Path, mine_: dict) -> None:
        before = self.lineage
        if before is not None and self.lease.token:
            try:
                self.lease.release()  # the abandoned lineage's lease: nobody uploads there now
            except RemoteError:
                pass
        self.remote = self.remote.of_lineage(lineage)
        self.lease.rebind(self.remote, mine_)  # the lineage's own lease, as this run (its identity) holds it
        self.lineage, self.done, self.verified, self.ahead = lineage, None, set(), None
        entries = self.book.entries("lineage")
        cur = runrecord.current(entries, mine_, root)
        note(self.cfg, lineage={"id": lineage, "why": (cur or {}).get("why") or "first",
                                "since": (cur or {}).get("time"), "count": runrecord.ours_count(entries, mine_, root)})
        if before is not None:
            self.say(f"[podkit:remote] the run began a new lineage ({lineage or 'the first'}, "
                     f"{(cur or {}).get('why') or 'first'}): checkpoints go to {self.remote.where()}; the abandoned "
                     "lineage's generations are kept there, never restored")

    def _first_identity(self) -> dict | None:
        """Who trained the newest whole generation of the first lineage (the top of the names' prefix), or None."""
        top = self.remote.of_lineage("")
        for step, whole in sorted(top.listing().items(), reverse=True):
            m = top.manifest(step, strict=True) if whole else None
            if m is not None:
                return m.get("identity") if identity.is_record(m.get("identity")) else None
        return None

    def _ours(self, ckpt: Local) -> bool:
        """Whether the volume's checkpoint is of the lineage this pod uploads into: one that does not say yet (the
        trainer's own) is marked as of it; one of a lineage the run left (a start-over on another pod while this one
        trains) is not uploaded, said once."""
        was = lineage_of(ckpt)
        if was is None:
            try:
                mark_lineage(ckpt, self.lineage or "")
            except OSError:
                pass  # a read-only or full volume: unmarked, it is taken as this lineage's at each look
            return True
        if was == self.lineage:
            return True
        why = (f"the checkpoint on this volume (step {ckpt.step}) is of the lineage {was or 'the first'}, which the run "
               f"left (a start-over or adopt on another pod): not uploaded into {self.lineage or 'the first'}. This "
               "pod trains a line the run abandoned: stop it, or `podkit adopt` to make its line the run's")
        if why != self.unread:  # said once
            self.unread = why
            self.say(f"[podkit:remote] {why}")
        self.why = why
        return False

    def _unreadable(self, why: str) -> None:
        """The remote could not be read before an upload: recorded for the checkpoint waiting (status names the
        failure), said once per reason."""
        self.why = why
        step = local(self.cfg).step
        if step is not None:
            _record(self.cfg, {"lineage": self.lineage or "", "outcome": "failed", "step": step, "why": why, "time": time.time()})
        if why != self.unread:
            self.unread = why
            self.say(f"[podkit:remote] nothing uploaded: {why}; trying again at the next look")

    def _learn(self) -> None:
        """What this lineage has on the remote already (never uploaded again), and whether it is ahead of this pod."""
        here = local(self.cfg)
        probe = Local(self.cfg.trainer.kind, here.root, None, [], here.record or mine(self.cfg))
        whole = self.remote.whole_of(ours(probe))
        self.verified, self.done = set(whole), (whole[0] if whole else 0)
        self.unread = ""
        if whole and (here.step is None or here.step < whole[0]):
            self._ahead(here.step)
            return
        noted = records.REMOTE.read(self.cfg.state_dir)
        if self.ahead is not None or noted.get("ahead"):
            self.ahead = None
            note(self.cfg, ahead=None)
        if (noted.get("restore") or {}).get("outcome") in ("failed", "retrying", "restoring"):
            # the remote is read now, and holds nothing newer of this lineage than this pod: the boot's restore that
            # gave up (or was cut) lost nothing; said, and no longer shown
            note(self.cfg, restore={**noted["restore"], "outcome": "resolved", "time": time.time()})
            self.say("[podkit:remote] the remote answers again and holds nothing newer of this lineage than this pod's "
                     f"checkpoint ({'none' if here.step is None else f'step {here.step}'}): the boot's restore lost "
                     "nothing")

    def _ahead(self, step: int | None) -> None:
        """The lineage's newest whole generation is newer than this pod's checkpoint (`step`): this pod trained from
        an older one (a restore that could not read the remote, another pod of the run ahead). Its steps are not
        uploaded under the lineage's newer one; said once, and shown until it is resolved."""
        where = self.remote.where(gen(self.done))
        self.why = (f"the remote holds a newer checkpoint of this lineage (step {self.done}, {where}) than this pod's "
                    f"({'none' if step is None else f'step {step}'}): this pod's steps are not uploaded under it")
        if self.ahead != self.done:
            self.ahead = self.done
            note(self.cfg, ahead={"step": self.done, "where": where, "time": time.time(), "from": step})
            self.say(f"[podkit:remote] {self.why}. To train on from step {self.done}: `podkit ctl stop trainer`, "
                     "`podkit restore`, `podkit ctl start trainer`; to make this pod's line the run's instead: "
                     "`podkit adopt` (a new lineage from this pod's checkpoint)")

    def _part(self, other: dict) -> None:
        """Another run holds this lineage's lease (it came under the same names and prefix): this run begins a
        lineage of its own, so that neither blocks nor overwrites the other."""
        here = local(self.cfg)
        mine_ = here.record or mine(self.cfg)
        entry = runrecord.begin(self.book, mine_, "another-run", push_s=0, other=runrecord.describe(other))
        self.say(f"[podkit:remote] another run ({runrecord.describe(other)}) uses this prefix "
                 f"({self.remote.where(root=True)}): give this run its own names (trainer.experiment / trainer.trial) "
                 f"or prefix (checkpoint.remote); meanwhile its checkpoints go to a lineage of their own "
                 f"({entry['id']}), and neither run blocks the other")
        self._rebind(entry["id"], here.root, mine_)

    def moved(self, step: int) -> str:
        """Why the volume's checkpoint is no longer the whole one of `step` ("" while it is): AReaL writes its
        recover checkpoint in place, with a marker in the run dir while a rank writes (areal/hooks.py). The fake
        trainer writes each step to a file of its own: a newer one leaves the older whole (the hashes say if not)."""
        if self.cfg.trainer.kind != "areal":
            return ""
        if any(Path(self.cfg.run_path).glob(records.SAVING_PREFIX + "*")):
            return "a save of the recover checkpoint is in flight"
        now = local(self.cfg).step
        return "" if now == step else f"the checkpoint on the volume is now step {now}"

    def once(self, final: bool = False) -> int | None:
        """Upload the volume's checkpoint if it is newer than the remote's newest; the step uploaded, or None (and
        `why`, when there was one to upload). `final`: the trainer has exited; its checkpoint is taken without
        progress.json's word and without waiting RETRY_S after a failure."""
        with self.lock:
            return self._once(final)

    def _once(self, final: bool) -> int | None:
        self.why = ""
        if self.stopped.is_set() and not final:
            return None  # the listener's stop made the last upload: none after it
        self.nice = 0 if final else mover.NICE  # beside a training trainer, the upload (and every read) yields
        for rem in (self.remote, self.book and self.book.remote):
            if rem is not None:
                rem.nice = self.nice
        if not self._bind():
            return None
        if self.done is None:  # what this lineage has there already (read once per lineage)
            try:
                self._learn()
            except RemoteError as e:
                self._unreadable(f"the remote could not be read ({e})")
                return None
        if not final:
            progress = records.PROGRESS.read(self.cfg.state_dir)
            if not isinstance(progress.get("checkpoint_step"), int) or progress["checkpoint_step"] in self.verified:
                return None
        ckpt = local(self.cfg)
        if ckpt.step is None or not self._ours(ckpt) or ckpt.step in self.verified:
            return None
        if ckpt.step < (self.done or 0):
            self._ahead(ckpt.step)
            return None
        if why := self.moved(ckpt.step):
            self.why = why
            return None  # mid-save: the next look takes it whole
        if not final and self.failed and self.failed[0] == ckpt.step and time.monotonic() - self.failed[1] < RETRY_S:
            return None  # the same step failed moments ago (credentials, a missing bucket): said once per RETRY_S
        t0 = time.monotonic()
        self.inflight = ckpt.step
        try:
            if who := self.lease.hold(fresh_s=FRESH_S):
                if self.lease.other_run:  # another run under these names: this run takes a lineage of its own
                    self._part(self.lease.other_run)
                    return None
                self.why = who
                self._blocked(who)
                return None
            if self.blocked:
                self.blocked = ""
                self.say(f"[podkit:remote] this pod ({self.lease.pod}) holds the run's lease on the remote now: "
                         "uploads go on")
                _record_lease(self.cfg, "held", f"pod {self.lease.pod}")
            began, self.began = self.began, time.monotonic()
            try:
                snap = self.freezer.freeze(ckpt, final, self.remote.check, self.remote.nice)
            except snapshot.Unfrozen as e:
                self.why = str(e)
                if not e.spent:
                    self.began = began  # nothing copied in vain: the next look tries again
                if e.fast:  # said once a row, recorded each time
                    _record(self.cfg, {"lineage": self.lineage or "", "outcome": "failed", "step": ckpt.step, "why": str(e), "time": time.time()})
                    if e.first:
                        self.say(f"[podkit:remote] {e}")
                return None
            with snap:  # frozen: a save during the upload changes nothing that goes up, so it drops nothing
                ckpt = snap.ckpt
                self.inflight = ckpt.step
                if snap.note:
                    self.say(f"[podkit:remote] {snap.note}")
                moved = (lambda: "") if snap.frozen else (lambda: self.moved(ckpt.step))
                manifest = self.remote.upload(snap.local, moved, self.lease.hold)
        except (RemoteError, OSError) as e:
            self.why = str(e)
            _record(self.cfg, {"lineage": self.lineage or "", "outcome": "failed", "step": ckpt.step, "why": str(e), "time": time.time()})
            self.say(f"[podkit:remote] step {ckpt.step} not uploaded: {e}")
            self.failed = (ckpt.step, time.monotonic())
            return None
        finally:
            self.inflight = None
        self.done = max(ckpt.step, self.done or 0)
        self.verified.add(ckpt.step)
        size = sum(f["size"] for f in manifest["files"].values())
        took = time.monotonic() - t0
        try:
            gone = self.remote.prune(self.cfg.checkpoint.remote_keep, ours(ckpt))
        except RemoteError as e:
            gone = []
            self.say(f"[podkit:remote] older generations not removed: {e}")
        self.verified -= set(gone)
        if self.ahead is not None and ckpt.step > self.ahead:
            self.ahead = None
            note(self.cfg, ahead=None)  # this pod's line is the lineage's newest now
        _record(self.cfg, {"lineage": self.lineage or "", "outcome": "uploaded", "step": ckpt.step, "bytes": size, "took_s": took,
                           "time": time.time(), "where": self.remote.where(gen(ckpt.step))})
        self.say(f"[podkit:remote] checkpoint of step {ckpt.step} uploaded to {self.remote.where(gen(ckpt.step))} "
                 f"({size / 1e6:.1f} MB in {took:.1f} s)" + (f"; removed generations {gone}" if gone else ""))
        return ckpt.step

    def _blocked(self, who: str) -> None:
        if who != self.blocked:
            self.say(f"[podkit:remote] nothing uploaded: {who}. Two pods of one run never upload into one "
                     "generation: this pod uploads once that lease is released or has lapsed (unchanged for "
                     f"{self.lease.holder_lapse_s:g} s: guard.lease_s, or twice the holder's renewal and 5 s)")
            _record_lease(self.cfg, "blocked", who)
        self.blocked = who

    def final(self, within_s: float, why: str, limit: str = "checkpoint.remote_final_s",
              for_good: bool = False) -> str:
        """The last whole checkpoint on the volume onto the remote before the pod stops (`why`), within `within_s`
        (`limit` names what set it): an older step's upload in flight is given up for it, the same step's is
        waited for, whatever still runs at the deadline is cut. The pod's stop calls it once the trainer has
        exited (its last checkpoint written): the trainer never waits on it. Said, and recorded (records.REMOTE
        "final"): the step now on the remote, or the step that is not and why. `for_good` (the listener's own
        stop): nothing is uploaded after it. Returns the words."""
        until = time.monotonic() + max(0.0, within_s)
        if for_good:
            self.stopped.set()
        try:
            newest = local(self.cfg).step
        except OSError as e:
            return self._final(None, "failed", f"the volume's checkpoint cannot be read ({e.strerror})", why)
        if newest is None:
            return self._final(None, "none", "", why)
        if newest in self.verified and lineage_of(local(self.cfg)) in (None, self.lineage):  # read or written there
            return self._final(newest, "uploaded", "", why)
        cut = f"the final upload's deadline passed ({within_s:.1f} s: {limit})"
        if self.inflight is not None and self.inflight < newest:  # the newest wins, at the end too
            self.remote.cut(time.monotonic(), f"given up for step {newest}, the last, at the pod's stop")
        else:
            self.remote.cut(until, cut)
        _record_final(self.cfg, {"lineage": self.lineage or "", "outcome": "uploading", "step": newest, "why": why, "time": time.time()})
        # A cut call ends within one of rclone's 0.2-s slices: the lock is free by the deadline and that slice.
        if not self.lock.acquire(timeout=max(0.0, until - time.monotonic()) + 0.5):
            return self._final(newest, "failed", f"the upload in flight did not end by the deadline ({limit})", why)
        try:
            self.remote.cut(until, cut)
            if until - time.monotonic() <= 0:
                self.why = f"no time was left for it ({within_s:.1f} s: {limit})"
            elif self._once(final=True) is None and not self.why and newest not in self.verified:
                self.why = "nothing was uploaded (see the lines above)"
        finally:
            if not for_good:
                self.remote.cut(None)
            self.lock.release()
        if newest in self.verified:
            return self._final(newest, "uploaded", "", why)
        return self._final(newest, "failed", self.why, why)

    def _final(self, step: int | None, outcome: str, problem: str, why: str) -> str:
        where = self.remote.where(gen(step)) if step is not None and outcome == "uploaded" else ""
        if outcome == "none":
            words = "no checkpoint on the volume to upload"
        elif outcome == "uploaded":
            words = f"the last checkpoint, step {step}, is on the remote ({where})"
        else:
            newest = f"step {self.done}" if self.done else "none of this run's" if self.done == 0 else \
                "not known (the remote could not be read)"
            words = (f"the last checkpoint{f', step {step},' if step is not None else ''} is NOT on the remote: "
                     f"{problem}; the remote's newest whole generation of this lineage is {newest}")
        _record_final(self.cfg, {"lineage": self.lineage or "", "outcome": outcome, "step": step, "why": problem, "time": time.time(),
                                 "where": where or None})
        self.say(f"[podkit:remote] {why}: {words}")
        return words

    def release(self, within_s: float = 30.0) -> None:
        """The run's lease on the remote given up (the pod stops): the next pod of the run uploads at once."""
        try:
            self.remote.cut(time.monotonic() + within_s, "no time was left to release it")
            self.lease.release()
        except RemoteError as e:
            self.say(f"[podkit:remote] the run's lease on the remote was not released ({e}); it lapses by itself")


def _record(cfg, fields: dict) -> None:
    note(cfg, last=fields, **({"uploaded": fields} if fields["outcome"] == "uploaded" else {}))


def _record_final(cfg, fields: dict) -> None:
    note(cfg, final=fields)


def _record_lease(cfg, outcome: str, why: str) -> None:
    note(cfg, lease={"outcome": outcome, "why": why, "time": time.time()})
