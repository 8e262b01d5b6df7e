"""podkit's GRPO entry script for AReaL 1.0.4 in SPMD mode (run by torchrun, one process per training GPU).

    torchrun --standalone --nproc-per-node N grpo.py --config areal/grpo-a40-4gpu.yaml key=value ...

GSM8K with AReaL's RLVRWorkflow (areal's gsm8k example uses a workflow SPMD mode refuses). Around
AReaL's own PPOTrainer it adds what podkit's supervision relies on:

- progress: rank 0 writes <workspace>/.podkit/progress.json after each step (status, health, watchdog);
- versioned weights: each disk weight update tells SGLang its version, so `/get_model_info` says which
  weights are served; a restarted SGLang says "default" (the base model), which rank 0 checks for every
  trainer.stale_weights_check_s and answers by exiting 75, so supervisord restarts the trainer, which
  resumes from its recover checkpoint and pushes those weights (AReaL pushes on recovery);
- SIGTERM: the step in flight finishes, a recover checkpoint is written if this step had none, exit 0;
- SIGUSR2: every thread's stack, to logs/stacks-<pid>.txt (the watchdog's dump).

Imports AReaL and torch: this runs only in the image, never on podkit's boot path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from podkit import log, records

_log = log.get("trainer")
EXIT_STALE_WEIGHTS = 75  # EX_TEMPFAIL: supervisord restarts the trainer (autorestart=unexpected)


def version_weight_updates() -> None:
    """Disk updates carry weight_version (SGLang's UpdateWeightFromDiskReqInput has the field)."""
    from areal.engine.sglang_remote import SGLangBackend

    build = SGLangBackend.build_disk_weight_update_requests

    def with_version(self, meta):
        requests = build(self, meta)
        if meta.version is not None and not meta.use_lora:
            for req in requests.requests:
                if req.endpoint == "/update_weights_from_disk":
                    req.payload["weight_version"] = str(meta.version)
        return requests

    SGLangBackend.build_disk_weight_update_requests = with_version


class Progress(records.Progress):
    """Rank 0's record for podkit (the same contract as the fake trainer's)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.state_dir, "areal")
        self.data["checkpoint_step"] = records.PROGRESS.read(cfg.state_dir).get("checkpoint_step")

    def write(self, **fields) -> None:
        self.update(**fields, time=time.time())


def first_stat(stats, *suffixes: str):
    items = stats if isinstance(stats, list) else [stats]
    for item in items:
        for key, value in item.items():
            if key.endswith(suffixes):
                try:
                    return float(value)
                except (TypeError, ValueError):
                    pass
    return None


def watch_served_weights(cfg, progress: Progress, addr: str) -> None:
    """Rank 0, in a daemon thread: a restarted SGLang serves base weights ('default') after this trainer
    pushed a version. Training on would compute rollouts from stale weights, silently."""
    import json
    import urllib.request

    while True:
        time.sleep(cfg.trainer.stale_weights_check_s)
        pushed = progress.data.get("weight_version")
        if pushed is None:
            continue
        try:
            with urllib.request.urlopen(f"http://{addr}/get_model_info", timeout=10) as r:
                served = str(json.loads(r.read()).get("weight_version"))
        except (OSError, ValueError):
            continue  # down or restarting: the rollouts wait, the watchdog watches
        if served == "default":
            _log.warn(f"inference serves the base weights but this trainer pushed version {pushed}: "
                      "inference restarted. Exiting so supervisord restarts the trainer; it resumes from its "
                      "recover checkpoint and pushes those weights again.")
            progress.write(stopped={"by": "stale-weights", "time": time.time(), "step": progress.data.get("step")})
            os._exit(EXIT_STALE_WEIGHTS)


def main(argv: list[str]) -> int:
    from podkit import config
    from podkit.programs import stacks_on_sigusr2

    cfg = config.load()
    stacks_on_sigusr2(cfg)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    import torch
    import torch.distributed as dist
    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    version_weight_updates()
    config_, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config_.tokenizer_path)
    train_dataset = get_custom_dataset(split="train", dataset_config=config_.train_dataset, tokenizer=tokenizer)
    valid_dataset = None
    if config_.valid_dataset is not None:
        valid_dataset = get_custom_dataset(split="test", dataset_config=config_.valid_dataset, tokenizer=tokenizer)

    rank = int(os.environ.get("RANK", "0"))
    progress = Progress(cfg) if rank == 0 else None
    addr = os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",")[0]

    with PPOTrainer(config_, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        export, save_recover = trainer._export_and_commit_stats, trainer._save_recover_checkpoint
        info_path = trainer.recover_handler.recover_info_path(
            config_.experiment_name, config_.trial_name, config_.cluster.fileroot)
        saved = {"step": None}

        def save_recover_and_note(epoch: int, epoch_step: int, global_step: int) -> None:
            before = os.path.getmtime(info_path) if os.path.exists(info_path) else None
            save_recover(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
            if os.path.exists(info_path) and os.path.getmtime(info_path) != before:
                saved["step"] = global_step + 1

        def commit(epoch: int, epoch_step: int, global_step: int) -> None:
            stats = {}
            commit_ = trainer.stats_logger.commit

            def keep(e, s, g, data):
                stats["data"] = data
                return commit_(e, s, g, data)

            trainer.stats_logger.commit = keep
            try:
                export(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
            finally:
                trainer.stats_logger.commit = commit_
            step = global_step + 1
            if progress is not None:
                data = stats.get("data") or {}
                progress.write(step=step, weight_version=str(step), checkpoint_step=saved["step"]
                               or progress.data.get("checkpoint_step"),
                               loss=first_stat(data, "loss/avg", "loss"),
                               reward=first_stat(data, "task_reward/avg", "reward/avg"))
            # Every rank must agree to stop at the same step, or the next collective hangs.
            flag = torch.tensor([1 if stopping.is_set() else 0])
            dist.all_reduce(flag, group=trainer.actor.cpu_group)
            if flag.item():
                if saved["step"] != step:
                    freq = trainer.recover_handler.freq_ctl
                    check, freq.check = freq.check, (lambda **_: True)
                    try:
                        save_recover_and_note(epoch, epoch_step, global_step)
                    finally:
                        freq.check = check
                if progress is not None:
                    progress.write(stopped={"by": "SIGTERM", "time": time.time(), "step": step})
                _log.info(f"SIGTERM: stopped after step {step} with a recover checkpoint")
                raise SystemExit(0)

        trainer._save_recover_checkpoint = save_recover_and_note
        trainer._export_and_commit_stats = commit
        if progress is not None and addr:
            threading.Thread(target=watch_served_weights, args=(cfg, progress, addr), daemon=True).start()
        if progress is not None and trainer.recover_info is not None:
            # AReaL pushed the recovered weights as version global_step + 1.
            resumed = trainer.recover_info.last_step_info.global_step + 1
            progress.write(step=resumed, weight_version=str(resumed), checkpoint_step=resumed,
                           resumed_from=info_path)
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow",
                      workflow_kwargs=dict(reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
                                           gconfig=config_.gconfig, tokenizer=config_.tokenizer_path,
                                           enable_thinking=False))
    if progress is not None:
        progress.write(stopped={"by": "done", "time": time.time(), "step": progress.data.get("step")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
