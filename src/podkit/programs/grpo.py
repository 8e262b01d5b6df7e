"""podkit's GRPO entry script for AReaL 1.0.4 in SPMD mode (run by torchrun, one process per rank).

    torchrun --standalone --nproc-per-node N grpo.py --config areal/grpo-a40-4gpu.yaml key=value ...

GSM8K with AReaL's RLVRWorkflow for training and for evaluation (areal's gsm8k example uses a workflow
SPMD mode refuses). AReaL's own PPOTrainer does the training, with podkit's patches
(areal_patches.py); around it, what podkit's supervision relies on:

- progress: rank 0 writes <workspace>/.podkit/progress.json after each step (status, health, watchdog):
  step, weight_version, checkpoint_step, reward, loss, the trainer-vs-inference log-prob gap (and, from
  a fresh run's first step, where every rollout came from the weights the trainer holds, the gap that
  must be float error: on_policy_logp_gap), and resumed_from/resumed_at when this run resumed;
- stale weights: a restarted SGLang serves the base weights ("default"), and rollouts it generates
  carry this trainer's version. Rank 0 asks /model_info every trainer.stale_weights_check_s; after the
  step in flight (its recover checkpoint written) every rank stops, and the launcher exits 75 so
  supervisord restarts the trainer, which resumes from that checkpoint and pushes its weights;
- SIGTERM: the step in flight finishes, with a recover checkpoint if it had none, and train() returns;
- SIGUSR2: every thread's stack, to logs/stacks-<pid>.txt (the watchdog's dump).

Every stop happens between steps and on all ranks at once (an all-reduce of the flags), through
AReaL's own step limit, so no checkpoint is cut and AReaL logs no failure.

Imports AReaL and torch: this runs only in the AReaL environment, never on podkit's boot path.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from podkit import log, records
from podkit.checks import API_KEY_ENV

_log = log.get("trainer")
CONFIG_ERROR = "config-error"  # progress.json stopped.by: AReaL refused the config (the launcher exits 0)


class Progress(records.Progress):
    """Rank 0's record for podkit (the same contract as the fake trainer's)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.state_dir, "areal")
        self.data["checkpoint_step"] = records.PROGRESS.read(cfg.state_dir).get("checkpoint_step")

    def write(self, **fields) -> None:
        self.update(**fields, time=time.time())


def stat(stats, *suffixes: str):
    """The first of `suffixes` (in that order of preference) that some stats key ends with."""
    items = stats if isinstance(stats, list) else [stats]
    for suffix in suffixes:
        for item in items:
            for key, value in item.items():
                if key.endswith(suffix):
                    try:
                        return float(value)
                    except (TypeError, ValueError):
                        pass
    return None


def logp_gap(stats) -> dict | None:
    """AReaL's kl_div_direct is old_logp - logprobs over the step's tokens: inference's (behaviour)
    log-probs against the trainer's recomputed ones. On-policy tokens (step 1 of a fresh run: every
    rollout from the weights the trainer holds) must agree to float error."""
    lo, hi, avg = (stat(stats, f"kl_div_direct/{k}") for k in ("min", "max", "avg"))
    if hi is None or lo is None:
        return None
    return {"max_abs": max(abs(lo), abs(hi)), "avg": avg}


def served_version(addr: str, api_key: str, timeout: float = 10) -> str | None:
    """What inference says it serves; None when it does not answer."""
    req = urllib.request.Request(f"http://{addr}/model_info",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            version = json.loads(r.read()).get("weight_version")
    except (OSError, ValueError, AttributeError, urllib.error.HTTPError):
        return None
    return None if version is None else str(version)


def server_identity(cfg) -> tuple | None:
    """Which SGLang process serves, by supervisord's word (pid and start time); None outside supervisord.
    A different one at the end of a step than at its start means a restart in between: part of the
    step's rollouts came from the base weights, whatever the label says once this step's push landed."""
    from podkit import supervisord

    if cfg.multi_node:  # AReaL's Ray launcher runs SGLang, not supervisord; the served version still tells
        return None
    info = supervisord.process_info(cfg.socket_path, "sglang")
    if info is None:
        return None
    return (info["pid"], info["start"]) if info.get("statename") == supervisord.RUNNING else ("not running",)


def watch_served_weights(cfg, progress: Progress, addr: str, api_key: str, stale: threading.Event) -> None:
    """Rank 0, a daemon thread: flags base weights served after this trainer pushed a version."""
    while not stale.is_set():
        time.sleep(cfg.trainer.stale_weights_check_s)
        pushed = progress.data.get("weight_version")
        if pushed is None:
            continue
        if served_version(addr, api_key) == "default":
            _log.warn(f"inference serves the base weights but this trainer pushed version {pushed}: inference "
                      "restarted. Stopping after this step; supervisord restarts the trainer, which resumes "
                      "from its recover checkpoint and pushes those weights again.")
            stale.set()


def main(argv: list[str]) -> int:
    from podkit import config
    from podkit.programs import stacks_on_sigusr2

    cfg = config.load()
    stacks_on_sigusr2(cfg)
    sigterm, stale = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: sigterm.set())
    if cfg.multi_node:  # a rank placed by AReaL's Ray launcher: rank 0's launcher watches it, and asks it to stop
        from podkit.programs import areal_cluster

        areal_cluster.start_heartbeat(cfg, sigterm.set)

    import torch
    import torch.distributed as dist
    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    from podkit.programs import areal_patches

    api_key = os.environ.get(API_KEY_ENV, "")
    # A cluster's server comes back elsewhere (AReaL's recover run starts it on a new port): fail fast into it.
    areal_patches.apply(api_key=api_key, ride_out_s=0.0 if cfg.multi_node else cfg.inference.ready_timeout_s)
    try:
        config_, _ = load_expr_config(argv, GRPOConfig)
    except Exception as e:  # noqa: BLE001 - hydra, omegaconf and AReaL's own checks raise their own types
        # The same on every restart: a restart loop re-importing torch every 20 s fixes nothing.
        message = f"{type(e).__name__}: {e}".strip()
        _log.error(f"AReaL rejected its config ({message.splitlines()[0]}); fix trainer.areal_config or "
                   "trainer.overrides, then `podkit ctl start trainer`")
        if int(os.environ.get("RANK", "0")) == 0:
            Progress(cfg).update(stopped={"by": CONFIG_ERROR, "time": time.time(), "message": message[:2000]})
        return 2
    tokenizer = load_hf_tokenizer(config_.tokenizer_path)
    train_dataset = get_custom_dataset(split="train", dataset_config=config_.train_dataset, tokenizer=tokenizer)
    valid_dataset = None
    if config_.valid_dataset is not None:
        valid_dataset = get_custom_dataset(split="test", dataset_config=config_.valid_dataset, tokenizer=tokenizer)

    rank = int(os.environ.get("RANK", "0"))
    progress = Progress(cfg) if rank == 0 else None
    addr = os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",")[0]
    workflow = "areal.workflow.rlvr.RLVRWorkflow"
    kwargs = dict(reward_fn="areal.reward.gsm8k.gsm8k_reward_fn", gconfig=config_.gconfig,
                  tokenizer=config_.tokenizer_path, enable_thinking=False)
    eval_kwargs = {**kwargs, "gconfig": config_.eval_gconfig}  # AReaL groups eval samples by its n_samples
    stopped = {"by": None}

    with PPOTrainer(config_, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        export, save_recover = trainer._export_and_commit_stats, trainer._save_recover_checkpoint
        info_path = trainer.recover_handler.recover_info_path(
            config_.experiment_name, config_.trial_name, config_.recover.fileroot)

        def commit(epoch: int, epoch_step: int, global_step: int) -> None:
            stats, commit_ = {}, trainer.stats_logger.commit

            def keep(e, s, g, data):
                stats["data"] = data
                return commit_(e, s, g, data)

            trainer.stats_logger.commit = keep
            try:
                export(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
            finally:
                trainer.stats_logger.commit = commit_
            step = global_step + 1  # AReaL pushed these weights as version global_step + 1
            if progress is not None:
                data = stats.get("data") or {}
                saved = areal_patches.recover_checkpoint_written(trainer, global_step)
                progress.write(step=step, weight_version=str(step),
                               checkpoint_step=step if saved else progress.data.get("checkpoint_step"),
                               loss=stat(data, "update/loss/avg", "loss/avg"),
                               reward=stat(data, "task_reward/avg", "reward/avg"),
                               logp_gap=logp_gap(data), weight_update_s=stat(data, "timeperf/update_weights"))
                evaluated = stat(data, "eval-rollout/reward")  # only on the evaluator's steps
                if evaluated is not None:
                    progress.write(eval_reward=evaluated, eval_step=step)
                if global_step == 0:  # every rollout came from the weights the trainer holds
                    progress.write(on_policy_logp_gap=logp_gap(data))
                if served_version(addr, api_key) not in (str(step), None):
                    stale.set()  # the push just made is not what is served
                # No answer (supervisord shutting down at a pod stop) says nothing about a restart.
                now_serving = server_identity(cfg) or serving[0]
                if serving[0] is not None and now_serving != serving[0]:
                    _log.warn(f"inference was restarted during step {step}: its rollouts came partly from the base "
                              "weights. Stopping after this step; the trainer restarts and resumes.")
                    stale.set()
                serving[0] = now_serving
            # Every rank must stop at the same step, or the next collective hangs.
            flags = torch.tensor([sigterm.is_set(), stale.is_set()], dtype=torch.int64)
            dist.all_reduce(flags, group=trainer.actor.cpu_group)
            by_sigterm, by_stale = bool(flags[0]), bool(flags[1])
            if not (by_sigterm or by_stale):
                return
            saved = areal_patches.recover_checkpoint_written(trainer, global_step) or \
                areal_patches.force_recover_checkpoint(trainer, save_recover, epoch, epoch_step, global_step)
            stopped["by"] = "SIGTERM" if by_sigterm else "stale-weights"
            if progress is not None and saved:
                progress.write(checkpoint_step=step)
            _log.info(f"{stopped['by']}: stopping after step {step}, " + (
                "with its recover checkpoint" if saved else "WITHOUT a recover checkpoint (recover.mode disabled?)"))
            areal_patches.stop_after_step(trainer, global_step)

        trainer._export_and_commit_stats = commit
        serving = [server_identity(cfg) if progress is not None else None]
        if progress is not None and addr:
            threading.Thread(target=watch_served_weights, args=(cfg, progress, addr, api_key, stale),
                             daemon=True).start()
        if progress is not None:
            fresh = {"resumed_from": None, "resumed_at": None, "stopped": None, "logp_gap": None,
                     "on_policy_logp_gap": None}
            if trainer.recover_info is not None:
                # AReaL pushed the recovered weights as version global_step + 1.
                resumed = trainer.recover_info.last_step_info.global_step + 1
                fresh.update(step=resumed, weight_version=str(resumed), checkpoint_step=resumed,
                             resumed_from=info_path, resumed_at=resumed)
                _log.info(f"resumed from the recover checkpoint of step {resumed} ({info_path})")
            progress.write(**fresh)
        trainer.train(workflow=workflow, workflow_kwargs=kwargs,
                      eval_workflow=workflow if valid_dataset is not None else None,
                      eval_workflow_kwargs=eval_kwargs if valid_dataset is not None else None)
    if progress is not None:
        progress.stopped(stopped["by"] or "done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
