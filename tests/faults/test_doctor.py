"""`podkit doctor` names the cause: each finding is staged for real on the smoke stack or on a
workspace after the fact, and doctor must name it with evidence and a fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PODKIT, wait_for
from podkit import config
from podkit.boot import guard
from podkit.views import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
HOLDER = str(Path(__file__).parent.parent / "holder.py")


def examine(stack_or_ws, **kw):
    ws = getattr(stack_or_ws, "workspace", stack_or_ws)
    env = getattr(stack_or_ws, "env", {"PODKIT_WORKSPACE": str(ws)})
    cfg = config.load(environ={k: v for k, v in env.items() if k.startswith("PODKIT_")})
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("min_mb_s", 0)
    return {f.id: f for f in doctor.examine(cfg, ws, **kw)}


def test_trainer_waiting_on_rollouts_is_blamed_on_the_dead_inference(stack_factory):
    """Inference frozen: the trainer logs that it waits for rollouts; doctor says inference is the
    cause (docs/failures.md), and `podkit doctor --json` exits 1."""
    # No checkpoint push in the window: a push to the frozen server would block for its own timeout
    # (weight_update_slow's case) before the trainer asks for rollouts again.
    s = stack_factory(PODKIT_TRAINER_CHECKPOINT_EVERY="1000").start()
    s.wait_step(3)
    server = s.pid("sglang")
    assert server, s.status()["programs"]["sglang"]  # never os.kill(0): that is this test's own process group
    os.kill(server, signal.SIGUSR1)  # the stand-in stops answering
    # Generous: the starving is seen within ~5 s (one /generate's timeout), and doctor's finding is what is under
    # test; once, on a machine loaded with a CPU hog beside three workers, 30 s passed without the line.
    try:
        wait_for(lambda: "waiting for rollouts" in s.log("trainer"), 90, what="the trainer to starve")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- trainer.log (tail)\n{s.log('trainer')[-3000:]}\n--- sglang.log (tail)\n"
                             f"{s.log('sglang')[-2000:]}") from None
    f = examine(s)["rollouts_starved"]
    assert "inference is unhealthy" in f.title and "sglang.log" in f.fix
    r = subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(s.workspace)], capture_output=True,
                       text=True, env=s.env, timeout=60)
    assert r.returncode == 1 and "rollouts_starved" in [x["id"] for x in json.loads(r.stdout)["findings"]]
    assert s.stop() == 0


def test_a_restart_loop_is_named_from_the_boot_history(tmp_path):
    """Four boots in the window, recorded by the guard: doctor calls it a restart loop (docs/failures.md)."""
    state = tmp_path / ".podkit"
    state.mkdir()
    for _ in range(4):
        guard.Boot(state).done("supervisord")
    f = examine(tmp_path)["restart_loop"]
    assert "4 boots" in f.title and "podkit resume" in f.fix


def test_weight_updates_slower_than_their_timeout_are_found(stack_factory):
    """Each update takes 3 s against a 1 s limit: the trainer logs the timeout, doctor names it."""
    s = stack_factory(PODKIT_INFERENCE_STANDIN_UPDATE_DELAY_S="3", PODKIT_TRAINER_WEIGHT_UPDATE_TIMEOUT_S="1").start()
    wait_for(lambda: "timed out after 1s" in s.log("trainer"), 60, what="a weight update to time out")
    f = examine(s)["weight_update_slow"]
    assert "1s limit" in f.title and "timed out" in f.evidence[-1]
    assert s.stop() == 0


def test_a_full_or_slow_workspace_is_found(tmp_path):
    """Free space and write speed are measured on the workspace itself (thresholds set above them)."""
    (tmp_path / ".podkit").mkdir()
    found = examine(tmp_path, min_free_bytes=1 << 60, min_mb_s=1e9)
    assert "GiB free" in found["workspace_full"].evidence[0]
    assert "MB/s" in found["workspace_slow"].title


def test_an_oom_kill_is_found_in_the_cgroup_events(tmp_path):
    """memory.events with oom_kill > 0 (a stand-in cgroup dir: this machine has no cgroup v2 file)."""
    cg = tmp_path / "cgroup"
    cg.mkdir()
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (tmp_path / ".podkit").mkdir()
    f = examine(tmp_path, cgroup_dir=cg)["oom_kill"]
    assert "oom_kill 1" in f.evidence[0]


def test_inference_restarts_are_counted_with_the_last_lines_of_its_log(stack_factory):
    """Two crashes of inference: doctor counts the restarts and quotes its log."""
    s = stack_factory().start()
    s.wait_step(2)
    for _ in range(2):
        pid = s.pid("sglang")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda pid=pid: s.pid("sglang") not in (0, pid), 30, what="sglang restart")
    # State events reach the listener asynchronously: the new pid can show before the count.
    f = wait_for(lambda: (f := examine(s).get("inference_restarts")) and "2 time(s)" in f.title and f, 15, 0.5,
                 what="both restarts recorded by the event listener")
    assert f.title.startswith("inference restarted 2 time(s)")
    assert s.stop() == 0


def test_gpu_holders_that_are_not_the_pods_programs_are_found(procs, tmp_path):
    """A leftover process holding a (stand-in) GPU device is named by pid and device."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_bytes(b"\0" * 4096)
    p = procs.spawn([sys.executable, HOLDER, "fd", str(dev / "nvidia0")], stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline().split("pid: ")[1].split(")")[0])
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    cfg = config.load(environ={"PODKIT_WORKSPACE": str(ws), "PODKIT_DEVICES": f"{dev}/nvidia*"})
    found = {f.id: f for f in doctor.examine(cfg, ws, min_free_bytes=0, min_mb_s=0)}
    assert f"{pid} (" in found["gpu_busy"].evidence[0] and "podkit reap" in found["gpu_busy"].fix


def test_a_long_start_up_phase_is_named_and_not_called_stuck(stack_factory):
    """Inference still capturing CUDA graphs: a note with the phase and how long, not a problem."""
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="30").start()
    wait_for(lambda: "Capture cuda graph begin" in s.log("sglang"), 30, what="graph capture")
    wait_for(lambda: s.status()["programs"]["sglang"]["uptime_s"] > 0, 30, what="sglang RUNNING")
    f = examine(s)["startup_phase"]
    assert f.severity == "info" and "capturing cuda graphs" in f.title and "not stuck" in f.title
    assert s.stop() == 0


def test_nccl_interface_names_the_machine_lacks_are_found(tmp_path):
    """NCCL_SOCKET_IFNAME naming a missing interface is a finding; one that exists is not."""
    (tmp_path / ".podkit").mkdir()
    f = examine(tmp_path, environ={"NCCL_SOCKET_IFNAME": "ens5"})["nccl_ifname"]
    assert "NCCL_SOCKET_IFNAME=ens5" in f.evidence[0]
    assert "nccl_ifname" not in examine(tmp_path, environ={"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "^docker"})


def test_a_nan_loss_and_a_sigterm_at_the_last_stop_are_found(stack_factory):
    """A diverging trainer (lr 1e30) reports a NaN loss; after `docker stop` and a new boot, doctor
    notes that the last stop was a SIGTERM."""
    s = stack_factory(PODKIT_TRAINER_LR="1e30").start()
    s.wait_step(4)
    f = examine(s)["nan_loss"]
    assert "nan" in f.title.lower() or "inf" in f.title.lower()
    assert s.stop() == 0
    s = stack_factory(PODKIT_TRAINER_LR="1e30").start()
    f = examine(s)["stopped_by_sigterm"]
    assert f.severity == "info" and f.evidence[0].startswith("SIGTERM")
    assert s.stop() == 0


def test_areals_own_weight_update_lines_are_read_against_its_fixed_120s_wait(tmp_path):
    """AReaL's trainer: its update waits a fixed 120 s for the trainer's save (remote_inf_engine.py:1389,
    name_resolve.py:135's message) and logs each update's time (remote_inf_engine.py:1075). A timeout,
    or an update over half the wait, is found; a fast one is not."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / ".podkit").mkdir()
    fast = ("(AReaL) 20261122-23:48:03.312 [RemoteInfEngine Rank 0] INFO: Loading weights from disk done in "
            "1.13s. Respond time: 1.08s.\n")
    (logs / "trainer.log").write_text(fast)
    env = {"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_TRAINER_KIND": "areal"}
    assert "weight_update_slow" not in examine(SimpleNamespace(workspace=tmp_path, env=env))
    slow = fast.replace("1.13s", "95.40s")
    timeout = ("TimeoutError: Timeout waiting for key 'root/podkit/run/update_weights_from_disk/7' "
               "(NfsNameRecordRepository)\n")
    (logs / "trainer.log").write_text(fast + slow + timeout)
    f = examine(SimpleNamespace(workspace=tmp_path, env=env))["weight_update_slow"]
    assert "120s limit" in f.title and "AReaL" in f.title
    assert any("95.40s" in e for e in f.evidence) and "update_weights_from_disk/7" in f.evidence[-1]
    assert not any("1.13s" in e for e in f.evidence)
