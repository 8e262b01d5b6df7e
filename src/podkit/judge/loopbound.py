"""The trainer's loop bound, the way supervisord bounds fast exits and Kubernetes backs off a crashing pod.

A trainer lives longer than supervisord's startsecs (it waits for inference and imports torch), so
startretries never counts its failures: a script that raised at start, or at step 2 on every run, was
restarted for ever. Here each end of a trainer run is judged on its evidence (ending.py) and counted by its
kind, each in a count of its own of ends in a row without a new step (no step past the best this boot has
seen): the script's failures, hangs, out-of-memory ends, and ends that are not the script's (inference down,
a network error, a kill). Each such end waits `trainer.restart_delay_s`, doubled for each end in a row, before
the next start; a count that reaches its bound (`trainer.max_failures`, three times that for ends not the
script's) stops the trainer for good with a kind of its own (crash-loop, hang-loop, oom-loop, outside-loop),
named by status, --health, metrics, doctor and a notification, and `podkit up` ends. An end after a new step
is new evidence and restarts at once; a run that fails after every new step is not stopped, but named once it
has cost TELL_RESTARTS starts in an hour. A stop that was asked for (podkit ctl, the pod's stop, podkit up, the
cost guard), the stale-weights restart and inference stopped on request are never counted.

`podkit ctl start trainer` or `podkit resume` after the bound, or a new boot (a push synced), starts from zero.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from podkit import log, notify, records
from podkit.judge import ending, failure, verdict

_log = log.get("trainer")
MAX_DELAY_S = 600.0
HOUR_S = 3600.0
TELL_RESTARTS = 5  # failures after new steps within an hour: said once by a notification, and by status and doctor
KEEP_STARTS, KEEP_ENDS = 64, 32


class Loop:
    """A program's failures in a row without progress in this boot, kept in `record` in the state dir: the back-off
    before each start (trainer.restart_delay_s, doubled) and the bound (trainer.max_failures). The trainer's is
    Bound below; a cluster node's `ray` program has its own (areal/ray_node.py: joins that failed)."""

    def __init__(self, cfg, record: records.Record, program: str, progress: str, logger=_log) -> None:
        self.cfg, self.record, self.program, self._log = cfg, record, program, logger
        self.state_dir = Path(cfg.state_dir)
        self.run_dir = Path(cfg.run_path) if getattr(cfg, "run_path", None) else None
        self.boot = records.CURRENT.read(self.state_dir).get("started")
        rec = records.kept(record, self.state_dir, self.run_dir)  # the run dir's copy, written while the volume was full
        if rec.get("boot") != self.boot:
            rec = {}  # a new boot: whatever failed before, the code may have changed
        elif rec.get("gave_up"):
            logger.info(f"started again after the loop bound stopped it ({rec.get('failures')} failures without "
                        f"{progress}): counting from zero")
            rec = self.kept(rec)
        elif rec.get("resumed"):
            logger.info("started again by `podkit resume` (the repo synced): counting from zero")
            rec = self.kept(rec)
        self.rec = {"boot": self.boot, "failures": 0, **rec}
        self.kept_said = False
        # the write count goes on across a reset, so the newer copy is always told by it
        self.seq = max((r.get("seq") for r in (record.read(self.state_dir), record.read(self.run_dir) if self.run_dir
                        else {}) if isinstance(r.get("seq"), int) and not isinstance(r.get("seq"), bool)), default=0)

    def kept(self, rec: dict) -> dict:
        """What a start after the bound's stop keeps of the record (`podkit ctl start`)."""
        return {}

    def save(self) -> None:
        """Onto the volume; while it cannot take it (full, failing), into the run dir (local disk), so the bound never
        forgets a failure: the next start reads the newer copy (records.kept), and the next write that works puts
        it back on the volume."""
        self.seq = min(self.seq, 10**12) + 1
        self.rec["seq"] = self.seq
        try:
            self.record.write(self.state_dir, self.rec)
        except OSError as e:
            if self.run_dir is not None:
                try:
                    self.record.write(self.run_dir, self.rec, mode=0o600)
                except OSError:
                    pass
                else:
                    if not self.kept_said:
                        self.kept_said = True
                        self._log.warn(f"cannot record the {self.program}'s failures on the volume ({e.strerror}): "
                                       f"kept in {self.run_dir} until it has room")
                    return
            self._log.warn(f"cannot record the {self.program}'s failures ({e.strerror}): the loop bound forgets them")
            return
        if self.run_dir is not None:
            try:
                os.unlink(self.record.path(self.run_dir))
            except OSError:
                pass

    def count(self, key: str) -> int:
        n = self.rec.get(key)
        return n if isinstance(n, int) and 0 <= n < 10**6 else 0  # a record is data: a planted count is none

    def delay_s(self, n: int) -> float:
        return min(self.cfg.trainer.restart_delay_s * 2 ** min(max(n - 1, 0), 16), MAX_DELAY_S) if n else 0.0

    def wait_s(self, n: int) -> float:
        """What is left of the back-off after `n` failures, counted from the last one."""
        delay = self.delay_s(n)
        last = self.rec.get("last_failure") or 0
        return min(max(0.0, delay - (time.time() - last)), delay)  # a last failure "in the future" waits no more

    def tell(self, text: str, event: str = "trainer-stopped") -> None:
        """The program's stopped notification, given a moment to go out before the process ends."""
        sent = notify.send(event, text, self.state_dir)
        if sent:
            sent.join(5)


class Bound(Loop):
    def __init__(self, cfg) -> None:
        super().__init__(cfg, records.TRAINER_LOOP, "trainer", "a new step")

    def kept(self, rec: dict) -> dict:
        return {"best_step": rec.get("best_step"), "started": rec.get("started"), "ends": rec.get("ends"),
                "running": rec.get("running"), "program": rec.get("program"), "oom_kills": rec.get("oom_kills")}

    def in_a_row(self) -> int:
        return sum(self.count(c.key) for c in ending.COUNTS.values())

    def hold_off(self) -> bool:
        """Before a start: a run whose program was killed before it judged its own end (the watchdog's hang
        restart, the OOM killer, supervisord's SIGKILL) is judged and counted now; then the back-off after ends
        without progress. A SIGTERM during the wait ends it (ending.Stop). False when the trainer stays
        stopped instead."""
        now = time.time()
        self.rec["starts"] = self.count("starts") + 1
        kept = [t for t in self.rec.get("started") or [] if isinstance(t, (int, float)) and now - 86400 < t <= now]
        self.rec["started"] = kept[-(KEEP_STARTS - 1):] + [now]
        ran, program = self.rec.pop("running", None), self.rec.pop("program", None)
        oom = self.rec.pop("oom_kills", None)
        if isinstance(ran, (int, float)):
            end = verdict.judge_killed(self.cfg, ran, program if isinstance(program, int) else None, oom)
            self.count_end(end, 1, ran)
            if self.rec.get("gave_up"):
                return False
            if end.family == ending.FINAL:
                # Its own final end, then killed before it could exit 0 (an OOM kill, supervisord's SIGKILL): a final
                # end stays final; only `podkit resume`, `podkit ctl start trainer` or a new boot start it again.
                ending.store(self.state_dir, {**end.rec, "program": os.getpid()})  # this start's end now
                self.rec.update(program=os.getpid(), phase="ended", ended_at=time.time())
                self.save()
                return False
        wait = self.wait_s(self.in_a_row())
        # The watchdog reads the phase: a back-off, or the program's end after its run, is not a hang.
        self.rec.update(program=os.getpid(), phase="backoff", backoff_until=time.time() + wait)
        self.save()
        if wait > 0:
            _log.info(f"back-off: waiting {wait:.0f}s before this start ({self.describe_counts()} in a row without "
                      "a new step)")
            time.sleep(wait)
        self.rec.pop("backoff_until", None)
        kills = ending.oom_kills()
        self.rec.update(running=time.time(), phase="running", oom_kills=kills[0] if kills else None)
        self.save()
        return True

    def describe_counts(self) -> str:
        c = ending.COUNTS
        parts = [f"{self.count('failures')} failure(s) of {self.cfg.trainer.max_failures}"]
        parts += [f"{self.count(c[k].key)} {what}" for k, what in (("hang", "hang(s)"), ("oom", "out-of-memory end(s)"),
                                                                  ("volume", "volume error(s)"),
                                                                  ("outside", "end(s) not the script's"))
                  if self.count(c[k].key)]
        return ", ".join(parts)

    def new_step(self, prog: dict, since: float) -> bool:
        """A step past the best this boot has seen, trained by this run (a resume's own step is not one)."""
        step = prog.get("step") if (prog.get("time") or 0) >= since else None
        if not isinstance(step, int) or isinstance(step, bool) or step == prog.get("resumed_at"):
            return False
        best = self.rec.get("best_step")
        if isinstance(best, int) and step <= best:
            return False
        # New evidence: the run got further than ever in this boot, so what ended it now starts a new count.
        self.rec.update(best_step=step, **{c.key: 0 for c in ending.COUNTS.values()})
        return True

    def at(self) -> str:
        best = self.rec.get("best_step")
        return f"after step {best}" if isinstance(best, int) else "before its first step"

    def finish(self, end: ending.End, rc: int, started: float) -> int:
        """The exit code for supervisord once the run that began at `started` ended as `end` (verdict.judge)."""
        for key in ("running", "oom_kills"):
            self.rec.pop(key, None)
        self.rec.update(phase="ended", ended_at=time.time(), program=os.getpid())
        return self.count_end(end, rc, started)

    def count_end(self, end: ending.End, rc: int, since: float) -> int:
        """Count `end` by its kind (a new step since `since` resets every count), record it, and say what it
        means; the exit code for supervisord."""
        k = end.kind
        new = self.new_step(records.PROGRESS.read(self.state_dir), since)
        self.remember(end, new)
        if k.family == ending.FINAL:  # the trainer's own refusal, or a judged one (a checkpoint it cannot load)
            self.save()
            if not end.stored:
                ending.store(self.state_dir, end.rec)
                _log.error(f"the trainer {end.words()}: {end.first()}; fix: {end.hint or k.fix}")
            self.tell(f"the trainer stopped for good ({k.name}): {end.first()} | fix: {end.hint or k.fix}")
            return 0
        if not end.stored and k.family != ending.GONE:  # gone: the workspace, and its record, may be another pod's
            ending.store(self.state_dir, end.rec)
        if isinstance(end.error, dict):
            self.rec["error"] = end.error
        if k.counts is None:
            self.save()
            if k.family in (ending.STOP, ending.RESTART):
                _log.info(f"the trainer {end.words()} {records.at_step(end.step)}: not counted by the loop bound")
            return ending.exit_code(end, rc)
        if new:
            self.save()
            _log.warn(f"the trainer {end.words()} {records.at_step(end.step)}, after a new step: restarting at once")
            self.restarting_often(end)
            return ending.exit_code(end, rc)
        c = ending.COUNTS[k.counts]
        n = self.rec[c.key] = self.count(c.key) + 1
        self.rec["last_failure"] = time.time()
        limit = self.cfg.trainer.max_failures * c.factor
        if limit and n >= limit:
            return self.give_up(c, n, end)
        delay = self.delay_s(self.in_a_row())
        self.save()
        _log.error(f"the trainer {k.words} {self.at()} without a new step ({n} of {limit or 'unbounded'} in a row"
                   + (f"; {self.describe_counts()} in all" if self.in_a_row() > n else "")
                   + f"): {end.first() or k.words}; restarting in {delay:.0f}s")
        return ending.exit_code(end, rc)

    def remember(self, end: ending.End, new: bool) -> None:
        ends = [e for e in self.rec.get("ends") or [] if isinstance(e, dict)][-(KEEP_ENDS - 1):]
        ends.append({"time": time.time(), "by": end.kind.name, "family": end.family, "step": end.step,
                     "what": (end.first() or end.words())[:300], "new": new})
        self.rec["ends"] = ends

    def restarting_often(self, end: ending.End) -> None:
        """A run that fails after every new step is never stopped (each start is progress), but each start costs
        its resume: once it has cost TELL_RESTARTS starts in an hour, it is said once."""
        n = len(failing_with_progress(self.rec))
        if n < TELL_RESTARTS or self.rec.get("told_restarts"):
            return
        self.rec["told_restarts"] = True
        self.save()
        self.tell(f"the trainer failed {n} times in the last hour, each time after a new step: it makes progress, so "
                  f"the loop bound lets it go on, but every start costs its resume (the last: {end.first()}) | fix: "
                  f"{ending.fix_code(self.cfg)}", event="trainer-restarting")

    def give_up(self, c: ending.Count, n: int, end: ending.End) -> int:
        self.rec["gave_up"] = True
        self.save()
        times = f"{n} times in a row" if n > 1 else "once"  # trainer.max_failures 1: its first counted end
        message = f"the trainer {c.what} {times} {self.at()} without a new step: {end.first() or end.kind.words}"
        hint = self.fix_for(c, end)
        ending.write(self.state_dir, c.final, message, hint, where=end.where, last=end.kind.name,
                     evidence=end.evidence)
        _log.error(f"{message}. The trainer stays stopped (trainer.max_failures {self.cfg.trainer.max_failures}"
                   + (f", x{c.factor} for ends not the script's" if c.factor > 1 else "") + f"); fix: {hint}")
        self.tell(f"the trainer stopped for good: {message} | fix: {hint}")
        return 0  # supervisord leaves an expected exit stopped

    def fix_for(self, c: ending.Count, end: ending.End) -> str:
        """What to do, fitted to where the trainer runs (a pod, podkit up, a rehearsal); never "run doctor"."""
        own = f"{end.hint}; " if end.hint else ""
        if c.final == ending.CRASH_LOOP:
            return own + ending.fix_code(self.cfg)
        if c.final == ending.OOM_LOOP:
            return (end.hint or ending.oom_fix("host")) + "; " + ending.fix_setting(self.cfg)
        if c.final == ending.HANG_LOOP:
            return (end.hint or "read the hang dump (logs/hang-*.txt)") + "; " + ending.fix_code(self.cfg)
        if end.kind.name == ending.NETWORK:
            own = own or "the pod could not reach what the script fetches: check the pod's network, or put what it " \
                         "fetches on the volume or in the repo; "
        elif end.kind.name == ending.INFERENCE:
            own = own or "inference's own log (logs/sglang.log) says why it was down; "
        elif end.kind.name == ending.KILLED:
            own = own or "find what kills it (on the host, `dmesg` names the OOM killer's victims); "
        elif c.final == ending.VOLUME_LOOP:
            own = f"{ending.kind(ending.VOLUME_LOOP).fix}; "
        return own + ending.fix_resume(self.cfg)


def failing_with_progress(rec: dict, now: float | None = None) -> list[dict]:
    """The failures after a new step in the last hour, as the loop record keeps them (data: checked)."""
    now = time.time() if now is None else now
    return [e for e in rec.get("ends") or [] if isinstance(e, dict) and e.get("new") is True
            and e.get("family") == ending.FAILURE and isinstance(e.get("time"), (int, float))
            and 0 <= now - e["time"] < HOUR_S]


def _noted(*_) -> None:
    """A stop signal after the run has ended: noted (ending.SIGNALS), never raised in the middle of its judgement."""


def run(cfg, main) -> int:
    """Run the trainer program's `main()` under the bound (a single pod; a cluster's launcher has its own), and
    judge how it ended (verdict.judge)."""
    bound = Bound(cfg)
    started, err, code = time.time(), None, 1
    try:
        if not bound.hold_off():
            return 0
        started = time.time()
        code = main()
    except ending.Stop:  # asked to stop before anything was in flight: the judge reads who asked
        code = 0
    except SystemExit as e:  # a program that exits with its own message
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the fake trainer runs in-process: its exception is the failure
        traceback.print_exc()
        err = failure.clean(failure.classify(e, failure.describe(e, [], str(cfg.workspace_path)),
                                             place=ending.place(cfg)), cfg)
        code = 1
    finally:
        if ending.SIGNALS.forward is None:
            ending.SIGNALS.forward = _noted
    end = verdict.judge(cfg, code, started, err, bound.rec.get("oom_kills"))
    return bound.finish(end, code, started)

