"""Run identity: a volume holds many runs, and each resumes only itself. The names AReaL reads are the user's
(their YAML, podkit's settings when set, trainer.overrides last); a checkpoint under those names that another
run wrote is not resumed. podkit's side here; AReaL's loader and a real torch checkpoint in test_areal_*
below (AReaL's environment); the real trainer in tests/trainer/test_your_code.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from areal_stack import CPU_OVERRIDES, EXAMPLE, PYTHON, areal_run
from conftest import PODKIT, ROOT
from podkit import config
from podkit.areal import discovery, identity
from podkit.errors import ConfigError


def cfg_for(tmp_path, yaml_names: dict | None = None, base=EXAMPLE / "config.yaml", **env):
    """The CPU rehearsal's pod config over a copy of an AReaL YAML (the example repo's) with `yaml_names`."""
    text = base.read_text()
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(("experiment_name:", "trial_name:")))
    text = "".join(f"{k}: {v}\n" for k, v in (yaml_names or {}).items()) + text
    (tmp_path / "config.yaml").write_text(text)
    environ = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
               "PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "config.yaml"),
               **env}
    return config.load(None, environ=environ)


def test_the_users_yaml_names_the_run_unless_a_setting_or_an_override_says_otherwise(tmp_path):
    assert str(identity.names(cfg_for(tmp_path))) == "podkit/run"  # no names in the YAML: podkit's
    mine = {"experiment_name": "myrepo", "trial_name": "t0"}
    assert str(identity.names(cfg_for(tmp_path, mine))) == "myrepo/t0"
    assert str(identity.names(cfg_for(tmp_path, mine, PODKIT_TRAINER_TRIAL="t1"))) == "myrepo/t1"
    run = identity.names(cfg_for(tmp_path, mine, PODKIT_TRAINER_TRIAL="t1",
                                 PODKIT_TRAINER_OVERRIDES="++trial_name=t2 actor.dtype=float32"))
    assert str(run) == "myrepo/t2" and run.origins["trial"] == ("trainer.overrides", "trainer.overrides")
    # What the launcher passes AReaL is what podkit reads (the user's overrides still come last).
    from podkit.areal.command import overrides

    argv = overrides(cfg_for(tmp_path, mine))
    assert "++experiment_name=myrepo" in argv and "++trial_name=t0" in argv, argv


@pytest.mark.parametrize("bad", ["/abs/path", "../x", "a/b", ".", "-x", "a b"])
def test_a_name_that_is_a_path_is_a_config_error_naming_the_key_and_nothing_outside_is_touched(tmp_path, bad):
    # podkit's setting: refused when the config loads.
    with pytest.raises(ConfigError) as e:
        cfg_for(tmp_path, PODKIT_TRAINER_EXPERIMENT=bad)
    assert e.value.key == "trainer.experiment" and "not a name" in e.value.problem
    # The YAML's own name: the check that boot and the launcher run names the file's key.
    from podkit.areal import checks

    cfg = cfg_for(tmp_path, {"experiment_name": json.dumps(bad), "trial_name": "t0"})
    found = [p for p in checks.areal(cfg) if "experiment_name" in p[1]]
    assert found and found[0][0] == "trainer.areal_config" and "not a name" in found[0][1], checks.areal(cfg)
    assert str(tmp_path / "config.yaml") in found[0][1]
    # And the discovery records of such a name are never cleared: nothing outside the root goes.
    outside = tmp_path / "outside" / "run"
    outside.mkdir(parents=True)
    lines = discovery.clear(str(tmp_path / "root" / "x"), str(outside.parent), "run")
    assert outside.is_dir() and "not cleared" in lines[0]


def test_a_repo_or_a_script_written_another_way_is_the_same_one_and_a_model_is_told_by_its_full_name(tmp_path):
    """A fix pushed over ssh to a repo cloned over https, ./train.py for train.py, a hub id and its own cache
    snapshot: the same run, resumed (a false 'another run' would send it back to step 0). A model is told by
    its full name: Qwen/X and the user's fine-tune me/X, or .../sft-v1/hf and .../sft-v2/hf, are two models."""
    same = {identity.repo_of(u) for u in ("https://tok@GitHub.com/me/r.git/", "git@github.com:Me/R.git",
                                          "ssh://git@github.com:22/me/r.git", "http://github.com/me/r")}
    assert same == {"github.com/me/r"}
    assert identity.repo_of("https://github.com/me/other") != "github.com/me/r"
    ids = {identity.model_id(m) for m in ("Qwen/Qwen2.5-0.5B-Instruct", "qwen/qwen2.5-0.5b-instruct",
                                          "/ws/hf/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557/")}
    assert ids == {"qwen/qwen2.5-0.5b-instruct"}
    assert identity.model_id("gpt2") == "gpt2" == identity.model_id("/hf/hub/models--gpt2/snapshots/1/")
    for v in ("sft-v1", "sft-v2"):
        (tmp_path / v / "hf").mkdir(parents=True)
        (tmp_path / v / "hf" / "config.json").write_text('{"hidden_size": 64}')
    mine = identity.record_for(["e", "t"], "train.py", "Qwen/Qwen2.5-0.5B-Instruct", "https://github.com/me/r.git")
    moved = identity.record_for(["e", "t"], "./train.py", "Qwen/Qwen2.5-0.5B-Instruct", "git@github.com:me/r.git")
    assert identity.differences(moved, mine, Path("/nonexistent")) == []
    for theirs, ours in (("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"), ("me/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
                         (str(tmp_path / "sft-v1" / "hf"), str(tmp_path / "sft-v2" / "hf"))):
        a = identity.record_for(["e", "t"], "train.py", theirs, "https://github.com/me/r")
        b = identity.record_for(["e", "t"], "train.py", ours, "https://github.com/me/r")
        assert identity.differences(b, a, Path("/nonexistent")) == [f"its model is {theirs}, this run's {ours}"]
    # The same weights at a new place (a hub model copied to the volume) are the same model; the same directory
    # written over with other weights is another, and a config.json edit alone is not.
    v1, copy = tmp_path / "sft-v1" / "hf", tmp_path / "volume" / "hf"
    (v1 / "model.safetensors").write_bytes(b"v1" * (3 << 20))
    copy.mkdir(parents=True)
    for f in v1.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = identity.record_for(["e", "t"], "train.py", str(v1), "")
    assert identity.differences(identity.record_for(["e", "t"], "train.py", str(copy), ""), before, Path("/x")) == []
    (v1 / "config.json").write_text('{"hidden_size": 64, "torch_dtype": "bfloat16"}')
    assert identity.differences(identity.record_for(["e", "t"], "train.py", str(v1), ""), before, Path("/x")) == []
    (v1 / "model.safetensors").write_bytes(b"v2" * (3 << 20))
    assert identity.differences(identity.record_for(["e", "t"], "train.py", str(v1), ""), before, Path("/x")) == [
        f"its model's weights ({v1}) are not this run's ({v1}): the directory was written over by another model"]
    # A record from before podkit kept resolved ids (path only) is compared by its path resolved now.
    legacy = {**mine, "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "entry": "./train.py"}
    legacy.pop("entry_id")
    assert identity.differences(mine, legacy, Path("/nonexistent")) == []


def test_the_entry_is_the_file_that_defines_it_and_the_training_data_is_part_of_the_run(tmp_path):
    """The same script through a link the repo keeps, or as grpo/train.py and grpo.train:main, is one run; a new
    dataset under the run's names is another (its dataloader position means nothing on other data): another path
    that names other contents. The same file moved is the same data; the same path edited (a bad row fixed, the
    repo's data pulled) is this run's own."""
    repo = tmp_path / "repo"
    (repo / "grpo").mkdir(parents=True)
    (repo / "grpo" / "train.py").write_text("def main(argv): ...\n")
    (repo / "train.py").symlink_to("grpo/train.py")
    (repo / "other.py").write_text("def main(argv): ...\n")
    as_script = identity.entry_file(str(repo / "grpo" / "train.py"), str(repo))
    assert as_script == "grpo/train.py" == identity.entry_file(str(repo / "train.py"), str(repo))
    rec = lambda entry, file, data="": identity.record_for(["e", "t"], entry, "gpt2", "", file=file, data=data)  # noqa: E731
    assert identity.differences(rec("grpo.train:main", "grpo/train.py"), rec("grpo/train.py", as_script), repo) == []
    assert identity.differences(rec("train.py", identity.entry_file(str(repo / "train.py"), str(repo))),
                                rec("grpo/train.py", as_script), repo) == []
    assert identity.differences(rec("other.py", "other.py"), rec("grpo/train.py", as_script), repo) == [
        "it was trained by grpo/train.py, this run runs other.py"]
    data, moved = tmp_path / "data" / "train.jsonl", tmp_path / "volume" / "train.jsonl"
    data.parent.mkdir()
    moved.parent.mkdir()
    data.write_text('{"q": "1+1", "a": 2}\n' * 1000)
    moved.write_bytes(data.read_bytes())
    before = rec("train.py", "train.py", str(data))
    assert identity.differences(rec("train.py", "train.py", str(moved)), before, repo) == [], "moved, not changed"
    other = tmp_path / "data" / "other.jsonl"
    other.write_text('{"q": "2+2", "a": 4}\n' * 1000)
    assert identity.differences(rec("train.py", "train.py", str(other)), before, repo) == [
        f"its training data is {data}, this run's {other} (other contents)"]
    data.write_text('{"q": "1+1", "a": 2}\n' * 999 + '{"q": "fixed", "a": 3}\n')
    assert identity.differences(rec("train.py", "train.py", str(data)), before, repo) == [], "a row fixed in place"
    hub = rec("train.py", "train.py", "openai/gsm8k")
    assert identity.differences(rec("train.py", "train.py", "me/gsm8k-clean"), hub, repo) == [
        "its training data is openai/gsm8k, this run's me/gsm8k-clean (other contents)"]
    legacy = {k: v for k, v in before.items() if k not in ("data", "entry_file")}
    assert identity.differences(rec("train.py", "train.py", str(data)), legacy, repo) == [], \
        "a record from before the data was kept: nothing to compare"


def test_a_run_from_step_0_under_names_that_trained_before_gets_a_new_wandb_run(tmp_path):
    """The W&B id a start logs into: AReaL's own while the names never trained; after a start-over (the old run
    set aside) or a checkpoint removed, the next free -2, -3; a resume keeps the id its run recorded."""
    root = tmp_path / "checkpoints" / "root" / "e" / "t[0]"
    base = "e_t[0]_train"
    assert identity.wandb_id(root, base, resuming=False) == base
    identity.write_record(root, {**identity.record_for(["e", "t[0]"], "train.py", "m/x", ""), "wandb": base})
    assert identity.wandb_id(root, base, resuming=True) == base
    root.rename(root.with_name("t[0].set-aside-20260101-000000"))  # what start-over does
    assert identity.wandb_id(root, base, resuming=False) == f"{base}-2"
    identity.write_record(root, {**identity.record_for(["e", "t[0]"], "train.py", "m/x", ""), "wandb": f"{base}-2"})
    assert identity.wandb_id(root, base, resuming=True) == f"{base}-2"
    assert identity.wandb_id(root, base, resuming=False) == f"{base}-3"  # its checkpoint removed by hand
    # W&B off in a run (None) used no id; a record from before podkit chose used AReaL's.
    other = tmp_path / "checkpoints" / "root" / "e" / "u"
    identity.write_record(other, {**identity.record_for(["e", "u"], "train.py", "m/x", ""), "wandb": None})
    assert identity.wandb_id(other, "e_u_train", resuming=False) == "e_u_train"
    identity.write_record(other, identity.record_for(["e", "u"], "train.py", "m/x", ""))
    assert identity.wandb_id(other, "e_u_train", resuming=False) == "e_u_train-2"
    # What W&B itself wrote on the volume counts whatever the records say (a start with W&B off rewrote the
    # record with None; a crash before the first checkpoint left the record of a run that logged).
    logs = tmp_path / "logs" / "e" / "u"
    for name in ("run-20260101_000000-e_u_train", "offline-run-20260102_000000-e_u_train-2", "notes",
                 "run-2026-x-planted"):
        (logs / "wandb" / name).mkdir(parents=True)
    (logs / "wandb" / "run-20260103_000000-a_file").write_text("")
    assert identity.wandb_logged(logs) == {"e_u_train", "e_u_train-2"}
    identity.write_record(other, {**identity.record_for(["e", "u"], "train.py", "m/x", ""), "wandb": None})
    assert identity.wandb_id(other, "e_u_train", False, identity.wandb_logged(logs)) == "e_u_train-3"
    # A resume of a run that never logged to W&B (off until now) takes a free id, not one a run logged into.
    assert identity.wandb_id(other, "e_u_train", True, identity.wandb_logged(logs)) == "e_u_train-3"
    assert identity.wandb_logged(tmp_path / "nowhere") == set()


def test_names_only_areals_loader_can_tell_are_left_to_it(tmp_path):
    """A Hydra defaults list, an interpolation, a value YAML types (a date, a boolean): podkit passes no name
    of its own over them (AReaL's loader decides; the trainer checks what it decided)."""
    from podkit.areal.command import overrides

    for yaml_names in ({"defaults": "[base, _self_]"}, {"experiment_name": "myrepo", "trial_name": "${oc.env:T,t0}"},
                       {"experiment_name": "myrepo", "trial_name": "2026-01-05"},
                       {"experiment_name": "myrepo", "trial_name": "off"}):
        cfg = cfg_for(tmp_path, yaml_names)
        run = identity.names(cfg)
        assert run.trial is None and run.problems() == [], (yaml_names, run.origins)
        assert not any(o.startswith("++trial_name=") for o in overrides(cfg)), yaml_names
        assert "AReaL decides" in str(run)
    # Set explicitly, podkit's setting wins even then.
    assert str(identity.names(cfg_for(tmp_path, {"defaults": "[base]"}, PODKIT_TRAINER_TRIAL="t3"))).endswith("/t3")


def test_start_over_moves_the_runs_checkpoints_aside_and_deletes_nothing(tmp_path):
    cfg = cfg_for(tmp_path, {"experiment_name": "myrepo", "trial_name": "t0"})
    root = identity.save_root(str(cfg.workspace_path / "areal"), "myrepo", "t0")
    (root / "recover_info").mkdir(parents=True)
    (root / "recover_info" / "step_info.json").write_text("{}")
    cfg.state_dir.mkdir(parents=True)
    (cfg.state_dir / "trainer-loop.json").write_text(json.dumps({"best_step": 500, "failures": 1}))
    (cfg.state_dir / "progress.json").write_text(json.dumps({"step": 500, "checkpoint_step": 500, "run": "myrepo/t0"}))
    other = identity.save_root(str(cfg.workspace_path / "areal"), "myrepo", "t1")
    other.mkdir(parents=True)
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
           "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "config.yaml"), "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([*PODKIT, "start-over", "--workspace", str(cfg.workspace_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    aside = [p for p in root.parent.iterdir() if p.name.startswith("t0.set-aside-")]
    assert not root.exists() and len(aside) == 1 and (aside[0] / "recover_info" / "step_info.json").is_file()
    assert other.is_dir() and "nothing deleted" in r.stdout, r.stdout
    r = subprocess.run([*PODKIT, "start-over", "--workspace", str(cfg.workspace_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "starts from step 0 as it is" in r.stdout, r.stdout + r.stderr
    # The old run's steps no longer count for the loop bound or show in status.
    assert not (cfg.state_dir / "trainer-loop.json").exists()
    assert json.loads((cfg.state_dir / "progress.json").read_text())["step"] is None


def test_adopt_marks_the_checkpoint_as_this_runs_keeping_the_old_record_and_refuses_where_there_is_none(tmp_path):
    """A refusal the user knows is wrong (the script renamed, the repo moved): `podkit adopt` resumes the
    checkpoint as this run's (check_run reads the mark) instead of a start from step 0; the old record stays."""
    cfg = cfg_for(tmp_path, {"experiment_name": "myrepo", "trial_name": "t0"})
    root = identity.save_root(str(cfg.workspace_path / "areal"), "myrepo", "t0")
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
           "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "config.yaml"), "PYTHONPATH": str(ROOT / "src")}
    adopt = [*PODKIT, "adopt", "--workspace", str(cfg.workspace_path)]
    r = subprocess.run(adopt, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "has no recover checkpoint" in r.stderr, r.stdout + r.stderr
    old = identity.record_for(["myrepo", "t0"], "old_name.py", "Qwen/X", "https://example.invalid/old/r")
    identity.write_record(root, old)
    (root / "recover_info").mkdir()
    (root / "recover_info" / "step_info.json").write_text("{}")
    r = subprocess.run([*adopt, "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "would mark" in r.stdout and "adopt" not in identity.read_record(root)
    r = subprocess.run(adopt, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "its next start resumes it" in r.stdout, r.stdout + r.stderr
    marked = identity.read_record(root)
    assert marked["adopt"] and marked["entry"] == "old_name.py" and identity.has_checkpoint(root), marked
    kept = list(root.parent.glob(f"t0.{identity.RECORD}.before-*"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["entry"] == "old_name.py", kept
    assert not identity.set_aside(root)  # a kept record is not a set-aside run


def test_start_over_refuses_a_workspace_another_pod_holds_and_a_linked_save_root(tmp_path):
    import time

    cfg = cfg_for(tmp_path, {"experiment_name": "myrepo", "trial_name": "t0"})
    root = identity.save_root(str(cfg.workspace_path / "areal"), "myrepo", "t0")
    (root / "recover_info").mkdir(parents=True)
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
           "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "config.yaml"), "PYTHONPATH": str(ROOT / "src")}
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    (cfg.state_dir / "lease.json").write_text(json.dumps({"host": "gpu-pod-7f3a", "pid": 1, "since": time.time(),
                                                          "renewed": time.time()}))
    r = subprocess.run([*PODKIT, "start-over", "--workspace", str(cfg.workspace_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "another pod holds this workspace (host gpu-pod-7f3a" in r.stderr, r.stderr
    assert root.is_dir()
    (cfg.state_dir / "lease.json").unlink()
    elsewhere = tmp_path / "elsewhere"
    root.rename(elsewhere)
    root.symlink_to(elsewhere)
    r = subprocess.run([*PODKIT, "start-over", "--workspace", str(cfg.workspace_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is a symbolic link" in r.stderr, r.stderr
    assert root.is_symlink() and (elsewhere / "recover_info").is_dir()


# The bootstrap in one process (AReaL imported once), one case after another: a script that loads its config
# through AReaL's own loader and constructs PPOTrainer; podkit's check runs first in that construction, before
# AReaL would load a checkpoint. A case the check lets through goes on into AReaL's own __init__, which fails
# at once here (the model directory has no tokenizer); one it refuses is podkit's config error.
CHECKS = """
import json, os, sys, shutil
sys.path.insert(0, os.environ["SRC"])
from podkit import config, records
from podkit.areal import bootstrap, hooks, identity
from podkit.areal.command import overrides
out = []
for case in json.loads(sys.argv[1]):
    os.environ.update(case.get("env", {}))
    cfg = config.load()
    root = identity.save_root(str(cfg.workspace_path / "areal"), *case["names"])
    shutil.rmtree(root, ignore_errors=True)
    if case.get("checkpoint"):
        (root / "recover_info").mkdir(parents=True)
        (root / "recover_info" / "step_info.json").write_text("{}")
    if case.get("record"):
        identity.write_record(root, {**identity.record_for(*case["record"]), **({"adopt": 1} if case.get("adopt") else {})})
    if case.get("shape"):  # a checkpoint from before podkit recorded its run: torch's own format
        import torch, torch.distributed.checkpoint as dcp
        vocab, hidden, layers = case["shape"]
        state = {"dcp.model.model.embed_tokens.weight": torch.zeros(vocab, hidden)}
        state.update({f"dcp.model.model.layers.{i}.mlp.weight": torch.zeros(2, 2) for i in range(layers)})
        dcp.save(state, checkpoint_id=str(root / "default" / "recover_checkpoint"))
    rc = bootstrap.main(["--config", cfg.trainer.areal_config, *overrides(cfg)])
    run = hooks.state().run  # the save root the check looked in, as AReaL's loader named it
    out.append({"rc": rc, "stopped": records.PROGRESS.read(cfg.state_dir).get("stopped"),
                "kept": (root / "recover_info" / "step_info.json").is_file(), "root": str(run[0]) if run else None})
print(json.dumps(out))
"""

LOADS = ("import sys\n\nfrom areal.api.cli_args import GRPOConfig, load_expr_config\n"
         "from areal.trainer.rl_trainer import PPOTrainer\n\n"
         "config, _ = load_expr_config(sys.argv[1:], GRPOConfig)\nPPOTrainer(config)\n")


URL = "https://example.invalid/me/r.git"


def checked_in_areal(tmp_path, script: str, entry: str, models=("model",)) -> tuple[list[Path], dict]:
    """The repo with `script` as `entry`, tiny model directories (config.json only), the AReaL YAML naming
    myrepo/t0, and the env CHECKS runs under: the models' paths and that env."""
    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / entry).write_text(script)
    dirs = [tmp_path / m for m in models]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 224}))
    cfg_for(tmp_path, {"experiment_name": "myrepo", "trial_name": "t0"},  # writes config.yaml
            base=ROOT / "configs" / "areal" / "grpo-cpu.yaml")
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "config.yaml"), "PODKIT_TRAINER_ENTRY": entry,
           "PODKIT_REPO_URL": URL, "PODKIT_INFERENCE_MODEL": str(dirs[0]), "PODKIT_TRAINER_OVERRIDES": CPU_OVERRIDES,
           "PODKIT_RUN_DIR": str(tmp_path / "run"), "RANK": "0", "SRC": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    return dirs, env


def in_areal(test):
    """A test that runs podkit's bootstrap under AReaL's own Python (the rehearsal group)."""
    for mark in (pytest.mark.rehearsal, pytest.mark.timeout(300),
                 pytest.mark.skipif(not PYTHON and not os.environ.get("CI"), reason="no AReaL environment (AREAL_PYTHON)")):
        test = mark(test)
    return test


@in_areal
def test_areals_loader_refuses_another_runs_checkpoint_and_resumes_its_own_across_commits(tmp_path):
    """Under the names myrepo/t0: no checkpoint, trains; this run's checkpoint at another commit, resumes;
    trial t1 beside it starts in its own directory;
    a checkpoint of another entry, of another repo, or (without a record) of a model of another shape:
    stopped once, saying which and why, nothing removed. A name AReaL's loader ends up with that is a path
    (the user's override) is refused there too."""
    (model,), env = checked_in_areal(tmp_path, LOADS, "load.py")
    url, names, mine = URL, ["myrepo", "t0"], str(model)
    cases = [
        {"names": names},
        {"names": names, "checkpoint": True, "record": [names, "load.py", mine, url, "0" * 40]},
        {"names": names, "checkpoint": True, "record": [names, "other.py", mine, url, "0" * 40]},
        {"names": names, "checkpoint": True, "record": [names, "load.py", mine, "https://example.invalid/x/y"]},
        {"names": names, "checkpoint": True, "shape": [224, 32, 4]},
        {"names": names, "checkpoint": True, "shape": [224, 64, 2]},
        {"names": ["myrepo", "t1"], "env": {"PODKIT_TRAINER_TRIAL": "t1"}},  # t0's checkpoint stays beside it
        # Recovery off: refused before anything is looked at; another run's checkpoint stays.
        {"names": ["myrepo", "t1"], "checkpoint": True, "record": [["myrepo", "t1"], "other.py", mine, url],
         "env": {"PODKIT_TRAINER_OVERRIDES": CPU_OVERRIDES + " ++recover.mode=disabled"}},
        # AReaL recovers by recover.experiment_name/trial_name: the check looks there.
        {"names": ["myrepo", "t9"], "checkpoint": True, "record": [["myrepo", "t9"], "other.py", mine, url],
         "env": {"PODKIT_TRAINER_OVERRIDES": CPU_OVERRIDES + " ++recover.trial_name=t9"}},
        {"names": ["myrepo", "unused"], "env": {"PODKIT_TRAINER_OVERRIDES": CPU_OVERRIDES + " ++trial_name=../t0"}},
    ]
    r = areal_run("-c", CHECKS, json.dumps(cases), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    fresh, same, entry, repo_, shape, shape_ok, t1, off, t9, path = json.loads(r.stdout.strip().splitlines()[-1])
    for ok in (fresh, same, shape_ok, t1):  # let through into AReaL's own __init__ (no tokenizer here)
        told = json.dumps(ok["stopped"])
        assert "tokenizer" in told and "belongs to another run" not in told, told
    root = identity.save_root(str(tmp_path / "ws" / "areal"), "myrepo", "t0")
    assert fresh["root"] == str(root) and t1["root"] == str(root.with_name("t1")), (fresh, t1)
    assert identity.has_checkpoint(root)  # a new trial starts beside the other run, which stays
    # Recovery off is podkit's refusal at the construction (the boot refuses the same override earlier): it
    # claims no checkpoint, and the other run's stays.
    assert off["stopped"]["by"] == "config-error" and "recover.mode is 'disabled'" in off["stopped"]["message"], off
    assert off["root"] is None and off["kept"], off
    assert t9["stopped"]["by"] == "config-error" and str(root.with_name("t9")) in t9["stopped"]["message"], t9
    for bad, why in ((entry, "it was trained by other.py, this run runs load.py"),
                     (repo_, "it came from the repo example.invalid/x/y, this run from example.invalid/me/r"),
                     (shape, "its model has hidden_size 32 (this model: 64), layers 4 (this model: 2)")):
        assert bad["rc"] == 2 and bad["stopped"]["by"] == "config-error" and bad["kept"], bad
        assert f"the recover checkpoint in {root} belongs to another run" in bad["stopped"]["message"], bad
        assert why in bad["stopped"]["message"], bad["stopped"]["message"]
        assert "own trial name" in bad["stopped"]["hint"] and "podkit start-over" in bad["stopped"]["hint"]
    assert path["stopped"]["by"] == "config-error" and "trial_name '../t0' is not a name" in \
        path["stopped"]["message"], path
    assert not (tmp_path / "ws" / "areal" / "checkpoints" / "t0").exists()


# A script that builds its config without AReaL's load_expr_config (parse_cli_args + to_structured_cfg) and may
# change it itself: podkit's check at PPOTrainer's construction, before anything is loaded, is the one every
# script passes. A config let through goes on into AReaL's own __init__, which fails at once here (the model
# directory has no tokenizer): not podkit's refusal.
CONSTRUCTS = ("import os, sys\n\nfrom omegaconf import OmegaConf\n\n"
              "from areal.api.cli_args import GRPOConfig, parse_cli_args, to_structured_cfg\n"
              "from areal.trainer.rl_trainer import PPOTrainer\n\n"
              "cfg, _ = parse_cli_args(sys.argv[1:])\n"
              "config = OmegaConf.to_object(to_structured_cfg(cfg, config_cls=GRPOConfig))\n"
              "if os.environ.get('SCRIPT_TURNS_RECOVERY_OFF'):\n"
              "    config.recover.mode = 'disabled'\n"
              "PPOTrainer(config)\n")


@in_areal
def test_what_areal_runs_is_checked_at_the_trainers_construction_whatever_loaded_or_changed_it(tmp_path):
    """Recovery or disk weight updates turned off in a Hydra syntax podkit's boot does not read (~key,
    section={...}) or by the script itself: stopped once, naming the key. A script that loads its config
    without load_expr_config, on a volume where another script's run (or a model of the same leaf name in
    another directory) left a checkpoint under its names: stopped once, saying so. ./construct.py is the
    run construct.py trained: let through to resume, and so is a checkpoint `podkit adopt` marked as this
    run's."""
    (model, elsewhere), env = checked_in_areal(tmp_path, CONSTRUCTS, "construct.py", ("model", "elsewhere/model"))
    url, names, mine = URL, ["myrepo", "t0"], str(model)

    def overridden(extra: str) -> dict:
        return {"PODKIT_TRAINER_OVERRIDES": f"{CPU_OVERRIDES} {extra}"}

    plain = overridden("")
    cases = [
        {"names": names, "env": overridden("~recover.mode")},
        {"names": names, "env": overridden("recover={mode:disabled}")},
        {"names": names, "env": overridden("actor={weight_update_mode:xccl}")},
        {"names": names, "env": {**plain, "SCRIPT_TURNS_RECOVERY_OFF": "1"}},
        {"names": names, "checkpoint": True, "record": [names, "other.py", mine, url], "env": {"SCRIPT_TURNS_RECOVERY_OFF": ""}},
        {"names": names, "checkpoint": True, "record": [names, "construct.py", str(elsewhere), url]},
        {"names": names, "checkpoint": True, "record": [names, "construct.py", mine, "git@example.invalid:me/r"],
         "env": {"PODKIT_TRAINER_ENTRY": "./construct.py"}},
        # `podkit adopt` after the refusal above: the user says the checkpoint is this run's.
        {"names": names, "checkpoint": True, "record": [names, "other.py", mine, url], "adopt": True},
        # The hub's Qwen/X trained it; this run names the user's own fine-tune of the same leaf name.
        {"names": names, "checkpoint": True, "record": [names, "construct.py", "Qwen/X", url],
         "env": {"PODKIT_INFERENCE_MODEL": "me/X"}},
    ]
    r = areal_run("-c", CHECKS, json.dumps(cases), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    deleted, as_dict, xccl, by_script, loader, leaf, dotted, adopted, hub = json.loads(r.stdout.strip().splitlines()[-1])
    for off, key, value in ((deleted, "recover.mode", "disabled"), (as_dict, "recover.mode", "disabled"),
                            (xccl, "actor.weight_update_mode", "xccl"), (by_script, "recover.mode", "disabled")):
        stopped = off["stopped"]
        assert off["rc"] == 2 and stopped["by"] == "config-error", off
        assert stopped["message"].startswith("AReaL's final config turns off what podkit needs: ") and \
            f"{key} is {value!r}, but podkit needs" in stopped["message"], stopped
        assert "trainer.overrides in any Hydra syntax" in stopped["hint"] and "the training script" in stopped["hint"]
    root = identity.save_root(str(tmp_path / "ws" / "areal"), *names)
    for bad, why in ((loader, "it was trained by other.py, this run runs construct.py"),
                     (leaf, f"its model is {elsewhere}, this run's {model}"),
                     (hub, "its model is Qwen/X, this run's me/X")):
        assert bad["rc"] == 2 and bad["stopped"]["by"] == "config-error" and bad["kept"], bad
        assert f"the recover checkpoint in {root} belongs to another run" in bad["stopped"]["message"], bad
        assert why in bad["stopped"]["message"], bad["stopped"]["message"]
    # Let through: AReaL's own __init__ went on (and failed on the tokenizer), nothing of podkit's refused it.
    told = json.dumps(dotted["stopped"])
    assert "tokenizer" in told and "belongs to another run" not in told and "podkit needs" not in told, told
    assert dotted["kept"], dotted
    told = json.dumps(adopted["stopped"])
    assert "tokenizer" in told and "belongs to another run" not in told and adopted["kept"], told


def test_status_names_the_wandb_run_the_trainer_recorded_and_ignores_a_planted_one(tmp_path):
    from podkit import records
    from podkit.views import status

    state = tmp_path / ".podkit"
    state.mkdir()
    records.PROGRESS.write(state, {"step": 3, "time": 1.0, "run": "myrepo/t0", "wandb": "myrepo_t0_train-2",
                                   "code": {"entry": "train.py", "commit": "a" * 40, "dirty": False}})
    text = status.human(status.collect(tmp_path, state))
    assert "; run myrepo/t0" in text and "W&B run: myrepo_t0_train-2" in text, text
    records.PROGRESS.write(state, {"step": 3, "time": 1.0, "wandb": {"<script>": 1}})
    st = status.collect(tmp_path, state)
    assert st["trainer"]["wandb"] is None and "W&B run" not in status.human(st)
