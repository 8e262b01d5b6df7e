"""Podkit's records on the volume (`<workspace>/.podkit/`): written atomically, read forgivingly."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, data: object) -> None:
    """temp file + fsync + rename: a reader sees the old record or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path, default: object = None) -> object:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default
