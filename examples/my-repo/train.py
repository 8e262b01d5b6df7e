"""GRPO on my own arithmetic data, with my own config fields, reward and workflow: an AReaL 1.0.4
training script as it would be without podkit (podkit runs it unchanged, as trainer.entry).

    torchrun --nproc-per-node 1 train.py --config config.yaml
"""

import sys
from dataclasses import dataclass, field

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.utils.hf_utils import load_hf_tokenizer
from datasets import load_dataset

from my_reward import boxed_answer_reward
from my_workflow import HintedWorkflow


@dataclass
class MyConfig(GRPOConfig):
    """AReaL's GRPO config with the fields this repo adds."""

    hint: str = field(default="Please put your final answer within \\boxed{}.",
                      metadata={"help": "appended to every question"})
    system_prompt: str = field(default="", metadata={"help": "a system message before every question"})


def jsonl_dataset(path: str, hint: str):
    """{"question", "answer"} lines as AReaL's RL datasets look: chat messages, and the answer for the reward."""
    rows = load_dataset("json", data_files=path, split="train")
    return rows.map(lambda r: {"messages": [{"role": "user", "content": f"{r['question']}\n{hint}"}],
                               "answer": str(r["answer"])}, remove_columns=["question"])


def main(argv: list[str]) -> None:
    config, _ = load_expr_config(argv, MyConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = jsonl_dataset(config.train_dataset.path, config.hint)
    valid = jsonl_dataset(config.valid_dataset.path, config.hint) if config.valid_dataset else None

    def workflow(gconfig):
        return HintedWorkflow(system_prompt=config.system_prompt, reward_fn=boxed_answer_reward, gconfig=gconfig,
                              tokenizer=tokenizer, enable_thinking=False)

    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        trainer.train(workflow=workflow(config.gconfig),
                      eval_workflow=workflow(config.eval_gconfig) if valid is not None else None)


if __name__ == "__main__":
    main(sys.argv[1:])
