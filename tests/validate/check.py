"""Runs in the AReaL environment (rehearse/env.sh), never in podkit's own.

Reads a JSON request on stdin and writes its answer as JSON to the file named by its argument (AReaL
logs to stdout):
  {"sglang": [argv, ...], "areal": [{"config": path, "overrides": [...]}, ...]}
Each SGLang argv (podkit's `python -m sglang.launch_server ...`) goes through SGLang's own ServerArgs
argument parser; each AReaL config goes through AReaL's own loader (hydra compose, GRPOConfig
structured merge, the dataclasses' own checks) and its backend strings through AReaL's allocation
parser. Nothing is checked by podkit's code here: a config the real parsers reject fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile


def import_server_args_without_torchvision() -> None:
    """The AReaL environment has no torchvision (PyPI has only CUDA builds; beside a CPU torch it breaks
    transformers' PreTrainedModel import, which the trainer needs). SGLang's server_args import chain
    reaches module-level `from torchvision... import X` (utils/common.py: torchvision.io.decode_jpeg;
    multimodal/internvl_utils.py: torchvision.transforms) for image code the parser never runs. A
    placeholder package answers those imports for that one import and is removed after; transformers,
    imported first, has already decided that torchvision is unavailable."""
    import importlib.abc
    import importlib.machinery
    import types

    import transformers  # noqa: F401 - decides "no torchvision" before the placeholder exists

    class Anything(types.ModuleType):
        __path__ = []

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return Anything(spec.name)

        def exec_module(self, module):
            pass

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        import sglang.srt.server_args  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]


class ParseError(Exception):
    pass


def sglang_check(argv: list[str]) -> dict:
    from sglang.srt.server_args import ServerArgs

    if argv[1:3] != ["-m", "sglang.launch_server"]:
        return {"ok": False, "error": f"not an SGLang server command line: {argv[:3]}"}
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)

    def error(message):
        raise ParseError(message)

    parser.error = error
    args = argv[3:]
    try:
        if "--config" in args:  # what sglang.srt.server_args.prepare_server_args does with it
            from sglang.srt.server_args_config_parser import ConfigArgumentMerger

            args = ConfigArgumentMerger(parser).merge_config_with_args(args)
        with contextlib.redirect_stderr(io.StringIO()):
            ns = parser.parse_args(args)
    except (ParseError, argparse.ArgumentError, ValueError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "args": {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool))}}


def sglang_flags() -> list[str]:
    """Every option string of SGLang's server parser, and whether it takes prefixes for them."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    assert parser.allow_abbrev  # what makes `--hos` mean --host
    return sorted(s for a in parser._actions for s in a.option_strings)


def declared_choices(obj, prefix: str = "") -> list[str]:
    """AReaL declares allowed values in its dataclass fields' metadata ("choices") but its loader does
    not enforce them (OmegaConf checks types only); the engines reject other values at run time, on
    the pod. Enforce AReaL's own declarations here."""
    import dataclasses

    bad = []
    if not dataclasses.is_dataclass(obj):
        return bad
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        choices = f.metadata.get("choices") if f.metadata else None
        if choices and isinstance(value, (str, int, float)) and value not in choices:
            bad.append(f"{prefix}{f.name}={value!r} is not one of {list(choices)}")
        if dataclasses.is_dataclass(value):
            bad += declared_choices(value, f"{prefix}{f.name}.")
    return bad


def areal_check(path: str, overrides: list[str]) -> dict:
    from areal.api.alloc_mode import ModelAllocation, _AllocationMode
    from areal.api.cli_args import GRPOConfig, parse_cli_args, to_structured_cfg
    from omegaconf import OmegaConf

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            raw, _ = parse_cli_args(["--config", path, *overrides])
            cfg = OmegaConf.to_object(to_structured_cfg(raw, config_cls=GRPOConfig))
        actor = ModelAllocation.from_str(cfg.actor.backend, name="actor")
        rollout = ModelAllocation.from_str(cfg.rollout.backend, name="rollout")
        # The combined form AReaL's SPMD launchers read (the seeds' `sglang.d1t1p1+d3t1p1` fails here).
        combined = _AllocationMode.from_str(f"{cfg.rollout.backend}+{cfg.actor.backend}")
        bad = declared_choices(cfg)
        if bad:
            raise ValueError("; ".join(bad))
    except Exception as e:  # noqa: BLE001 - any rejection by AReaL is the answer
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "actor_gpus": actor.parallel.world_size, "rollout_gpus": rollout.parallel.world_size,
            "combined_gen_gpus": combined.gen.world_size, "combined_train_gpus": combined.train.world_size,
            "actor_backend": actor.backend, "rollout_backend": rollout.backend,
            "experiment_name": cfg.experiment_name, "trial_name": cfg.trial_name,
            "fileroot": cfg.cluster.fileroot, "name_resolve_root": cfg.cluster.name_resolve.nfs_record_root,
            "actor_path": cfg.actor.path, "tokenizer_path": cfg.tokenizer_path,
            "attention_backend": cfg.sglang.attention_backend, "mem_fraction_static": cfg.sglang.mem_fraction_static,
            "context_length": cfg.sglang.context_length, "weight_update_mode": cfg.actor.weight_update_mode,
            "recover_mode": cfg.recover.mode, "recover_fileroot": cfg.recover.fileroot,
            "saver_fileroot": cfg.saver.fileroot, "stats_fileroot": cfg.stats_logger.fileroot,
            "total_train_steps": cfg.total_train_steps,
            "request_timeout": cfg.rollout.request_timeout, "request_retries": cfg.rollout.request_retries,
            "setup_timeout": cfg.rollout.setup_timeout, "max_concurrent_rollouts": cfg.rollout.max_concurrent_rollouts,
            "attn_impl": cfg.actor.attn_impl, "n_nodes": cfg.cluster.n_nodes,
            "n_gpus_per_node": cfg.cluster.n_gpus_per_node, **allocation(cfg)}


def allocation(cfg) -> dict:
    """The deprecated allocation_mode AReaL's Ray launcher reads, as its parser reads it."""
    from areal.api.alloc_mode import _AllocationMode

    if not cfg.allocation_mode:
        return {"allocation_mode": None}
    mode = _AllocationMode.from_str(cfg.allocation_mode)
    return {"allocation_mode": cfg.allocation_mode, "alloc_gen_gpus": mode.gen.world_size,
            "alloc_train_gpus": mode.train.world_size}


def sglang_request_fields(name: str) -> set[str]:
    """The fields of one of SGLang's request dataclasses, read from its source: importing
    sglang.srt.managers.io_struct pulls in sgl_kernel, which needs CUDA's runtime libraries."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang.srt.managers.io_struct")
    tree = ast.parse(open(spec.origin).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def weight_update_check(src: str) -> dict:
    """podkit's entry script tags AReaL's disk weight updates with weight_version: the patched request
    is built by AReaL's own SGLang backend, and every key must be a field of SGLang's
    UpdateWeightFromDiskReqInput."""
    sys.path.insert(0, src)
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.sglang_remote import SGLangBackend

    from podkit.areal.patches import version_weight_updates

    version_weight_updates()
    meta = WeightUpdateMeta.from_disk("podkit", "run", "/workspace/areal").with_version(7)
    reqs = SGLangBackend().build_disk_weight_update_requests(meta).requests
    payloads = [r.payload for r in reqs if r.endpoint == "/update_weights_from_disk"]
    fields = sglang_request_fields("UpdateWeightFromDiskReqInput")
    unknown = sorted({k for p in payloads for k in p} - fields)
    if unknown or not payloads:
        return {"ok": False, "error": f"not fields of SGLang's request: {unknown}", "payloads": payloads}
    return {"ok": True, "payloads": payloads, "weight_versions": [p.get("weight_version") for p in payloads]}


def main() -> int:
    request, answer = json.load(sys.stdin), os.path.abspath(sys.argv[1])
    # AReaL's loader may write logs under its fileroot; keep them out of the tree.
    os.chdir(tempfile.mkdtemp(prefix="podkit-validate-"))
    import_server_args_without_torchvision()
    out = {"sglang": [sglang_check(a) for a in request.get("sglang", [])],
           "areal": [areal_check(r["config"], r.get("overrides", [])) for r in request.get("areal", [])]}
    if request.get("sglang_flags"):
        out["sglang_flags"] = sglang_flags()
    if request.get("podkit_src"):
        out["weight_update"] = weight_update_check(request["podkit_src"])
    with open(answer, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
