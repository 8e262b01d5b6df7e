"""`podkit weights`: the model on the volume before the GPU pod needs it, and a boot that will download
it at start saying so. No hub here: the cache a download fills is staged in the hub's own layout."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import PODKIT, ROOT
from podkit import config, weights

pytestmark = pytest.mark.timeout(60)


def model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def pod(ws, **env):
    return config.load(ROOT / "configs" / "a40-1gpu.yaml", environ={"PODKIT_WORKSPACE": str(ws), **env})


def test_a_boot_says_when_the_weights_will_be_downloaded_at_start_and_not_once_they_are_on_the_volume(tmp_path):
    cfg = pod(tmp_path)
    env = {"HF_HOME": str(tmp_path / "hf")}
    assert weights.where(cfg, env) == "download"
    snap = tmp_path / "hf" / "hub" / f"models--{cfg.inference.model.replace('/', '--')}" / "snapshots" / "abc123"
    model_dir(snap)
    assert weights.where(cfg, env) == "cached" and weights.cached(cfg, env) == snap
    assert weights.where(pod(tmp_path, PODKIT_INFERENCE_MODEL=str(snap)), env) == "local"


def test_weights_from_a_local_directory_are_copied_onto_the_volume_and_never_over_what_is_there(tmp_path):
    src = model_dir(tmp_path / "my-model")
    ws = tmp_path / "ws"
    ws.mkdir()
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "a40-1gpu.yaml"), "PODKIT_WORKSPACE": str(ws)}
    r = subprocess.run([*PODKIT, "weights", "--from", str(src)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    dest = ws / "models" / "my-model"
    assert (dest / "model.safetensors").read_bytes() == b"\0" * 64
    assert f"set inference.model: {dest}" in r.stdout + r.stderr
    (dest / "model.safetensors").write_bytes(b"mine")
    r = subprocess.run([*PODKIT, "weights", "--from", str(src)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "it is kept" in r.stderr and (dest / "model.safetensors").read_bytes() == b"mine"
    r = subprocess.run([*PODKIT, "weights", "--from", str(tmp_path / "nothing")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and "--from" in r.stderr and "not a model directory" in r.stderr
