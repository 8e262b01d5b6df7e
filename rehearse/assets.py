"""Tiny, offline, deterministic assets for the CPU rehearsal of AReaL's GSM8K GRPO (nothing from a hub):

  OUT/model/   a tiny Qwen2ForCausalLM (hidden 64, 2 layers, 4 heads, 357 KB) + its BPE tokenizer with a
               chat template (one directory: podkit passes the same path as actor.path, tokenizer_path and
               sglang.model_path), briefly fine-tuned so that some sampled answers are right
  OUT/gsm8k/   a GSM8K-shaped dataset laid out like the hub repo openai/gsm8k (README.md with a `main`
               config, main/{train,test}-00000-of-00001.parquet), so AReaL's
               `load_dataset(path, name="main", split=...)` loads it from the local path (the path must
               contain "gsm8k" for get_custom_dataset to pick the GSM8K loader).

    python rehearse/assets.py OUT_DIR [SFT_STEPS=250]   (0: a random model; every reward is then 0)

Runs in the AReaL environment (rehearse/env.sh). Built into a temporary directory and renamed into
place, with a stamp of this file's hash: a half-built or foreign OUT is moved aside, never trusted.
~30 s on one core; the same bytes every time (checked by a test).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time

import torch

SEED = 1234
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NAMES = ["Tom", "Ann", "Bob", "Eve", "Sam", "Kim"]
THINGS = ["apples", "pens", "books", "coins", "cards", "eggs"]


def problems(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, 9), rng.randint(1, 9)  # small numbers: a tiny model gets some right
        kind = rng.choice(["add", "sub", "mul"])
        if kind == "add":
            q = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
            r, work = a + b, f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}"
        elif kind == "sub":
            a, b = max(a, b), min(a, b)
            q = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
            r, work = a - b, f"{a}-{b}=<<{a}-{b}={a - b}>>{a - b}"
        else:
            a, b = a % 4 + 2, b % 4 + 2
            q = f"{who} buys {a} boxes with {b} {what} in each. How many {what} does {who} buy?"
            r, work = a * b, f"{a}*{b}=<<{a}*{b}={a * b}>>{a * b}"
        rows.append({"question": q, "answer": f"{who} has {work} {what}.\n#### {r}"})
    return rows


def make_tokenizer(corpus: list[str], out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Digits stay single characters (numbers compose from them, as in Qwen's tokenizer).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
    ])
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=224, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", bos_token=None, model_max_length=1024,
                                   padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def sft(model, tok, rows: list[dict], steps: int) -> None:
    """A few hundred supervised steps so that sampled answers are sometimes right (GRPO needs reward
    variance inside a group, or every advantage is 0 and nothing is learned): the target is
    "The answer is \\boxed{N}." + <|im_end|>."""
    rng = random.Random(SEED + 1)
    data = []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["question"] + "\nPlease put your final "
                                            "answer within \\boxed{}."}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"]
        ans = tok(f"The answer is \\boxed{{{r['answer'].split('####')[-1].strip()}}}.")["input_ids"] + [tok.eos_token_id]
        data.append((list(prompt), ans))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(32)]
        n = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), n), tok.pad_token_id)
        labels = torch.full((len(batch), n), -100)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"sft step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def make_model(tok, out: str, rows: list[dict], sft_steps: int) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True)
    cfg.torch_dtype = "float32"
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    if sft_steps:
        sft(model, tok, rows, sft_steps)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id,
                     do_sample=True, temperature=1.0).save_pretrained(out)


def make_dataset(train: list[dict], test: list[dict], out: str) -> None:
    from datasets import Dataset

    os.makedirs(os.path.join(out, "main"), exist_ok=True)
    Dataset.from_list(train).to_parquet(os.path.join(out, "main", "train-00000-of-00001.parquet"))
    Dataset.from_list(test).to_parquet(os.path.join(out, "main", "test-00000-of-00001.parquet"))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("---\nconfigs:\n- config_name: main\n  data_files:\n"
                "  - split: train\n    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n"
                "Tiny synthetic GSM8K-shaped data for a CPU rehearsal (not GSM8K).\n")


def build(out: str, sft_steps: int) -> None:
    torch.set_num_threads(1)  # deterministic CPU kernels
    rng = random.Random(SEED)
    train, test = problems(256, rng), problems(32, rng)
    corpus = [r["question"] + "\nPlease put your final answer within \\boxed{}." for r in train + test]
    corpus += [r["answer"] for r in train + test] + ["The answer is \\boxed{42}."] * 8
    model_dir = os.path.join(out, "model")
    tok = make_tokenizer(corpus, model_dir)
    make_model(tok, model_dir, train, sft_steps)
    make_dataset(train, test, os.path.join(out, "gsm8k"))
    print(f"vocab {len(tok)}; model and tokenizer in {model_dir}; dataset in {os.path.join(out, 'gsm8k')}")


def stamp(sft_steps: int) -> dict:
    with open(__file__, "rb") as f:
        return {"assets": hashlib.sha256(f.read()).hexdigest()[:16], "sft_steps": sft_steps}


def main(out: str, sft_steps: int) -> int:
    out = os.path.abspath(out)
    want = stamp(sft_steps)
    try:
        with open(os.path.join(out, "stamp.json")) as f:
            if json.load(f) == want:
                print(f"assets in {out} are current")
                return 0
    except (OSError, ValueError):
        pass
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp, sft_steps)
    with open(os.path.join(tmp, "stamp.json"), "w") as f:
        json.dump(want, f)
    if os.path.lexists(out):  # stale or foreign: kept beside, not deleted
        aside = f"{out}.old-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.rename(out, aside)
        print(f"moved the previous {out} aside to {aside}")
    os.rename(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 250))
