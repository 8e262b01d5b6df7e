"""`podkit run trainer` with trainer.kind areal: AReaL's GRPO trainer under torchrun, in SPMD mode.

The launcher stays torchrun's parent (see `supervise`) instead of exec'ing it: stops and leftovers
need someone between supervisord and torchrun's ranks.

SPMD mode is AReaL's way to use inference servers it did not start: torchrun runs the entry script
(podkit/programs/grpo.py) with AREAL_SPMD_MODE=1 and AREAL_LLM_SERVER_ADDRS. AReaL asks its
name_resolve store first and the env var only after, so a record left by a previous run would send it
to a dead server; this clears the trial's records before it starts, as the reap stage does at boot.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from podkit import log

_log = log.get("trainer")


SHARED_MEM_FRACTION = 0.5  # most SGLang may take of a GPU the trainer also uses


def entry_script() -> str:
    return str(Path(__file__).with_name("grpo.py"))


def gpu_count(gpus: str) -> int:
    return len([g for g in gpus.split(",") if g.strip()])


def backend_gpus(backend: str) -> int | None:
    """GPUs an AReaL backend string takes: 'fsdp:d3' -> 3, 'sglang:d1t2' -> 2 (the product of its
    parallel degrees). None when it is not of that form; AReaL's own parser has the last word."""
    import re

    _, _, dims = backend.partition(":")
    parts = re.fullmatch(r"((?:[a-z]\d+)+)", dims or "")
    if not parts:
        return None
    n = 1
    for degree in re.findall(r"\d+", dims):
        n *= int(degree)
    return n


def fileroot(cfg) -> str:
    """AReaL's logs, HF saves and recover checkpoints: on the volume, so a new container resumes."""
    return str(cfg.workspace_path / "areal")


def overrides(cfg) -> list[str]:
    """Hydra overrides that make the pod config the one source of truth for what podkit also reads."""
    t, model = cfg.trainer, cfg.inference.model
    return [f"experiment_name={t.experiment}", f"trial_name={t.trial}",
            f"cluster.fileroot={fileroot(cfg)}",
            "cluster.name_resolve.type=nfs", f"cluster.name_resolve.nfs_record_root={t.name_resolve_root}",
            f"actor.path={model}", f"tokenizer_path={model}", f"sglang.model_path={model}",
            *shlex.split(t.overrides)]


def command(cfg, python: str | None = None) -> list[str]:
    n = gpu_count(cfg.trainer.gpus)
    # --standalone: a local rendezvous on a free port, so a dying previous run's port cannot collide.
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(n), entry_script(), "--config", cfg.trainer.areal_config, *overrides(cfg)]


def environment(cfg, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    inf = cfg.inference
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::") else inf.host
    env.update(AREAL_SPMD_MODE="1", AREAL_LLM_SERVER_ADDRS=f"{host}:{inf.port}",
               CUDA_VISIBLE_DEVICES=cfg.trainer.gpus,
               # What AReaL's own launcher sets for an SGLang rollout backend.
               NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0")
    env.setdefault("HF_HOME", str(cfg.workspace_path / "hf"))
    return env


def problems(cfg) -> list[tuple[str, str, str]]:
    """(key, what is wrong, hint) for a setup that cannot train; checked at boot and before exec."""
    t, out = cfg.trainer, []
    if not t.areal_config:
        out.append(("trainer.areal_config", "empty: the AReaL trainer needs an experiment config",
                    "use a shipped pod config (configs/a40-4gpu.yaml) or set it to your AReaL YAML"))
    elif not os.path.isfile(t.areal_config):
        out.append(("trainer.areal_config", f"{t.areal_config} does not exist",
                    "a relative path is read from the pod config's directory"))
    if gpu_count(t.gpus) == 0:
        out.append(("trainer.gpus", "empty: torchrun needs at least one training GPU",
                    "e.g. 1,2,3 on a 4-GPU pod with inference on 0"))
    shared = {g.strip() for g in t.gpus.split(",")} & {g.strip() for g in cfg.inference.gpus.split(",")} - {""}
    if shared and cfg.inference.mem_fraction_static > SHARED_MEM_FRACTION:
        out.append(("trainer.gpus", f"GPU(s) {','.join(sorted(shared))} also serve inference, which takes "
                    f"{cfg.inference.mem_fraction_static:g} of their memory",
                    f"give the trainer other GPUs, or share with inference.mem_fraction_static <= "
                    f"{SHARED_MEM_FRACTION} (configs/a40-1gpu.yaml)"))
    if cfg.inference.kind != "sglang":
        out.append(("trainer.kind", f"areal needs inference.kind sglang, not {cfg.inference.kind}",
                    "the stand-in speaks only what the fake trainer uses; use configs/smoke.yaml for it"))
    try:
        shlex.split(t.overrides)
    except ValueError as e:
        out.append(("trainer.overrides", f"cannot be split like a shell line: {e}", "check the quoting"))
    if t.areal_config and os.path.isfile(t.areal_config):
        out += _backend_problems(cfg)
    return out


def _backend_problems(cfg) -> list[tuple[str, str, str]]:
    import yaml

    try:
        with open(cfg.trainer.areal_config) as f:
            areal = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        return [("trainer.areal_config", f"cannot read {cfg.trainer.areal_config}: {e}", "fix the YAML")]
    out = []
    for section, pod_key in (("actor", "trainer.gpus"), ("rollout", "inference.gpus")):
        backend = str(((areal.get(section) or {}).get("backend")) or "")
        want = gpu_count(cfg.trainer.gpus if section == "actor" else cfg.inference.gpus)
        have = backend_gpus(backend)
        if have is not None and have != want:
            out.append((pod_key, f"names {want} GPU(s) but {cfg.trainer.areal_config} has {section}.backend "
                        f"{backend!r} ({have} GPU(s))", f"make {section}.backend and {pod_key} agree"))
    return out


def wait_for_inference(cfg, is_dead=None, interval: float = 1.0) -> str | None:
    """Wait until SGLang answers /health (bounded). Returns why not, or None when ready. `is_dead` says
    whether supervisord already reports the server dead (FATAL/EXITED): then waiting is pointless."""
    from podkit.health import probe

    inf = cfg.inference
    t0 = time.monotonic()
    told = 0.0
    while not probe(inf.host if inf.host not in ("0.0.0.0", "::") else "127.0.0.1", inf.port):
        waited = time.monotonic() - t0
        dead = is_dead() if is_dead else None
        if dead:
            return f"inference is {dead} in supervisord: not waiting for it (see logs/sglang.log)"
        if waited > inf.ready_timeout_s:
            return f"inference at {inf.host}:{inf.port} not ready after {inf.ready_timeout_s:.0f}s"
        if waited - told >= 30:
            _log.info(f"waiting for inference at {inf.host}:{inf.port} ({waited:.0f}s; loading weights and "
                      "capturing CUDA graphs takes minutes)")
            told = waited
        time.sleep(interval)
    return None


def sglang_state(cfg):
    """supervisord's word on the sglang program when it is dead for good, else None."""
    from podkit.programs import program_info

    def check():
        info = program_info(cfg, "sglang")
        return info["statename"] if info and info["statename"] in ("FATAL", "EXITED", "STOPPED") else None
    return check


def main(cfg) -> int:
    from podkit.programs import refused

    if refused(cfg, problems(cfg), _log):
        return 2
    why = wait_for_inference(cfg, sglang_state(cfg))
    if why:
        _log.error(why)
        return 1
    from podkit.reap import clear_name_resolve

    for line in clear_name_resolve(cfg.trainer.name_resolve_root, cfg.trainer.experiment, cfg.trainer.trial):
        _log.info(line)
    argv, env = command(cfg), environment(cfg)
    _log.info(f"starting {shlex.join(argv)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, "
              f"AREAL_LLM_SERVER_ADDRS={env['AREAL_LLM_SERVER_ADDRS']})")
    return supervise(argv, env, cfg.run_path / "torchrun.json")


def _group_members(pgid: int, not_before: int = 0) -> list[int]:
    from podkit.reap import processes

    return [p.pid for p in processes()
            if p.pgid == pgid and p.starttime >= not_before and p.pid != os.getpid() and not p.gone]


def _children(pid: int) -> list:
    from podkit.reap import processes

    return [p for p in processes() if p.ppid == pid]


def _set_pdeathsig() -> None:
    import ctypes
    import signal

    # torchrun dies with this launcher, even when supervisord has to SIGKILL it.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill_groups(groups: list) -> list[int]:
    """SIGKILL every process still in the recorded (pgid, start time) groups; a pid reused by a
    younger process is not theirs and is left alone."""
    import signal

    killed = []
    for pgid, since in groups:
        for pid in _group_members(pgid, since):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def clear_leftovers(record: Path) -> list[int]:
    """What a previous torchrun left when its launcher was SIGKILLed: torchrun starts each rank in a
    session of its own, so neither PDEATHSIG nor supervisord's killasgroup reaches them, and a left
    rank keeps its GPU. Returns the pids killed."""
    from podkit.state import read_json

    groups = (read_json(record, {}) or {}).get("groups") or []
    killed = _kill_groups(groups)
    record.unlink(missing_ok=True)
    return killed


def supervise(argv: list[str], env: dict[str, str], record: Path) -> int:
    """Run torchrun in a process group of its own and stand between it and supervisord's signals.

    supervisord stops the trainer's process group; had torchrun been in it, its elastic agent would
    answer SIGTERM by giving the ranks 30 s (hard-coded before torch 2.12) and then SIGKILL, cutting a
    step's end and its recover checkpoint short. Here SIGTERM goes to the ranks only: they finish the
    step, checkpoint and exit 0, and torchrun with them. SIGUSR2 (the watchdog's stack dump) is passed
    on too. torchrun's group and each rank's own group are recorded as they appear, and whatever is
    left of them when torchrun ends, or after this launcher was killed, is killed."""
    import signal
    import subprocess
    import threading

    from podkit.reap import read_stat
    from podkit.state import write_json

    for pid in clear_leftovers(record):
        _log.warn(f"killed pid {pid}, left by a previous torchrun whose launcher was killed")
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_set_pdeathsig)  # noqa: PLW1509
    stat = read_stat(proc.pid)
    groups = {proc.pid: stat.starttime if stat else 0}
    done = threading.Event()

    def track() -> None:
        interval = 0.5
        while not done.wait(interval):
            fresh = {c.pid: c.starttime for c in _children(proc.pid) if c.pgid == c.pid and c.pid not in groups}
            if fresh:
                groups.update(fresh)
                write_json(record, {"groups": [[g, t] for g, t in groups.items()]})
            interval = min(10.0, interval * 1.5)

    write_json(record, {"groups": [[g, t] for g, t in groups.items()]})
    threading.Thread(target=track, daemon=True).start()

    def forward(sig, _frame):
        ranks = [c.pid for c in _children(proc.pid)]
        if sig in (signal.SIGTERM, signal.SIGINT):
            _log.info(f"{signal.Signals(sig).name}: passing it to the {len(ranks)} worker process(es), not "
                      "torchrun, so the step in flight ends with a recover checkpoint")
            sig = signal.SIGTERM
        for pid in ranks or [proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        rc = proc.wait()
    finally:
        done.set()
        _kill_groups(list(groups.items()))
        record.unlink(missing_ok=True)
    _log.info(f"torchrun exited with {rc}")
    return rc if rc >= 0 else 128 - rc
