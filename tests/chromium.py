"""A real headless browser for the page's tests (tests/views/test_page.py) and the real trainer's
(tests/trainer/test_your_code.py): Debian's chromium, which `make sysdeps` installs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browser(profile: Path, *args: str, timeout: float = 90) -> str:
    """chromium --headless with a profile of its own (its cookie jar), in a session of its own: on a timeout, its
    whole process group (the renderers it forked) is killed, nothing else."""
    p = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--disable-extensions", f"--user-data-dir={profile}", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a renderer left behind by a crash: the group is ours
        except ProcessLookupError:
            pass
    assert p.returncode == 0, err[-3000:]
    return out
