"""Safe mode: a boot that cannot start training waits here, explaining itself, instead of exiting.

An exiting PID 1 is a restart loop under `restart: always` or RunPod (docs/failures.md: a failed
`git clone` restarted the container every 17 s for hours and looked like a training crash).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from podkit import records
from podkit.host import pid1

REMIND_EVERY_S = 600


def banner(stage: str, message: str, hint: str) -> str:
    lines = [
        "=" * 78,
        f"podkit is in SAFE MODE: the {stage} stage failed, so training was not started.",
        f"  why: {message}",
    ]
    if hint:
        lines.append(f"  fix: {hint}")
    lines += [
        "  The container stays up on purpose (exiting would restart-loop it). Fix the cause, then",
        "  run `podkit resume` in the container (or restart it); `podkit status` shows this again.",
        "=" * 78,
    ]
    return "\n".join(lines)


def record(state_dir: Path | None, stage: str, message: str, hint: str, traceback: str = "") -> None:
    if state_dir is None:
        return
    rec = {"stage": stage, "message": message, "hint": hint, "since": time.time(), "pid": os.getpid()}
    if traceback:
        rec["traceback"] = traceback
    try:
        records.SAFE_MODE.write(state_dir, rec)
    except OSError:
        pass  # a read-only or full workspace is often the reason we are here


def clear(state_dir: Path) -> None:
    records.SAFE_MODE.path(state_dir).unlink(missing_ok=True)


def say(text: str) -> None:
    """stdout may be closed or full (a detached container): safe mode goes on without it."""
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        pass


RETRY_EVERY_S = 5


class Why:
    """Everything safe mode is told, built once by the boot: the failure (`stage`, `message`, `hint`, the
    `traceback` of a bug), `retry()` (asked every few seconds: true once the cause went away by itself), and
    where the waiting pod reports and bills: `state_dir` (the records), `workspace`, `guards` (the cost
    guard's settings: stop_pod_after_s, stop_pod_at), `metrics` (metrics.serve_in_background's arguments), `page`
    (the config the run's page is served with: a pod in safe mode is when a person looks).
    Data goes one way: boot -> safe mode -> its reporters (records, notify, metrics, costguard)."""

    def __init__(self, stage: str, message: str, hint: str = "", traceback: str = "", retry=None,
                 state_dir: Path | None = None, workspace: Path | None = None, guards: dict | None = None,
                 metrics: dict | None = None, page=None) -> None:
        self.stage, self.message, self.hint, self.traceback, self.retry = stage, message, hint, traceback, retry
        self.state_dir, self.workspace, self.guards, self.metrics = state_dir, workspace, guards, metrics
        self.page = page  # the config the page is served with (page.serve_in_background), or None


def wait(why: Why) -> int:
    """Blocks until SIGTERM/SIGINT, then returns 0 (docker stop ends safe mode promptly).
    SIGUSR1 (`podkit resume`) boots again in place: same pid, so PID 1 stays PID 1; so does `why.retry()`
    turning true (the cause went away by itself, such as another pod's hold on the workspace). On RunPod
    the cost guard stops the pod after a while (costguard.in_safe_mode, from `why.guards`). With
    `why.metrics`, /metrics says so meanwhile. Nothing in here may end the process otherwise: a failure of
    its own falls back to waiting."""
    stage, message, hint, state_dir, retry = why.stage, why.message, why.hint, why.state_dir, why.retry
    stopping = []
    resume = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    signal.signal(signal.SIGUSR1, lambda *_: resume.append(1))
    try:
        record(state_dir, stage, message, hint, why.traceback)
        say(banner(stage, message, hint))
        from podkit import notify  # here, not at the top: urllib is not on a healthy boot's path

        notify.send("guard" if stage == "guard" else "safe-mode",
                    f"SAFE MODE ({stage}): {message}" + (f" | fix: {hint}" if hint else ""), state_dir)
    except Exception:  # noqa: BLE001 - explaining must not be what ends PID 1
        pass
    if why.metrics and why.metrics.get("port"):
        try:
            from podkit.views import metrics as endpoint  # prometheus_client: not on a healthy boot's path

            endpoint.serve_in_background(**why.metrics)
        except Exception as e:  # noqa: BLE001 - nor may serving metrics
            say(f"[podkit:metrics] cannot serve metrics in safe mode ({type(e).__name__}: {e})")
    if why.page is not None:
        try:
            from podkit.views import page  # http.server: not on a healthy boot's path

            page.serve_in_background(why.page)
        except Exception as e:  # noqa: BLE001 - nor may serving the page
            say(f"[podkit:page] cannot serve the page in safe mode ({type(e).__name__}: {e})")
    last = checked = time.monotonic()
    if why.guards:
        try:
            from podkit.money import costguard  # the cost guard watches in a thread of its own

            costguard.in_safe_mode(stage, why.guards, why.workspace, state_dir, say)
        except Exception:  # noqa: BLE001 - the cost guard must not be what ends PID 1
            pass
    while not stopping:
        if retry and time.monotonic() - checked >= RETRY_EVERY_S:
            checked = time.monotonic()
            try:
                if retry():
                    say("[podkit:boot] the cause of safe mode is gone: booting again")
                    resume.append(1)
            except Exception:  # noqa: BLE001 - a failing check keeps waiting
                pass
        if resume:
            resume.clear()
            say("[podkit:boot] resume requested: booting again")
            try:
                # The same command line: `podkit --config X boot` boots again with X, not the defaults.
                os.execv(sys.executable, [sys.executable, "-m", "podkit", *(sys.argv[1:] or ["boot"])])
            except OSError as e:
                say(f"[podkit:boot] cannot boot again ({e}); still in safe mode")
        time.sleep(0.2)
        try:
            pid1.collect_children()
        except OSError:
            pass
        if time.monotonic() - last > REMIND_EVERY_S:
            say(f"[podkit:boot] still in safe mode ({stage}: {message})")
            last = time.monotonic()
    return 0
