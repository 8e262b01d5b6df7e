"""`python -m podkit.host.subreap --report FILE -- CMD...`: run CMD below a child subreaper, and stop whatever it
leaves once it ends.

The setup stage runs repo.setup's command so. A daemon the command starts and leaves (forked twice, in a
session and an environment of its own, so carrying no mark to find it by) is re-parented here instead of to
PID 1, and is stopped (TERM, 2 s, KILL) when the command ends, or when this process gets SIGTERM (the stage's
timeout, the pod's stop). Only this process's descendants: never anything outside them. What was stopped goes
to FILE as JSON for the stage to name. Exits with the command's code (128 + N for a signal N).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from podkit.host import proc


class _Stopped(Exception):
    pass


def _stop(*_) -> None:
    raise _Stopped


def main(argv: list[str]) -> int:
    report = None
    if argv[:1] == ["--report"] and len(argv) > 1:
        report, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m podkit.host.subreap [--report FILE] -- CMD...", file=sys.stderr)
        return 2
    proc.become_subreaper()
    signal.signal(signal.SIGTERM, _stop)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"{argv[0]}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127)
    try:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
    except _Stopped:
        code = 128 + signal.SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping what is left is this process's last duty
    left = proc.stop_descendants("left running by repo.setup, which has ended")
    if report:
        try:
            with open(report, "w") as f:
                json.dump([{"pid": t.pid, "cmdline": t.cmdline or t.name, "outcome": t.outcome, "signal": t.signal,
                            "reason": t.reason, "state": t.state} for t in left], f)
        except OSError:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
