"""The trainer's loop bound, the way supervisord bounds fast exits and Kubernetes backs off a crashing pod.

A trainer lives longer than supervisord's startsecs (it waits for inference and imports torch), so
startretries never counts its failures: a script that raises at start, or at step 2 on every run, was
restarted for ever. Here a failure without progress (no step past the best this boot has seen) waits
`trainer.restart_delay_s`, doubled for each such failure in a row, before the next start; after
`trainer.max_failures` of them the trainer stays stopped (`stopped.by: crash-loop` with the user's own
exception), named by status, --health, metrics, doctor and a notification, and `podkit up` ends. A
failure after a new step is new evidence and restarts at once. A stop (SIGTERM) and the stale-weights restart
(exit 75) are not failures. Ends that are not the script's (a failure while inference was restarted or
down, the trainer killed: the watchdog's hang restart, out of memory) are counted apart, against
OUTSIDE_FACTOR times the bound: a hang at the same place on every run ends too, only later.

`podkit ctl start trainer` after the bound, or a new boot (a push synced), starts from zero.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from podkit import failure, log, notify, records, supervisord

_log = log.get("trainer")
MAX_DELAY_S = 600.0
# Ends that are not the script's (inference down or restarted under it; the trainer killed: the watchdog's
# hang restart, out of memory) are not counted toward trainer.max_failures, but they are not free either:
# this many times that bound in a row, without a new step, and the trainer stays stopped too.
OUTSIDE_FACTOR = 3


class Loop:
    """A program's failures in a row without progress in this boot, kept in `record` in the state dir: the back-off
    before each start (trainer.restart_delay_s, doubled) and the bound (trainer.max_failures). The trainer's is
    Bound below; a cluster node's `ray` program has its own (areal/ray_node.py: joins that failed)."""

    def __init__(self, cfg, record: records.Record, program: str, progress: str, logger=_log) -> None:
        self.cfg, self.record, self.program, self._log = cfg, record, program, logger
        self.state_dir = Path(cfg.state_dir)
        self.boot = records.CURRENT.read(self.state_dir).get("started")
        rec = record.read(self.state_dir)
        if rec.get("boot") != self.boot:
            rec = {}  # a new boot: whatever failed before, the code may have changed
        elif rec.get("gave_up"):
            logger.info(f"started again after the loop bound stopped it ({rec.get('failures')} failures without "
                        f"{progress}): counting from zero")
            rec = self.kept(rec)
        self.rec = {"boot": self.boot, "failures": 0, **rec}

    def kept(self, rec: dict) -> dict:
        """What a start after the bound's stop keeps of the record (`podkit ctl start`)."""
        return {}

    def save(self) -> None:
        try:
            self.record.write(self.state_dir, self.rec)
        except OSError as e:
            self._log.warn(f"cannot record the {self.program}'s failures ({e.strerror}): the loop bound forgets them")

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
        self.rec.setdefault("outside", 0)

    def kept(self, rec: dict) -> dict:
        return {"best_step": rec.get("best_step")}

    def hold_off(self) -> bool:
        """Before a start that follows failures without progress: wait out the back-off. A start whose previous
        run never reached after() was killed (the watchdog's hang restart, out of memory): counted apart.
        False when the trainer stays stopped instead."""
        self.rec["starts"] = self.count("starts") + 1
        ran = self.rec.pop("running", None)
        if isinstance(ran, (int, float)) and not self.outside_end(
                "it was killed (the watchdog's hang restart, out of memory, or a stop past its grace)", ran):
            return False
        wait = self.wait_s(self.count("failures") + self.count("outside"))
        self.save()
        if wait > 0:
            _log.info(f"back-off: waiting {wait:.0f}s before this start ({self.count('failures')} failure(s) of "
                      f"{self.cfg.trainer.max_failures} in a row without a new step"
                      + (f", {self.count('outside')} end(s) not the script's" if self.count("outside") else "") + ")")
            time.sleep(wait)
        self.rec["running"] = time.time()
        self.save()
        return True

    def new_step(self, prog: dict, since: float) -> bool:
        """A step past the best this boot has seen, trained by this run (a resume's own step is not one)."""
        step = prog.get("step") if (prog.get("time") or 0) >= since else None
        if not isinstance(step, int) or step == prog.get("resumed_at"):
            return False
        best = self.rec.get("best_step")
        if isinstance(best, int) and step <= best:
            return False
        # New evidence: the run got further than ever in this boot, so what failed now starts a new count.
        self.rec.update(best_step=step, failures=0, outside=0)
        return True

    def outside_end(self, why: str, since: float) -> bool:
        """An end not blamed on the script; False when the trainer now stays stopped."""
        if self.new_step(records.PROGRESS.read(self.state_dir), since):
            return True
        n = self.rec["outside"] = self.count("outside") + 1
        self.rec["last_failure"] = time.time()
        limit = self.cfg.trainer.max_failures * OUTSIDE_FACTOR
        _log.warn(f"the trainer's run ended because {why}: not counted as a failure of the script ({n} in a row "
                  "without a new step)")
        if limit and n >= limit:
            self.give_up(n, self.at(), f"each time for a cause outside the script, the last: {why}", None,
                         outside=True)
            return False
        return True

    def at(self) -> str:
        best = self.rec.get("best_step")
        return f"after step {best}" if isinstance(best, int) else "before its first step"

    def after(self, code: int, started: float, err: dict | None = None) -> int:
        """The exit code for supervisord once the trainer's run ended with `code`."""
        self.rec.pop("running", None)
        if code == 0:
            self.stopped_for_good(started)
        if code in (0, supervisord.EXIT_RESTART):
            self.save()
            return code
        prog = records.PROGRESS.read(self.state_dir)
        stopped = prog.get("stopped") or {}
        if stopped.get("by") == "SIGTERM" and (stopped.get("time") or 0) >= started:
            self.save()
            return code
        sglang = supervisord.process_info(self.cfg.socket_path, "sglang") or {}
        if sglang and ((sglang.get("start") or 0) > started or sglang.get("statename") not in supervisord.UP):
            kept = self.outside_end(f"inference was restarted or down (exit {code})", started)
            self.save()
            return code if kept else 0
        err = err or failure.first_since(self.cfg.run_path, started)
        if err:
            self.rec["error"] = err
        if self.new_step(prog, started):
            self.save()
            return code
        failures = self.rec["failures"] = self.count("failures") + 1
        self.rec["last_failure"] = time.time()
        limit = self.cfg.trainer.max_failures
        what = failure.summary(err) if err else f"exit {code} (no exception recorded: `podkit doctor`)"
        if limit and failures >= limit:
            return self.give_up(failures, self.at(), what, err)
        delay = self.delay_s(failures + self.count("outside"))
        self.save()
        _log.error(f"the trainer failed {self.at()} without a new step ({failures} of {limit or 'unbounded'} in a "
                   f"row): {what}; restarting in {delay:.0f}s")
        return code

    def stopped_for_good(self, started: float) -> None:
        """A refusal (the script's own error, AReaL's config) or a script that never trained: said once, as the
        loop bound's own stop is."""
        stopped = records.PROGRESS.read(self.state_dir).get("stopped") or {}
        if stopped.get("by") in ("config-error", "never-trained") and (stopped.get("time") or 0) >= started:
            first = (stopped.get("message") or "").splitlines()[:1]
            self.tell(f"the trainer stopped for good ({stopped['by']}): {first[0] if first else ''} | fix: "
                      f"{stopped.get('hint', '')}")

    def give_up(self, failures: int, at: str, what: str, err: dict | None, outside: bool = False) -> int:
        self.rec["gave_up"] = True
        self.save()
        message = f"the trainer {'ended' if outside else 'failed'} {failures} times in a row {at} without a new " \
                  f"step: {what}"
        hint = ("`podkit doctor` names what ended it (inference's log, the watchdog's dumps in logs/hang-*.txt); "
                "then `podkit ctl start trainer`") if outside else \
            ((err or {}).get("hint") or "fix it in the repo and push: the next boot syncs it") + \
            " (or fix the checkout, then `podkit ctl start trainer`)"
        failure.stop_for_good(self.state_dir, "crash-loop", message, hint)
        _log.error(f"{message}. The trainer stays stopped (trainer.max_failures {self.cfg.trainer.max_failures}); "
                   f"hint: {hint}")
        self.tell(f"the trainer stopped for good: {message} | fix: {hint}")
        return 0  # supervisord leaves an expected exit stopped


def run(cfg, main) -> int:
    """Run the trainer program's `main()` under the bound (a single pod; a cluster's launcher has its own)."""
    bound = Bound(cfg)
    if not bound.hold_off():
        return 0
    started = time.time()
    err = None
    try:
        code = main()
    except Exception as e:  # noqa: BLE001 - the fake trainer runs in-process: its exception is the failure
        traceback.print_exc()
        err = failure.clean(failure.describe(e, [], str(cfg.workspace_path)), cfg)
        code = 1
    return bound.after(code, started, err)
