"""The PID-stamped lock: an flock on a file that holds its holder's pid, so the one who waits, or is
refused, can say who holds it. The kernel drops the lock with its holder's last descriptor (a killed
holder leaves no stale lock); the pid in the file is for people only, never trusted to decide.
Used by the sync stage (one sync per checkout) and `podkit deploy watch` (one watch per run). Depends on
nothing else in podkit.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class Busy(Exception):
    """Another process holds the lock (for longer than the wait allowed)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path, self.holder = path, holder


class PidLock:
    """`with PidLock(path, wait_s=...)`: held inside the block, or Busy after `wait_s` (0: refused at once).
    `waiting(holder)` is called once when it has to wait. The file is made `mode`, never through a symlink."""

    POLL_S = 0.2

    def __init__(self, path: Path, wait_s: float = 0.0, mode: int = 0o600, waiting=None) -> None:
        self.path, self.wait_s, self.mode, self.waiting = Path(path), wait_s, mode, waiting
        self.fd = -1

    def __enter__(self) -> PidLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, self.mode)
        until, told = time.monotonic() + self.wait_s, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= until:
                    holder = self.holder()
                    os.close(self.fd)
                    raise Busy(self.path, holder) from None
                if not told and self.waiting:
                    self.waiting(self.holder())
                told = True
                time.sleep(self.POLL_S)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def holder(self) -> str:
        """The pid the holder wrote ("?" before it has)."""
        return os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
