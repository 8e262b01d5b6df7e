"""What supervisord runs: `podkit run <program>`. Each program reads the rendered config from its
environment (render exports every setting as its PODKIT_ twin), so it sees exactly what boot validated."""

from __future__ import annotations

import os
import sys

from podkit import log

PROGRAMS = ("sglang", "trainer", "watchdog", "logs")


def stacks_file(cfg, pid: int):
    return cfg.log_dir / f"stacks-{pid}.txt"


def stacks_on_sigusr2(cfg) -> None:
    """SIGUSR2 writes every thread's Python stack (the watchdog's dump when py-spy cannot attach).
    faulthandler writes from the C signal handler: it works while Python code is blocked in C."""
    import faulthandler
    import signal

    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    f = open(stacks_file(cfg, os.getpid()), "a")  # noqa: SIM115 - open for the process's lifetime
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)


def refused(cfg, problems: list[tuple[str, str, str]], logger) -> bool:
    """Log each (key, what, hint) as `file: key: what (hint: ...)`; True when there was any."""
    for key, what, hint in problems:
        logger.error(f"{cfg.source}: {key}: {what} (hint: {hint})")
    return bool(problems)


def program_info(cfg, name: str) -> dict | None:
    """supervisord's word on one of its programs; None without a supervisord (a bare `podkit run`)."""
    from podkit.status import rpc

    try:
        return rpc(cfg.socket_path).supervisor.getProcessInfo(name)
    except Exception:  # noqa: BLE001 - no socket, no supervisord, no such program: nothing to ask
        return None


def hold_devices(cfg) -> list:
    """The smoke programs open the device files (stand-ins in tests) as CUDA processes hold
    /dev/nvidia*, so a run killed without its programs leaves holders for the reap stage to free."""
    import glob

    return [open(p, "rb") for p in sorted(glob.glob(cfg.devices))] if cfg.devices else []  # noqa: SIM115


def run(name: str, cfg) -> int:
    if name == "logs":
        from podkit.programs import logs

        return logs.main(cfg)
    # The marker line lets phase detection read only this start's part of the log.
    print(f"[podkit:run] starting {name} (pid {os.getpid()})", flush=True)
    log.set_level(cfg.log_level)
    if name == "sglang" and cfg.inference.kind == "sglang":
        from podkit.programs import sglang

        return sglang.main(cfg)
    if name == "trainer" and cfg.trainer.kind == "areal":
        from podkit.programs import areal_launch

        return areal_launch.main(cfg)  # the entry script registers the stack dump in each rank
    if name == "sglang":
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.inference.gpus
        from podkit.programs import standin

        held = hold_devices(cfg)  # noqa: F841 - held for the process's lifetime

        return standin.main(cfg)
    if name == "watchdog":
        from podkit import watchdog

        return watchdog.main(cfg)
    if name == "trainer":
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.trainer.gpus
        stacks_on_sigusr2(cfg)
        from podkit.programs import fake_trainer

        held = hold_devices(cfg)  # noqa: F841 - held for the process's lifetime

        return fake_trainer.main(cfg)
    print(f"podkit: error: unknown program {name!r}; one of: {', '.join(PROGRAMS)}", file=sys.stderr)
    return 2
