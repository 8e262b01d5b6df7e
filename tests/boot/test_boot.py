"""podkit boot never exits fast: a bad config or a failed stage waits in safe mode, explaining itself."""

from __future__ import annotations

import json
import os
import re
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


def test_up_with_steps_trains_to_the_step_and_exits_0_and_leaves_its_start_up_timeline(tmp_path, monkeypatch):
    """`podkit up --smoke --steps N` is the README's main job: it stops everything cleanly at step N, and its
    boot is on record as `podkit boot`'s is: status --json and doctor show its start-up timeline."""
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
    assert re.search(rf"the trainer stopped by podkit up: trainer reached step \d+ \(--steps 6\) at step "
                     rf"{progress['step']} ", st.stdout), st.stdout
    assert f"checkpoint at step {progress['step']}" in st.stdout and "inference: stopped" in st.stdout, st.stdout
    assert "unhealthy" not in st.stdout
    js = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(ws)], env=e, capture_output=True, text=True,
                        timeout=30)
    status = json.loads(js.stdout)
    phases = [p["phase"] for p in status["startup"]["phases"]]
    assert phases[:7] == ["preflight", "reap", "sync", "setup", "restore", "render", "supervisord"], phases
    assert "first_step" in phases and status["startup"]["total_s"] > 0, status["startup"]
    last = status["boots"]["last"]
    assert last["via"] == "up" and last["outcome"] == "supervisord", last
    # doctor names the slowest phase of a slow start from the same timeline (any start is slow past 0 s)
    from podkit import config
    from podkit.views import doctor

    monkeypatch.setattr(doctor, "STARTUP_SLOW_S", 0.0)
    found = {f.id: f for f in doctor.examine(config.load(environ={"PODKIT_WORKSPACE": str(ws)}), ws)}
    assert "restart_loop" not in found  # a person's `up`s are not the container's restart loop
    assert any(line.startswith("start-up: preflight +") for line in found["startup_slow"].evidence), found


def test_up_whose_trainer_cannot_import_its_code_exits_1_with_doctors_finding(tmp_path):
    """A trainer that fails at every start (here: its `import numpy` fails) ends `podkit up --steps N` with exit 1
    and doctor's finding, instead of waiting for steps that never come: the loop bound stops it in the
    exception's own words (supervisord's own start retries never count: each start outlives its startsecs)."""
    ws, broken = tmp_path / "ws", tmp_path / "broken"
    broken.mkdir()
    (broken / "numpy.py").write_text("raise ImportError('numpy is broken in this test')\n")
    e = smoke_env(ws, free_port(), PYTHONPATH=str(broken), PODKIT_TRAINER_RESTART_DELAY_S="1")
    e.pop("PODKIT_CONFIG")
    r = subprocess.run([*PODKIT, "up", "--smoke", "--workspace", str(ws), "--steps", "6"], env=e,
                       capture_output=True, text=True, timeout=100, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "the trainer stopped for good (crash-loop) before its first step" in out, out[-3000:]
    assert "[podkit:doctor] PROBLEM: " in out and "ImportError: numpy is broken in this test" in out, out[-3000:]


def test_up_that_stops_at_a_stage_says_why_afterwards_in_status_and_doctor(tmp_path):
    """`podkit up` with a repo that cannot be fetched exits at the sync stage; status said only "boot: failed"
    and doctor "nothing wrong found" (`podkit boot` waits in safe mode, which records why; `up` exits)."""
    ws = tmp_path / "ws"
    e = smoke_env(ws, free_port(), PODKIT_REPO_URL=str(tmp_path / "no-such-repo.git"), PODKIT_REPO_RETRIES="1")
    e.pop("PODKIT_CONFIG")
    r = subprocess.run([*PODKIT, "up", "--smoke", "--workspace", str(ws), "--steps", "2"], env=e,
                       capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    st = subprocess.run([*PODKIT, "status", "--workspace", str(ws)], env=e, capture_output=True, text=True,
                        timeout=30).stdout
    assert "  it failed at sync: " in st and "no-such-repo.git" in st and "(fix: " in st, st
    doc = json.loads(subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(ws)], env=e,
                                    capture_output=True, text=True, timeout=30).stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "boot_failed")
    assert finding["severity"] == "problem" and finding["title"].startswith("the last boot (") and \
        "failed at sync: " in finding["title"], finding
    assert "no-such-repo.git" in finding["fix"] and finding["evidence"] == [
        "boot via up; stages: preflight ok, reap ok, sync failed"], finding


def test_resume_after_a_boot_with_its_own_config_file_boots_again_with_that_file(procs, tmp_path):
    """`podkit --config X boot` waits in safe mode (its repo is not there yet); the user pushes it and runs
    `podkit resume`: the boot starts again in place with X (smoke programs), not with podkit's defaults."""
    from gitserver import Remote

    ws = tmp_path / "ws"
    ws.mkdir()
    remote_root = tmp_path / "later"
    own = tmp_path / "my-config.yaml"
    own.write_text((ROOT / "configs" / "smoke.yaml").read_text() + f"""
repo:
  url: {remote_root / "train.git"}
  retries: 1
""")
    env = smoke_env(ws, free_port())
    env.pop("PODKIT_CONFIG")
    out = open(tmp_path / "boot.log", "wb")  # noqa: SIM115 - closed with the test's tmp dir
    p = procs.spawn([*PODKIT, "--config", str(own), "boot"], env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: "SAFE MODE" in (tmp_path / "boot.log").read_text(), 30, what="safe mode (no repo yet)")
    remote_root.mkdir()
    Remote(remote_root).commit("train.py", "print('mine')\n")
    r = subprocess.run([*PODKIT, "resume", "--workspace", str(ws)], capture_output=True, text=True, timeout=30,
                       env=env)
    assert r.returncode == 0 and "told the boot waiting in safe mode" in r.stdout, r.stdout + r.stderr
    current = ws / ".podkit" / "current.json"
    wait_for(lambda: current.exists() and json.loads(current.read_text()).get("supervisord_pid") == p.pid, 60,
             what="supervisord in place of the boot, with the smoke programs of X")
    assert (ws / "repo" / "train.py").read_text() == "print('mine')\n"

    def trainer_runs() -> bool:
        st = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(ws)], capture_output=True, text=True,
                            timeout=30, env=env)
        return (json.loads(st.stdout or "{}").get("programs", {}).get("trainer") or {}).get("state") == "RUNNING"

    wait_for(trainer_runs, 60, what="X's fake trainer running")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
