"""Cost guards: on RunPod, a pod whose training finished, or that has waited in safe mode for
`guard.stop_pod_after_s`, stops itself, so a run that ended at 3 a.m. does not bill GPUs until someone
looks; so does one past its maximum run time (`guard.stop_pod_at`) or its budget (`guard.max_spend`), the
trainer first with its checkpoint. Off outside RunPod (no RUNPOD_POD_ID) and with
`guard.stop_pod_when_finished: never` / `guard.stop_pod_after_s: 0` / `guard.stop_pod_at: 0` /
`guard.max_spend: 0`.

What the pod costs is one record, `<state_dir>/cost.json` (records.COST): the Meter reads the pod's price
(`GET /v2/pods/{id}`: cost, startedAt) and its bill (`GET /v2/billing/pods?podId=`) every
`guard.cost_every_s` and writes it, with the run's spend across its pods (`total`: runmeter.py gathers the
others, spend.run_total sums them), which the budget acts on; `ledger.cost()` reads it back checked (never another
run's), for status, notifications and the page.

A stopped pod keeps its volume (checkpoints, logs, the repo) and bills only for disk; it restarts from
the console or `podkit deploy start`. The call is REST API v2's `POST /v2/pods/{id}/action` with
{"action": "stop"}, made with the pod's own RUNPOD_API_KEY (RunPod puts RUNPOD_POD_ID and a pod-scoped
key in every pod), through podkit.runpod: stdlib only, as the image has no SDK.

This module is the cost guard's one room: the rules that say when a pod stops (in_safe_mode, cannot_train,
when_finished, Deadline), the stop with its retries (Stopper) and what is said and notified about it.
Safe mode (safemode.py) and the log listener (programs/logs.py) only tell it what happened.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.money import guards, ledger, spend

_log = log.get("costguard")
POD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def on_runpod(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get("RUNPOD_POD_ID") and environ.get("RUNPOD_API_KEY"))


def stop_pod(reason: str, environ=None) -> bool:
    """Stop this pod; True when RunPod took the stop (or the pod is stopped already). Never raises: a
    failure is logged, and the caller tries again later."""
    from podkit import runpod

    environ = os.environ if environ is None else environ
    pod = environ.get("RUNPOD_POD_ID", "")
    if not POD_ID.match(pod) or not environ.get("RUNPOD_API_KEY"):
        _log.warn(f"cannot stop the pod ({reason}): RUNPOD_POD_ID {'is not a pod id' if pod else 'is not set'}"
                  f"{'' if environ.get('RUNPOD_API_KEY') else ' and RUNPOD_API_KEY is not set'}")
        return False
    _log.info(f"stopping pod {pod}: {reason}")
    client = None
    try:
        client = runpod.Client(environ=environ, timeout_s=20, retries=1, agent="podkit-costguard")
        client.action(pod, "stop")
        return True
    except runpod.ApiError as e:
        if e.status == 409 and client is not None:  # not a stop RunPod allows now: stopped already, locked...
            return _stop_refused(client, pod, e)
        _log.warn(f"RunPod did not stop pod {pod}: {e.message}" + (f" ({e.hint})" if e.hint else ""))
        return False
    except Exception as e:  # noqa: BLE001 - never raises: the caller tries again
        _log.warn(f"RunPod did not stop pod {pod}: {type(e).__name__}")
        return False


def _stop_refused(client, pod: str, e) -> bool:
    from podkit import runpod

    try:
        now = client.pod(pod) or {}
    except runpod.ApiError:
        now = {}
    if runpod.pod_state(now) == "stopped":  # RunPod stopped it already (runpod.STATUSES, the one map)
        return True
    cluster = now.get("cluster") if isinstance(now.get("cluster"), dict) else None
    if cluster:
        _log.warn(f"pod {pod} is a node of Instant Cluster {cluster.get('id')}, and RunPod stops a cluster only by "
                  f"deleting it: `podkit deploy cluster-delete {cluster.get('id')}` ends its billing (the network "
                  "volume keeps the checkpoints)")
    elif now.get("locked"):
        _log.warn(f"RunPod does not stop pod {pod}: it is locked (unlock it in the console, or stop it there)")
    else:
        _log.warn(f"RunPod refused to stop pod {pod}: {e.detail or e.message} (status {now.get('status', '?')})")
    return False


def stop_pod_notified(reason: str, state_dir: Path | None, notify: bool = True) -> bool:
    """The `pod-stop` notification (given a moment to go out), then stop_pod. A retry of a refused stop
    passes notify=False: one notification per stop, not per attempt."""
    if notify:
        from podkit import notify as webhook

        t = webhook.send("pod-stop", f"stopping this pod: {reason}; the volume stays", state_dir)
        if t:
            t.join(15)
    return stop_pod(reason)


# -- when the pod stops, and how a stop is retried: the one room for both ------------------------------------
# A refused stop (a 502 as training ends, RunPod busy) is tried again after 2 s, then twice as long each time
# up to RETRY_MAX_S, for RETRY_FOR_S; then a person is told the pod bills on.
FIRST_RETRY_S = 2.0
RETRY_MAX_S = 300.0
RETRY_FOR_S = 3600.0


# What must be done before this pod stops itself, once per stop, in the stop's own thread: the log listener's
# upload of the last checkpoint (checkpoint.remote: remote.Uploader.final, within checkpoint.remote_final_s). Each
# takes the stop's reason and returns what to say of it, which the pod-stop notification carries.
BEFORE_STOP: list = []


class Stopper:
    """One pod stop: notified once, sent, retried. `wanted()` (a reason to call it off, or "") is asked
    before each attempt: a guard set to never meanwhile, or a trainer started again, ends the retries.
    BEFORE_STOP is done first, and waited for, on the stop's first attempt."""

    def __init__(self, reason: str, state_dir: Path | None, wanted=None, say=None, notified: bool = False) -> None:
        self.reason, self.state_dir, self.notified = reason, state_dir, notified
        self.wanted = wanted or (lambda: "")
        self.say = say or _log.info
        self.done = False
        self.thread: threading.Thread | None = None

    def _before(self, fn) -> str:
        try:
            return fn(self.reason)
        except Exception as e:  # noqa: BLE001 - the pod stops whatever failed before it
            return f"what comes before the stop failed ({type(e).__name__}: {e})"

    def start(self, after: threading.Thread | None = None) -> Stopper:
        """In a daemon thread (events and signals keep flowing); `after`, a notification to let go out first."""
        self.thread = threading.Thread(target=self.run, args=(after,), name="pod-stop", daemon=True)
        self.thread.start()
        return self

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run(self, after: threading.Thread | None = None) -> bool:
        if after:
            after.join(15)
        delay, until, first = FIRST_RETRY_S, time.monotonic() + RETRY_FOR_S, not self.notified
        before = first
        while True:
            off = self.wanted()
            if off:
                self.say(f"the pod's self-stop is called off: {off}")
                return False
            if before:  # once: a retry of a refused stop has nothing new to upload
                before = False
                self.reason += "".join(f"; {said}" for said in map(self._before, BEFORE_STOP) if said)
                continue  # asked again: a guard set to never during a long upload calls the stop off
            if stop_pod_notified(self.reason, self.state_dir, notify=first):
                self.done = True
                return True
            first = False
            if time.monotonic() + delay > until:
                from podkit import notify as webhook

                webhook.send("pod-stop-failed", f"this pod could not stop itself after {self.reason} and is still "
                             "billing: stop it from RunPod's console", self.state_dir)
                return False
            self.say(f"the pod did not stop; trying again in {delay:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


class WhenIdle:
    """The rule for a pod that can no longer train (safe mode; the trainer stopped for good by a refusal,
    the loop bound, or a script that never trained): once that has lasted `after_s`, the pod stops
    (Stopper). `limits()` gives (after_s, the setting that says so) afresh each time it is looked at, so
    `podkit guard set` changes it on the waiting pod; `still()` says "" while the pod still cannot train,
    else why it can again (the trainer was started again)."""

    def __init__(self, state_dir: Path | None, what: str, after_s: float, why: str = "guard.stop_pod_after_s",
                 limits=None, still=None, say=None) -> None:
        self.state_dir, self.what, self.after_s, self.why = state_dir, what, after_s, why
        self.limits, self.still, self.say = limits, still or (lambda: ""), say
        self.stopper: Stopper | None = None
        self.cancelled = False

    def watch(self, since: float, every_s: float = 1.0) -> WhenIdle:
        """Checks the rule in a daemon thread, counting from `since` (wall clock: the moment the pod could no
        longer train), until the pod's stop began or cancel()."""
        base = time.monotonic() - max(0.0, time.time() - since)  # counted on the monotonic clock: a step of the wall
        # clock during the wait neither delays nor hastens the stop

        def tick() -> None:
            while not self.cancelled and self.stopper is None:
                try:
                    self.check(time.monotonic() - base)
                except Exception:  # noqa: BLE001 - the cost guard must not be what ends its caller
                    pass
                time.sleep(every_s)
        threading.Thread(target=tick, name="cannot-train", daemon=True).start()
        return self

    def cancel(self) -> None:
        self.cancelled = True

    def check(self, waited_s: float) -> None:
        if self.limits:
            try:
                self.after_s, self.why = self.limits()
            except Exception:  # noqa: BLE001 - a bad guard file keeps the limit there was
                pass
        if self.stopper is not None or not self.after_s or waited_s < self.after_s:
            return
        if not on_runpod():
            self.stopper = Stopper("", None)  # not a RunPod pod: nothing to stop, never again
            return
        self.stopper = Stopper(f"{self.what} for {waited_s:.0f} s ({self.why})", self.state_dir,
                               wanted=self.still, say=self.say).start()


# -- the rules: when the pod stops -----------------------------------------------------------------------------
def in_safe_mode(stage: str, settings: dict, workspace: Path | None, state_dir: Path | None, say) -> WhenIdle:
    """Safe mode's rule, watched from now: the pod stops after the sooner of guard.stop_pod_after_s and
    guard.stop_pod_at (`settings`, the pod's own), looked up afresh with `podkit guard set`'s changes
    (<workspace>/.podkit/guards.json) on top. `say` prints a line (stdout may be gone: it never raises)."""
    since = time.time()
    limits = None
    if state_dir is not None and workspace is not None:
        try:
            from podkit.money import guardfile  # safe mode only: not on a healthy boot's path

            live = guardfile.Live(workspace, settings, lambda m: say(f"[podkit:guard] {m}"))

            def limits() -> tuple[float, str]:
                v = live.values()
                changed = live.from_file("stop_pod_after_s") or live.from_file("stop_pod_at")
                return guards.sooner(v["stop_pod_after_s"], v["stop_pod_at"], since,
                              ", set by `podkit guard set`" if changed else "")
        except Exception:  # noqa: BLE001 - safe mode goes on with the settings alone
            limits = None
    rule = WhenIdle(state_dir, f"in safe mode ({stage})", *guards.sooner(settings["stop_pod_after_s"],
                                                                   settings["stop_pod_at"], since),
                    limits=limits, say=lambda m: say(f"[podkit:costguard] {m}"))
    return rule.watch(since, every_s=0.2)


def cannot_train(rule: WhenIdle | None, why: str, who: str, since: float, guard, state_dir: Path | None, say,
                 still) -> WhenIdle | None:
    """The log listener's rule for a pod that cannot train (`why`; "" while it can): after
    guard.stop_pod_after_s of it (`guard(key)`, looked up each time), counted from `since` (the state change
    that began it), the pod stops; `who` started again meanwhile (`still()` turns "") calls it off. Returns
    the rule in force, which the listener passes back the next time."""
    if not why:
        if rule is not None:
            rule.cancel()
        return None
    if rule is not None or not guard("stop_pod_after_s"):
        return rule
    rule = WhenIdle(state_dir, why, 0.0, limits=lambda: (guard("stop_pod_after_s"), "guard.stop_pod_after_s"),
                    still=lambda: "" if still() else f"{who} was started again", say=say)
    say(f"{why}: the pod stops itself after guard.stop_pod_after_s ({guard('stop_pod_after_s'):g} s) "
        f"unless {who} is started again")
    return rule.watch(since)


def when_finished(step, guard, state_dir: Path | None, say, after: threading.Thread | None = None) -> Stopper | None:
    """Training finished (the trainer exited after its last checkpoint): with guard.stop_pod_when_finished
    auto, the pod stops once `after` (the `finished` notification) has gone out; set to never while a
    refused stop is retried, the retries end. The started Stopper, or None."""
    if guard("stop_pod_when_finished") != "auto":
        return None

    def wanted() -> str:  # `podkit guard set stop_pod_when_finished=never` while retrying
        now = guard("stop_pod_when_finished")
        return "" if now == "auto" else f"guard.stop_pod_when_finished is now {now}"
    from podkit import records

    return Stopper(f"training finished {records.at_step(step)} (guard.stop_pod_when_finished: auto)", state_dir,
                   wanted=wanted, say=say).start(after=after)


class Deadline:
    """The lines a training pod stops at, for the log listener: guard.stop_pod_at (the maximum run time) and
    guard.max_spend (the budget, against `spent()`, the Meter's last read). Once one is crossed, in a thread
    (events keep flowing), `stop_trainer(why)` stops the trainer with its checkpoint (it returns what to say of
    that checkpoint), then the pod (Stopper); a stop still refused after Stopper's retries is begun again
    RETRY_MAX_S later. `guard(key)` and `from_file(key)` are looked up each time: `podkit guard set` moves a
    line, and moved past now (or the budget raised) after the trainer was stopped for it, the pod is left up,
    said once."""

    def __init__(self, guard, from_file, state_dir: Path | None, say, stop_trainer, spent=None) -> None:
        self.guard, self.from_file, self.state_dir, self.say = guard, from_file, state_dir, say
        self.stop_trainer = stop_trainer
        self.spent = spent or (lambda: None)
        self.thread: threading.Thread | None = None
        self.retry_at = 0.0
        self.done = False
        self.key = ""  # the guard whose line stopped the trainer
        self.reason = ""
        self.moved = False

    def due(self, now: float) -> str:
        """The guard whose line is crossed at `now`: "stop_pod_at", "max_spend", or ""."""
        at = self.guard("stop_pod_at")
        if at and now >= at:
            return "stop_pod_at"
        budget, spent = self.guard("max_spend"), self.spent()
        return "max_spend" if budget and spent is not None and spent >= budget else ""

    def check(self, now: float) -> None:
        due = self.due(now)
        if self.thread is not None and not self.done and not due:
            if not self.moved:  # moved after the trainer was stopped for it: say what is left
                self.moved = True
                msg = (f"guard.{self.key} {_MOVED[self.key]} after the trainer was stopped for it: the pod is not "
                       "stopped, and the trainer stays stopped until `podkit ctl start trainer watchdog`")
                self.say(msg)
                from podkit import notify

                notify.send("guard", msg, self.state_dir)
            return
        if self.done or not due or time.monotonic() < self.retry_at:
            return
        if self.thread and self.thread.is_alive():
            return
        self.retry_at = time.monotonic() + RETRY_MAX_S
        first = self.thread is None
        if first:
            self.key, self.reason = due, self._why(due)
        self.thread = threading.Thread(target=self._stop, args=(first,), name=_THREAD[due], daemon=True)
        self.thread.start()

    def _why(self, key: str) -> str:
        here = "set on the running pod by `podkit guard set`" if self.from_file(key) else ""
        if key == "stop_pod_at":
            return ("the maximum run time was reached (guard.stop_pod_at, "
                    f"{here or 'set by podkit deploy --max-runtime'})")
        return (f"the run's spend reached its budget ({spend.cents(self.spent())} of guard.max_spend "
                f"{spend.usd(self.guard('max_spend'))}{', ' + here if here else ''})")

    def _stop(self, first: bool) -> None:
        if first:
            self.say(f"{self.reason}: stopping the trainer with a checkpoint, then the pod")
            self.reason += f"; {self.stop_trainer(_ASKED[self.key])}"

        def wanted() -> str:
            return "" if self.due(time.time()) else f"guard.{self.key} {_MOVED[self.key]}"
        self.done = Stopper(self.reason, self.state_dir, wanted=wanted, say=self.say, notified=not first).run()


# Per line (guards.TABLE): the stop's thread, who asked for the trainer's stop (its end record says "stopped by
# ..."), and what a change that calls the stop off is called.
_THREAD = {k: g.enforced[0] for k, g in guards.TABLE.items() if g.enforced}
_ASKED = {k: g.enforced[1] for k, g in guards.TABLE.items() if g.enforced}
_MOVED = {k: g.enforced[2] for k, g in guards.TABLE.items() if g.enforced}


STOPPED_STATUSES = ("EXITED", "TERMINATED")  # RunPod's statuses of a pod that does not bill its GPUs


class Meter:
    """What this RunPod pod costs, looked at every `every_s` in a daemon thread of the log listener and kept in
    cost.json as a ledger (spend.advance: the price over time, the bill when it can be read, estimates that say
    so): guard.max_spend acts on its run total. With `total_steps` (trainer.max_steps), the cost of the steps left
    at the trainer's pace. What RunPod does not answer is said once (and once more when it answers again);
    nothing here raises into the listener."""

    def __init__(self, state_dir: Path, every_s: float, total_steps: int = 0, say=None, environ=None,
                 runs=None) -> None:

        self.state_dir, self.every_s, self.total_steps = Path(state_dir), every_s, total_steps
        self.runs = runs  # runmeter.RunMeter: the run's other pods (the run's record, a cluster's nodes), or None
        self.say = say or _log.info
        self.environ = os.environ if environ is None else environ
        self.pod = self.environ.get("RUNPOD_POD_ID", "")
        self.run = ledger.run_id(self.environ)
        self.boot = time.time()  # the listener starts with the container: a start RunPod does not give is this
        self.mono: float | None = None
        self.failing = ""  # what the last failed read said ("" once one works)
        self.no_bill = ""
        self.said: set[str] = set()
        self.catalogue: list[dict] | None = None
        self.pace: list[tuple[int, float, int | None]] = []  # (step, its time, the trainer's pid): first, latest
        self._client = None
        kept = ledger.checked(ledger.newest(self.state_dir), future_ok=True)  # a clock stepped back loses nothing
        if kept is not None and kept["time"] > time.time() + 300 and kept.get("pod") == self.pod:
            self.say(f"cost.json was written {(kept['time'] - time.time()) / 60:.0f} min in this clock's future (the "
                     "clock stepped back): its spend is kept, and counted on from now")
        # this pod's ledger, or a replacement's of this run (spend.advance carries the earlier pods' spend at the
        # first look); another run's record on a reused volume is not this run's spend
        self.last = kept if kept is not None and (kept.get("pod") == self.pod or self.run and
                                                  kept.get("run") == self.run) else None

    def start(self) -> Meter:
        def loop() -> None:
            if self.runs is not None:  # the run's record first: a replacement's first look has the run's spend
                try:
                    self.runs.begin((self.last or {}).get("total"))
                except Exception:  # noqa: BLE001 - the record thread tries again
                    pass
                self.runs.start()
            while True:
                try:
                    self.read()
                except Exception:  # noqa: BLE001 - saying so failed (stdout gone): the next read says it again
                    pass
                time.sleep(self.every_s)
        threading.Thread(target=loop, name="cost-meter", daemon=True).start()
        return self

    def spent(self) -> float | None:
        """USD this run has spent by the ledger (this pod's and the earlier pods' of the run); None while unknown."""
        return spend.total(self.last)

    def read(self) -> dict | None:
        """One look at RunPod, into the ledger and cost.json; the ledger, or None when RunPod did not answer (the
        ledger then runs on at the last price, estimated)."""
        from podkit import runpod

        now, mono = time.time(), time.monotonic()
        look = {"time": now, "dt": None if self.mono is None else mono - self.mono, "pod": self.pod, "run": self.run,
                "boot": self.boot}
        try:
            look.update(self._look())
            answered = True
        except Exception as e:  # noqa: BLE001 - a read that fails waits for the next, whatever failed
            why = e.message if isinstance(e, runpod.ApiError) else f"{type(e).__name__}: {e}"
            look.update(ok=False, failed=why)
            self._failed(why)
            answered = False
        self.mono = mono
        rec = spend.advance(self.last, look)
        rec["projected"] = self.projected(rec["per_hour"]) if rec.get("per_hour") else None
        if self.runs is not None:
            rec["total"] = self._run_total(rec, now)
        self.last = ledger.checked(rec, future_ok=True) or rec  # the budget goes by the ledger, written or not (a full volume)
        self._tell(rec)
        if self.runs is not None:
            try:
                self.runs.mine(self.last)
            except Exception as e:  # noqa: BLE001 - the record's write fails alone (a full volume): said once
                self._once_said("mine", f"this pod's spend cannot be written to the run's record ({e})")
        run_dir = ledger.run_dir_of(self.state_dir)
        try:
            records.COST.write(self.state_dir, rec)
        except OSError as e:
            kept = False
            if run_dir is not None:  # status and the page read it there (cost()) until the volume has room
                try:
                    records.COST.write(run_dir, rec, mode=0o600)
                    kept = True
                except OSError:
                    pass
            if not self.failing:
                self.say(f"cannot write {records.COST.path(self.state_dir)} ({e.strerror}): "
                         + (f"kept in {run_dir} until it has room" if kept else "status and the page show an older "
                            "spend") + "; guard.max_spend goes by what RunPod says")
            self.failing = e.strerror or "?"
            return rec if answered else None
        if run_dir is not None:
            try:
                os.unlink(records.COST.path(run_dir))
            except OSError:
                pass
        if answered and self.failing:
            self.say(f"the pod's cost is read again: {ledger.words(self.last)}")
            self.failing = ""
        return rec if answered else None

    def _run_total(self, rec: dict, now: float) -> dict | None:
        try:
            return self.runs.total(self._client, rec, now, (self.last or {}).get("total"))
        except Exception as e:  # noqa: BLE001 - the run's other pods are left out, said once; this pod's spend holds
            self._once_said("total", f"the run's other pods cannot be counted ({type(e).__name__}: {e}): the budget "
                            "goes by this pod's spend and what its volume carries")
            return None

    def _once_said(self, key: str, msg: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(msg)

    def final(self, timeout_s: float) -> bool:
        """At the pod's stop: its figures, saying it stopped, into the run's record within `timeout_s`."""
        try:
            return self.runs is not None and self.runs.final(self.last, timeout_s)
        except Exception:  # noqa: BLE001 - the stop goes on
            return False

    def _tell(self, rec: dict) -> None:
        """Say once each way the spend is unsure (status, doctor and the page show it from cost.json)."""
        if rec["source"] == "unknown" and "unknown" not in self.said:
            self.said.add("unknown")
            self.say(f"the pod's spend is unknown ({rec.get('why') or 'RunPod gives no price'}): guard.max_spend "
                     "cannot act until it can be estimated")
        elif rec.get("why") and rec["source"] == "estimated" and rec.get("why") not in self.said \
                and not rec["why"].startswith("RunPod did not answer"):
            self.said.add(rec["why"])
            self.say(f"the pod's spend is estimated: {rec['why']}")

    def _failed(self, why: str) -> None:
        if not self.failing:
            self.say(f"cannot read what pod {self.pod} costs ({why}): its spend is estimated at the last price"
                     + (", and guard.max_spend goes by it" if self.last and self.last.get("per_hour") else
                        "; guard.max_spend cannot act until it can") + "; trying again every "
                     f"{self.every_s:g} s, said again once it works")
        self.failing = why or "?"

    def _look(self) -> dict:
        """What RunPod says of the pod now: its price, status, start, its GPUs' list price and its bill."""
        from podkit import runpod  # the listener on RunPod only: urllib stays off every other path

        if self._client is None:
            self._client = runpod.Client(environ=self.environ, timeout_s=20, retries=1, agent="podkit-costguard")
        pod = self._client.pod(runpod.check_id(self.pod, "pod"))
        if pod is None:
            raise runpod.ApiError(f"RunPod has no pod {self.pod}")
        price = runpod.pod_cost(pod)
        if price is not None and price > ledger.PER_HOUR_MAX:
            raise runpod.ApiError(f"RunPod's answer for pod {self.pod} has no price (cost {pod.get('cost')!r:.40})")
        running = pod.get("status") not in STOPPED_STATUSES  # this runs inside the pod: it runs
        if self.runs is not None:  # where this pod runs, for the run's record (a migration moves it)
            self.runs.facts = {k: pod.get(f)[:64] for k, f in (("data_center", "dataCenterId"), ("created", "createdAt"))
                               if isinstance(pod.get(f), str)}
        look = {"ok": True, "price": price if price is not None else pod.get("cost"), "running": running,
                "started": runpod.started_at(pod), "start_raw": pod.get("startedAt"), "bill": None,
                "server_time": self._client.answered_at,
                "catalogue": self._catalogue(pod) if running and not price else None}
        try:
            look["bill"] = self._client.pod_billing(self.pod, pod.get("createdAt"))
        except runpod.ApiError as e:  # a pod-scoped key may not read the bill: the price tells the spend
            if not self.no_bill:
                self.say(f"RunPod's billing for pod {self.pod} did not answer ({e.message}): its spend is the price "
                         "over the time it runs until it does")
            self.no_bill = e.message or "?"
        else:
            if self.no_bill:
                self.say(f"RunPod's billing for pod {self.pod} answers again")
            self.no_bill = ""
        return look

    def _catalogue(self, pod: dict) -> float | None:
        """The GPU catalogue's list price for the pod's GPUs, in its cloud (asked once), or None."""
        from podkit import runpod

        gpu = pod.get("gpu") if isinstance(pod.get("gpu"), dict) else {}
        count = gpu.get("count") if isinstance(gpu.get("count"), int) and gpu.get("count") > 0 else 1
        if not isinstance(gpu.get("id"), str):
            return None
        try:
            if self.catalogue is None:
                self.catalogue = self._client.gpu_types()
        except runpod.ApiError:
            return None
        cloud = pod.get("cloud") if pod.get("cloud") in ("SECURE", "COMMUNITY") else "SECURE"
        return runpod.gpu_price(self.catalogue, gpu["id"], cloud, count)

    def projected(self, per_hour: float) -> float | None:
        """USD for the steps left to trainer.max_steps at the pace the trainer has kept since this meter first
        saw it step (progress.json, sampled at each read; a restarted trainer starts the pace again); None
        without a total or before two steps were seen."""
        prog = records.PROGRESS.read(self.state_dir)
        step, t, pid = prog.get("step"), prog.get("time"), prog.get("pid")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(t, (int, float)):
            return None
        if not self.pace or step < self.pace[0][0] or pid != self.pace[0][2]:
            self.pace = [(step, float(t), pid)]
        self.pace[1:] = [(step, float(t), pid)]
        if not self.total_steps:
            return None
        if step >= self.total_steps:
            return 0.0
        (s0, t0, _), (s1, t1, _) = self.pace[0], self.pace[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return round((self.total_steps - step) * (t1 - t0) / (s1 - s0) * per_hour / 3600, 6)
