"""podkit's example training script: GRPO on GSM8K with AReaL 1.0.4, a plain AReaL script.

It runs when the pod config names no trainer.entry, through the same bootstrap as a user's script
(podkit/areal/bootstrap.py), so it imports nothing of podkit's:

    torchrun --nproc-per-node N gsm8k_grpo.py --config grpo-a40-4gpu.yaml key=value ...

AReaL's RLVRWorkflow for training and for evaluation (AReaL's own gsm8k example evaluates with a
workflow that SPMD mode refuses), with AReaL's GSM8K reward.
"""

import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer

WORKFLOW = "areal.workflow.rlvr.RLVRWorkflow"
REWARD = "areal.reward.gsm8k.gsm8k_reward_fn"


def main(argv: list[str]) -> None:
    config, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)
    valid_dataset = None
    if config.valid_dataset is not None:
        valid_dataset = get_custom_dataset(split="test", dataset_config=config.valid_dataset, tokenizer=tokenizer)
    kwargs = dict(reward_fn=REWARD, gconfig=config.gconfig, tokenizer=config.tokenizer_path, enable_thinking=False)
    eval_kwargs = {**kwargs, "gconfig": config.eval_gconfig}  # AReaL groups eval samples by its n_samples
    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        trainer.train(workflow=WORKFLOW, workflow_kwargs=kwargs,
                      eval_workflow=WORKFLOW if valid_dataset is not None else None,
                      eval_workflow_kwargs=eval_kwargs if valid_dataset is not None else None)


if __name__ == "__main__":
    main(sys.argv[1:])
