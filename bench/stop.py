"""Graceful stop and kill -9 on the smoke stack booted through `podkit boot`.

    python bench/stop.py [--runs 3]

1. SIGTERM to supervisord (what `docker stop` sends PID 1) until everything has exited, with the
   trainer's final checkpoint at its last step (target <= 3 s), and where each program's stop went.
2. The stop budget: the same with a trainer that spends most of its grace (a 6.5-s step, SIGTERM
   just after one) and a webhook that never answers: PID 1 must exit by itself inside docker's and
   RunPod's 10 s (target <= stop_timeout_s - 1.5 s = 8.5 s, the deadline pid1 keeps).
3. kill -9 of every process of the stack at a random moment (a container kill): steps lost =
   the trainer's last recorded step minus the step of the checkpoint it resumes from
   (target <= one checkpoint interval).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xmlrpc.client
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.append(str(ROOT / "tests"))  # harness.py: free ports as the tests take them (never one twice)

from harness import alive, free_port  # noqa: E402
from harness import read_json as read  # noqa: E402
from podkit.host.supervisord import rpc  # noqa: E402

EVERY = 10


def boot(ws: Path, **extra: str) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    env.update(PODKIT_CONFIG=str(ROOT / "configs" / "smoke.yaml"), PODKIT_WORKSPACE=str(ws),
               PODKIT_INFERENCE_PORT=str(free_port()), PODKIT_METRICS_PORT=str(free_port()),
               PODKIT_TRAINER_CHECKPOINT_EVERY=str(EVERY),
               PODKIT_INFERENCE_STARTUP_DELAY_S="0.5", **extra)
    p = subprocess.Popen([str(Path(sys.executable).with_name("podkit")), "boot"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p, env


def wait_step(ws: Path, step: int, timeout: float = 90) -> dict:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        rec = read(ws / ".podkit" / "progress.json")
        if rec.get("step", 0) >= step:
            return rec
        time.sleep(0.05)
    raise SystemExit(f"trainer did not reach step {step}")


def program_pids(ws: Path) -> dict[str, int]:
    sock = read(ws / ".podkit" / "current.json").get("socket")
    try:
        return {i["name"]: i["pid"] for i in rpc(sock).supervisor.getAllProcessInfo() if i["pid"]}
    except (OSError, xmlrpc.client.Error):
        return {}


def sigterm(p: subprocess.Popen, pids: dict[str, int], timeout: float = 60) -> tuple[float, dict[str, float]]:
    """SIGTERM to PID 1; seconds until it and every program had exited, and when each one did."""
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    gone: dict[str, float] = {}
    while len(gone) <= len(pids) and time.perf_counter() - t0 < timeout:
        for name, pid in [*pids.items(), ("PID 1", p.pid)]:
            if name not in gone and (p.poll() is not None if name == "PID 1" else not alive(pid)):
                gone[name] = time.perf_counter() - t0
        time.sleep(0.005)
    if p.poll() is None:
        p.kill()  # what docker does at its stop timeout
        p.wait(10)
    return max(gone.values(), default=timeout), gone


def order(gone: dict[str, float]) -> str:
    return ", ".join(f"{name} {t:.2f}" for name, t in sorted(gone.items(), key=lambda kv: kv[1]))


def graceful(ws: Path) -> tuple[float, bool, dict[str, float]]:
    p, _ = boot(ws)
    wait_step(ws, wait_step(ws, 1).get("step", 0) + 15)
    elapsed, gone = sigterm(p, program_pids(ws))
    rec = read(ws / ".podkit" / "progress.json")
    latest = (ws / "checkpoints" / "latest").read_text().strip()
    return elapsed, latest == f"step-{rec['step']:08d}.pt" and rec.get("checkpoint_step") == rec["step"], gone


def budget(ws: Path, webhook: str) -> tuple[float, dict[str, float]]:
    """A trainer that spends most of its grace, a webhook that never answers: SIGTERM just after a step."""
    p, _ = boot(ws, PODKIT_TRAINER_STEP_INTERVAL_S="6.5", PODKIT_NOTIFY_WEBHOOK_URL=webhook)
    step = wait_step(ws, 1).get("step", 0)
    wait_step(ws, step + 1)
    return sigterm(p, program_pids(ws), timeout=15)


def killed(ws: Path) -> tuple[int, int]:
    p, _ = boot(ws)
    start = wait_step(ws, 1)["step"]
    wait_step(ws, start + 12)
    time.sleep(random.uniform(0, 2.5))  # anywhere in the checkpoint interval
    pids = [p.pid, *program_pids(ws).values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    p.wait(10)
    at_kill = read(ws / ".podkit" / "progress.json")["step"]
    ckpt = int((ws / "checkpoints" / "latest").read_text().strip()[5:13])
    return at_kill, at_kill - ckpt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    stops, budgeted, lost = [], [], []
    webhook = socket.socket()  # accepts (the listen backlog) and never answers
    webhook.bind(("127.0.0.1", 0))
    webhook.listen(16)
    url = f"http://127.0.0.1:{webhook.getsockname()[1]}/hooks/never-answers"
    for i in range(args.runs):
        ws = Path(tempfile.mkdtemp(prefix=f"podkit-bench-stop-{i}-"))
        t, ok, gone = graceful(ws)
        stops.append(t)
        print(f"SIGTERM run {i + 1}: everything stopped in {t:.2f} s, final checkpoint at the last step: {ok} "
              f"({order(gone)})")
        t, gone = budget(Path(tempfile.mkdtemp(prefix=f"podkit-bench-budget-{i}-")), url)
        budgeted.append(t)
        print(f"budget run {i + 1}: 6.5-s step, webhook never answers: PID 1 exited in {t:.2f} s ({order(gone)})")
        at, n = killed(ws)
        lost.append(n)
        print(f"kill -9 run {i + 1}: at step {at}, resumes from step {at - n}: {n} step(s) lost")
    webhook.close()
    print(f"graceful stop median {statistics.median(stops):.2f} s, max {max(stops):.2f} s (target <= 3 s)")
    print(f"stop budget: PID 1 exited in max {max(budgeted):.2f} s of docker's 10 s (target <= 8.5 s, "
          "stop_timeout_s - 1.5)")
    print(f"steps lost on kill -9: max {max(lost)} (target <= one checkpoint interval = {EVERY})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
