"""Cost guards: on RunPod, a pod whose training finished, or that has waited in safe mode for
`guard.stop_pod_after_s`, stops itself, so a run that ended at 3 a.m. does not bill GPUs until someone
looks. Off outside RunPod (no RUNPOD_POD_ID) and with `guard.stop_pod_when_finished: never` /
`guard.stop_pod_after_s: 0`.

A stopped pod keeps its volume (checkpoints, logs, the repo) and bills only for disk; it restarts from
the console or `podkit deploy start`. The call is REST API v2's `POST /v2/pods/{id}/action` with
{"action": "stop"}, made with the pod's own RUNPOD_API_KEY (RunPod puts RUNPOD_POD_ID and a pod-scoped
key in every pod), through podkit.runpod: stdlib only, as the image has no SDK.
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
    if now.get("status") == "EXITED":
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
