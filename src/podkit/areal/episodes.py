"""The user's rollout workflow, watched: its episodes (arun_episode: generation, then the user's reward
function) run in AReaL's rollout thread, which logs each one that raises and goes on to the next. A reward
that raised on every call looped for ever without a step: millions of log lines, status "before its first
step", doctor "nothing wrong found", the pod billing.

Each episode's outcome is counted here (a patch of WorkflowExecutor._create_workflow_task wraps the
workflow of each task). trainer.max_episode_failures episodes failing in a row, none succeeding between
them, is code that cannot train: the last one's exception is handed to AReaL's task dispatcher as a failed
background thread's (BatchTaskDispatcher._set_thread_exception), so the trainer's main thread raises it
from its wait for rollouts, as AReaL does for its own threads. The bootstrap names it with the user's file
and line (failure.own reads through AReaL's wrapper) and the loop bound counts it. Failures that do not
come in a row (a flaky judge) are counted on rank 0's progress record: status and doctor show them.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from podkit import failure, log

_log = log.get("trainer")
WRITE_EVERY_S = 5.0  # the progress record of failures, at most this often (and at once on the first)


class Episodes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.limit = 0  # trainer.max_episode_failures; 0: never stop
        self.roots: list[str] = []  # the user's code (bootstrap): where a failure is named
        self.cfg = None  # the pod config (hooks.install): secrets are taken out of what is recorded
        self.progress = None  # rank 0's hooks.Progress while train() runs
        self.failed = self.succeeded = self.in_a_row = 0
        self.tripped = False
        self.last: dict | None = None
        self.written = 0.0

    def ok(self) -> None:
        with self.lock:
            self.succeeded += 1
            self.in_a_row = 0

    def fail(self, exc: BaseException, dispatcher) -> None:
        with self.lock:
            self.failed += 1
            self.in_a_row += 1
            trip = bool(self.limit) and self.in_a_row >= self.limit and not self.tripped
            self.tripped |= trip
            n, total = self.in_a_row, self.failed
            write = self.last is None or trip or time.monotonic() - self.written >= WRITE_EVERY_S
            if write:  # read the traceback only for what is written: a broken reward fails thousands of times
                self.written = time.monotonic()
                err = failure.describe(exc, self.roots)
                self.last = failure.clean(err, self.cfg) if self.cfg is not None else err
        if write:
            self._record(trip)
        if trip:
            _log.error(f"{n} rollout episodes in a row failed in the workflow, none succeeded ({total} so far): "
                       f"{self.last['type']}: {self.last['message'][:300]} at {self.last['where']}. Stopping the "
                       "trainer with it (trainer.max_episode_failures)")
            setter = getattr(dispatcher, "_set_thread_exception", None)
            if setter is not None:
                setter(exc)

    def _record(self, tripped: bool) -> None:
        progress = self.progress
        if progress is None:
            return
        last = {k: self.last.get(k) for k in ("type", "message", "where", "code", "hint")} if self.last else None
        try:
            progress.update(episodes={"failed": self.failed, "succeeded": self.succeeded, "in_a_row": self.in_a_row,
                                      "limit": self.limit, "tripped": tripped, "time": time.time(), "last": last})
        except OSError as e:  # a full volume must not turn the user's error into podkit's
            _log.warn(f"could not record the failed episodes: {e}")


EPISODES = Episodes()


class Watched:
    """The task's workflow, with its arun_episode's outcome counted; anything else is the workflow's own."""

    def __init__(self, workflow, dispatcher) -> None:
        self._workflow, self._dispatcher = workflow, dispatcher

    def __getattr__(self, name):
        return getattr(self._workflow, name)

    async def arun_episode(self, engine, data):
        try:
            out = await self._workflow.arun_episode(engine, data)
        except Exception as e:
            EPISODES.fail(e, self._dispatcher)
            raise
        EPISODES.ok()  # a trajectory, or None (rejected by the workflow): the code ran
        return out


def watch(create):
    """The wrapper of WorkflowExecutor._create_workflow_task (patches.watch_episodes)."""
    def watched(self, pending_task):
        return create(self, dataclasses.replace(pending_task, workflow=Watched(pending_task.workflow,
                                                                               self._dispatcher)))

    return watched
