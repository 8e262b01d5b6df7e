"""Tagged log lines: `[podkit:<stage>] message`, the tag being the stage's module and CLI verb."""

from __future__ import annotations

import sys
import time

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_threshold = 20


_stream = None


def to_stderr() -> None:
    """Keep stdout for machine output (--json)."""
    global _stream
    _stream = sys.stderr


def set_level(name: str) -> None:
    global _threshold
    _threshold = _LEVELS.get(name, 20)


class Log:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def _emit(self, level: int, prefix: str, msg: str) -> None:
        if level < _threshold:
            return
        out = _stream or sys.stdout
        stamp = time.strftime("%H:%M:%S")
        for i, line in enumerate(str(msg).splitlines() or [""]):
            lead = f"{stamp} [podkit:{self.tag}] {prefix}" if i == 0 else f"{stamp} [podkit:{self.tag}]   "
            out.write(lead + line + "\n")
        out.flush()

    def debug(self, msg: str) -> None:
        self._emit(10, "", msg)

    def info(self, msg: str) -> None:
        self._emit(20, "", msg)

    def warn(self, msg: str) -> None:
        self._emit(30, "WARNING: ", msg)

    def error(self, msg: str) -> None:
        self._emit(40, "ERROR: ", msg)


def get(tag: str) -> Log:
    return Log(tag)
