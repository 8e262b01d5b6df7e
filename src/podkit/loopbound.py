"""The trainer's loop bound, the way supervisord bounds fast exits and Kubernetes backs off a crashing pod.

A trainer lives longer than supervisord's startsecs (it waits for inference and imports torch), so
startretries never counts its failures: a script that raises at start, or at step 2 on every run, was
restarted for ever. Here a failure without progress (no step past the best this boot has seen) waits
`trainer.restart_delay_s`, doubled for each such failure in a row, before the next start; after
`trainer.max_failures` of them the trainer stays stopped (`stopped.by: crash-loop` with the user's own
exception), named by status, --health, metrics, doctor and a notification, and `podkit up` ends. A
failure after a new step is new evidence and restarts at once. What podkit itself causes is not counted:
a stop (SIGTERM), the stale-weights restart (exit 75), the watchdog's kill (the launcher dies with it
and counts nothing) and a failure while inference was restarted under the trainer.

`podkit ctl start trainer` after the bound, or a new boot (a push synced), starts from zero.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from podkit import failure, log, notify, records, supervisord

_log = log.get("trainer")
MAX_DELAY_S = 600.0


class Bound:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir)
        self.boot = records.CURRENT.read(self.state_dir).get("started")
        rec = records.TRAINER_LOOP.read(self.state_dir)
        if rec.get("boot") != self.boot:
            rec = {}  # a new boot: whatever failed before, the code may have changed
        elif rec.get("gave_up"):
            _log.info(f"started again after the loop bound stopped it ({rec.get('failures')} failures without a new "
                      "step): counting from zero")
            rec = {"best_step": rec.get("best_step")}
        self.rec = {"boot": self.boot, "failures": 0, **rec}

    def save(self) -> None:
        try:
            records.TRAINER_LOOP.write(self.state_dir, self.rec)
        except OSError as e:
            _log.warn(f"cannot record the trainer's failures ({e.strerror}): the loop bound forgets them")

    def delay_s(self, failures: int) -> float:
        return min(self.cfg.trainer.restart_delay_s * 2 ** max(failures - 1, 0), MAX_DELAY_S) if failures else 0.0

    def hold_off(self) -> None:
        """Before a start that follows failures without progress: wait out the back-off."""
        self.rec["starts"] = self.rec.get("starts", 0) + 1
        self.save()
        failures = self.rec.get("failures") or 0
        wait = self.delay_s(failures) - (time.time() - (self.rec.get("last_failure") or 0))
        if failures and wait > 0:
            _log.info(f"back-off: waiting {wait:.0f}s before this start (failure {failures} of "
                      f"{self.cfg.trainer.max_failures} in a row without a new step)")
            time.sleep(wait)

    def after(self, code: int, started: float, err: dict | None = None) -> int:
        """The exit code for supervisord once the trainer's run ended with `code`."""
        if code == 0:
            self.stopped_for_good(started)
        if code in (0, supervisord.EXIT_RESTART):
            return code
        prog = records.PROGRESS.read(self.state_dir)
        stopped = prog.get("stopped") or {}
        if stopped.get("by") == "SIGTERM" and (stopped.get("time") or 0) >= started:
            return code
        sglang = supervisord.process_info(self.cfg.socket_path, "sglang") or {}
        if sglang and ((sglang.get("start") or 0) > started or sglang.get("statename") != supervisord.RUNNING):
            _log.warn(f"the trainer failed (exit {code}) while inference was restarted or down: not counted as a "
                      "failure of the script")
            return code
        step = prog.get("step") if (prog.get("time") or 0) >= started else None
        best = self.rec.get("best_step")
        err = err or failure.first_since(self.cfg.run_path, started)
        if err:
            self.rec["error"] = err
        if isinstance(step, int) and (best is None or step > best):
            # New evidence: the run got further than ever in this boot, so this failure starts a new count.
            self.rec.update(best_step=step, failures=0)
            self.save()
            return code
        failures = self.rec["failures"] = (self.rec.get("failures") or 0) + 1
        self.rec["last_failure"] = time.time()
        limit = self.cfg.trainer.max_failures
        what = failure.summary(err) if err else f"exit {code} (no exception recorded: `podkit doctor`)"
        at = f"after step {best}" if best is not None else "before its first step"
        if limit and failures >= limit:
            return self.give_up(failures, at, what, err)
        self.rec["delay_s"] = self.delay_s(failures)
        self.save()
        _log.error(f"the trainer failed {at} without a new step ({failures} of {limit or 'unbounded'} in a row): "
                   f"{what}; restarting in {self.rec['delay_s']:.0f}s")
        return code

    def stopped_for_good(self, started: float) -> None:
        """A refusal (the script's own error, AReaL's config) or a script that never trained: said once, as the
        loop bound's own stop is."""
        stopped = records.PROGRESS.read(self.state_dir).get("stopped") or {}
        if stopped.get("by") in ("config-error", "never-trained") and (stopped.get("time") or 0) >= started:
            first = (stopped.get("message") or "").splitlines()[:1]
            sent = notify.send("trainer-stopped", f"the trainer stopped for good ({stopped['by']}): "
                               f"{first[0] if first else ''} | fix: {stopped.get('hint', '')}", self.state_dir)
            if sent:
                sent.join(5)

    def give_up(self, failures: int, at: str, what: str, err: dict | None) -> int:
        self.rec["gave_up"] = True
        self.save()
        message = f"the trainer failed {failures} times in a row {at} without a new step: {what}"
        hint = ((err or {}).get("hint") or "fix it in the repo and push: the next boot syncs it") + \
            " (or fix the checkout, then `podkit ctl start trainer`)"
        failure.stop_for_good(self.state_dir, "crash-loop", message, hint)
        _log.error(f"{message}. The trainer stays stopped (trainer.max_failures {self.cfg.trainer.max_failures}); "
                   f"hint: {hint}")
        sent = notify.send("trainer-stopped", f"the trainer stopped for good: {message} | fix: {hint}", self.state_dir)
        if sent:
            sent.join(5)
        return 0  # supervisord leaves an expected exit stopped


def run(cfg, main) -> int:
    """Run the trainer program's `main()` under the bound (a single pod; a cluster's launcher has its own)."""
    bound = Bound(cfg)
    bound.hold_off()
    started = time.time()
    err = None
    try:
        code = main()
    except Exception as e:  # noqa: BLE001 - the fake trainer runs in-process: its exception is the failure
        traceback.print_exc()
        err = failure.describe(e, [], str(cfg.workspace_path))
        code = 1
    return bound.after(code, started, err)
