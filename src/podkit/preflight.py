"""The preflight stage: check what the other stages and programs need before touching anything."""

from __future__ import annotations

import glob
import os
import stat
import sys
from pathlib import Path

from podkit import checks, lease, log, proc
from podkit.errors import ConfigError, StageError

_log = log.get("preflight")
MIN_FREE_BYTES = 2 << 30  # below this a checkpoint write can fail mid-file


def supervisord_path() -> str | None:
    beside = Path(sys.executable).parent / "supervisord"  # same venv as podkit
    return str(beside) if beside.exists() else proc.which("supervisord")


class WorkspaceHeld(StageError):
    """Another pod holds the workspace: wait in safe mode, and boot by itself once it is free."""

    def __init__(self, cfg, holder: dict) -> None:
        super().__init__("preflight", f"workspace {cfg.workspace_path} is in use by another pod "
                         f"({lease.describe(holder, cfg.guard.lease_s)})",
                         "two pods on one volume would train into one checkpoint directory; stop the other "
                         "pod, or give this one its own volume or PODKIT_WORKSPACE. This boot goes on by "
                         "itself once the other pod's hold is released or lapses")
        self.retry = lambda: not lease.live(lease.read(cfg.state_dir), cfg.guard.lease_s)


def private_dir(path: Path) -> None:
    """The run dir holds supervisord's control socket and the records of which processes are podkit's:
    it must be podkit's own. Created mode 0700; one that exists must be a real directory (not a
    symlink) owned by this user, and nobody else may write into it. /tmp is shared: anyone can
    create a directory at a predictable name there first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StageError("preflight", f"cannot create run dir {path}: {e.strerror}",
                         "set PODKIT_RUN_DIR to a writable local directory") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StageError("preflight", f"cannot inspect run dir {path}: {e.strerror}", "set PODKIT_RUN_DIR") from None
    why = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
           else f"is owned by uid {st.st_uid}, not {os.getuid()}" if st.st_uid != os.getuid() else "")
    if why:
        raise StageError("preflight", f"run dir {path} {why}: someone else made it, so podkit will not use it",
                         "set PODKIT_RUN_DIR to a directory of your own, or remove that one")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: tighten it, then nobody else can have planted anything after this


def run(cfg) -> None:
    for w in cfg.warnings:
        _log.warn(w)
    _log.info(f"config {cfg.source}; workspace {cfg.workspace_path}")
    ws = cfg.workspace_path
    for d in (ws, cfg.log_dir, cfg.checkpoint_dir, cfg.state_dir):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StageError("preflight", f"cannot create {d}: {e.strerror}",
                             "mount a writable volume at the workspace (PODKIT_WORKSPACE)") from None
    probe = cfg.state_dir / f".write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"podkit")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise StageError("preflight", f"workspace {ws} is not writable: {e.strerror}",
                         "checkpoints and logs go there; mount it read-write") from None
    holder = lease.acquire(cfg.state_dir, cfg.guard.lease_s)
    if holder is not None:
        raise WorkspaceHeld(cfg, holder)
    vfs = os.statvfs(ws)
    free = vfs.f_bavail * vfs.f_frsize
    if free < MIN_FREE_BYTES:
        _log.warn(f"only {free / 2**30:.1f} GiB free on {ws}: checkpoints may fail; free space or grow the volume")
    private_dir(cfg.run_path)
    if not supervisord_path():
        raise StageError("preflight", "supervisord is not installed", "pip install supervisor (podkit depends on it)")
    if cfg.inference.kind == "standin" and not checks.loopback(cfg.inference.host):
        raise StageError("preflight", f"inference.host {cfg.inference.host} is not loopback",
                         "the stand-in binds 127.0.0.1 only; set PODKIT_INFERENCE_HOST=127.0.0.1")
    for key, what, hint in checks.programs(cfg):
        raise ConfigError(cfg.origin(key), key, what, hint=hint)
    devices = glob.glob(cfg.devices)
    smi = proc.which("nvidia-smi")
    _log.info(f"{len(devices)} device file(s) match {cfg.devices}; nvidia-smi {'found' if smi else 'absent'}")
