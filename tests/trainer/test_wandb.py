"""One W&B run per run (issue 32): AReaL's StatsLogger names its W&B run `<experiment>_<trial>_train`
with resume="allow", so with the run's names passed through, every start of one run (a restart, a
relaunch, a migration onto another pod) writes into the same W&B run and another trial gets its own.
Checked with the real AReaL config loader, StatsLogger and wandb (AReaL's environment, $AREAL_PYTHON) in
offline mode: each start is a process of its own with podkit's command line and trainer env, and its
offline run directory names the run's id. No network, no API key: wandb's own analytics and system
probes are off, and any HTTP(S) that escapes goes to a proxy port on 127.0.0.1 that refuses."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from conftest import PODKIT, ROOT
from podkit import config
from podkit.areal import command

PYTHON = os.environ.get("AREAL_PYTHON")
# The test's bound is its starts' own (150 s each, five batches) and start-over's (60 s): 240 s in all ran out under a
# CPU hog while every start was still stepping (suite run 85: 106-147 s without one).
pytestmark = [pytest.mark.validate, pytest.mark.timeout(5 * 150 + 60 + 30),
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(sh rehearse/env.sh))")]

# Rank 0 of the trainer as far as W&B goes, with podkit's hooks installed as the bootstrap installs them: what
# PPOTrainer's construction runs first under podkit (hooks.hook_construction: the checks, then the W&B run
# chosen), AReaL's StatsLogger, and the run's record as train() writes it when it starts. CHECKPOINT=1: the run leaves a recover checkpoint.
HOOKED = """
import json, os, sys
sys.path.insert(0, os.environ["SRC"])
import wandb
from podkit import config as pod_config
from podkit.areal import hooks, identity
from areal.api import FinetuneSpec
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.utils.stats_logger import StatsLogger

st = hooks.install(pod_config.load())
config, _ = load_expr_config(sys.argv[1:], GRPOConfig)
hooks.check_required(st, config)
hooks.check_run(st, config)
hooks.choose_wandb_run(st, config)
logger = StatsLogger(config, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
print("WANDB " + json.dumps({"id": wandb.run.id, "mode": wandb.run.settings.mode}), flush=True)
identity.write_record(*st.run)
logger.commit(0, 0, 0, {"reward": 1.0})
logger.close()
if os.environ.get("CHECKPOINT"):
    (st.run[0] / "recover_info").mkdir(parents=True, exist_ok=True)
    (st.run[0] / "recover_info" / "step_info.json").write_text("{}")
"""
OFFLINE_RUN = re.compile(r"offline-run-\d{8}_\d{6}-(?P<id>.+)")
REFUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def start(tmp_path, trial: str, overrides: str = "", **pod_env: str) -> subprocess.Popen:
    """One start of the run myrepo/<trial>: the user's YAML names it, and their trainer.overrides as given,
    under podkit's hooks (HOOKED), which read the pod config from the env as the bootstrap does."""
    ws = tmp_path / "ws"
    data = yaml.safe_load((ROOT / "configs" / "areal" / "grpo-cpu.yaml").read_text())
    data.update(experiment_name="myrepo", trial_name=trial)
    areal_yaml = tmp_path / f"{trial}.yaml"
    areal_yaml.write_text(yaml.safe_dump(data))
    cfg = config.load(ROOT / "configs" / "cpu-rehearsal.yaml", environ={
        "PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(tmp_path / "run"),
        "PODKIT_TRAINER_AREAL_CONFIG": str(areal_yaml), "PODKIT_TRAINER_OVERRIDES": overrides})
    # The pod's env: no W&B or podkit settings of this machine's, no API key; W&B's files under tmp_path.
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    pod = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PODKIT_", "SWANLAB_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    pod.update(HOME=str(home), PODKIT_WORKSPACE=str(ws), WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(home / "wandb-config"), WANDB_CACHE_DIR=str(home / "wandb-cache"),
               WANDB_DATA_DIR=str(home / "wandb-data"),
               # wandb's own analytics (its OpenTelemetry proxy probes W&B's API host when the env's mode is
               # not offline), system metrics and machine info: none of them is the run's id.
               WANDB_ERROR_REPORTING="false", WANDB__DISABLE_STATS="true", WANDB__DISABLE_MACHINE_INFO="true",
               WANDB__SAVE_REQUIREMENTS="false", HTTP_PROXY=REFUSED, HTTPS_PROXY=REFUSED, NO_PROXY="", **pod_env)
    env = command.environment(cfg, environ=pod)
    if "WANDB_MODE" not in pod_env:
        assert env["WANDB_MODE"] == "disabled"  # podkit's default: W&B off unless the user turns it on
    env.update(PODKIT_CONFIG=str(ROOT / "configs" / "cpu-rehearsal.yaml"), PODKIT_RUN_DIR=str(tmp_path / "run"),
               PODKIT_TRAINER_AREAL_CONFIG=str(areal_yaml), PODKIT_TRAINER_OVERRIDES=overrides,
               SRC=str(ROOT / "src"), RANK="0")
    return subprocess.Popen([PYTHON, "-c", HOOKED, "--config", cfg.trainer.areal_config,
                             *command.overrides(cfg)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(p: subprocess.Popen) -> dict:
    try:
        out, _ = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"the trainer's W&B start hung:\n{out[-4000:]}") from None
    assert p.returncode == 0, out[-4000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("WANDB "))[6:])


def offline_runs(tmp_path, trial: str) -> list[str]:
    """The ids of the offline runs in AReaL's log directory of myrepo/<trial> (one directory per start)."""
    runs = sorted((tmp_path / "ws" / "areal" / "logs").glob(f"*/myrepo/{trial}/wandb/offline-run-*"))
    for d in runs:
        assert (d / f"run-{OFFLINE_RUN.fullmatch(d.name)['id']}.wandb").is_file(), sorted(d.iterdir())
    return [OFFLINE_RUN.fullmatch(d.name)["id"] for d in runs]


def test_each_start_logs_into_its_runs_one_wandb_run_another_trial_into_its_own_and_a_start_over_into_a_new_one(
        tmp_path):
    """Under podkit's hooks, as the bootstrap starts the trainer: the first run of myrepo/t0 logs into
    myrepo_t0_train and its resume (a restart, a relaunch or a migration is the same: a new process with the same
    names) into the same; another trial, t1, into its own; t2's pod sets only WANDB_MODE, which AReaL's own mode
    (disabled) beats. AReaL's id with resume="allow" would send the run that a start-over restarts from step 0
    into the W&B run it set aside, where W&B drops every step below the last one logged: after `podkit
    start-over` the run from step 0 logs into myrepo_t0_train-2, its record says so, and its own resume stays
    there. Two starts at a time where they are independent: each start costs AReaL's and W&B's imports."""
    offline = "stats_logger.wandb.mode=offline"  # what a user sets (online on a pod with WANDB_API_KEY)
    seen: dict[str, dict] = {}

    def starts(*batch: tuple[str, str, str, dict]) -> None:
        started = []
        try:
            for name, trial, overrides, env in batch:
                started.append((name, start(tmp_path, trial, overrides, **env)))
            seen.update((name, finished(p)) for name, p in started)
        finally:  # a failed start leaves no sibling running
            for _, p in started:
                if p.poll() is None:
                    p.kill()
                    p.communicate()

    starts(("first", "t0", offline, {"CHECKPOINT": "1"}), ("t1", "t1", offline, {}))
    starts(("its resume", "t0", offline, {"CHECKPOINT": "1"}), ("t2", "t2", "", {"WANDB_MODE": "offline"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    r = subprocess.run([*PODKIT, "start-over", "--workspace", str(tmp_path / "ws")],
                       env={**env, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
                            "PODKIT_TRAINER_AREAL_CONFIG": str(tmp_path / "t0.yaml"),
                            "PODKIT_RUN_DIR": str(tmp_path / "run")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "nothing deleted" in r.stdout, r.stdout + r.stderr
    starts(("from step 0", "t0", offline, {"CHECKPOINT": "1"}))
    starts(("its resume after", "t0", offline, {"CHECKPOINT": "1"}))

    # The user's mode wins over podkit's WANDB_MODE=disabled: wandb.init(mode=...) beats the env.
    assert seen["first"] == seen["its resume"] == {"id": "myrepo_t0_train", "mode": "offline"}, seen
    assert seen["t1"] == {"id": "myrepo_t1_train", "mode": "offline"}, seen
    assert seen["t2"]["mode"] == "disabled", seen
    assert seen["from step 0"] == seen["its resume after"] == {"id": "myrepo_t0_train-2", "mode": "offline"}, seen
    # On disk: each start of t0 its own offline directory, two W&B runs; t1 its own; t2 none.
    assert offline_runs(tmp_path, "t0") == ["myrepo_t0_train"] * 2 + ["myrepo_t0_train-2"] * 2
    assert offline_runs(tmp_path, "t1") == ["myrepo_t1_train"]
    t2 = next((tmp_path / "ws" / "areal" / "logs").glob("*/myrepo/t2"))
    assert (t2 / "config.yaml").is_file() and not (t2 / "wandb").exists(), sorted(t2.iterdir())
    assert not list(tmp_path.glob("**/run-*-myrepo_t2_train")), "W&B wrote a run for t2"
    from podkit.areal import identity

    root = identity.save_root(str(tmp_path / "ws" / "areal"), "myrepo", "t0")
    assert identity.read_record(root)["wandb"] == "myrepo_t0_train-2"
    aside = identity.set_aside(root)
    assert len(aside) == 1 and identity.read_record(aside[0])["wandb"] == "myrepo_t0_train", aside
