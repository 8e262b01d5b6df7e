"""How a trainer is started: torchrun's command line, its environment, AReaL's overrides, and what a
killed launcher left. Shared by the single-pod launcher (launch.py) and a cluster's (cluster.py)."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import sys
from pathlib import Path

from podkit import records
from podkit.areal import identity
from podkit.host import proc
from podkit.programs import compile_caches

HERE = Path(__file__).resolve().parent


def bootstrap_script() -> str:
    """What torchrun (and AReaL's Ray launcher) runs: the bootstrap, which runs the training script."""
    return str(HERE / "bootstrap.py")


def update_root(cfg) -> str:
    """AReaL's cluster.fileroot, which only its disk weight updates read: a full HF save every step
    (~1 GB for 0.5B in bf16) that must be written within AReaL's fixed 120 s wait, then read by SGLang.
    Local disk in the private run dir, not the network volume."""
    return str(cfg.run_path / "areal")


def overrides(cfg) -> list[str]:
    """Hydra overrides that make the pod config the one source of truth for what podkit also reads.
    `++key=value` sets a key whether or not the YAML has it (a user's YAML may leave a section to
    AReaL's defaults, where `key=value` fails); the user's trainer.overrides come last, as written."""
    t, model, root = cfg.trainer, cfg.inference.model, identity.fileroot(cfg)
    run = identity.names(cfg)  # the user's names, passed back so that podkit and AReaL read the same
    own = [*(f"{k}={v}" for k, v in (("experiment_name", run.experiment), ("trial_name", run.trial)) if v),
           f"cluster.fileroot={update_root(cfg)}", f"saver.fileroot={root}", f"recover.fileroot={root}",
           f"stats_logger.fileroot={root}", f"evaluator.fileroot={root}",
           "cluster.name_resolve.type=nfs", f"cluster.name_resolve.nfs_record_root={t.name_resolve_root}",
           f"actor.path={model}", f"tokenizer_path={model}", f"sglang.model_path={model}"]
    from podkit.areal import checks

    own += [f"{s.key}={s.value}" for s in checks.settings(cfg)[0]]  # what podkit depends on, over the YAML
    return [*(f"++{o}" for o in own), *shlex.split(t.overrides)]


def ranks(cfg) -> int:
    return cfg.trainer.cpu_ranks or len(cfg.gpus["trainer"])


def command(cfg, python: str | None = None) -> list[str]:
    n = ranks(cfg)
    # --standalone: a local rendezvous on a free port, so a dying previous run's port cannot collide.
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(n), bootstrap_script(), "--config", cfg.trainer.areal_config, *overrides(cfg)]


def environment(cfg, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    inf = cfg.inference
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::") else inf.host
    env.update(AREAL_SPMD_MODE="1", AREAL_LLM_SERVER_ADDRS=f"{host}:{inf.port}",
               # CPU ranks see no GPU: AReaL then picks its CPU platform (gloo).
               CUDA_VISIBLE_DEVICES="" if cfg.trainer.cpu_ranks else cfg.trainer.gpus,
               # What AReaL's own launcher sets for an SGLang rollout backend.
               NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0")
    env.setdefault("HF_HOME", str(cfg.workspace_path / "hf"))
    env.setdefault("WANDB_MODE", "disabled")  # opt in with stats_logger.wandb.mode=online in trainer.overrides
    return compile_caches(cfg, env, "trainer")



def set_pdeathsig() -> None:
    # torchrun dies with this launcher, even when supervisord has to SIGKILL it.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def clear_leftovers(run_dir: Path, record: records.Record = records.TORCHRUN) -> list[int]:
    """What a previous launcher left when it was SIGKILLed, from the process groups it recorded in
    `record` (records.TORCHRUN: torchrun's ranks; records.RAY_NODE: a node's Ray workers): torchrun starts
    each rank in a session of its own, so neither PDEATHSIG nor supervisord's killasgroup reaches them,
    and a left rank keeps its GPU. Returns the pids killed; the record is removed."""
    groups = [g for g in record.read_owned(run_dir).get("groups") or []
              if isinstance(g, list) and len(g) == 2 and all(isinstance(x, int) for x in g)]
    killed = proc.kill_groups(groups)
    record.path(run_dir).unlink(missing_ok=True)
    return killed
