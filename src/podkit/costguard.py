"""Cost guards: on RunPod, a pod whose training finished, or that has waited in safe mode for
`guard.stop_pod_after_s`, stops itself, so a run that ended at 3 a.m. does not bill GPUs until someone
looks. Off outside RunPod (no RUNPOD_POD_ID) and with `guard.stop_pod_when_finished: never` /
`guard.stop_pod_after_s: 0`.

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

from podkit import log

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


class Stopper:
    """One pod stop: notified once, sent, retried. `wanted()` (a reason to call it off, or "") is asked
    before each attempt: a guard set to never meanwhile, or a trainer started again, ends the retries."""

    def __init__(self, reason: str, state_dir: Path | None, wanted=None, say=None, notified: bool = False) -> None:
        self.reason, self.state_dir, self.notified = reason, state_dir, notified
        self.wanted = wanted or (lambda: "")
        self.say = say or _log.info
        self.done = False
        self.thread: threading.Thread | None = None

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
        while True:
            off = self.wanted()
            if off:
                self.say(f"the pod's self-stop is called off: {off}")
                return False
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
        def tick() -> None:
            while not self.cancelled and self.stopper is None:
                try:
                    self.check(time.time() - since)
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
def sooner(after: float, at: float, since: float, how: str = "") -> tuple[float, str]:
    """How long from `since` until the pod stops, and which setting says so: the sooner of
    guard.stop_pod_after_s and guard.stop_pod_at (deploy's maximum run time); 0: never."""
    if at and (not after or at - since < after):
        return max(at - since, 0.001), f"guard.stop_pod_at, the maximum run time{how}"
    return after, f"guard.stop_pod_after_s{how}"


def in_safe_mode(stage: str, settings: dict, workspace: Path | None, state_dir: Path | None, say) -> WhenIdle:
    """Safe mode's rule, watched from now: the pod stops after the sooner of guard.stop_pod_after_s and
    guard.stop_pod_at (`settings`, the pod's own), looked up afresh with `podkit guard set`'s changes
    (<workspace>/.podkit/guards.json) on top. `say` prints a line (stdout may be gone: it never raises)."""
    since = time.time()
    limits = None
    if state_dir is not None and workspace is not None:
        try:
            from podkit import guardfile  # safe mode only: not on a healthy boot's path

            live = guardfile.Live(workspace, settings, lambda m: say(f"[podkit:guard] {m}"))

            def limits() -> tuple[float, str]:
                v = live.values()
                changed = live.from_file("stop_pod_after_s") or live.from_file("stop_pod_at")
                return sooner(v["stop_pod_after_s"], v["stop_pod_at"], since,
                              ", set by `podkit guard set`" if changed else "")
        except Exception:  # noqa: BLE001 - safe mode goes on with the settings alone
            limits = None
    rule = WhenIdle(state_dir, f"in safe mode ({stage})", *sooner(settings["stop_pod_after_s"],
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
    """guard.stop_pod_at, the maximum run time, for the log listener: once it has passed, in a thread
    (events keep flowing), `stop_trainer()` stops the trainer with its checkpoint (it returns what to say of
    that checkpoint), then the pod (Stopper); a stop still refused after Stopper's retries is begun again
    RETRY_MAX_S later. `guard(key)` and `from_file(key)` are looked up each time: `podkit guard set` moves
    it, and moved past now after the trainer was stopped for it, the pod is left up, said once."""

    def __init__(self, guard, from_file, state_dir: Path | None, say, stop_trainer) -> None:
        self.guard, self.from_file, self.state_dir, self.say = guard, from_file, state_dir, say
        self.stop_trainer = stop_trainer
        self.thread: threading.Thread | None = None
        self.retry_at = 0.0
        self.done = False
        self.reason = ""
        self.moved = False

    def check(self, now: float) -> None:
        at = self.guard("stop_pod_at")
        if self.thread is not None and not self.done and (not at or now < at):
            if not self.moved:  # moved after the trainer was stopped for it: say what is left
                self.moved = True
                msg = ("guard.stop_pod_at moved after the trainer was stopped for it: the pod is not stopped, and "
                       "the trainer stays stopped until `podkit ctl start trainer watchdog`")
                self.say(msg)
                from podkit import notify

                notify.send("guard", msg, self.state_dir)
            return
        if self.done or not at or now < at or time.monotonic() < self.retry_at:
            return
        if self.thread and self.thread.is_alive():
            return
        self.retry_at = time.monotonic() + RETRY_MAX_S
        first = self.thread is None
        if first:
            self.reason = ("the maximum run time was reached (guard.stop_pod_at, " +
                           ("set on the running pod by `podkit guard set`)" if self.from_file("stop_pod_at")
                            else "set by podkit deploy --max-runtime)"))
        self.thread = threading.Thread(target=self._stop, args=(first,), name="max-runtime", daemon=True)
        self.thread.start()

    def _stop(self, first: bool) -> None:
        if first:
            self.say(f"{self.reason}: stopping the trainer with a checkpoint, then the pod")
            self.reason += f"; {self.stop_trainer()}"

        def wanted() -> str:
            at = self.guard("stop_pod_at")
            return "" if at and time.time() >= at else "guard.stop_pod_at moved"
        self.done = Stopper(self.reason, self.state_dir, wanted=wanted, say=self.say, notified=not first).run()
