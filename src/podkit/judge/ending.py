"""The trainer's end, in one room: what each way a trainer run (one start of the `trainer` program) can end
means, decided on evidence, not by an exit code alone.

KINDS is the one table of ends. Each kind has a family (FINISHED, FINAL: stopped for good, STOP: a stop that
was asked for, RESTART: one podkit wants, FAILURE, GONE), the loop bound's count it goes to (COUNTS), and
its words for status, doctor, metrics and the notification. The family decides the rest: the exit code
supervisord gets (`exit_code`), whether the cost guard may stop the pod (FINAL only; FINISHED has its own
guard), whether the watchdog may restart it (never after FINISHED). Adding a kind is a row here.

One writer (`write`: progress.json's `stopped` record), one reader (`read`, with one freshness rule: an end
counts for a run when it names that run's program, if it names one, and was recorded since the moment
asked about), and one judge (`judge`) for the single-pod launcher, a cluster's launcher and the fake
trainer alike. The judge reads, in order: the end the trainer recorded itself (finished, refused), the stop
this program was asked for (its SIGTERM, with who asked: `podkit ctl`, the pod's stop, `podkit up`, the cost
guard), a rank's own exception (in the user's words; a network error before training is transient; CUDA's
out of memory), then the kernel's word on a rank that ended without one (the cgroup's OOM kill count,
the signal torchrun saw) and inference's state under the run. A run whose program was killed before it
could judge (the watchdog's hang restart, the OOM killer, supervisord's SIGKILL) is judged at the next
start (`judge_killed`) from the same evidence and the watchdog's record.

No torch or AReaL here: the launcher, the fake trainer, status, doctor and metrics all read it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

from podkit import records

# -- the table -------------------------------------------------------------------------------------------------
FINISHED, FINAL, STOP, RESTART, FAILURE, GONE = "finished", "final", "stop", "restart", "failure", "gone"


class Count:
    """One of the loop bound's counts of ends in a row without a new step (trainer-loop.json's `key`),
    bounded at `factor` x trainer.max_failures; reaching it writes the `final` kind. `what`: "the trainer
    <what> 3 times in a row"."""

    __slots__ = ("key", "factor", "final", "what")

    def __init__(self, key: str, factor: int, final: str, what: str) -> None:
        self.key, self.factor, self.final, self.what = key, factor, final, what


class Kind:
    """One way a trainer run ends: `name` (progress.json's stopped.by), its family, its words for status ("the
    trainer <words> at step 3"), the count of COUNTS it goes to (None: never counted), doctor's id and title
    for a final kind, and the fix when the record names none of its own."""

    __slots__ = ("name", "family", "words", "counts", "finding", "title", "fix")

    def __init__(self, name: str, family: str, words: str, counts: str | None = None, finding: str = "",
                 title: str = "", fix: str = "") -> None:
        self.name, self.family, self.words, self.counts = name, family, words, counts
        self.finding, self.title, self.fix = finding, title, fix


DONE, MAX_STEPS = "done", "max_steps"
CONFIG_ERROR, NEVER_TRAINED, ENDED_EARLY = "config-error", "never-trained", "ended-early"
CRASH_LOOP, HANG_LOOP, OOM_LOOP, OUTSIDE_LOOP = "crash-loop", "hang-loop", "oom-loop", "outside-loop"
SIGTERM, STRAY, STALE, LEASE_LOST, ENDED = "SIGTERM", "stray SIGTERM", "stale-weights", "lease-lost", "no-record"
FAILED, OOM, HANG, NETWORK = "script-error", "out-of-memory", "hung", "network-error"
INFERENCE, KILLED, INFERENCE_STOPPED = "inference-down", "killed-by-signal", "inference-stopped"
VOLUME, VOLUME_LOOP, SHM, CHECKPOINT = "volume-error", "volume-loop", "shared-memory", "checkpoint-unloadable"

_REPO_FIX = "`podkit resume` once it is fixed"  # completed per place by fix_for()
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(DONE, FINISHED, "finished its run"),
    Kind(MAX_STEPS, FINISHED, "finished (trainer.max_steps)"),
    Kind(CONFIG_ERROR, FINAL, "stopped for good: its config or code cannot train", None, "trainer_config_error",
         "the trainer's config or code cannot train: the trainer is stopped, not looping",
         "fix trainer.overrides (a key missing from the YAML needs hydra's +key=value) or trainer.areal_config"),
    Kind(NEVER_TRAINED, FINAL, "stopped for good: the script ended without training", None, "trainer_never_trained",
         "your script never trained: it ended without calling PPOTrainer.train"),
    Kind(ENDED_EARLY, FINAL, "stopped for good: your script ended training itself (exit 0 inside train()) before its "
         "last step", None, "trainer_ended_early", "your script ended training before its last step (exit 0 inside "
         "train())", "nothing to do if that is its early stop; else the exit 0 at the line named is why, and "
         + "`podkit resume` once it is fixed"),
    Kind(CRASH_LOOP, FINAL, "stopped for good by the loop bound (trainer.max_failures): your script failed again "
         "and again", None, "trainer_crash_loop",
         "your script failed again and again without a new step: the loop bound stopped the trainer"),
    Kind(HANG_LOOP, FINAL, "stopped for good by the loop bound (trainer.max_failures): it hung again and again",
         None, "trainer_hang_loop", "the trainer hung again and again without a new step: the loop bound stopped it"),
    Kind(OOM_LOOP, FINAL, "stopped for good by the loop bound (trainer.max_failures): it ran out of memory again "
         "and again", None, "trainer_oom_loop",
         "the trainer ran out of memory again and again without a new step: the loop bound stopped it",
         "a smaller batch or sequence length (train_dataset.batch_size, gconfig.max_new_tokens, "
         "actor.mb_spec.max_tokens_per_mb), or a pod with more memory"),
    Kind(OUTSIDE_LOOP, FINAL, "stopped for good: it could not run, again and again, for a cause outside your script",
         None, "trainer_could_not_run",
         "the trainer could not run again and again, for a cause outside your script: the loop bound stopped it"),
    Kind(VOLUME_LOOP, FINAL, "stopped for good: the volume is full or failing (not your script)", None,
         "trainer_volume", "the volume is full or failing: the trainer could not write (or read) it, again and again",
         "free space on the volume (`du -sh /workspace/*`: old checkpoints, caches) or give the pod a bigger one; "
         "an I/O error or a stale handle is the host's disk or the network volume: move the pod"),
    Kind(CHECKPOINT, FINAL, "stopped for good: its recover checkpoint cannot be loaded (not your script)", None,
         "trainer_checkpoint_unloadable",
         "the recover checkpoint cannot be loaded (cut in the middle of its save, or damaged): every start would "
         "fail on it", "`podkit start-over` moves the checkpoint aside (kept, never deleted) and trains from "
         "step 0; or put a whole copy of it back in its place"),
    Kind(SIGTERM, STOP, "stopped on request"),
    # Nobody asked podkit (someone's kill): counted as a cause outside the script when it comes again with no new
    # step, so that a script (or a neighbour) that signals its ranks at every start is bounded, with a back-off
    Kind(STRAY, STOP, "stopped by a SIGTERM that supervisord did not send, and restarted to resume", "outside"),
    Kind(STALE, RESTART, "stopped after a step to push its weights to a restarted inference server, and restarted"),
    Kind(LEASE_LOST, GONE, "stopped: another pod holds the workspace now"),
    Kind(ENDED, GONE, "ended with exit 0 and no record of why"),
    Kind(INFERENCE_STOPPED, RESTART, "ended while inference was stopped on request; it waits for inference"),
    Kind(FAILED, FAILURE, "failed", "script"),
    Kind(OOM, FAILURE, "ran out of memory", "oom"),
    Kind(HANG, FAILURE, "hung, and the watchdog restarted it", "hang"),
    Kind(NETWORK, FAILURE, "could not reach a service it needs (a network error)", "outside"),
    Kind(INFERENCE, FAILURE, "ended while inference was restarted or down", "outside"),
    Kind(KILLED, FAILURE, "was killed by a signal podkit did not send", "outside"),
    Kind(VOLUME, FAILURE, "hit a volume that is full or failing (not your script)", "volume"),
    Kind(SHM, FAILURE, "crashed with SIGBUS: shared memory (/dev/shm) ran out, or a driver fault (not your script)",
         "outside"),
)}
COUNTS = {"script": Count("failures", 1, CRASH_LOOP, "failed"), "hang": Count("hangs", 1, HANG_LOOP, "hung"),
          "oom": Count("ooms", 1, OOM_LOOP, "ran out of memory"),
          "volume": Count("volume", 1, VOLUME_LOOP, "found the volume full or failing"),
          # inference down, a network error, a kill: not the script's, so three times the bound
          "outside": Count("outside", 3, OUTSIDE_LOOP, "could not run")}
FINISHED_KINDS = tuple(k.name for k in KINDS.values() if k.family == FINISHED)
FINAL_KINDS = tuple(k.name for k in KINDS.values() if k.family == FINAL)


def kind(name) -> Kind:
    """The kind named `name`; a name podkit does not know (another version's, a planted one) reads as a
    failure of unknown cause, never as finished or final."""
    return KINDS.get(name) if isinstance(name, str) and name in KINDS else \
        Kind(str(name)[:40], FAILURE, f"ended ({str(name)[:40]})")


# -- one writer --------------------------------------------------------------------------------------------------
# The trainer program's pid, inherited by torchrun and the ranks: an end names the run it is the end of.
PROGRAM_ENV = "_PODKIT_TRAINER_PROGRAM"  # not PODKIT_: config would warn of an unknown setting


def program() -> int | None:
    v = os.environ.get(PROGRAM_ENV, "")
    return int(v) if v.isdigit() and 0 < int(v) < 1 << 31 else None


def record(by: str, message: str = "", hint: str = "", step=None, **fields) -> dict:
    rec = {"by": by, "time": time.time(), "step": step, "message": str(message)[:2000], "hint": str(hint)[:1000],
           "program": program(), **fields}
    return {k: v for k, v in rec.items() if v not in (None, "", [])}


def write(state_dir: Path, by: str, message: str = "", hint: str = "", progress=None, **fields) -> dict:
    """A new end of kind `by`, stored (below). The step is the progress record's unless given."""
    if "step" not in fields:
        fields["step"] = (progress.data if progress is not None else records.PROGRESS.read(state_dir)).get("step")
    return store(state_dir, record(by, message, hint, **fields), progress)


def store(state_dir: Path, rec: dict, progress=None) -> dict:
    """The one writer of progress.json's `stopped`: how the trainer's last run ended, only the fields its shape
    declares (records.STOPPED). Through `progress` (the records.Progress this process keeps writing) when there
    is one, so that its next write keeps it; else read, changed and written back. A write that fails (a full
    volume) is let go: the log says it too."""
    rec = {k: v for k, v in rec.items() if k in records.STOPPED and v is not None}
    try:
        if progress is not None:
            if progress.update(stopped=rec) is False:  # not written (it said why): kept off the volume
                keep(rec, state_dir)
        else:
            prog = records.PROGRESS.read(state_dir)
            prog["stopped"] = rec
            records.PROGRESS.write(state_dir, prog)
    except OSError:
        keep(rec, state_dir)
    return rec


# Where an end the volume could not take (full, failing) is kept: the run dir (local disk), named by the trainer
# program for itself and its ranks. The log listener puts it on the volume once it has room (flush_kept); until
# then every reader of the end reads both (read_kept), so a stop never waits on a write that failed.
KEEP_ENV = "_PODKIT_END_KEPT_IN"
KEPT = records.Record("trainer-end.json", records.STOPPED)


def _mark(rec) -> str:
    """An end as who wrote it when: what a kept end was written over (never compared as times: a clock steps)."""
    return f"{rec.get('by')}|{rec.get('time')}|{rec.get('program')}" if isinstance(rec, dict) and rec else ""


def keep(rec: dict, state_dir: Path | None = None) -> None:
    """`rec` into the run dir, with the volume's end it was meant to replace (`over`): it is the newer one for as
    long as the volume still holds that end, whatever the clocks say."""
    where = os.environ.get(KEEP_ENV, "")
    if not where:
        return
    over = _mark(records.PROGRESS.read(state_dir).get("stopped")) if state_dir is not None else ""
    try:
        KEPT.write(Path(where), {**rec, "over": over}, mode=0o600)
    except OSError:
        pass


def _kept(run_dir: Path | None, vol) -> dict | None:
    """The run dir's end, only while the volume's end is still the one it was written over."""
    local = KEPT.read_owned(run_dir) if run_dir is not None else {}
    if not local or not isinstance(local.get("over"), str) or local["over"] != _mark(vol):
        return None
    return {k: v for k, v in local.items() if k != "over"}


def read_kept(state_dir: Path, run_dir: Path | None) -> dict | None:
    """The trainer's last end, raw: the volume's, or the one kept in the run dir while the volume could not take it
    (as long as nothing newer reached the volume since)."""
    vol = records.PROGRESS.read(state_dir).get("stopped")
    return _kept(run_dir, vol) or vol


def flush_kept(state_dir: Path, run_dir: Path) -> bool:
    """An end kept in the run dir, put on the volume (it has room again) unless a newer one reached it since; True
    when there is none left to put."""
    if not KEPT.read_owned(run_dir):
        return True
    prog = records.PROGRESS.read(state_dir)
    local = _kept(run_dir, prog.get("stopped"))
    try:
        if local is not None:
            prog["stopped"] = local
            records.PROGRESS.write(state_dir, prog)
        os.unlink(KEPT.path(run_dir))
        return True
    except OSError:
        return False


# -- one reader --------------------------------------------------------------------------------------------------
class End:
    """One recorded end, read as data."""

    def __init__(self, rec: dict, stored: bool = False) -> None:
        self.rec, self.stored = rec, stored  # stored: read from progress.json, not judged from evidence
        self.kind = kind(rec.get("by"))

    def __getattr__(self, name):  # by, time, step, message, hint, asked, where, ...: the record's, or None
        if name.startswith("_") or name in ("rec", "stored", "kind"):
            raise AttributeError(name)
        return self.rec.get(name)

    @property
    def family(self) -> str:
        return self.kind.family

    def first(self) -> str:
        lines = str(self.rec.get("message") or "").strip().splitlines()
        return lines[0] if lines else ""

    def words(self) -> str:
        """What happened, for a person: "stopped by you (podkit ctl restart trainer)", "failed: KeyError ..."."""
        k = self.kind
        if k.name in (SIGTERM, STRAY) and self.rec.get("asked"):
            out = f"stopped by {self.rec['asked']}"
            if k.name == STRAY:
                out += ", and restarted to resume"
        elif k.family == FAILURE and self.first():
            out = f"{k.words}: {self.first()}"
        else:
            out = k.words
        if self.rec.get("cut"):
            out += " (its step in flight was cut at the end of trainer.stop_grace_s: no recover checkpoint for it)"
        return out

    def said(self) -> str:
        """status's line: "the trainer finished its run at step 3"."""
        return f"the trainer {self.words()} {records.at_step(self.rec.get('step'))}"


FUTURE_S = 60.0  # an end stamped further ahead than this is not one (a planted record, another node's clock)


def of(rec, since: float | None = None, program_pid: int | None = None, now: float | None = None) -> End | None:
    """`rec` (a `stopped` record) as an End if it is one and fresh: recorded at or after `since`, and, when both
    name one, by the program `program_pid`. supervisord's start times are whole seconds, rounded down: a
    record made after a start is never older than it."""
    if not isinstance(rec, dict) or not isinstance(rec.get("by"), str):
        return None
    t = rec.get("time")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    if since is not None and t < since or t > (time.time() if now is None else now) + FUTURE_S:
        return None  # older than the run asked about; or stamped ahead of this clock (planted, or another's)
    named = rec.get("program")
    if program_pid is not None and isinstance(named, int) and not isinstance(named, bool) and named != program_pid:
        return None
    return End(rec, stored=True)


def read(state_dir: Path, since: float | None = None, program_pid: int | None = None,
         run_dir: Path | None = None) -> End | None:
    return of(read_kept(state_dir, run_dir), since, program_pid)


# -- who asked for a stop ----------------------------------------------------------------------------------------
# Who asked supervisord to stop a program, written by whoever asks (podkit ctl, podkit up, the cost guard, the
# watchdog) just before; the trainer program reads it when its SIGTERM comes, to name the asker.
ASKED = records.Record("stop-asked.json", [{"program": str, "by": str, "time": records.TIME, "kind": str}])
# The trainer program's own note of a SIGTERM it got, for its next start should it be killed before it judged.
RECEIVED = records.Record("trainer-stop.json", {"pid": int, "start": int, "time": records.TIME, "by": str,
                                                "supervisord": bool})
ASKED_FRESH_S = 120.0  # an ask older than this before the SIGTERM is not its cause


ASKED_KEEP_S = 86400.0


def ask(run_dir: Path, programs: list[str], by: str, kind: str = "") -> None:
    """Say who is about to ask supervisord to stop `programs` ("all" for every one), and, when the stop is not
    a stop but the end of a kind of its own (the watchdog's restart of a hung trainer: HANG), which. Never
    raises: the stop matters more than the words about it."""
    try:
        asked = [a for a in ASKED.read_owned(run_dir) if time.time() - (a.get("time") or 0) < ASKED_KEEP_S][-20:]
        asked += [{"program": p, "by": by, "time": time.time(), **({"kind": kind} if kind else {})} for p in programs]
        ASKED.write(run_dir, asked, mode=0o600)
    except OSError:
        pass


def _asks(run_dir: Path, name: str, at: float | None = None, since: float | None = None) -> list[dict]:
    return [a for a in ASKED.read_owned(run_dir) if a.get("program") in (name, "all")
            and (at is None or at - ASKED_FRESH_S <= (a.get("time") or 0) <= at + 5)
            and (since is None or (a.get("time") or 0) >= since)]


def asked_by(run_dir: Path, name: str, at: float | None = None, since: float | None = None) -> str:
    """Who said they asked for `name`'s stop: within ASKED_FRESH_S before `at` (a SIGTERM's time), since `since`,
    or the last one of all (inference waited for since its stop); "" when nobody did."""
    found = _asks(run_dir, name, at, since)
    return str(found[-1]["by"])[:200] if found else ""


class Asked:
    """A stop this program was asked for: when its SIGTERM (or SIGINT) came, who asked, whether supervisord was
    the one stopping it (then it stays stopped; else it is restarted to resume), and the kind the asker said it
    was when it was no plain stop (HANG)."""

    def __init__(self, at: float, by: str, supervisord: bool, kind: str = "") -> None:
        self.at, self.by, self.supervisord, self.kind = at, by, supervisord, kind


def who_asked(socket_path, run_dir: Path, name: str, at: float, since: float | None = None) -> Asked:
    """supervisord's word (it marks a program STOPPING before it signals it, and refuses every call once it
    shuts down) and the asker's own note: one made since `since` (the program's start; an ask before it was
    for the instance before, whose stop it already named)."""
    from podkit.host import supervisord

    try:
        state = supervisord.rpc(socket_path).supervisor.getProcessInfo(name)["statename"]
    except Exception as e:  # noqa: BLE001 - a fault, a socket error: what it says is the evidence
        state = "SHUTDOWN" if getattr(e, "faultCode", None) == supervisord.SHUTDOWN_STATE_FAULT else \
            "NO-SUPERVISORD" if isinstance(e, OSError) else "?"
    notes = _asks(run_dir, name, at, since)
    note, kind = (str(notes[-1]["by"])[:200], notes[-1].get("kind") or "") if notes else ("", "")
    if state == supervisord.STOPPING:
        return Asked(at, note or "supervisord (podkit ctl or supervisorctl)", True, kind if kind == HANG else "")
    if state == "SHUTDOWN":
        return Asked(at, note or "the pod's stop (docker stop, a RunPod stop or migration)", True)
    if state == "NO-SUPERVISORD":  # a bare `podkit run trainer`: whoever runs it asked
        return Asked(at, note or "whoever runs this program (no supervisord)", True)
    return Asked(at, "a SIGTERM that supervisord did not send (someone's kill)", False)


# The launcher's note that it handed a stop signal to the ranks (launch.supervise): a rank's SIGTERM is then the
# stop that was asked for; without it, it is torchrun's own (its teardown after another rank failed).
FORWARDED = records.Record("stop-forwarded.json", {"time": records.TIME})


def forwarded(run_dir: Path, since: float) -> bool:
    t = FORWARDED.read_owned(run_dir).get("time")
    return isinstance(t, (int, float)) and since - 1 <= t <= time.time() + 1


class Stop(BaseException):
    """Raised in the trainer program by its SIGTERM before torchrun runs (or in the fake trainer's wait):
    nothing is in flight, so the program ends at once. A BaseException: a user's `except Exception` around
    code that runs before training does not swallow it."""


class Signals:
    """This trainer program's stop signal, from its first line (programs.run): when it came, who asked, and what
    to do with it: hand it on (the launcher's forward, to the ranks) or end the program (raise Stop)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.asked: Asked | None = None
        self.forward = None  # set while torchrun runs (launch.supervise): the signal goes to the ranks
        self.cut = False  # the launcher cut the ranks at the end of the stop's grace
        self.cfg = None
        self.started = 0.0  # this program's first line: an ask made before it was for the instance before
        self.lock = threading.Lock()

    def install(self, cfg) -> None:
        self.cfg, self.started = cfg, time.time()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)

    def on_signal(self, sig, frame) -> None:
        first = self.at is None
        if first:
            self.at = time.time()
            # Who asked, noted in a thread (an RPC and a file write do not belong in a signal handler): if
            # this program is killed before it judges its end, its next start reads the note.
            threading.Thread(target=self.resolve, name="stop-asked", daemon=True).start()
        if self.forward is not None:
            return self.forward(sig, frame)
        raise Stop()

    def resolve(self) -> Asked | None:
        """Who asked (once), noted in the run dir."""
        with self.lock:
            if self.asked is None and self.at is not None and self.cfg is not None:
                from podkit.host import proc

                self.asked = who_asked(self.cfg.socket_path, Path(self.cfg.run_path), "trainer", self.at,
                                       self.started or None)
                try:
                    RECEIVED.write(self.cfg.run_path, {"pid": os.getpid(), "start": proc.starttime(os.getpid()) or 0,
                                                       "time": self.at, "by": self.asked.by,
                                                       "supervisord": self.asked.supervisord}, mode=0o600)
                except OSError:
                    pass
            return self.asked


SIGNALS = Signals()


# -- the kernel's evidence ---------------------------------------------------------------------------------------
CGROUP_ENV = "_PODKIT_CGROUP_ROOT"  # where cgroupfs is mounted; tests point it elsewhere


def oom_kills(pid: int | str = "self") -> tuple[int, str] | None:
    """(the OOM killer's kill count in this process's memory cgroup, the file it was read from), or None where
    there is none to read. cgroup v2: memory.events `oom_kill`; v1: memory.oom_control `oom_kill`. Both count
    the cgroup's descendants: the launcher's count covers its ranks."""
    root = Path(os.environ.get(CGROUP_ENV) or "/sys/fs/cgroup")
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "":
            places.append(root / path / "memory.events")
        elif "memory" in parts[1].split(","):
            places.append(root / "memory" / path / "memory.oom_control")
    places += [root / "memory.events", root / "memory" / "memory.oom_control"]  # a cgroup namespace's root
    for place in places:
        try:
            text = place.read_text()[:4096]
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value.strip()), str(place)
    return None


def oom_since(before) -> str:
    """Evidence of an OOM kill in this cgroup since `before` (oom_kills()'s count then), or ""."""
    now = oom_kills()
    if now is None or not isinstance(before, int) or isinstance(before, bool) or now[0] <= before:
        return ""
    return f"the kernel's OOM killer killed {now[0] - before} process(es) in this container ({now[1]}: oom_kill " \
           f"{before} -> {now[0]})"


# Rank 0 notes the kernel's count at each step and at the finish (hooks.supervise): a kill the run stepped past was
# not what ended it (another process's, long before), and one after the finish is a failure after it (verdict.py).
OOM_AT_STEP = records.Record("oom-at-step.json", {"kills": int, "time": records.TIME, "step": int})


def note_oom_kills(run_dir: Path, step=None) -> None:
    """The kernel's OOM-kill count now, as of this step (rank 0, after each step and at the finish)."""
    kills = oom_kills()
    if kills is None:
        return
    try:
        OOM_AT_STEP.write(run_dir, {"kills": kills[0], "time": time.time(),
                                    **({"step": step} if isinstance(step, int) else {})}, mode=0o600)
    except OSError:
        pass


def oom_since_step(run_dir: Path, since: float) -> str | None:
    """Evidence of an OOM kill in this cgroup since the last step this run noted (note_oom_kills), "" for none;
    None when this run noted no step (then only oom_since's count from its start says anything)."""
    rec = OOM_AT_STEP.read_owned(run_dir)
    if not isinstance(rec.get("kills"), int) or not isinstance(rec.get("time"), (int, float)) or rec["time"] < since:
        return None
    return oom_since(rec["kills"])


# A rank records itself while it lives (the bootstrap); one whose record outlives it ended without going through
# Python's exit: a signal (the OOM killer's SIGKILL, a crash in native code) or os._exit.
def rank_record(rank: int) -> records.Record:
    return records.Record(f"rank-{rank}.json", {"rank": int, "pid": int, "start": int, "time": records.TIME,
                                                "training": bool})


def rank_alive(run_dir: Path, rank: int, training: bool = False) -> None:
    """This rank lives (training: it entered PPOTrainer.train)."""
    from podkit.host import proc

    try:
        rank_record(rank).write(run_dir, {"rank": rank, "pid": os.getpid(), "start": proc.starttime(os.getpid()) or 0,
                                          "time": time.time(), "training": training}, mode=0o600)
    except OSError:
        pass


def clear_ranks(run_dir: Path) -> None:
    """Before torchrun starts: no rank of this program lives yet, and a killed run's records are old news."""
    for path in Path(run_dir).glob("rank-*.json"):  # rank-N.json and rank-signal-N.json
        path.unlink(missing_ok=True)


def training(run_dir: Path) -> bool:
    """Whether a live rank has entered train() (a stop then waits for the step in flight)."""
    for path in Path(run_dir).glob("rank-*.json"):
        n = path.name.removeprefix("rank-").removesuffix(".json")
        if n.isdigit() and rank_record(int(n)).read_owned(run_dir).get("training") is True:
            return True
    return False


def rank_exited(run_dir: Path, rank: int) -> None:
    rank_record(rank).path(run_dir).unlink(missing_ok=True)


# The stop signals a rank got, noted as they come (bootstrap and hooks; the script's own handler is wrapped so
# that they are noted under it too): whether the trainer program handed it on (FORWARDED) or someone sent it
# to the rank itself.
def signal_record(rank: int) -> records.Record:
    return records.Record(f"rank-signal-{rank}.json", {"rank": int, "signal": str, "at": records.TIME,
                                                       "forwarded": bool})


def rank_signalled(run_dir: Path, rank: int, sig: int, since: float) -> None:
    """Rank `rank` got `sig` now. Written in the signal handler: Python runs it between two bytecodes of the
    main thread, and the rank may end right after it."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    try:
        signal_record(rank).write(run_dir, {"rank": rank, "signal": name, "at": time.time(),
                                            "forwarded": forwarded(run_dir, since)}, mode=0o600)
    except OSError:
        pass


def rank_signals(run_dir: Path, since: float) -> list[dict]:
    """The stop signals ranks got since `since`, the earliest first."""
    out = []
    for path in Path(run_dir).glob("rank-signal-*.json"):
        n = path.name.removeprefix("rank-signal-").removesuffix(".json")
        rec = signal_record(int(n)).read_owned(run_dir) if n.isdigit() else {}
        if isinstance(rec.get("at"), (int, float)) and rec["at"] >= since:
            out.append(rec)
    return sorted(out, key=lambda r: r["at"])


# torch's elastic agent, for a worker that died (torch/distributed/elastic/multiprocessing/api.py):
# "failed (exitcode: -9) local_rank: 0 (pid: 1234) of binary: ..."
TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
NATIVE_CRASH = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def silent_ranks(run_dir: Path, since: float, log_file: Path | None = None) -> list[dict]:
    """The ranks of this run that ended without a word ({rank, pid, signal}): their life record outlives them.
    The signal is torch's agent's own report of the rank's exit, from the trainer's log, when it is there."""
    from podkit.host import proc

    out = []
    for path in Path(run_dir).glob("rank-*.json"):
        n = path.name.removeprefix("rank-").removesuffix(".json")
        if not n.isdigit():
            continue
        rec = rank_record(int(n)).read_owned(run_dir)
        if not rec or (rec.get("time") or 0) < since or not isinstance(rec.get("pid"), int):
            continue
        if proc.same_process(rec["pid"], rec.get("start")):
            continue  # still running: not ended at all
        out.append({"rank": rec.get("rank", int(n)), "pid": rec["pid"], "signal": None})
        path.unlink(missing_ok=True)
    if out and log_file is not None:
        by_pid = {}
        tail = records.read_end(log_file, 256 * 1024, follow=True)[2].decode(errors="replace")  # a log is data
        for line in tail.splitlines()[-2000:]:
            m = TORCHRUN_FAILED.search(line)
            if m:
                by_pid[int(m.group(3))] = int(m.group(1))
        for r in out:
            code = by_pid.get(r["pid"])
            if code is not None and code > 0:
                r["exit"] = code  # os._exit(code): no signal, no Python exit
            sig = -code if code is not None and code < 0 else None
            if sig:
                try:
                    r["signal"] = signal.Signals(sig).name
                except ValueError:
                    r["signal"] = f"signal {sig}"
    return sorted(out, key=lambda r: r["rank"])


def oom_fix(where: str) -> str:
    return (f"out of {where} memory: a smaller batch or sequence length (train_dataset.batch_size, "
            "gconfig.max_new_tokens, actor.mb_spec.max_tokens_per_mb)"
            + (", or fewer dataloader workers" if where == "host" else ", or a larger share of the GPU for the "
               "trainer") + "; or a pod with more memory")


def hang_fix(action: dict) -> str:
    where = action.get("where")
    if where:
        return (f"the code at {where} waits for something that never comes: give that wait a timeout "
                "(asyncio.wait_for for an await) or fix what it waits for; the dump names every thread and task")
    return f"no frame of your code was waiting: read the dump ({action.get('dump') or 'logs/hang-*.txt'}) for " \
           "where AReaL or torch waited (a collective, a lost rank, a dead rollout server)"


# -- the exit code ---------------------------------------------------------------------------------------------------
EXIT_RESTART = 75  # EX_TEMPFAIL: not finished, supervisord starts it again (supervisord.conf's exitcodes=0)


def exit_code(end: End, rc: int) -> int:
    f = end.family
    if f in (FINISHED, FINAL, GONE):
        return 0  # supervisord leaves it stopped (exitcodes=0)
    if f == RESTART or end.kind.name == STRAY:
        return EXIT_RESTART
    if f == STOP:
        return 0  # supervisord is stopping it: it stays stopped whatever the code
    return rc if rc not in (0, EXIT_RESTART) else 1


# -- where the user is: the fix in words that fit it ----------------------------------------------------------------
def place(cfg) -> str:
    """"rehearse" (make rehearse), "up" (podkit up: make run), or "pod" (podkit boot: a container)."""
    v = os.environ.get(PLACE_ENV, "")
    return v if v in ("rehearse", "up") else "pod"


PLACE_ENV = "_PODKIT_PLACE"  # set by `podkit up` (and `make rehearse`) for what it starts


# How a fix of the repo's code reaches the trainer, and how it starts again, where it runs.
FIXES = {"code": {"rehearse": "fix it in the rehearsed checkout and run `make rehearse` again (it resumes where it can)",
                  "up": "fix it in the repo, then run the same `podkit up` again",
                  "pod": "fix it in the repo and push, then `podkit resume` (it syncs the fix and starts the trainer)"},
         "resume": {"rehearse": "then run `make rehearse` again", "up": "then run the same `podkit up` again",
                    "pod": "then `podkit resume` (it syncs the repo and starts the trainer)"}}


def fix_code(cfg) -> str:
    return FIXES["code"][place(cfg)]


def fix_resume(cfg) -> str:
    return FIXES["resume"][place(cfg)]


def fix_setting(cfg, key: str = "trainer.overrides") -> str:
    """How a changed setting reaches this trainer."""
    p = place(cfg)
    if p == "rehearse":
        return "change it with OVERRIDES=... (or CONFIG) on `make rehearse` and run it again"
    if p == "up":
        return f"change {key} and run the same `podkit up` again"
    src = cfg.origin(key) if hasattr(cfg, "origin") else ""
    if src.startswith("env"):
        return (f"{key} comes from the pod's env ({src}): a new boot picks up a change (edit a stopped pod's env: "
                "RunPod restarts a running pod whose env is edited)")
    return f"change {key}{' in ' + src if src else ''}, then `podkit resume`"

