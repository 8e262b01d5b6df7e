"""The user's rollout workflow, watched: its episodes (arun_episode: generation, then the user's reward
function; then AReaL's checks of the trajectory and the user's should_accept_fn) run in AReaL's rollout
thread, which logs each one that fails and goes on to the next. A reward that raised on every call looped
for ever without a step: millions of log lines, status "before its first step", doctor "nothing wrong
found", the pod billing.

Each task's outcome is counted here (a patch of WorkflowExecutor._create_workflow_task wraps the function it
makes, and the task's workflow and should_accept_fn, which are the user's code in it). A failure is an
exception from the workflow or should_accept_fn, or a trajectory AReaL could not use; a workflow that returns
None, or a trajectory should_accept_fn rejects, is the code working. trainer.max_episode_failures failing
in a row, none succeeding, over at least trainer.episode_failure_window_s (a judge or server out for a
moment fails every episode in flight without being the code's), is code that cannot train: the last
exception is handed to AReaL's task dispatcher as a failed background thread's
(BatchTaskDispatcher._set_thread_exception), so the trainer's main thread raises it from its wait for
rollouts, as AReaL does for its own threads. The bootstrap names it with the user's file and line
(failure.describe reads through AReaL's wrapper) and the loop bound counts it. Failures that do not come in
a row (a flaky judge) are counted on rank 0's progress record: status and doctor show them. Episodes that
fail because inference is down are counted too, and named so (failure.unreachable): on a cluster, where
nothing restarts a dead server under a waiting trainer, the trip is what ends the wait for rollouts and lets
AReaL's recover run start a new one.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from podkit import log
from podkit.judge import failure

_log = log.get("trainer")
WRITE_EVERY_S = 5.0  # the progress record of failures, at most this often (and at once on the first and the trip)


class TrajectoryRefused(RuntimeError):
    """The workflow returned a trajectory that AReaL's own checks or conversion refused (its traceback is in
    the trainer's log, 'Workflow execution failed')."""


class Episodes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.limit, self.window_s = 0, 0.0  # trainer.max_episode_failures (0: never stop), its minimum span
        self.roots: list[str] = []  # the user's code (bootstrap): where a failure is named
        self.cfg = None  # the pod config (hooks.install): secrets are taken out of what is recorded
        self.progress = None  # rank 0's hooks.Progress while train() runs
        self.failed = self.succeeded = self.in_a_row = 0
        self.since = 0.0  # when the failures in a row began (monotonic)
        self.tripped = False
        self.last: dict | None = None  # the last failure of the user's code, described
        # Failures that were AReaL's request to inference never getting through (failure.unreachable_at, at one of
        # the engine's own addresses): the server's, not the workflow's. The last one's words, and how many.
        self.unreachable, self.down_failed, self.down_in_a_row = "", 0, 0
        self.written = 0.0

    def server_down(self) -> str:
        """The server's words when the trip that stopped the trainer was every failure of it inference not
        answering (its own addresses), else "": the end is then inference's, not the workflow's (verdict.judge)."""
        with self.lock:
            return self.unreachable if self.tripped and self.in_a_row and self.down_in_a_row >= self.in_a_row else ""

    def ok(self) -> None:
        with self.lock:
            self.succeeded += 1
            self.in_a_row = self.down_in_a_row = 0
            # the record's counts stay current once there is a failure to show beside them
            write = self.failed and time.monotonic() - self.written >= WRITE_EVERY_S
            if write:
                self.written = time.monotonic()
        if write:
            self._record()

    def fail(self, exc: BaseException, dispatcher, servers=()) -> None:
        now = time.monotonic()
        at = failure.unreachable_at(exc)
        down = at is not None and (not servers or at["addr"] in servers)  # not a judge the user's code calls
        with self.lock:
            self.failed += 1
            self.in_a_row += 1
            self.down_failed += down
            self.down_in_a_row = self.down_in_a_row + 1 if down else 0
            if self.in_a_row == 1:
                self.since = now
            trip = bool(self.limit) and self.in_a_row >= self.limit and now - self.since >= self.window_s \
                and not self.tripped
            self.tripped |= trip
            n, total, span = self.in_a_row, self.failed, now - self.since
            server = self.down_in_a_row == self.in_a_row  # the failures in a row are all the server's
            write = self.failed == 1 or trip or now - self.written >= WRITE_EVERY_S \
                or (not down and self.last is None)
            if write:  # read the traceback only for what is written: a broken reward fails thousands of times
                self.written = now
                if down:
                    self.unreachable = self._clean(failure.unreachable(at))
                else:
                    self.last = self._clean(failure.describe(exc, self.roots))
            why = self.unreachable if server else \
                f"{self.last['type']}: {self.last['message'][:300]} at {self.last['where']}" if self.last else ""
        if write:
            self._record()
        if trip:
            _log.error(f"{n} rollout episodes in a row failed over {span:.0f}s, none succeeded ({total} so far): "
                       f"{why}. Stopping the trainer with it (trainer.max_episode_failures)")
            setter = getattr(dispatcher, "_set_thread_exception", None)
            if setter is not None:
                setter(exc)

    def _clean(self, err):
        """`err` (a record, or text) with the pod's secrets taken out (failure.clean)."""
        if self.cfg is None:
            return err
        if isinstance(err, str):
            return failure.clean({"text": err}, self.cfg)["text"]
        return failure.clean(err, self.cfg)

    def _record(self) -> None:
        progress = self.progress
        if progress is None:
            return
        with self.lock:
            last = {k: self.last.get(k) for k in ("type", "message", "where", "code", "hint")} if self.last else None
            record = {"failed": self.failed, "succeeded": self.succeeded, "in_a_row": self.in_a_row,
                      "limit": self.limit, "tripped": self.tripped, "time": time.time(), "last": last,
                      "unreachable": self.unreachable, "unreachable_failed": self.down_failed,
                      "unreachable_in_a_row": self.down_in_a_row}
        try:
            progress.update(episodes=record)
        except OSError as e:  # a full volume must not turn the user's error into podkit's
            _log.warn(f"could not record the failed episodes: {e}")


EPISODES = Episodes()


class Outcome:
    """What one task's user code did: raised (exc), returned a trajectory or None, or had it rejected."""

    __slots__ = ("exc", "returned", "trajectory", "rejected")

    def __init__(self) -> None:
        self.exc: BaseException | None = None
        self.returned = self.trajectory = self.rejected = False


class Watched:
    """The task's workflow, its arun_episode's outcome noted; anything else is the workflow's own."""

    def __init__(self, workflow, outcome: Outcome) -> None:
        self._workflow, self._outcome = workflow, outcome

    def __getattr__(self, name):
        if name in ("_workflow", "_outcome"):  # copy/pickle look before __init__ ran
            raise AttributeError(name)
        return getattr(self._workflow, name)

    async def arun_episode(self, engine, data):
        try:
            traj = await self._workflow.arun_episode(engine, data)
        except Exception as e:
            self._outcome.exc = e
            raise
        self._outcome.returned, self._outcome.trajectory = True, traj is not None
        return traj


def _accepting(fn, outcome: Outcome):
    if fn is None:
        return None

    def should_accept(traj):
        try:
            ok = fn(traj)
        except Exception as e:
            outcome.exc = e
            raise
        outcome.rejected = not ok
        return ok

    return should_accept


def _refused(workflow) -> TrajectoryRefused:
    cls = type(workflow)
    code = getattr(getattr(cls, "arun_episode", None), "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return TrajectoryRefused(f"AReaL could not use the trajectory {cls.__qualname__}.arun_episode{where} returned "
                             "(its format check or conversion failed; logs/trainer.log has AReaL's traceback under "
                             "'Workflow execution failed')")


def _addresses(engine) -> tuple[str, ...]:
    """The inference servers this rollout asks (RemoteInfEngine.addresses, through RemoteSGLangEngine's _engine);
    () when they cannot be told: any unreachable address then counts as inference's."""
    for e in (engine, getattr(engine, "_engine", None)):
        addrs = getattr(e, "addresses", None)
        if isinstance(addrs, (list, tuple)) and addrs:
            return tuple(str(a) for a in addrs)
    return ()


def watch(create):
    """The wrapper of WorkflowExecutor._create_workflow_task (patches.watch_episodes)."""
    def watched(self, pending_task):
        outcome = Outcome()
        task = dataclasses.replace(pending_task, workflow=Watched(pending_task.workflow, outcome),
                                   should_accept_fn=_accepting(pending_task.should_accept_fn, outcome))
        execute, dispatcher = create(self, task), self._dispatcher
        servers = _addresses(getattr(self, "inference_engine", None))

        async def counted():
            result = await execute()
            if outcome.exc is not None:
                EPISODES.fail(outcome.exc, dispatcher, servers)
            elif result is not None or not outcome.trajectory or outcome.rejected:
                if outcome.returned:  # a trajectory used, None from the workflow, or one it rejected
                    EPISODES.ok()
            else:  # a trajectory, not rejected, and nothing came of it: AReaL's own handling failed
                EPISODES.fail(_refused(pending_task.workflow), dispatcher, servers)
            return result

        return counted

    return watched

