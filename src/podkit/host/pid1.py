"""PID-1 duties: when podkit is the container's entrypoint, every orphan in the container becomes its
child, and an init that does not wait for them fills the process table with zombies; and supervisord,
PID 1 once boot execs it, must end the container's stop by itself before the stop timeout's SIGKILL.
Depends on nothing else in podkit."""

from __future__ import annotations

import os


def collect_children() -> None:
    """Wait for every child that has exited, without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


INITS = ("tini", "docker-init", "dumb-init")


def is_entrypoint() -> bool:
    """PID 1, or the direct child of a small init (tini, docker-init, dumb-init) that is PID 1."""
    if os.getpid() == 1:
        return True
    if os.getppid() != 1:
        return False
    try:
        with open("/proc/1/comm") as f:
            return f.read().strip() in INITS
    except OSError:
        return False


# -- supervisord as PID 1: the stop budget ----------------------------------------------------------------
STOP_DEADLINE_ENV = "PODKIT_STOP_DEADLINE_S"  # rendered from stop_timeout_s (render.stop_budget)
STOP_TURN_S = 0.05  # while stopping, supervisord's loop turns at least this often


def patch_supervisord(deadline_s: float) -> None:
    """Three changes to supervisord's main loop (supervisor 4.3: supervisord.py `runforever`, poller.py
    `PollPoller.poll`) that the stop budget needs; tests/faults/test_stop_budget.py holds their shape.

    1. A signal wakes the loop at once. Python retries poll() after a signal handler (PEP 475), so
       supervisord saw docker's SIGTERM, and each program's exit (SIGCHLD), only at its next 1-s turn:
       up to a second before the stop began, and again for every program on the way down.
    2. While stopping, the loop turns every STOP_TURN_S: a stopwaitsecs that runs out is acted on then.
    3. `deadline_s` after the stop began, every program still running is killed (SIGKILL, to its process
       group): PID 1 then exits by itself, before the container's stop timeout kills it (exit 137).
    """
    import select
    import signal
    import time

    from supervisor import poller, supervisord
    from supervisor.states import ProcessStates, SupervisorStates

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    base_poll, base_tick = poller.PollPoller.poll, supervisord.Supervisor.tick

    def poll(self, timeout):
        if getattr(self, "_podkit_polled", None) is not self._poller:  # once per select.poll object
            self._poller.register(wake_r, select.POLLIN)  # never in self.readables: the loop never sees it
            self._podkit_polled = self._poller
        if self.options.mood < SupervisorStates.RUNNING:
            timeout = min(timeout, STOP_TURN_S)
        readables, writables = base_poll(self, timeout)
        if wake_r in readables:
            readables.remove(wake_r)
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        return readables, writables

    stop = {}

    def tick(self, now=None):
        base_tick(self, now)
        if self.options.mood >= SupervisorStates.RUNNING or not deadline_s:
            stop.clear()  # running again after a reload (SIGHUP): the next stop has its own deadline
            return
        began = stop.setdefault("began", time.monotonic())
        if stop.get("killed") or time.monotonic() - began < deadline_s:
            return
        stop["killed"] = True
        for group in self.process_groups.values():
            for p in group.processes.values():
                if p.pid and p.get_state() in (ProcessStates.RUNNING, ProcessStates.STARTING, ProcessStates.STOPPING):
                    self.options.logger.warn(f"killing {p.config.name} (pid {p.pid}): the stop's deadline "
                                             f"({deadline_s:g} s, {STOP_DEADLINE_ENV}) has passed")
                    p.kill(signal.SIGKILL)

    poller.PollPoller.poll = poll
    supervisord.Supervisor.tick = tick


def exit_now(code: int) -> None:
    """End a supervised program that has done all it had to (its checkpoint, its records) without the
    interpreter's teardown: torch's alone takes 1 to 2 s of the stop's budget and writes nothing. Its
    threads that are not daemons are waited for first, as the interpreter would."""
    import sys
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_supervisord(argv: list[str]) -> None:
    """`python -m podkit.host.pid1 <supervisord> -n -c <conf>`: supervisord, with the stop budget's patch."""
    import sys

    patch_supervisord(float(os.environ.get(STOP_DEADLINE_ENV) or 0))
    from supervisor.supervisord import main

    sys.argv = argv
    main()


if __name__ == "__main__":
    import sys

    run_supervisord(sys.argv[1:])
