"""AReaL's discovery records (its file-based name_resolve store): where a trial's server addresses and
weight-update keys live, and clearing them before a run.

AReaL asks this store before AREAL_LLM_SERVER_ADDRS, so a record left by a dead run sends a new
trainer to a dead server, and a leftover weight-update key fails the rerun with NameEntryExistsError.
Only discovery records live there, never user data: removing a trial's directory is safe.
"""

from __future__ import annotations

import getpass
import re
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # config.NAME: one path component


def trial_dir(root: str, experiment: str, trial: str) -> Path:
    """AReaL's name_resolve keys live at <root>/<user>/<experiment>/<trial>/ (areal.utils.names)."""
    return Path(root) / getpass.getuser() / experiment / trial


def clear_user(root: str) -> list[str]:
    """Every trial's records under a root that is podkit's own (the private run dir's): when only AReaL's
    loader can tell the run's names, all of this user's go; nothing else uses that root."""
    d = Path(root) / getpass.getuser()
    if d.is_symlink() or not d.is_dir():
        return []
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    return [f"cleared stale name_resolve records {d}"]


def clear(root: str, experiment: str, trial: str) -> list[str]:
    if not all(NAME.match(n) and n not in (".", "..") for n in (experiment, trial)):
        return [f"name_resolve records of {experiment!r}/{trial!r} not cleared: not names (nothing outside "
                f"{root} is ever removed)"]
    d = trial_dir(root, experiment, trial)
    if not d.exists() and not d.is_symlink():
        return []
    if d.is_symlink() or not d.is_dir():
        d.unlink()
    else:
        import shutil  # only when there is something to remove: shutil loads zlib, bz2 and lzma

        shutil.rmtree(d, ignore_errors=True)
    return [f"cleared stale name_resolve records {d}"]
