"""Checkpoints that a kill -9 cannot corrupt: write to a temp file, fsync, rename, then move `latest`.

`latest` names the newest complete checkpoint; a reader that finds it unreadable falls back to the
newest checkpoint that loads. Temp files of a writer that died are the writer's own, never data.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from podkit import log

_log = log.get("checkpoint")
NAME = re.compile(r"^step-(\d+)\.pt$")
TEMP = re.compile(r"^\.step-\d+\.pt\.tmp-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class CheckpointDir:
    def __init__(self, path: Path, keep: int = 0) -> None:
        self.path = Path(path)
        self.keep = keep

    def steps(self) -> list[tuple[int, Path]]:
        if not self.path.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := NAME.match(p.name))]
        return sorted(found, reverse=True)

    def latest_path(self) -> Path | None:
        try:
            name = (self.path / "latest").read_text().strip()
        except OSError:
            name = ""
        if name and NAME.match(name) and (self.path / name).exists():
            return self.path / name
        steps = self.steps()
        return steps[0][1] if steps else None

    def save(self, torch, step: int, state: dict) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / f"step-{step:08d}.pt"
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not also keep our half file
            raise
        os.replace(tmp, final)
        pointer = self.path / f".latest.tmp-{os.getpid()}"
        pointer.write_text(final.name + "\n")
        with open(pointer) as f:
            os.fsync(f.fileno())
        os.replace(pointer, self.path / "latest")
        _fsync_dir(self.path)
        self._retain()
        return final

    def _retain(self) -> None:
        if self.keep:
            for _, old in self.steps()[self.keep:]:
                old.unlink(missing_ok=True)

    def clear_dead_temps(self) -> list[Path]:
        removed = []
        if self.path.is_dir():
            for p in self.path.iterdir():
                m = TEMP.match(p.name) or re.match(r"^\.latest\.tmp-(\d+)$", p.name)
                if m and not _pid_alive(int(m.group(1))):
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    def load_latest(self, torch) -> tuple[Path, dict] | None:
        """The newest checkpoint that loads; a corrupt one is reported and skipped, never deleted."""
        for p in self.clear_dead_temps():
            _log.info(f"removed {p.name}, the temp file of a writer that died mid-checkpoint")
        candidates = []
        latest = self.latest_path()
        if latest is not None:
            candidates.append(latest)
        candidates += [p for _, p in self.steps() if p != latest]
        for p in candidates:
            try:
                return p, torch.load(p, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file means: try the previous one
                _log.warn(f"checkpoint {p.name} is unreadable ({type(e).__name__}: {e}); trying an older one")
        return None
