"""Runs in the AReaL environment (tests/trainer/test_rehearsal.py): AReaL 1.0.4's own FSDPEngine.forward_batch
path on CPU (no FSDP wrap), a tiny random Qwen2, three sequences packed into one micro-batch; each
sequence's log-probs against the same sequence run alone, for sdpa and eager, without and with podkit's
packed-mask patch. Prints one JSON line: {impl: {"unpatched": [max diff per sequence], "patched": [...]}}."""

import json
import logging
import os
import sys
import tempfile
import types

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29533")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1)
from areal.api.cli_args import MicroBatchSpec, TrainEngineConfig  # noqa: E402
from areal.engine.fsdp_engine import FSDPEngine  # noqa: E402

from podkit.areal import patches as areal_patches  # noqa: E402


def make_engine(impl: str, d: str) -> FSDPEngine:
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    model = Qwen2ForCausalLM.from_pretrained(d, attn_implementation=impl, dtype=torch.float32).eval()
    e = FSDPEngine(TrainEngineConfig(experiment_name="x", trial_name="y", path=d, attn_impl=impl,
                                     mb_spec=MicroBatchSpec(max_tokens_per_mb=10240)))
    e.model, e.device, e.is_offload = model, torch.device("cpu"), False
    e.parallel_helper = types.SimpleNamespace(sp_size=1, tp_size=1, tp_group=None)
    e.logger = logging.getLogger("engine")
    return e


torch.manual_seed(1)
seqs = [torch.randint(1, 128, (n,)) for n in (7, 12, 5)]
ids = torch.zeros(3, 12, dtype=torch.long)
mask = torch.zeros(3, 12, dtype=torch.bool)
for i, s in enumerate(seqs):
    ids[i, : len(s)], mask[i, : len(s)] = s, True


def alone(model, s):
    with torch.no_grad():
        logits = model(input_ids=s[None]).logits[0]
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, s[1:, None])[:, 0]


def packed(e):
    with torch.no_grad():
        out = e.forward_batch({"input_ids": ids, "attention_mask": mask})
    return [out[i, : len(s) - 1] for i, s in enumerate(seqs)]


results = {}
original = FSDPEngine._prepare_mb_list
with tempfile.TemporaryDirectory() as d:
    for impl in ("sdpa", "eager"):
        FSDPEngine._prepare_mb_list = original
        e = make_engine(impl, d)
        ref = [alone(e.model, s) for s in seqs]
        before = packed(e)
        areal_patches.packed_mask()
        after = packed(e)
        results[impl] = {name: [float((g - r).abs().max()) for g, r in zip(got, ref, strict=True)]
                         for name, got in (("unpatched", before), ("patched", after))}
dist.destroy_process_group()
print(json.dumps(results))
