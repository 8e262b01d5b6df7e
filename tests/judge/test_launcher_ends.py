"""The trainer program's ends around a real torchrun: `podkit run trainer`'s own path (programs.run: its stop
signal from the first line, the child subreaper, the loop bound, verdict.judge) with the AReaL launcher's
`supervise`, and small rank scripts in AReaL's place (no AReaL: the ends are the launcher's and the kernel's).
A step that never ends after a stop you asked for is cut, and it is a stop; a rank the kernel's OOM killer kills
(a real memory cgroup, where the machine lets one be made) is out of memory, with its step, counted apart and
stopped for good in those words. The real AReaL trainer's ends: tests/trainer/test_your_code.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, alive, free_port, smoke_env, wait_for

pytestmark = pytest.mark.timeout(180)

# The trainer program, its fake trainer swapped for a launcher of torchrun on RANK (as AReaL's launcher runs it).
PROGRAM = """import os, sys
from pathlib import Path
from podkit import config, programs
from podkit.areal import launch

def main(cfg):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
            os.environ.get("RANKS", "1"), os.environ["RANK_SCRIPT"], str(cfg.run_path)]
    return launch.supervise(argv, dict(os.environ), Path(cfg.run_path), grace_s=cfg.trainer.stop_grace_s,
                            stopping=lambda: True)

sys.modules["torchrun_trainer"] = sys.modules[__name__]
programs.TABLE[("trainer", "fake")] = "torchrun_trainer"
sys.exit(programs.run("trainer", config.load()))
"""
# A rank in its step: noted alive and training as the bootstrap and hooks note it; the step never ends.
LONG_STEP = """import os, signal, sys, time
from podkit.judge import ending
ending.rank_alive(sys.argv[1], int(os.environ["RANK"]), training=True)
signal.signal(signal.SIGTERM, lambda *_: None)  # the step in flight does not end: a slow judge, a stuck reward
open(os.path.join(sys.argv[1], "ready"), "w").close()
while True:
    time.sleep(0.1)
"""
# A rank whose memory grows until the kernel kills it (first in line for the OOM killer, as the biggest rank is).
GROWS = """import os, sys, time
from podkit.judge import ending
ending.rank_alive(sys.argv[1], int(os.environ["RANK"]), training=True)
open("/proc/self/oom_score_adj", "w").write("1000")
hold = []
while True:
    hold.append(bytearray(32 << 20))
    time.sleep(0.01)
"""


def program(procs, tmp_path, rank_script: str, out_name: str = "trainer.log", prefix=(), **env):
    ws = tmp_path / "ws"
    (ws / "logs").mkdir(parents=True, exist_ok=True)
    script = tmp_path / "rank.py"
    script.write_text(rank_script)
    e = smoke_env(ws, free_port(), RANK_SCRIPT=str(script), PODKIT_RUN_DIR=str(tmp_path / "run"),
                  PYTHONPATH=str(ROOT / "src"), **env)
    out = ws / "logs" / out_name  # where supervisord would put it: the judge reads torchrun's report there
    p = procs.spawn([*prefix, sys.executable, "-c", PROGRAM], env=e, stdout=open(out, "ab"), stderr=subprocess.STDOUT,
                    start_new_session=True)
    return p, ws, out


def test_a_step_that_never_ends_after_the_stop_you_asked_for_is_cut_and_is_a_stop_not_a_failure(procs, tmp_path):
    """`podkit ctl restart trainer` while a step is longer than trainer.stop_grace_s: the launcher cuts the ranks
    at the end of the grace (so none outlives it), and the end is the stop that was asked for, said so, counted
    by nobody: three in a row stop nothing."""
    for _n in range(3):
        p, ws, out = program(procs, tmp_path, LONG_STEP, PODKIT_TRAINER_STOP_GRACE_S="2")
        wait_for(lambda: (tmp_path / "run" / "ready").exists(), 60, what="the rank's step")
        (tmp_path / "run" / "ready").unlink()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, out.read_text()[-3000:]
        assert time.monotonic() - t0 < 10
    log = out.read_text()
    assert "the step in flight did not end within trainer.stop_grace_s (2 s)" in log, log[-3000:]
    stopped = json.loads((ws / ".podkit" / "progress.json").read_text())["stopped"]
    assert stopped["by"] == "SIGTERM" and stopped["cut"] is True, stopped
    assert stopped["asked"] == "whoever runs this program (no supervisord)", stopped
    loop = json.loads((ws / ".podkit" / "trainer-loop.json").read_text())
    assert [e["by"] for e in loop["ends"]] == ["SIGTERM"] * 3 and not loop.get("gave_up"), loop
    assert (loop.get("failures") or 0, loop.get("outside") or 0) == (0, 0), loop
    assert "not counted by the loop bound" in log
    assert (tmp_path / "run" / "stop-forwarded.json").exists(), "the ranks can tell this stop from torchrun's own"


def memory_cgroup(limit: int) -> Path | None:
    """A memory cgroup of the test's own, at the hierarchy's root (a sibling of everything else, so that another
    pod's doctor on this machine does not read its OOM kill as its own); None where one cannot be made."""
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        cg = root / f"podkit-test-oom-{os.getpid()}"
        try:
            cg.mkdir(exist_ok=True)
            (cg / limit_file).write_text(str(limit))
            if (cg / "memory.swappiness").exists():
                (cg / "memory.swappiness").write_text("0")
            return cg
        except OSError:
            try:
                cg.rmdir()
            except OSError:
                pass
    return None


def test_a_rank_the_kernels_oom_killer_kills_is_out_of_memory_with_its_step_and_stopped_for_good_in_those_words(
        procs, tmp_path):
    """A real OOM kill: the trainer program in a memory cgroup of 700 MiB, its rank growing past it. The judge
    reads the cgroup's own count (the kernel's evidence) and torchrun's report of the rank's SIGKILL: out of
    memory at the run's step, counted apart from the script's failures, and the third stops the trainer for good
    as oom-loop, with the fix (a smaller batch or sequence length)."""
    cg = memory_cgroup(700 << 20)
    if cg is None:
        pytest.skip("no memory cgroup can be made here (not root, or cgroupfs read-only): the OOM kill needs one")
    try:
        enter = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "enter"]
        for n in range(3):
            ws = tmp_path / "ws"
            (ws / ".podkit").mkdir(parents=True, exist_ok=True)
            (ws / ".podkit" / "progress.json").write_text(json.dumps({"step": 2, "time": time.time() - 60}))
            p, ws, out = program(procs, tmp_path, GROWS, prefix=enter, PODKIT_TRAINER_RESTART_DELAY_S="0.2")
            code = p.wait(120)
            assert code == (1 if n < 2 else 0), out.read_text()[-3000:]
        log = out.read_text()
        stopped = json.loads((ws / ".podkit" / "progress.json").read_text())["stopped"]
        assert stopped["by"] == "oom-loop" and stopped["last"] == "out-of-memory", stopped
        assert stopped["message"].startswith("the trainer ran out of memory 3 times in a row before its first step"), \
            stopped
        assert "out of host memory at step 2: rank 0 (pid" in stopped["message"] and ", SIGKILL) killed by the " \
            "kernel's OOM killer" in stopped["message"], stopped
        assert "smaller batch or sequence length" in stopped["hint"], stopped
        assert any("oom_kill" in e and str(cg.name) in e for e in stopped.get("evidence", [])), stopped
        loop = json.loads((ws / ".podkit" / "trainer-loop.json").read_text())
        assert loop["ooms"] == 3 and loop["failures"] == 0 and loop["gave_up"], loop
        assert "ran out of memory before its first step without a new step (1 of 3 in a row)" in log, log[-4000:]
    finally:
        for pid in (int(x) for x in (cg / "cgroup.procs").read_text().split()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
