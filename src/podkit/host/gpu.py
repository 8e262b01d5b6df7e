"""The GPUs as the machine shows them: who holds the device files (open fds and memory mappings,
read from /proc: bounded, never stats a mount, so a slow network volume cannot hang it), what
nvidia-smi says of each GPU, and waiting until they are free.

No torch import and no CUDA context here: creating one is what broke SGLang's start (docs/failures.md,
"busy or unavailable").
"""

from __future__ import annotations

import glob as globmod
import os
import re
import time

from podkit import log
from podkit.errors import StageError
from podkit.host import proc

_log = log.get("reap")


class Holder(proc.Target):
    """A process holding a device file (`devices`, `how`: fd/mmap), or sharing a holder's group."""

    FIELDS = (*proc.Target.FIELDS, "devices", "how")

    def __init__(self, *a, devices=None, how=None, **kw) -> None:
        super().__init__(*a, **kw)
        self.devices: list[str] = devices or []
        self.how: list[str] = how or []

    def describe(self) -> str:
        cmd = self.cmdline or self.name
        cmd = cmd if len(cmd) <= 40 else cmd[:39] + "…"
        held = f"held {', '.join(self.devices)}" if self.devices else f"in the {self.reason}"
        return f"{self.pid} ({cmd}, {held})"


def matches(pattern: str) -> tuple[list[str], list[str]]:
    """What `pattern` matches, as (GPU device files, files that are not): the reap stage stops every
    holder of what it is given, so only NVIDIA's files (named nvidia*, read where links lead, never a
    directory) are; a glob such as /workspace/* must not steer kills."""
    devices, refused = set(), set()
    for p in globmod.glob(pattern) if pattern else []:
        real = os.path.realpath(p)
        if not os.path.basename(real).startswith("nvidia"):
            refused.add(real)
        elif not os.path.isdir(real):  # /dev/nvidia-caps is NVIDIA's, but a directory
            devices.add(real)
    return sorted(devices), sorted(refused)


def match_devices(pattern: str) -> list[str]:
    devices, refused = matches(pattern)
    if refused:
        _log.warn(f"{pattern} also matches {len(refused)} file(s) that are not GPU device files "
                  f"({', '.join(refused[:3])}): left alone")
    return devices


def device_files(devices_glob: str, gpu_ids) -> list[str]:
    """The device files of the GPUs numbered `gpu_ids` (/dev/nvidiaN). /dev/nvidiactl is left out:
    every CUDA process holds it."""
    wanted = {str(g) for g in gpu_ids}
    return [d for d in match_devices(devices_glob) if (m := re.search(r"nvidia(\d+)$", d)) and m.group(1) in wanted]


def holders(devices: list[str], deadline_s: float = 10.0) -> tuple[list[Holder], int]:
    """Every process holding one of `devices` by fd or mapping. Returns (holders, unreadable count)."""
    try:
        found, unreadable = proc.holding(devices, deadline_s)
    except TimeoutError:
        raise StageError("reap", f"scanning /proc took longer than {deadline_s:.0f}s",
                         "the machine is overloaded; run `podkit reap --dry-run` to retry") from None
    out: list[Holder] = []
    for pid, held in sorted(found.items()):
        st = proc.read_stat(pid)
        if st is None or st.gone:
            continue
        out.append(Holder.of(st, reason="holder", devices=sorted(held), how=sorted(set().union(*held.values()))))
    return out, unreadable


def group_mates(found: list[Holder]) -> list[Holder]:
    """Members of a holder's process group, when that group holds nothing else that must live:
    every member is a holder or a descendant of one, and none is protected."""
    if not found:
        return []
    procs = {p.pid: p for p in proc.processes()}
    keep = proc.protected_pids()
    keep_groups = {procs[p].pgid for p in keep if p in procs}
    held = {h.pid for h in found}

    def under_holder(pid: int) -> bool:
        seen = set()
        while pid in procs and pid not in seen:
            if pid in held:
                return True
            seen.add(pid)
            pid = procs[pid].ppid
        return False

    extra: list[Holder] = []
    for pgid in sorted({h.pgid for h in found}):
        if pgid in keep_groups or pgid <= 1:
            continue
        members = [p for p in procs.values() if p.pgid == pgid and not p.gone]
        if any(m.pid in keep or not under_holder(m.pid) for m in members):
            continue
        leader = next((h.pid for h in found if h.pgid == pgid), pgid)
        for m in members:
            if m.pid not in held:
                extra.append(Holder.of(m, reason=f"group of {leader}"))
    return extra


def smi_state(timeout_s: float = 10.0) -> list[dict] | None:
    """Per-GPU used memory and compute mode from nvidia-smi, or None where there is no nvidia-smi."""
    exe = proc.which("nvidia-smi")
    if not exe:
        return None
    import subprocess  # only where there is an nvidia-smi: not on a CPU machine's boot path

    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.used,compute_mode", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        _log.warn(f"nvidia-smi failed ({e}); cannot verify that the GPUs are free")
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            gpus.append({"index": int(parts[0]), "memory_used_mib": int(parts[1]), "compute_mode": parts[2]})
    return gpus


def wait_free(timeout_s: float, threshold_mib: int = 256) -> list[dict]:
    """Wait (bounded) until each GPU's used memory is near zero; returns the last reading."""
    until = time.monotonic() + timeout_s
    while True:
        gpus = smi_state()
        if gpus is None:
            return []
        busy = [g for g in gpus if g["memory_used_mib"] > threshold_mib]
        if not busy or time.monotonic() >= until:
            for g in gpus:
                if g["compute_mode"].lower().startswith("exclusive"):
                    _log.warn(f"GPU {g['index']} is in compute mode {g['compute_mode']}: a second CUDA context "
                              "fails with 'busy or unavailable'; nothing of podkit's may touch it before SGLang")
            for g in busy:
                _log.warn(f"GPU {g['index']} still uses {g['memory_used_mib']} MiB after {timeout_s:.0f}s and no "
                          "holder is visible here: it is held outside this container's PID namespace. "
                          "Stop and start the pod (not just the container) to reset it")
            return gpus
        time.sleep(0.5)
