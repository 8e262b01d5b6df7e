"""The setup stage: the training repo's requirements installed by real pip (offline: a wheel in the repo,
--no-index) into a venv on the volume that inherits the trainer's packages, once per change of the
dependency files; a failure waits in safe mode; an unreachable index falls back to the last good env."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PODKIT, ROOT, free_port, smoke_env, wait_for, wheel
from podkit import config, records, setup

pytestmark = pytest.mark.timeout(180)
INSTALL = "pip install --no-index -r requirements.txt"


def checkout(tmp_path: Path, version: str = "1.0") -> Path:
    repo = tmp_path / "ws" / "repo"
    w = wheel(repo / "wheels", version=version)
    (repo / "requirements.txt").write_text(f"./wheels/{w.name}\n")
    (repo / "train.py").write_text("import podkit_demo_dep\n")
    return repo


def cfg_for(tmp_path: Path, command: str = INSTALL):
    return config.load(ROOT / "configs" / "smoke.yaml", environ={
        "PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_REPO_SETUP": command})


def podkit_setup(tmp_path: Path, command: str = INSTALL) -> subprocess.CompletedProcess:
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": command}
    return subprocess.run([*PODKIT, "setup", "--json"], capture_output=True, text=True, env=env, timeout=150)


def test_setup_installs_the_repos_requirement_once_and_the_next_boot_reuses_it(tmp_path):
    checkout(tmp_path)
    t0 = time.monotonic()
    first = podkit_setup(tmp_path)
    built = time.monotonic() - t0
    assert first.returncode == 0, first.stderr
    rec = json.loads(first.stdout)
    py = rec["python"]
    assert py.startswith(str(tmp_path / "ws" / "envs" / "setup-"))
    # The requirement is in the env, and so is what the trainer's Python had (torch: inherited, not copied).
    r = subprocess.run([py, "-c", "import podkit_demo_dep, torch, sys; print(podkit_demo_dep.VERSION, sys.prefix)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["1.0", str(Path(py).parent.parent)], r.stderr
    assert not list(Path(py).parent.parent.glob("lib/python*/site-packages/torch"))
    # Installed into the env, never into the trainer's own Python.
    assert subprocess.run([sys.executable, "-c", "import podkit_demo_dep"], capture_output=True).returncode != 0
    t0 = time.monotonic()
    again = podkit_setup(tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["python"] == py, again.stderr
    assert "reusing" in again.stderr and time.monotonic() - t0 < built
    # A changed dependency file is a new env; the old one is kept.
    checkout(tmp_path, version="2.0")
    newer = json.loads(podkit_setup(tmp_path).stdout)["python"]
    assert newer != py and Path(py).exists()
    assert setup.python_for(cfg_for(tmp_path)) == (newer, "")


def test_an_unreachable_index_falls_back_to_the_last_good_environment_with_a_warning(tmp_path):
    checkout(tmp_path)
    good = json.loads(podkit_setup(tmp_path).stdout)["python"]
    (tmp_path / "ws" / "repo" / "requirements.txt").write_text("podkit-demo-missing==9\n")
    offline = f"pip install --index-url http://127.0.0.1:{free_port()}/simple --retries 1 --timeout 2 -r requirements.txt"
    r = podkit_setup(tmp_path, offline)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["python"] == good and rec["fallback"] is True, rec
    assert "package index looks unreachable" in r.stderr


def test_a_failing_setup_waits_in_safe_mode_naming_the_command_and_its_last_lines(procs, tmp_path):
    checkout(tmp_path)
    command = "echo building-the-thing; echo 'error: no such compiler' >&2; exit 3"
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": command}
    procs.workspaces.add(str(tmp_path / "ws"))
    boot = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    safe = wait_for(lambda: records.SAFE_MODE.read(tmp_path / "ws" / ".podkit"), 60, what="safe mode")
    assert safe["stage"] == "setup", safe
    assert "exited 3" in safe["message"] and "error: no such compiler" in safe["message"], safe
    assert command in safe["message"] and "setup.log" in safe["hint"], safe
    time.sleep(1)
    assert boot.poll() is None  # waits, explaining itself: no restart loop
    # Half-installed, so never used: no env is marked ready, and the trainer would run the image's Python.
    assert not list((tmp_path / "ws" / "envs").glob(f"setup-*/{setup.READY}"))
    assert setup.python_for(cfg_for(tmp_path, command)) == (None, "")


def test_a_planted_setup_record_is_not_run(tmp_path):
    checkout(tmp_path)
    cfg = cfg_for(tmp_path)
    cfg.state_dir.mkdir(parents=True)
    records.SETUP.write(cfg.state_dir, {"python": "/tmp/evil/bin/python", "key": "x"})
    py, why = setup.python_for(cfg)
    assert py is None and "not a ready environment" in why
