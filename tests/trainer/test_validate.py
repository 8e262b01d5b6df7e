"""What podkit generates, checked by the real parsers: every SGLang command line by SGLang's own
ServerArgs argument parser, every shipped AReaL config (with podkit's overrides) by AReaL's own config
loader and allocation parser. They run in a separate environment (rehearse/env.sh, built and
cached by `make test`), found through $AREAL_PYTHON; one process answers every case."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from conftest import ROOT
from podkit import config
from podkit.areal import checks, command, discovery, identity
from podkit.areal import cluster as areal_cluster
from podkit.programs import sglang

PYTHON = os.environ.get("AREAL_PYTHON")
pytestmark = [pytest.mark.validate, pytest.mark.timeout(300),
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(rehearse/env.sh))")]
POD_CONFIGS = ["a40-1gpu.yaml", "a40-2gpu.yaml", "a40-4gpu.yaml"]
# Multi-node: as rank 0 of each sees itself (RunPod's env on an Instant Cluster; the test cluster's).
CLUSTER_CONFIGS = {"cluster-2x8.yaml": {"NODE_RANK": "0", "PRIMARY_ADDR": "10.65.0.2", "NODE_ADDR": "10.65.0.2"},
                   "cpu-cluster.yaml": {"PODKIT_CLUSTER_RANK": "0", "PODKIT_CLUSTER_NODE_ADDR": "127.0.0.2"}}
WS = "/workspace"


def pod(name, **env):
    return config.load(ROOT / "configs" / name, environ={"PODKIT_WORKSPACE": WS, **env})


def with_changes(tmp, name, change):
    data = yaml.safe_load((ROOT / "configs/areal" / name).read_text())
    change(data)
    path = tmp / f"changed-{len(list(tmp.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    assert PYTHON, "CI must run the validation: `make test` sets AREAL_PYTHON"
    tmp = tmp_path_factory.mktemp("areal")
    cases = {"sglang": {}, "areal": {}}
    for name in POD_CONFIGS:
        cfg = pod(name)
        cases["sglang"][name] = sglang.command(cfg, environ={})
        secrets = tmp / f"{name}-secrets.yaml"
        secrets.write_text(sglang.secrets_yaml({"SGLANG_API_KEY": "k"}))
        cases["sglang"][name + "+key"] = sglang.command(pod(name, PODKIT_INFERENCE_HOST="0.0.0.0"),
                                                        environ={"SGLANG_API_KEY": "k"}, secrets_file=str(secrets))
        cases["areal"][name] = {"config": cfg.trainer.areal_config, "overrides": command.overrides(cfg)}
    default = config.load(ROOT / "configs/default.yaml", environ={})
    cases["sglang"]["default.yaml"] = sglang.command(default, environ={})
    cases["sglang"]["typo"] = sglang.command(pod("a40-4gpu.yaml", PODKIT_INFERENCE_EXTRA_ARGS="--mem-fraction-statik 0.5"),
                                             environ={})
    cases["sglang"]["bad-backend"] = sglang.command(pod("a40-4gpu.yaml", PODKIT_INFERENCE_EXTRA_ARGS=
                                                        "--attention-backend flash"), environ={})
    cases["sglang"]["abbreviated"] = sglang.command(pod("a40-4gpu.yaml", PODKIT_INFERENCE_EXTRA_ARGS=
                                                        "--hos 0.0.0.0 --api-ke k"), environ={})
    four = "grpo-a40-4gpu.yaml"
    cases["areal"]["seed-allocation"] = {"config": with_changes(
        tmp, four, lambda d: d["actor"].update(backend="sglang.d1t1p1+d3t1p1"))}
    cases["areal"]["removed-recover-mode"] = {"config": with_changes(
        tmp, four, lambda d: d["recover"].update(mode="fault"))}
    cases["areal"]["unknown-key"] = {"config": with_changes(
        tmp, four, lambda d: d["actor"].update(weight_update="disk"))}
    cases["areal"]["bad-override"] = {"config": str(ROOT / "configs/areal" / four),
                                      "overrides": ["actor.weight_update_mode=nccl"]}
    shaped = with_changes(tmp, four, lambda d: (d["recover"].update(mode="disabled"), d["actor"].pop("attn_impl"),
                                               d["actor"].update(weight_update_mode="xccl", backend="fsdp:d4p1t1"),
                                               d["rollout"].update(backend="sglang:d4p1t1")))
    cases["areal"]["areal-example-shaped"] = {"config": shaped, "overrides": command.overrides(
        pod("a40-4gpu.yaml", PODKIT_TRAINER_AREAL_CONFIG=shaped))}
    for name, env in CLUSTER_CONFIGS.items():
        cfg = pod(name, **env)
        cases["areal"][name] = {"config": cfg.trainer.areal_config, "overrides": areal_cluster.overrides(cfg)}
    names = {k: list(v) for k, v in cases.items()}
    request = {k: list(v.values()) for k, v in cases.items()}
    request["podkit_src"], request["sglang_flags"] = str(ROOT / "src"), True
    answer = tmp / "answer.json"
    r = subprocess.run([PYTHON, str(ROOT / "tests/validate/check.py"), str(answer)], input=json.dumps(request),
                       capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PODKIT_WORKSPACE": WS})  # what podkit exports (the CPU configs read it)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(answer.read_text())
    return {**{k: dict(zip(names[k], out[k], strict=True)) for k in names}, "weight_update": out["weight_update"],
            "sglang_flags": out["sglang_flags"]}


@pytest.mark.parametrize("name", POD_CONFIGS + ["default.yaml"])
def test_sglang_accepts_the_command_line_podkit_builds(verdicts, name):
    v = verdicts["sglang"][name]
    assert v["ok"], v["error"]
    cfg = pod(name) if name != "default.yaml" else config.load(ROOT / "configs/default.yaml", environ={})
    args = v["args"]
    assert args["model_path"] == cfg.inference.model and args["port"] == cfg.inference.port
    assert args["attention_backend"] == cfg.inference.attention_backend
    assert args["tensor_parallel_size"] == cfg.inference.tp and args["mem_fraction_static"] == cfg.inference.mem_fraction_static
    assert args["host"] == "127.0.0.1"


@pytest.mark.parametrize("name", POD_CONFIGS)
def test_sglang_exposed_beyond_loopback_gets_its_api_key(verdicts, name):
    v = verdicts["sglang"][name + "+key"]
    assert v["ok"], v["error"]
    assert v["args"]["host"] == "0.0.0.0" and v["args"]["api_key"] == "k"


def test_sglang_parser_rejects_a_misspelt_flag_and_a_wrong_backend(verdicts):
    """The check can fail: extra_args with a typo, or an attention backend SGLang does not know."""
    assert not verdicts["sglang"]["typo"]["ok"]
    assert "--mem-fraction-statik" in verdicts["sglang"]["typo"]["error"]
    assert "invalid choice: 'flash'" in verdicts["sglang"]["bad-backend"]["error"]


def test_extra_args_refuse_every_prefix_sglang_reads_as_a_flag_podkit_owns_and_no_other_flag(verdicts):
    """SGLang's parser takes an unambiguous prefix for the flag: `--hos 0.0.0.0 --api-ke k` undoes the
    loopback bind and swaps the API key. Each prefix of an owned flag is refused; each of SGLang's other
    flags passes."""
    args = verdicts["sglang"]["abbreviated"]["args"]
    assert args["host"] == "0.0.0.0" and args["api_key"] == "k", args
    flags = verdicts["sglang_flags"]
    owned = [f for f in checks.OWNED_FLAGS if f in flags]
    assert len(owned) >= len(checks.OWNED_FLAGS) - 1, set(checks.OWNED_FLAGS) - set(flags)  # --tp: a prefix itself

    def refused(words: str) -> list:
        return checks._owned_flags(words)

    for flag in owned:
        for n in range(3, len(flag) + 1):
            assert refused(f"{flag[:n]} 1") and refused(f"{flag[:n]}=1"), flag[:n]
    passed = [f for f in flags if f.startswith("--") and f not in checks.OWNED_FLAGS and not refused(f"{f} 1")]
    assert len(passed) == len([f for f in flags if f.startswith("--") and f not in checks.OWNED_FLAGS]) > 300
    problem = refused("--hos 0.0.0.0")[0]
    assert "--host" in problem[1] and "inference.host" in problem[2], problem


def test_the_flags_the_piecewise_check_reads_are_sglangs_own(verdicts):
    """checks._piecewise reads three of SGLang's flags from extra_args: each is in the installed parser."""
    assert {"--disable-piecewise-cuda-graph", "--piecewise-cuda-graph-max-tokens",
            "--chunked-prefill-size"} <= set(verdicts["sglang_flags"])


@pytest.mark.parametrize("name", POD_CONFIGS)
def test_areal_loads_the_shipped_grpo_config_with_podkits_overrides(verdicts, name):
    v = verdicts["areal"][name]
    assert v["ok"], v["error"]
    cfg = pod(name)
    n_train, n_inf = len(cfg.gpus["trainer"]), len(cfg.gpus["inference"])
    # AReaL's allocation parser and podkit's reading of the same strings agree with the pod's GPUs.
    assert v["actor_gpus"] == v["combined_train_gpus"] == n_train
    assert v["rollout_gpus"] == v["combined_gen_gpus"] == n_inf == cfg.inference.tp
    assert (v["actor_backend"], v["rollout_backend"]) == ("fsdp", "sglang")
    # What podkit reads elsewhere (reap's name_resolve path, the volume) is what AReaL will use.
    run = identity.names(cfg)  # what podkit reads is what AReaL loaded
    assert (v["experiment_name"], v["trial_name"]) == (run.experiment, run.trial) == ("podkit", "run")
    assert v["name_resolve_root"] == cfg.trainer.name_resolve_root
    assert str(discovery.trial_dir(v["name_resolve_root"], v["experiment_name"], v["trial_name"])).startswith(
        cfg.trainer.name_resolve_root)
    # Weight updates (cluster.fileroot) on local disk in the run dir; what must outlive the container on
    # the volume.
    assert v["fileroot"] == command.update_root(cfg) == f"{cfg.run_path}/areal" and not v["fileroot"].startswith(WS)
    assert v["recover_fileroot"] == v["saver_fileroot"] == v["stats_fileroot"] == f"{WS}/areal"
    assert v["actor_path"] == v["tokenizer_path"] == cfg.inference.model
    # The A40 facts and the seeds' timeouts.
    assert v["attention_backend"] == "flashinfer" and v["attn_impl"] != "flash_attention_3"
    assert v["weight_update_mode"] == "disk" and v["recover_mode"] == "auto"
    assert (v["request_timeout"], v["request_retries"], v["setup_timeout"]) == (7200, 5, 300)
    assert v["mem_fraction_static"] == cfg.inference.mem_fraction_static
    assert v["context_length"] == cfg.inference.context_length
    assert v["max_concurrent_rollouts"] == cfg.inference.cuda_graph_max_bs


@pytest.mark.parametrize("case, words", [
    ("seed-allocation", "backend"),           # the seeds' `sglang.d1t1p1+d3t1p1` no longer parses
    ("removed-recover-mode", "fault"),        # modes fault/resume were removed
    ("unknown-key", "weight_update"),
    ("bad-override", "nccl"),
])
def test_areal_rejects_what_would_fail_on_the_pod(verdicts, case, words):
    v = verdicts["areal"][case]
    assert not v["ok"] and words in v["error"], v


def test_disk_weight_updates_carry_their_version_in_a_request_sglang_accepts(verdicts):
    """How a restarted SGLang is told apart: AReaL's own request builder, patched by podkit's entry
    script, sends weight_version; SGLang's own request type takes it."""
    v = verdicts["weight_update"]
    assert v["ok"], v
    assert v["weight_versions"] == ["7"] and v["payloads"][0]["model_path"].endswith("weight_update_v7")


def test_the_images_constraints_hold_sglang_and_what_it_requires():
    """docker/base-pins.py, run as the Dockerfile runs it where SGLang is installed (here: the AReaL
    environment), pins SGLang, torch and SGLang's exact requirements at their installed versions, and
    puts the image's overrides in place of SGLang's openai and soundfile pins."""
    assert PYTHON, "CI must run the validation: `make test` sets AREAL_PYTHON"
    r = subprocess.run([PYTHON, str(ROOT / "docker/base-pins.py"), "--overrides",
                        str(ROOT / "docker/areal-overrides.txt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    pins = dict(line.split("==", 1) for line in lines if "==" in line and "," not in line)
    assert pins["sglang"] == "0.5.10.post1" and pins["transformers"] == "5.3.0"
    assert pins["torch"].startswith("2.13.0")  # the CPU torch of this env
    assert "openai" not in pins and pins["soundfile"] == "0.13.1", lines
    assert [ln for ln in lines if ln.startswith("openai>")] == ["openai>=2.8.0,<3"], lines


@pytest.mark.parametrize("name", list(CLUSTER_CONFIGS))
def test_areal_loads_the_cluster_configs_and_the_ray_launcher_places_what_the_trainer_reads(verdicts, name):
    v = verdicts["areal"][name]
    assert v["ok"], v["error"]
    cfg = pod(name, **CLUSTER_CONFIGS[name])
    assert checks.cluster(cfg) == []
    # The launcher places by allocation_mode, the trainer by the backends: the same GPUs, on whole nodes.
    assert (v["alloc_gen_gpus"], v["alloc_train_gpus"]) == (v["rollout_gpus"], v["actor_gpus"])
    assert v["alloc_gen_gpus"] + v["alloc_train_gpus"] == v["n_nodes"] * v["n_gpus_per_node"]
    assert v["n_nodes"] == cfg.cluster.nodes >= 2 and v["alloc_gen_gpus"] % v["n_gpus_per_node"] == 0
    # What crosses nodes is on the shared volume: weight updates and name_resolve.
    assert v["fileroot"].startswith(f"{WS}/") and v["name_resolve_root"].startswith(f"{WS}/")
    assert v["weight_update_mode"] == "disk" and v["recover_mode"] == "auto"


@pytest.mark.parametrize("change, key, words", [
    ("allocation_mode=sglang:d8+fsdp:d4", "trainer.areal_config", "allocation_mode"),
    ("cluster.n_nodes=3", "cluster.nodes", "n_nodes 3"),
    ("allocation_mode=sglang:d4+fsdp:d12 rollout.backend=sglang:d4 actor.backend=fsdp:d12",
     "trainer.areal_config", "whole nodes"),
])
def test_a_cluster_config_the_ray_launcher_would_misplace_is_refused(change, key, words):
    cfg = pod("cluster-2x8.yaml", NODE_RANK="0", PRIMARY_ADDR="10.65.0.2", PODKIT_TRAINER_OVERRIDES=change)
    problems = checks.cluster(cfg)
    assert any(k == key and words in what + hint for k, what, hint in problems), problems


def test_areal_loads_an_example_shaped_yaml_as_it_is_with_what_podkit_sets_over_it(verdicts):
    """Recovery off, xccl, no attn_impl and backends for 8 GPUs, as AReaL's own example YAMLs have them: AReaL's
    loader, given podkit's overrides, ends up with what the pod runs."""
    v = verdicts["areal"]["areal-example-shaped"]
    assert v["ok"], v["error"]
    assert v["recover_mode"] == "auto" and v["weight_update_mode"] == "disk", v
    assert v["actor_gpus"] == 3 and v["rollout_gpus"] == 1 and v["attn_impl"] == "sdpa", v


def test_an_entry_that_is_a_link_out_of_the_checkout_is_refused_naming_where_it_leads(tmp_path):
    """The check was lexical: `train.py` (or `sub/train.py` with `sub` a link, or `pkg:main` with `pkg` one)
    leading to a file outside the checkout was accepted, and would have run that file. A link inside the
    checkout is fine, and so is a module that is not in the checkout (installed by the setup stage)."""
    repo, outside = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    outside.mkdir()
    (outside / "train.py").write_text("print('not from the repo')\n")
    (repo / "train.py").symlink_to(outside / "train.py")
    (repo / "sub").symlink_to(outside)
    (repo / "real.py").write_text("")
    (repo / "alias.py").symlink_to("real.py")
    (outside / "pkg").mkdir()
    (outside / "pkg" / "__init__.py").write_text("def main(argv): pass\n")
    (repo / "pkg").symlink_to(outside / "pkg")

    def problems(entry):
        return checks.entry(config.load(ROOT / "configs/a40-4gpu.yaml", environ={
            "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_REPO_URL": "https://example.invalid/me/repo",
            "PODKIT_REPO_DEST": str(repo), "PODKIT_TRAINER_ENTRY": entry}))

    for entry, leads in (("train.py", "train.py"), ("sub/train.py", "train.py"), ("pkg:main", "pkg/__init__.py")):
        found = [what for key, what, _ in problems(entry) if key == "trainer.entry"]
        assert found and f"leads to {outside / leads}, outside the checkout" in found[0], (entry, found)
    assert problems("alias.py") == [] and problems("installed.mod:main") == []
