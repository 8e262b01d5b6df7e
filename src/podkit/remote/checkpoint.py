"""Checkpoints that a kill -9 cannot corrupt: write to a temp file, fsync, rename, then move `latest`.

`latest` names the newest complete checkpoint; a reader that finds it unreadable falls back to the
newest checkpoint that loads. Temp files of a writer that died are the writer's own, never data.

The bytes are a codec's (`save(state, file)`, `load(path) -> dict`): NPZ, numpy's uncompressed zip, whose
member CRCs make a flipped or torn byte an error on load, and which loads no pickle.
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
        self.unreadable: list[Path] = []

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

    def save(self, codec, step: int, state: dict) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / f"step-{step:08d}.pt"
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                codec.save(state, f)
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

    def set_aside(self, p: Path) -> Path:
        """Move a checkpoint that does not load to `unreadable/` beside the others, kept for a person: a step
        number it still held would outrank the run's own checkpoints (retention would delete those, and
        the remote would take it for the newest)."""
        dest_dir = self.path / "unreadable"
        if dest_dir.is_symlink() or (os.path.lexists(dest_dir) and not dest_dir.is_dir()):
            raise OSError(f"{dest_dir} is not a directory of podkit's (a link or a file)")
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / p.name
        n = 1
        while os.path.lexists(dest):  # one set aside before (a restore brought it back): both kept
            dest, n = dest_dir / f"{p.name}.{n}", n + 1
        os.rename(p, dest)
        return dest

    def load_latest(self, codec) -> tuple[Path, dict] | None:
        """The newest checkpoint that loads; a corrupt one is reported and skipped, never deleted. Those
        skipped for their contents (not for a read that failed) are in `self.unreadable`, newest first."""
        for p in self.clear_dead_temps():
            _log.info(f"removed {p.name}, the temp file of a writer that died mid-checkpoint")
        candidates = []
        latest = self.latest_path()
        if latest is not None:
            candidates.append(latest)
        candidates += [p for _, p in self.steps() if p != latest]
        self.unreadable = []
        for p in candidates:
            try:
                return p, codec.load(p)
            except Exception as e:  # noqa: BLE001 - any unreadable file means: try the previous one
                _log.warn(f"checkpoint {p.name} is unreadable ({type(e).__name__}: {e}); trying an older one")
                if not isinstance(e, OSError):  # its bytes, not a read that failed this time (EIO, gone)
                    self.unreadable.append(p)
        return None


class NPZ:
    """A nested dict of arrays and numbers as one .npz (keys joined with '/'); numpy is imported on use, so
    what reads checkpoint names (remote, status) never pays for it."""

    @staticmethod
    def save(state: dict, target) -> None:
        import numpy as np

        flat: dict = {}

        def walk(prefix: str, node) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    if "/" in str(k) or not str(k):
                        raise ValueError(f"checkpoint key {k!r}: empty or holds '/'")
                    walk(f"{prefix}{k}/", v)
            else:
                flat[prefix[:-1]] = np.asarray(node)

        walk("", state)
        if isinstance(target, (str, os.PathLike)):  # np.savez would append .npz to a name
            with open(target, "wb") as f:
                np.savez(f, **flat)
        else:
            np.savez(target, **flat)

    @staticmethod
    def load(path) -> dict:
        import zipfile

        import numpy as np

        state: dict = {}
        with np.load(path, allow_pickle=False) as z:
            names = [i.filename for i in z.zip.infolist()]
            if any(n.endswith("data.pkl") for n in names):
                raise ValueError("a torch checkpoint, not NPZ (an older podkit's fake trainer wrote torch's)")
            if any(i.compress_type != zipfile.ZIP_STORED for i in z.zip.infolist()):
                # np.savez stores: a deflated member is not ours, and could inflate a small file to GBs
                raise ValueError("a compressed member: not an NPZ checkpoint podkit wrote")
            for key in z.files:
                *parents, leaf = key.split("/")
                node = state
                for k in parents:
                    node = node.setdefault(k, {})
                    if not isinstance(node, dict):
                        raise ValueError(f"checkpoint key {key!r} is under a value")
                if isinstance(node.get(leaf), dict):
                    raise ValueError(f"checkpoint key {key!r} is a value and a tree")
                value = z[key]
                if not isinstance(value, np.ndarray):  # a member that is not .npy: another format's zip
                    raise ValueError(f"member {key!r} is not an array: not an NPZ checkpoint")
                node[leaf] = value.item() if value.ndim == 0 else value
        return state
