"""The crash-loop guard: every boot is recorded on the volume; boots that come too fast stop in
safe mode instead of starting training again (docs/failures.md: a loop every 17 s looked like a crash).

`<workspace>/.podkit/boots.json` holds the recent boots (time, pid, each stage's outcome and how long it
took, the reason of the stop before it when known): `podkit boot`'s, and `podkit up`'s (marked "via": "up",
not counted by the guard: a person starts those, and they exit rather than loop). `podkit resume` writes `resume.json`: boots before it
no longer count, and a boot waiting in safe mode is told (SIGUSR1) to boot again in place.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from podkit import records
from podkit.errors import PodkitError
from podkit.judge import ending

KEEP = 50


class Boot:
    """This boot's record; every change is written through (a boot may die at any point)."""

    def __init__(self, state_dir: Path, via: str = "boot") -> None:
        self.state_dir = state_dir
        self.boots = records.BOOTS.read(state_dir)
        previous = self.boots[-1] if self.boots else None
        self.rec = {"time": time.time(), "pid": os.getpid(), "stages": {}, "outcome": "booting",
                    "last_stop": last_stop(state_dir, previous)}
        if via != "boot":
            self.rec["via"] = via
        self.boots = (self.boots + [self.rec])[-KEEP:]
        self._write()

    def _write(self) -> None:
        try:
            records.BOOTS.write(self.state_dir, self.boots)
        except OSError:
            pass  # read-only or full volume: preflight says so; the guard must not hide it

    def stage(self, name: str, outcome: str, took_s: float | None = None) -> None:
        self.rec["stages"][name] = outcome
        if took_s is not None:  # the start-up timeline's first phases (podkit status, startup.py)
            self.rec.setdefault("took_s", {})[name] = round(took_s, 3)
        self._write()

    def done(self, outcome: str) -> None:
        self.rec["outcome"] = outcome
        self._write()


def last_stop(state_dir: Path, previous: dict | None) -> str:
    """Why the run before this boot ended, from the end its trainer recorded (ending.py), in its kind's words
    and at the end's own step (a start-over since clears the progress record's)."""
    if previous is None:
        return "first boot on this workspace"
    when = previous.get("time")
    end = ending.read(state_dir, since=when if isinstance(when, (int, float)) else None)
    if end is not None:
        return f"{end.kind.name}: {end.said()}"
    if previous.get("outcome") == "safe-mode":
        return f"stopped in safe mode ({previous.get('reason', '')})"
    return "unknown: no end recorded (killed, crashed, OOM, or the container was restarted)"


def recent(state_dir: Path, window_s: float, now: float | None = None) -> list[dict]:
    """The container's boots within the window and after the last `podkit resume` (not `podkit up`'s)."""
    now = time.time() if now is None else now
    since = max(now - window_s, records.RESUME.read(state_dir).get("time") or 0)
    return [b for b in records.BOOTS.read(state_dir) if (b.get("time") or 0) > since and b.get("via") != "up"]


def storm(state_dir: Path, max_boots: int, window_s: float) -> str | None:
    boots = recent(state_dir, window_s)
    if len(boots) <= max_boots:
        return None
    span = boots[-1]["time"] - boots[0]["time"]
    return (f"crash-loop guard: {len(boots)} boots in {span:.0f}s (limit {max_boots} in {window_s:.0f}s); "
            f"the last stop: {boots[-2].get('last_stop') if len(boots) > 1 else 'unknown'}")


def resume(state_dir: Path) -> str:
    """Forgive the boots so far; wake a boot that waits in safe mode."""
    if not state_dir.is_dir():
        raise PodkitError(f"no podkit workspace at {state_dir.parent} (it has no .podkit/)",
                          "pass the pod's workspace: --workspace /workspace, or PODKIT_WORKSPACE")
    records.RESUME.write(state_dir, {"time": time.time()})
    waiting = records.SAFE_MODE.read(state_dir)
    pid = waiting.get("pid")
    if pid and _is_podkit(pid):
        os.kill(pid, signal.SIGUSR1)
        return f"told the boot waiting in safe mode (pid {pid}) to boot again"
    return "boot history cleared: the next boot starts training"


def _is_podkit(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"podkit" in f.read()
    except OSError:
        return False
