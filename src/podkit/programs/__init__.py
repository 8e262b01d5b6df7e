"""What supervisord runs: `podkit run <program>`. Each program reads the rendered config from its
environment (render exports every setting as its PODKIT_ twin), so it sees exactly what boot validated.

TABLE is the one list of programs: (program, kind) -> the module whose `main(cfg)` runs it, the kind
read from the config key in KIND. supervisord.conf's [program:x] sections are checked against it
(render), and so are the tests.
"""

from __future__ import annotations

import glob
import importlib
import os
import signal
import sys

from podkit import log, records
from podkit.host import pid1, proc

TABLE: dict[tuple[str, str], str] = {
    ("sglang", "sglang"): "podkit.programs.sglang",          # SGLang itself (exec)
    ("sglang", "standin"): "podkit.programs.standin",        # stand-in for SGLang's HTTP API (smoke stack)
    ("sglang", "standin-lm"): "podkit.programs.standin_lm",  # generating stand-in, tiny model on CPU (rehearsal)
    ("trainer", "areal"): "podkit.areal.launch",             # AReaL under torchrun (or its Ray launcher)
    ("trainer", "fake"): "podkit.programs.fake_trainer",     # a real numpy training loop on random data (smoke stack)
    ("ray", ""): "podkit.areal.ray_node",                     # a node of a multi-node run's Ray cluster
    ("watchdog", ""): "podkit.programs.watchdog",                     # the hang watchdog
    ("logs", ""): "podkit.programs.logs",                    # supervisord's event listener
    ("metrics", ""): "podkit.views.metrics",                       # the pod's Prometheus endpoint
    ("page", ""): "podkit.views.page",                             # the run at a glance: a web page of the records
}
KIND = {"sglang": ("inference", "kind"), "trainer": ("trainer", "kind")}
NAMES = tuple(dict.fromkeys(name for name, _ in TABLE))


def kind(cfg, name: str) -> str:
    if name not in KIND:
        return ""
    section, key = KIND[name]
    return getattr(getattr(cfg, section), key)


def module(cfg, name: str) -> str:
    return TABLE[(name, kind(cfg, name))]


def stacks_file(cfg, pid: int):
    return cfg.log_dir / f"stacks-{pid}.txt"


def stacks_on_sigusr2(cfg) -> None:
    """SIGUSR2 writes every thread's Python stack and every pending asyncio task's (stacks.py; the watchdog's
    dump, beside py-spy's). faulthandler writes from the C signal handler: it works while Python code is
    blocked in C."""
    from podkit.host import stacks

    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    stacks.on_sigusr2(str(stacks_file(cfg, os.getpid())))


def refused(cfg, problems: list[tuple[str, str, str]], logger) -> bool:
    """Log each (key, what, hint) as `source: key: what (hint: ...)`; True when there was any."""
    for key, what, hint in problems:
        logger.error(f"{cfg.origin(key)}: {key}: {what} (hint: {hint})")
    return bool(problems)


def compile_caches(cfg, env: dict[str, str], program: str = "") -> dict[str, str]:
    """Kernel caches on the volume: a new container reuses what the last one compiled (FlashInfer JITs
    its sm_86 kernels at SGLang's first start; AReaL's torch.compile'd log-prob gather compiles through
    inductor and triton). Keyed by their own versions, so an image with other pins does not reuse them."""
    base = cfg.workspace_path / "cache"
    # Triton's cache, one per program: processes compiling into one directory at once corrupt entries
    # (AReaL gave each SGLang server its own for that, #1589).
    for var, sub in (("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
                     ("TRITON_CACHE_DIR", f"triton/{program}" if program else "triton"),
                     ("TVM_FFI_CACHE_DIR", "tvm-ffi"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     # SGLang's piecewise CUDA graph compile cache (on by default for text models since 0.5.10).
                     ("SGLANG_CACHE_DIR", "sglang")):
        env.setdefault(var, str(base / sub))
    if cfg.multi_node:
        # AReaL's Ray launcher takes TRITON_CACHE_DIR (and torch's kernel cache) from AREAL_CACHE_DIR, /tmp by
        # default: on the volume too, one per node, as nodes must not share one Triton directory.
        env.setdefault("AREAL_CACHE_DIR", str(base / f"areal-{cfg.node or 'node-0'}"))
    return env


def hold_devices(cfg) -> list:
    """The smoke programs open the device files (stand-ins in tests) as CUDA processes hold
    /dev/nvidia*, so a run killed without its programs leaves holders for the reap stage to free."""
    return [open(p, "rb") for p in sorted(glob.glob(cfg.devices))] if cfg.devices else []  # noqa: SIM115


def run(name: str, cfg) -> int:
    if name not in NAMES:
        print(f"podkit: error: unknown program {name!r}; one of: {', '.join(NAMES)}", file=sys.stderr)
        return 2
    if name == "trainer":
        return run_trainer(cfg)
    if name != "logs":  # the listener's stdout is supervisord's event protocol
        # The marker line lets phase detection read only this start's part of the log.
        print(f"[podkit:run] starting {name} (pid {os.getpid()})", flush=True)
    log.set_level(cfg.log_level)
    register(cfg, name)
    why = idle_because(cfg, name)
    if why:
        return idle(name, why)
    return importlib.import_module(module(cfg, name)).main(cfg)


def run_trainer(cfg) -> int:
    """The trainer program: its stop signal handled from its first line (a stop before anything runs is a
    stop, not a kill: ending.SIGNALS), a child subreaper (what it starts and leaves, a double-forked daemon, is
    re-parented here), its run under the loop bound (a cluster's launcher bounds its own restarts), and
    nothing it started outliving it."""
    from podkit.host import supervisord  # here: render imports this module on the boot path
    from podkit.judge import ending

    ending.SIGNALS.install(cfg)
    try:
        os.environ[ending.PROGRAM_ENV] = str(os.getpid())  # an end the ranks record names this run
        os.environ[ending.KEEP_ENV] = str(cfg.run_path)  # and is kept there while the volume cannot take it
        proc.become_subreaper()
        # The marker line lets phase detection read only this start's part of the log.
        print(f"[podkit:run] starting trainer (pid {os.getpid()})", flush=True)
        log.set_level(cfg.log_level)
        register(cfg, "trainer")
        why = idle_because(cfg, "trainer")
        if why:
            return idle("trainer", why)
        os.environ[proc.OWNER_ENV] = proc.owner_mark(cfg.state_dir, "trainer")  # what it starts inherits it
        # First what its previous start left (its launcher may have been killed: ranks and daemons hold GPU
        # memory), before any back-off.
        stop_own_leftovers(cfg, "left running by the trainer's previous start")
        main = lambda: importlib.import_module(module(cfg, "trainer")).main(cfg)  # noqa: E731
        if cfg.multi_node:
            code = main()
        else:
            from podkit.judge import loopbound

            code = loopbound.run(cfg, main)
    except ending.Stop:  # asked to stop before its run began: nothing in flight
        code = 0
    finally:
        if ending.SIGNALS.forward is None:
            ending.SIGNALS.forward = lambda *_: None  # from here on a stop is noted, never raised mid-cleanup
        # Stopped, finished or failed: nothing it started outlives it.
        stop_own_leftovers(cfg, "left running by the trainer, which has ended", descendants=True)
    # An exit within supervisord's startsecs is a failed start to it, whatever its code: finished (or stopped for
    # good) that soon, it would be restarted and end FATAL; failing that soon after a new step, its own
    # startretries would end FATAL a run the loop bound lets go on. The loop bound alone bounds the trainer: it
    # exits only once it counts as started.
    supervisord.wait_started(cfg.socket_path, "trainer")
    if cfg.trainer.kind == "fake":
        pid1.exit_now(code)  # torch's teardown at exit costs 1-2 s of the stop's budget, and saves nothing
    return code


def stop_own_leftovers(cfg, reason: str, descendants: bool = False) -> None:
    """Stop every process that carries this workspace's trainer mark: what the trainer started, in any
    session or group (a reward server, a daemon), where supervisord's killasgroup does not reach; and, once the
    trainer has ended, every process still below this program, whatever its environment (this program is a
    child subreaper: a daemon that forked twice with an environment of its own was re-parented to it). Never
    anything outside those."""
    logger = log.get("trainer")
    if descendants:
        proc.tell(proc.stop_descendants(reason), logger)
    proc.tell(proc.stop_marked(cfg.state_dir, {"trainer": reason}, reap_children=proc.reap_orphans), logger)


def idle_because(cfg, name: str) -> str:
    """Why this program has nothing to do on this node ("" when it has): a cluster's SGLang servers
    are AReaL's Ray launcher's to start, and only rank 0 runs the launcher."""
    c = cfg.cluster
    if name == "ray" and not cfg.multi_node:
        return "a single pod (cluster.nodes 1): no Ray cluster"
    if name == "sglang" and cfg.multi_node:
        return f"a {c.nodes}-node run: AReaL's Ray launcher starts the SGLang servers on the cluster's nodes"
    if name == "watchdog" and cfg.multi_node and c.rank > 0:
        return f"node rank {c.rank} of {c.nodes}: rank 0's watchdog watches the run"
    if name == "trainer" and cfg.multi_node and c.rank > 0:
        return (f"node rank {c.rank} of {c.nodes}: the launcher runs on rank 0 ({c.head}); this node's Ray worker "
                "runs the ranks it places here")
    return ""


def idle(name: str, why: str) -> int:
    """RUNNING and doing nothing, like metrics with port 0, so health and status keep one rule."""
    log.get(name).info(f"{why}; idle")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def register(cfg, name: str) -> None:
    """Record this program's process group (supervisord makes one per program, led by it) with its
    start time, so a boot after a killed supervisord stops exactly what this run started. A program
    that does not lead its own group (a bare `podkit run` from a shell) records nothing: its group is
    the shell's."""
    pgid = os.getpgrp()
    if pgid != os.getpid():
        return
    try:
        records.group(name).write(cfg.run_path, {"program": name, "pgid": pgid, "start": proc.starttime(pgid) or 0},
                                  mode=0o600)
    except OSError as e:
        log.get(name).warn(f"cannot record this program's process group in {cfg.run_path} ({e.strerror}); a "
                           "boot after a killed supervisord will not find what it leaves running")
