"""podkit boot never exits fast: a bad config or a failed stage waits in safe mode, explaining itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from conftest import PODKIT, ROOT, free_port, smoke_env, wait_for

pytestmark = pytest.mark.timeout(120)


def start_boot(procs, tmp_path, **env):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    out = open(tmp_path / "boot.log", "wb")
    e = smoke_env(ws, free_port(), **env)
    p = procs.spawn([*PODKIT, "boot"], env=e, stdout=out, stderr=subprocess.STDOUT)
    return p, ws, tmp_path / "boot.log"


def test_boot_with_a_corrupt_config_stays_up_in_safe_mode(procs, tmp_path):
    """A config error does not exit PID 1 (a restart loop); it explains itself and waits for SIGTERM."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    p, ws, out = start_boot(procs, tmp_path, PODKIT_CONFIG=str(bad))
    wait_for(lambda: "SAFE MODE" in out.read_text(), 20, what="safe-mode banner")
    assert p.poll() is None, "boot exited: under restart: always that is a restart loop"
    text = out.read_text()
    assert "checkpoint_evry: unknown key" in text and "did you mean 'checkpoint_every'?" in text
    assert json.loads((ws / ".podkit" / "safe-mode.json").read_text())["stage"] == "config"
    d = subprocess.run([*PODKIT, "doctor", "--workspace", str(ws)], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")})
    assert d.returncode == 1 and "safe mode: the config stage failed" in d.stdout and "checkpoint_evry" in d.stdout
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0


def test_boot_with_an_unreachable_repo_and_no_checkout_waits_in_safe_mode(procs, tmp_path):
    """A sync that cannot produce any checkout becomes safe mode, not an exit."""
    p, ws, out = start_boot(procs, tmp_path, PODKIT_REPO_URL=str(tmp_path / "no-such-remote.git"),
                            PODKIT_REPO_RETRIES="1")
    wait_for(lambda: "SAFE MODE" in out.read_text(), 30, what="safe-mode banner")
    assert p.poll() is None
    assert "the sync stage failed" in out.read_text()
    st = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(ws)], capture_output=True, text=True,
                        timeout=30)
    assert json.loads(st.stdout)["safe_mode"]["stage"] == "sync"
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0


def test_up_with_steps_trains_to_the_step_and_exits_0(tmp_path):
    """`podkit up --smoke --steps N` is the README's main job: it stops everything cleanly at step N."""
    ws = tmp_path / "ws"
    e = smoke_env(ws, free_port())
    e.pop("PODKIT_CONFIG")
    r = subprocess.run([*PODKIT, "up", "--smoke", "--workspace", str(ws), "--steps", "6"], env=e,
                       capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    progress = json.loads((ws / ".podkit" / "progress.json").read_text())
    assert progress["step"] >= 6 and progress["checkpoint_step"] == progress["step"]
    assert "trainer reached step" in r.stdout
    # What a newcomer runs next: a clean stop reads as one, not as a failure.
    st = subprocess.run([*PODKIT, "status", "--workspace", str(ws)], env=e, capture_output=True, text=True,
                        timeout=30)
    assert "pod: not running (supervisord has exited)" in st.stdout, st.stdout
    assert f"stopped by SIGTERM at step {progress['step']}" in st.stdout, st.stdout
    assert f"checkpoint at step {progress['step']}" in st.stdout and "inference: stopped" in st.stdout, st.stdout
    assert "unhealthy" not in st.stdout


def test_up_whose_trainer_cannot_import_its_code_exits_1_with_doctors_finding(tmp_path):
    """A trainer that goes FATAL (here: its `import torch` fails) ends `podkit up --steps N` with exit 1
    and doctor's finding, instead of waiting for steps that never come."""
    ws, broken = tmp_path / "ws", tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('torch is broken in this test')\n")
    e = smoke_env(ws, free_port(), PYTHONPATH=str(broken))
    e.pop("PODKIT_CONFIG")
    r = subprocess.run([*PODKIT, "up", "--smoke", "--workspace", str(ws), "--steps", "6"], env=e,
                       capture_output=True, text=True, timeout=100, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "trainer is FATAL: supervisord gave up restarting it" in out, out[-3000:]
    assert "[podkit:doctor] PROBLEM: " in out and "torch is broken in this test" in out, out[-3000:]
