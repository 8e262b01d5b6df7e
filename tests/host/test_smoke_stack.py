"""The smoke stack end to end: real supervisord, the SGLang stand-in, the fake trainer (a real numpy training loop)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def served_version(port: int) -> str | None:
    """What inference serves now; None while it is not listening (restarting)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_model_info", timeout=5) as r:
            return json.loads(r.read())["weight_version"]
    except OSError:
        return None


def latest_checkpoint_step(ws) -> int:
    name = (ws / "checkpoints" / "latest").read_text().strip()
    return int(name.removeprefix("step-").removesuffix(".pt"))


def test_smoke_stack_survives_kills_and_stops_with_a_final_checkpoint(stack_factory):
    """SIGKILL restarts only the killed program; the trainer resumes from its checkpoint and re-pushes
    weights to a restarted server; SIGTERM stops everything with a final checkpoint and no process left."""
    # Checkpoints far apart: after the kill only stale-weight detection can restore the served weights.
    s = stack_factory(PODKIT_TRAINER_CHECKPOINT_EVERY="8").start()
    assert s.current()["supervisord_pid"] == s.proc.pid, "podkit boot must exec supervisord in place"
    s.wait_step(9)
    sglang, trainer, logs = s.pid("sglang"), s.pid("trainer"), s.pid("logs")
    wait_for(lambda: served_version(s.port) == str(latest_checkpoint_step(s.workspace)), 20,
             what="inference to serve the trainer's checkpoint")

    os.kill(sglang, signal.SIGKILL)
    new_sglang = wait_for(lambda: (p := s.pid("sglang")) not in (0, sglang) and p, 30, what="sglang restart")
    assert s.pid("trainer") == trainer, "killing inference must not restart the trainer"
    # The restarted server serves base weights until the trainer notices and pushes its latest again.
    wait_for(lambda: "inference restarted?" in s.log("trainer"), 30, what="trainer to notice stale weights")
    wait_for(lambda: served_version(s.port) == str(latest_checkpoint_step(s.workspace)), 30,
             what="trainer to re-push its weights to the restarted server")

    before = s.wait_step(s.progress()["step"] + 3)
    ckpt = before["checkpoint_step"]
    os.kill(trainer, signal.SIGKILL)
    wait_for(lambda: s.pid("trainer") not in (0, trainer), 30, what="trainer restart")
    assert s.pid("sglang") == new_sglang, "killing the trainer must not restart inference"
    wait_for(lambda: f"resumed from checkpoint step-{ckpt:08d}.pt" in s.log("trainer")
             or "resumed from checkpoint" in s.log("trainer").split("starting trainer")[-1], 60,
             what="the restarted trainer to resume from its checkpoint")
    resumed_line = [ln for ln in s.log("trainer").splitlines() if "resumed from checkpoint" in ln][-1]
    assert int(resumed_line.rsplit("(step ", 1)[1].rstrip(")")) >= ckpt
    s.wait_step(before["step"] + 2)
    st = s.status()
    assert st["programs"]["trainer"]["restarts"] == 1 and st["programs"]["sglang"]["restarts"] == 1

    pids = [s.pid("sglang"), s.pid("trainer"), logs]
    assert s.stop() == 0
    final = s.progress()
    assert final["checkpoint_step"] == final["step"] == latest_checkpoint_step(s.workspace)
    assert f"stopped cleanly at step {final['step']}" in s.log("trainer")
    assert not [p for p in pids if alive(p)], "a program outlived supervisord"


def test_supervisorctl_restart_of_one_program_leaves_the_other_running(stack_factory):
    """`supervisorctl restart sglang` keeps the trainer's pid, and the reverse."""
    s = stack_factory().start()
    s.wait_step(2)
    # The real supervisorctl, with the literal config render writes for it.
    ctl = [os.path.join(os.path.dirname(sys.executable), "supervisorctl"),
           "-c", os.path.join(s.current()["run_dir"], "supervisorctl.conf")]
    sglang, trainer = s.pid("sglang"), s.pid("trainer")
    subprocess.run([*ctl, "restart", "sglang"], check=True, timeout=60, capture_output=True)
    assert s.pid("trainer") == trainer
    new_sglang = wait_for(lambda: s.pid("sglang"), 30, what="sglang running")
    assert new_sglang != sglang
    subprocess.run([*ctl, "restart", "trainer"], check=True, timeout=60, capture_output=True)
    assert s.pid("sglang") == new_sglang
    assert wait_for(lambda: s.pid("trainer"), 30, what="trainer running") != trainer
    assert s.stop() == 0


def test_every_program_line_reaches_stdout_prefixed_and_its_own_log_file(stack_factory):
    """Both programs' output shows on the container's stdout with the program's name, and in a
    per-program file under <workspace>/logs/."""
    s = stack_factory().start()
    s.wait_step(6)
    assert s.stop() == 0
    out = s.stdout().splitlines()
    assert any(ln.startswith("sglang   | ") and "fired up and ready to roll" in ln for ln in out)
    assert any(ln.startswith("trainer  | ") and "checkpoint step-00000005.pt written" in ln for ln in out)
    assert "fired up and ready to roll" in s.log("sglang")
    assert "checkpoint step-00000005.pt written" in s.log("trainer")
    assert "sglang" not in s.log("trainer").replace("[podkit:run] starting trainer", "")


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A":  # LISTEN
                inodes.add(cols[9])
    return inodes


def test_supervisord_listens_only_on_an_owner_only_unix_socket(stack_factory):
    """No TCP listener in supervisord; its control socket is mode 0700."""
    s = stack_factory().start()
    sock = s.current()["socket"]
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o700
    listening = _listening_inodes()
    pid = s.proc.pid
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass  # closed meanwhile: supervisord opens and closes fds as it works
    sockets = {f[len("socket:["):-1] for f in fds if f.startswith("socket:[")}
    assert not sockets & listening, "supervisord has a TCP listening socket"
    assert s.stop() == 0


def test_status_reports_programs_progress_and_inference_phase(stack_factory):
    """`podkit status --json` has each program's state, pid, uptime and restarts, the trainer's step and
    last progress, and the inference phase."""
    s = stack_factory().start()
    s.wait_step(3)
    # supervisord calls a program RUNNING once it has lived startsecs (3 s for the trainer, 5 s for inference).
    st = wait_for(lambda: all((st := s.status())["programs"][n]["state"] == "RUNNING" for n in ("sglang", "trainer"))
                  and st, 30, what="both RUNNING")
    for name in ("sglang", "trainer"):
        p = st["programs"][name]
        assert p["state"] == "RUNNING" and p["pid"] == s.pid(name) and p["restarts"] == 0
        assert p["uptime_s"] >= 0
    assert st["trainer"]["step"] >= 3 and st["trainer"]["last_progress"] > 0
    assert st["inference"]["phase"] == "ready"
    human = subprocess.run([sys.executable, "-m", "podkit", "status", "--workspace", str(s.workspace)],
                           capture_output=True, text=True, env=s.env, timeout=30)
    assert human.returncode == 0 and "trainer" in human.stdout and "inference: ready" in human.stdout
    assert s.stop() == 0


def test_a_run_that_reaches_max_steps_ends_exited_even_when_it_finishes_within_startsecs(stack_factory):
    """4 steps at 0.1 s finish inside the trainer's startsecs (3 s), where supervisord counts any exit,
    exit 0 included, as a failed start: the trainer must still end EXITED once, not be restarted into
    BACKOFF and FATAL. Booted again on the finished workspace, it resumes at its last step, trains
    nothing more and ends EXITED again."""
    for name in ("first", "again"):
        s = stack_factory(PODKIT_TRAINER_MAX_STEPS="4")
        s.workspace = s.workspace.parent / "ws"
        s.out_path = s.workspace.parent / f"{name}-stdout.log"
        s.start()
        st = wait_for(lambda s=s: (st := s.status())["programs"]["trainer"]["state"] in ("EXITED", "FATAL", "BACKOFF")
                      and st, 60, what="the trainer to end")
        assert st["programs"]["trainer"]["state"] == "EXITED" and st["programs"]["trainer"]["exitstatus"] == 0, st
        time.sleep(1)
        st = s.status()["programs"]["trainer"]
        assert st["state"] == "EXITED" and st["restarts"] == 0, st
        p = s.progress()
        assert p["step"] == 4 and p["stopped"]["by"] == "max_steps", p
        assert "not expected" not in (s.workspace / "logs" / "supervisord.log").read_text()
        assert s.stop() == 0
