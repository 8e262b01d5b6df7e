"""Preflight reads the pod's facts on RunPod: RUNPOD_GPU_COUNT (untrusted) against the GPU device files seen and
the GPUs the config takes, and RUNPOD_VOLUME_ID against guard.network_volume. GPUs are stand-in device files in
a temporary directory (the `devices` setting's glob), never /dev."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import PODKIT, ROOT, wait_for
from podkit import config, log
from podkit.boot import preflight
from podkit.errors import StageError

pytestmark = pytest.mark.timeout(60)


def gpus(tmp_path: Path, n: int) -> str:
    """n stand-in GPU device files (and nvidiactl, which every pod has); returns the `devices` glob."""
    d = tmp_path / "dev"
    d.mkdir(exist_ok=True)
    for i in range(n):
        (d / f"nvidia{i}").write_bytes(b"\0" * 64)
    (d / "nvidiactl").write_bytes(b"\0" * 64)
    return str(d / "nvidia*")


@pytest.fixture
def pod(tmp_path, monkeypatch, capsys):
    """Preflight of a config on a RunPod pod whose variables are `runpod`; returns what it logged."""
    monkeypatch.setattr(log, "_stream", None)  # to stdout, where capsys reads it
    for var in [v for v in os.environ if v.startswith("RUNPOD_")]:
        monkeypatch.delenv(var)

    def run(name: str, n_gpus: int, runpod: dict[str, str], **env: str) -> str:
        environ = {"PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_RUN_DIR": str(tmp_path / "run"),
                   "PODKIT_DEVICES": gpus(tmp_path, n_gpus), **env}
        cfg = config.load(ROOT / "configs" / name, environ=environ)
        # The weights on the volume already (`podkit weights`): preflight has no download to warn of.
        snap = tmp_path / "ws" / "hf" / "hub" / f"models--{cfg.inference.model.replace('/', '--')}" / "snapshots" / "a"
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text("{}")
        (snap / "model.safetensors").write_bytes(b"\0")
        monkeypatch.delenv("HF_HOME", raising=False)
        for k, v in runpod.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        preflight.run(cfg)
        return capsys.readouterr().out
    return run


ON_RUNPOD = {"RUNPOD_POD_ID": "pod-facts1", "RUNPOD_VOLUME_ID": "vol-abc123"}


def test_a_pod_whose_gpus_agree_with_runpod_and_the_config_starts_and_says_so(pod):
    """Four GPUs from RunPod, four device files, a config that takes four: no warning."""
    out = pod("a40-4gpu.yaml", 4, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "4"})
    assert "RunPod pod pod-facts1: RUNPOD_GPU_COUNT=4, 4 GPU device file(s) match" in out
    assert "config takes 4 GPU(s); network volume vol-abc123" in out and "WARNING" not in out


def test_a_pod_restarted_with_zero_gpus_is_refused_naming_it(pod):
    """RunPod restarts a stopped pod with zero GPUs when its host has none free: training must not start."""
    with pytest.raises(StageError) as e:
        pod("a40-1gpu.yaml", 0, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "0"})
    assert e.value.stage == "preflight"
    assert e.value.message.startswith("RunPod started this pod with zero GPUs (RUNPOD_GPU_COUNT=0, 0 GPU device file")
    assert "the config takes GPU(s) 0 (inference.gpus '0', trainer.gpus '0')" in e.value.message
    assert "`podkit deploy watch`" in e.value.hint and "keeps the checkpoints" in e.value.hint


def test_a_pod_with_fewer_gpus_than_the_config_takes_is_refused_with_the_config_that_fits(pod):
    with pytest.raises(StageError) as e:
        pod("a40-4gpu.yaml", 2, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "2"})
    assert "fewer GPUs than the config takes (RUNPOD_GPU_COUNT=2, 2 GPU device file(s)" in e.value.message
    assert "`podkit deploy --gpus 4`" in e.value.hint and "configs/a40-2gpu.yaml" in e.value.hint


def test_gpus_runpod_gave_but_the_container_does_not_see_are_refused_naming_the_devices(pod):
    with pytest.raises(StageError) as e:
        pod("a40-4gpu.yaml", 1, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "4"})
    assert "RunPod gave the pod 4 but 1 are visible" in e.value.hint and "PODKIT_DEVICES" in e.value.hint


@pytest.mark.parametrize("raw", ["4; rm -rf /", "-1", "", " 4", "4.0", "\u0664", "99999", "0x4"])
def test_a_gpu_count_that_is_not_a_count_is_not_believed(pod, raw):
    """RUNPOD_GPU_COUNT is untrusted text: anything but plain ASCII digits is said and left out; the device
    files alone are compared with the config (here they agree)."""
    out = pod("a40-2gpu.yaml", 2, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": raw})
    assert f"WARNING: RUNPOD_GPU_COUNT {raw!r} is not a number of GPUs" in out
    assert "RunPod pod pod-facts1: 2 GPU device file(s) match" in out


def test_idle_gpus_and_a_count_that_differs_from_the_devices_are_warnings(pod, tmp_path):
    out = pod("a40-1gpu.yaml", 4, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "4"})
    assert "this pod has 4 GPUs and the config takes 1" in out and "3 GPU(s) idle and billed" in out
    out = pod("a40-1gpu.yaml", 4, {**ON_RUNPOD, "RUNPOD_GPU_COUNT": "8"})
    assert "RunPod says this pod has 8 GPU(s) (RUNPOD_GPU_COUNT) but 4 GPU device file(s) match" in out


@pytest.mark.parametrize("policy", ["warn", "refuse", "off"])
def test_a_pod_without_a_network_volume_is_warned_or_refused_per_config(pod, policy):
    """No RUNPOD_VOLUME_ID: the checkpoints die with the pod; guard.network_volume says what to do."""
    facts = {"RUNPOD_POD_ID": "pod-facts1", "RUNPOD_GPU_COUNT": "0"}  # the smoke stack takes no GPU
    if policy == "refuse":
        with pytest.raises(StageError) as e:
            pod("smoke.yaml", 0, facts, PODKIT_GUARD_NETWORK_VOLUME=policy)
        assert "has no network volume (RUNPOD_VOLUME_ID is not set)" in e.value.message
        assert "guard.network_volume: refuse" in e.value.message and "--network-volume" in e.value.hint
        assert "checkpoint.remote (PODKIT_CHECKPOINT_REMOTE)" in e.value.hint
        return
    out = pod("smoke.yaml", 0, facts, PODKIT_GUARD_NETWORK_VOLUME=policy)
    assert ("die with the pod" in out) == (policy == "warn")
    assert "network volume none" in out


@pytest.mark.parametrize("policy", ["warn", "refuse"])
def test_a_pod_with_a_remote_and_no_network_volume_trains_saying_where_its_checkpoints_go(pod, policy):
    """checkpoint.remote outlives the pod: no warning, no refusal (even `refuse`, which deploy --network-volume
    sets), and the log says the checkpoints go to the remote instead."""
    facts = {"RUNPOD_POD_ID": "pod-facts1", "RUNPOD_GPU_COUNT": "0"}
    out = pod("smoke.yaml", 0, facts, PODKIT_GUARD_NETWORK_VOLUME=policy, PODKIT_CHECKPOINT_REMOTE="s3://ckpts/runs")
    assert "no network volume: the run's checkpoints go to checkpoint.remote s3://ckpts/runs instead" in out
    assert f"guard.network_volume {policy} does not apply" in out and "WARNING" not in out


def test_off_runpod_the_pod_facts_are_not_read(pod):
    """Without RUNPOD_POD_ID this is not a RunPod pod: a stray RUNPOD_GPU_COUNT=0 refuses nothing."""
    out = pod("a40-1gpu.yaml", 0, {"RUNPOD_GPU_COUNT": "0"}, PODKIT_GUARD_NETWORK_VOLUME="refuse")
    assert "RunPod pod" not in out


def test_a_zero_gpu_pod_boots_into_safe_mode_that_names_it(procs, tmp_path):
    """The whole boot: the preflight's refusal is safe mode (the container stays up, explained), not a loop."""
    ws = tmp_path / "ws"
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(ROOT / "configs" / "a40-1gpu.yaml"),
           "PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(tmp_path / "run"), "PODKIT_METRICS_PORT": "0",
           "PODKIT_DEVICES": gpus(tmp_path, 0), "RUNPOD_POD_ID": "pod-facts1", "RUNPOD_GPU_COUNT": "0",
           "RUNPOD_VOLUME_ID": "vol-abc123"}
    out = tmp_path / "boot.log"
    with open(out, "wb") as f:
        p = procs.spawn([*PODKIT, "boot"], env=env, stdout=f, stderr=subprocess.STDOUT)
    rec = wait_for(lambda: (ws / ".podkit" / "safe-mode.json").exists()
                   and json.loads((ws / ".podkit" / "safe-mode.json").read_text()), 30, what="safe mode")
    assert rec["stage"] == "preflight" and "zero GPUs (RUNPOD_GPU_COUNT=0" in rec["message"]
    wait_for(lambda: "SAFE MODE" in out.read_text(), 10, what="the banner")
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0
