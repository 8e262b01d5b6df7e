"""The preflight stage: check what the other stages and programs need before touching anything."""

from __future__ import annotations

import glob
import os
import re
import stat
import sys
from pathlib import Path

from podkit import log
from podkit.areal import checks
from podkit.errors import StageError
from podkit.host import lease, proc

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
        # Taken in the waiting process, which has watched the holder since it came: a boot exec'd to
        # check would start its watch over (and the lease, ours from before the exec, stays ours).
        self.retry = lambda: lease.acquire(cfg.state_dir, cfg.guard.lease_s, renew_s=lease.RENEW_S) is None


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
    holder = lease.acquire(cfg.state_dir, cfg.guard.lease_s, renew_s=lease.RENEW_S)
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
    page_note = checks.page_loopback_only(cfg)
    if page_note:
        _log.warn(page_note)
    problems = checks.programs(cfg)
    if problems:
        raise checks.config_error(cfg, problems)
    devices = glob.glob(cfg.devices)
    smi = proc.which("nvidia-smi")
    _log.info(f"{len(devices)} device file(s) match {cfg.devices}; nvidia-smi {'found' if smi else 'absent'}")
    if cfg.inference.kind == "sglang" and (not cfg.multi_node or cfg.cluster.rank == 0):
        from podkit.boot import weights

        if weights.where(cfg) == "download":
            _log.warn(f"the weights of {cfg.inference.model} are not on the volume: SGLang downloads them at "
                      "start, while the GPUs bill; `podkit weights` puts them there ahead (on a cheap pod of "
                      "the same volume)")
    if os.environ.get("RUNPOD_POD_ID"):
        pod_facts(cfg, os.environ)


COUNT = re.compile(r"^[0-9]{1,4}$")
VOLUME_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def gpus_used(cfg) -> tuple[int, ...]:
    """The GPU indexes this node's programs take (inference.gpus for SGLang, trainer.gpus for AReaL on GPUs);
    a cluster's node gives Ray cluster.gpus (0: unknown, Ray counts them)."""
    if cfg.multi_node:
        return tuple(range(cfg.cluster.gpus))
    used = set()
    if cfg.inference.kind == "sglang":
        used |= set(cfg.gpus["inference"])
    if cfg.trainer.kind == "areal" and not cfg.trainer.cpu_ranks:
        used |= set(cfg.gpus["trainer"])
    return tuple(sorted(used))


def pod_facts(cfg, environ) -> None:
    """On RunPod: the GPUs RunPod says this pod has (RUNPOD_GPU_COUNT, untrusted), the GPU device files
    visible and the GPUs the config takes must agree; a pod RunPod restarted with fewer GPUs, or none (its
    host had none free), must not start training. A pod without a network volume (no RUNPOD_VOLUME_ID)
    keeps its checkpoints on a volume that dies with it: guard.network_volume says warn or refuse, unless
    checkpoint.remote is set (the remote outlives the pod, and any pod of the run restores from it)."""
    raw = environ.get("RUNPOD_GPU_COUNT")
    told = int(raw) if raw is not None and COUNT.match(raw) else None
    if raw is not None and told is None:
        _log.warn(f"RUNPOD_GPU_COUNT {raw[:40]!r} is not a number of GPUs: not compared with the GPUs seen")
    from podkit.host import gpu

    files = [d for d in gpu.matches(cfg.devices)[0] if re.search(r"nvidia\d+$", d)] if cfg.devices else None
    seen = len(files) if files is not None else None
    used = gpus_used(cfg)
    need = max(used) + 1 if used else 0
    counts = [c for c in (told, seen) if c is not None]
    have = min(counts) if counts else None
    said = ", ".join(x for x in (f"RUNPOD_GPU_COUNT={told}" if told is not None else "",
                                 f"{seen} GPU device file(s) match {cfg.devices}" if seen is not None else "") if x)
    _log.info(f"RunPod pod {environ['RUNPOD_POD_ID'][:64]}: {said or 'GPU count unknown'}; config takes "
              f"{len(used)} GPU(s); network volume {_volume(environ)}")
    takes = (f"the config takes GPU(s) {','.join(map(str, used))} ({_gpu_keys(cfg)})" if used else "")
    if need and told == 0:
        raise StageError("preflight", f"RunPod started this pod with zero GPUs ({said}); {takes}",
                         "RunPod restarts a stopped pod with zero GPUs when its host has none free. Stop the pod and "
                         "start it later, or start a new pod on the same network volume (`podkit deploy watch` does "
                         "it by itself); the volume keeps the checkpoints. Training was not started")
    if need and have is not None and have < need:
        if told is not None and seen is not None and seen < told:
            fix = (f"RunPod gave the pod {told} but {seen} are visible: check `devices` (PODKIT_DEVICES) and that the "
                   "container has the GPUs (NVIDIA_VISIBLE_DEVICES); then `podkit resume`")
        else:
            fix = (f"deploy the pod with {need} GPU(s) (`podkit deploy --gpus {need}`)"
                   + (f", or use configs/a40-{have}gpu.yaml" if have in (1, 2, 4) else "")
                   + "; the checkpoints stay on the volume")
        raise StageError("preflight", f"this pod has fewer GPUs than the config takes ({said}); {takes}",
                         fix + ". Training was not started")
    if told is not None and seen is not None and told != seen:
        _log.warn(f"RunPod says this pod has {told} GPU(s) (RUNPOD_GPU_COUNT) but {seen} GPU device file(s) match "
                  f"{cfg.devices}: the devices glob or the container's GPU access differs from what RunPod gave")
    elif used and have is not None and have > len(used):
        _log.warn(f"this pod has {have} GPUs and the config takes {len(used)} ({_gpu_keys(cfg)}): {have - len(used)} "
                  "GPU(s) idle and billed; deploy fewer, or give them to the config")
    policy = cfg.guard.network_volume
    named = True
    if cfg.checkpoint.remote and not environ.get("RUNPOD_VOLUME_ID"):
        # only with a remote and no volume: whether another pod can find the run
        from podkit.areal import identity

        run = identity.names(cfg)
        named = run.known
        if not named:  # uploads begin once the trainer names the run, but a pod without this volume cannot find it
            _log.warn(f"checkpoint.remote is set, but the run's names are AReaL's to tell ({run}): a pod of this run "
                      "without this volume cannot tell where its checkpoints are on the remote and would train from "
                      "step 0; set trainer.experiment and trainer.trial. Until then the remote does not count as "
                      "durable here")
    if cfg.checkpoint.remote and named and not environ.get("RUNPOD_VOLUME_ID"):  # the remote outlives this pod
        _log.info(f"no network volume: the run's checkpoints go to checkpoint.remote {cfg.as_dict()['checkpoint']['remote']} "
                  "instead, each whole one as it is saved, and a pod of this run in any data center restores the "
                  f"newest at boot (a remote counts as durable: guard.network_volume {policy} does not apply)")
    elif policy != "off" and not environ.get("RUNPOD_VOLUME_ID"):
        what = ("this RunPod pod has no network volume (RUNPOD_VOLUME_ID is not set): its checkpoints, logs and "
                f"repo under {cfg.workspace_path} die with the pod (terminated, or migrated to a new pod when its GPU "
                "was taken)")
        fix = ("deploy with a network volume (`podkit deploy --network-volume <id>`), or set checkpoint.remote "
               "(PODKIT_CHECKPOINT_REMOTE) to keep each whole checkpoint off the pod, or set "
               "PODKIT_GUARD_NETWORK_VOLUME=" + ("warn" if policy == "refuse" else "off") + " to accept it")
        if policy == "refuse":
            raise StageError("preflight", what + " (guard.network_volume: refuse)", fix)
        _log.warn(f"{what}; {fix}")


def _volume(environ) -> str:
    v = environ.get("RUNPOD_VOLUME_ID")
    if not v:
        return "none"
    return v if VOLUME_ID.match(v) else "set (not an id)"


def _gpu_keys(cfg) -> str:
    if cfg.multi_node:
        return f"cluster.gpus {cfg.cluster.gpus}"
    keys = [f"inference.gpus {cfg.inference.gpus!r}"] if cfg.inference.kind == "sglang" else []
    if cfg.trainer.kind == "areal" and not cfg.trainer.cpu_ranks:
        keys.append(f"trainer.gpus {cfg.trainer.gpus!r}")
    return ", ".join(keys)
