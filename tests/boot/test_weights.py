"""`podkit weights`: the model on the volume before the GPU pod needs it, and a boot that will download
it at start saying so. No hub here: the cache a download fills is staged in the hub's own layout."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import PODKIT, ROOT
from podkit import config
from podkit.boot import weights

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


def weights_cli(src, ws):
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "a40-1gpu.yaml"), "PODKIT_WORKSPACE": str(ws)}
    return subprocess.run([*PODKIT, "weights", "--from", str(src)], capture_output=True, text=True, env=env,
                          timeout=60)


def test_a_model_directory_with_a_link_loop_and_links_out_of_it_is_copied_once_and_the_links_are_named(tmp_path):
    """`loop -> .` once made 41 copies of the model in a hidden .copying directory; links out of the
    directory would copy whatever they point at (a home directory, /)."""
    src = model_dir(tmp_path / "my-model")
    (src / "tokenizer.json").write_text("{}")
    (src / "loop").symlink_to(".")
    (src / "up").symlink_to("..")
    (src / "sub").mkdir()
    (src / "sub" / "again").symlink_to("..")
    (src / "same").symlink_to("sub")  # a second path to a directory copied anyway
    (src / "secret").symlink_to(tmp_path / "elsewhere.txt")
    (tmp_path / "elsewhere.txt").write_text("not the model's")
    (src / "alias.safetensors").symlink_to("model.safetensors")  # a file link inside: copied as the file
    os.mkfifo(src / "pipe")  # copying it would block for ever
    ws = tmp_path / "ws"
    ws.mkdir()
    r = weights_cli(src, ws)
    assert r.returncode == 0, r.stderr
    dest = ws / "models" / "my-model"
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    assert files == ["alias.safetensors", "config.json", "model.safetensors", "sub", "tokenizer.json"], files
    assert not (dest / "alias.safetensors").is_symlink()
    out = r.stdout + r.stderr
    for name, why in (("loop", "a loop"), ("up", "a loop"), ("again", "a loop"), ("same", "a second path"),
                      ("secret", "a link out of"), ("pipe", "not a regular file")):
        assert f"{name} " in out and why in out, (name, out)
    assert [p.name for p in (ws / "models").iterdir()] == ["my-model"], "a hidden directory was left behind"
    r = weights_cli(src, src)  # the workspace inside the model: the copy would copy itself, over and over
    assert r.returncode == 2 and "holds the destination" in r.stderr and not (src / "models").exists(), r.stderr


def test_a_copy_that_fails_removes_its_own_temporary_directory_and_no_one_elses(tmp_path, monkeypatch):
    """A model whose weights are only links out of it, and a volume that fills up mid-copy: an error naming
    what failed, no hidden .copying left, and another copy's temporary directory untouched."""
    import shutil

    ws = tmp_path / "ws"
    other = ws / "models" / ".my-model.copying"  # another `podkit weights` copying the same model now
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    src = tmp_path / "my-model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").symlink_to(model_dir(tmp_path / "outside") / "model.safetensors")
    r = weights_cli(src, ws)
    assert r.returncode == 1 and "link out of" in r.stderr and "not a model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in (ws / "models").iterdir()) == [".my-model.copying"]
    assert (other / "config.json").exists()

    full = model_dir(tmp_path / "full")
    real = shutil.copyfile

    def enospc(a, b, **kw):
        if str(a).endswith(".safetensors"):
            raise OSError(28, "No space left on device")
        return real(a, b, **kw)

    monkeypatch.setattr(shutil, "copyfile", enospc)
    with pytest.raises(weights.PodkitError, match="No space left on device"):
        weights.fill(pod(ws), str(full))
    assert sorted(p.name for p in (ws / "models").iterdir()) == [".my-model.copying"]


def test_a_hugging_face_cache_snapshot_is_copied_through_its_links_into_the_repos_blobs(tmp_path):
    repo = tmp_path / "hub" / "models--me--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"\1" * 64)):
        (repo / "blobs" / name.upper()).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{name.upper()}")
    ws = tmp_path / "ws"
    r = weights_cli(snap, ws)
    assert r.returncode == 0, r.stderr
    assert (ws / "models" / "abc123" / "model.safetensors").read_bytes() == b"\1" * 64
