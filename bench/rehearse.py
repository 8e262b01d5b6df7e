"""The CPU rehearsal's real GRPO trainer (configs/cpu-rehearsal.yaml, booted by `podkit boot` in the
AReaL environment, against the generating stand-in for SGLang): step time and recovery times.

    python bench/rehearse.py [--steps 6] [--runs 2] [--workspace DIR] [--env] [--smoke]

1. Cold launch (boot until progress.json records step 1), then seconds per step in steady state
   (--steps steps after the first).
2. kill -9 of the trainer (the launcher, supervisord's `trainer`) until a new trainer completes a step.
3. Inference restarted alone (supervisord stopProcess + startProcess of `sglang`) until the stand-in
   serves the trainer's weights again (/model_info weight_version == progress.json's, not "default"),
   and until the trainer's next step: with trainer.on_inference_restart reattach (the trainer goes on),
   then, as the baseline in the same run, on a second pod with restart (the trainer stops after its
   step, restarts and resumes: what podkit did before re-attaching).
4. With --env: build the AReaL environment fresh (rehearse/env.sh into a temporary PODKIT_CACHE_DIR;
   minutes, and it downloads) and measure its size with du.

Recovery times are given as ratios against the cold launch -> first step and the steady-state step
time of the same run. The AReaL python is $AREAL_PYTHON, else what `sh rehearse/env.sh` prints.

--smoke runs the same measurements on the smoke stack (configs/smoke.yaml: the fake-data trainer and
the SGLang stand-in, podkit's own python, seconds): the suite's check that this script still runs
(tests/house/test_bench.py), beside the real-trainer tests rather than on their lane. Its figures are the
smoke stack's, not the real trainer's.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.append(str(ROOT / "tests"))  # harness.py: the pod harness the tests drive pods with

import harness  # noqa: E402
from harness import alive, free_port  # noqa: E402
from podkit import config  # noqa: E402


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """harness.wait_for, ending the benchmark with a message rather than a traceback."""
    return harness.wait_for(cond, timeout, interval, f"{what}; see the workspace's logs/", error=SystemExit)


def areal_python() -> str:
    if os.environ.get("AREAL_PYTHON"):
        return os.environ["AREAL_PYTHON"]
    return env_sh(os.environ)[-1]


def env_sh(env, quiet: bool = False) -> list[str]:
    """rehearse/env.sh: builds the AReaL environment where it is missing (pip's output on stderr, or
    only when it fails if `quiet`)."""
    out = subprocess.run(["sh", str(ROOT / "rehearse" / "env.sh")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE if quiet else None, text=True)
    if out.returncode:
        raise SystemExit(f"rehearse/env.sh failed (exit {out.returncode}):\n{(out.stderr or '')[-3000:]}")
    return out.stdout.strip().splitlines()


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


class Pod(harness.Pod):
    """configs/cpu-rehearsal.yaml under `podkit boot` on one workspace; every process it starts carries
    PODKIT_WORKSPACE=<workspace>, which is how `close` finds what supervisord left (by pid)."""

    boot_timeout = 60.0
    error = SystemExit

    def __init__(self, python: str, workspace: Path, log: Path, config_: str = "cpu-rehearsal.yaml") -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        env.update(PODKIT_CONFIG=str(ROOT / "configs" / config_),
                   PODKIT_WORKSPACE=str(workspace), PODKIT_INFERENCE_HOST="127.0.0.1",
                   PODKIT_INFERENCE_PORT=str(port), PODKIT_METRICS_PORT=str(free_port()),
                   PYTHONPATH=str(ROOT / "src"),
                   PYTHONUNBUFFERED="1")
        super().__init__(workspace, port, env, python)
        self.log_path = log
        self.run_path = config.load(environ=self.env).run_path
        self.launched = 0.0

    def boot(self) -> None:
        with open(self.log_path, "ab") as out:
            self.launched = time.time()
            self.launch(out)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def running_pid(self, name: str) -> int:
        info = self.rpc().supervisor.getProcessInfo(name)
        return info["pid"] if info["statename"] == "RUNNING" else 0

    def close(self) -> None:
        """SIGTERM to supervisord (the trainer checkpoints, inference stops), then SIGKILL by pid to
        anything of this workspace still running (what a killed launcher's torchrun may leave)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in harness.pids_of_workspaces([self.workspace]):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def steady(pod: Pod, steps: int) -> dict:
    """From progress.json: launch -> the trainer's first record (AReaL set up) and -> step 1, then the
    median seconds per step after step 1 ({"per": [...]} every interval)."""
    seen: dict[int, float] = {}
    ready = None

    def upto(n: int):
        nonlocal ready
        p = pod.progress()
        if p.get("time"):
            ready = ready or p["time"]
        if p.get("step") and p.get("time"):
            seen.setdefault(p["step"], p["time"])
        return p.get("step", 0) >= n

    wait_for(lambda: upto(1), 600, "step 1 (cold launch)")
    first = min(seen)
    wait_for(lambda: upto(first + steps), 60 + 60 * steps, f"step {first + steps}")
    marks = sorted(seen.items())
    per = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(marks, marks[1:], strict=False)]
    return {"ready": ready - pod.launched, "cold": seen[first] - pod.launched, "step": statistics.median(per),
            "per": per, "first": first, "last": max(seen)}


def fresh_step(pod: Pod, after: float, timeout: float = 300) -> dict:
    """The next step completed after `after` (a full step, not a resumed run's first record)."""
    return wait_for(lambda: (p := pod.progress()).get("time", 0) > after and
                    p.get("step", 0) > (p.get("resumed_at") or 0) and p, timeout, "a fresh step")


def kill_trainer(pod: Pod, step_s: float) -> dict:
    """kill -9 of the launcher at a random moment of a step, until a new trainer completes a step."""
    p = fresh_step(pod, time.time())
    time.sleep(random.uniform(0, step_s))
    launcher = wait_for(lambda: pod.running_pid("trainer"), 60, "the trainer to be RUNNING")  # never 0
    rank0 = p["pid"]
    at = pod.progress().get("step", 0)
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    ready = None

    def stepped():
        # The killed launcher's rank may finish its step before the new launcher stops it: not a recovery.
        nonlocal ready
        q = pod.progress()
        if q.get("pid") == rank0 or q.get("time", 0) <= killed:
            return None
        ready = ready or q["time"]  # the new rank's first record: AReaL set up, checkpoint loaded
        return q.get("step", 0) > (q.get("resumed_at") or 0) and q

    p = wait_for(stepped, 300, "a step by the restarted trainer")
    return {"step": p["time"] - killed, "ready": ready - killed, "at": at,
            "resumed": p.get("resumed_at") or 0}


def restart_inference(pod: Pod) -> dict:
    """stopProcess + startProcess of sglang until the trainer's weights are served again."""
    rank0 = fresh_step(pod, time.time())["pid"]
    t0 = time.time()
    pod.rpc().supervisor.stopProcess("sglang")
    stopped = time.time()
    pod.rpc().supervisor.startProcess("sglang", False)  # no wait for startsecs: /health says when it is up
    health = wait_for(lambda: pod.healthy() and time.time(), 300, "the restarted stand-in's /health", 0.05)
    wait_for(lambda: (v := pod.served()) not in (None, "default")
             and v == pod.progress().get("weight_version"), 300,
             "inference serving the trainer's weights again", interval=0.05)
    served = time.time()
    # A trainer that saw the base weights served stops after the step in flight and restarts, resumes
    # and pushes again: two steps later, either that has happened or it did not see them.
    p1 = fresh_step(pod, served)
    p2 = fresh_step(pod, p1["time"])
    trains = next(p for p in (p1, p2) if p["pid"] != rank0 or p2["pid"] == rank0)
    return {"served": served - t0, "stop": stopped - t0, "health": health - stopped, "push": served - health,
            "restarted": p2["pid"] != rank0, "trains": trains["time"] - t0, "stall": trains["time"] - health}


def build_env() -> tuple[float, int]:
    """rehearse/env.sh into a temporary PODKIT_CACHE_DIR: (seconds, bytes), then removed."""
    cache = Path(tempfile.mkdtemp(prefix="podkit-bench-env-"))
    try:
        t0 = time.perf_counter()
        python = env_sh({**os.environ, "PODKIT_CACHE_DIR": str(cache)}, quiet=True)[-1]
        elapsed = time.perf_counter() - t0
        return elapsed, du(Path(python).parent.parent)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_pod(python: str, ws: Path, args, kill_runs: int, mode: str) -> dict:
    """One pod (trainer.on_inference_restart `mode`): cold launch, steady state, kill -9 runs, inference
    restarts; its figures, printed as they come."""
    pod = Pod(python, ws, ws.parent / f"{ws.name}-boot.log", "smoke.yaml" if args.smoke else "cpu-rehearsal.yaml")
    pod.env["PODKIT_TRAINER_ON_INFERENCE_RESTART"] = mode
    out = {"kills": [], "restarts": [], "trains": [], "stalls": [], "trainer_restarts": 0}
    done = False
    try:
        pod.boot()
        health = wait_for(lambda: pod.healthy() and time.time(), 300, "the stand-in's /health") - pod.launched
        st = steady(pod, args.steps if kill_runs else min(args.steps, 3))
        out.update(cold=st["cold"], step=st["step"])
        print(f"-- trainer.on_inference_restart {mode}")
        print(f"cold launch -> inference /health  {health:6.1f} s")
        print(f"cold launch -> trainer set up     {st['ready']:6.1f} s  (its first progress record)")
        print(f"cold launch -> step 1             {st['cold']:6.1f} s")
        print(f"steady state                      {st['step']:6.2f} s/step  (median of {len(st['per'])} "
              f"intervals, steps {st['first']}-{st['last']}; min {min(st['per']):.2f},"
              f" max {max(st['per']):.2f})")
        for i in range(kill_runs):
            k = kill_trainer(pod, st["step"])
            out["kills"].append(k["step"])
            print(f"kill -9 run {i + 1}: at step {k['at']}, resumed at {k['resumed']}; new trainer set up "
                  f"{k['ready']:.1f} s, next step {k['step']:.1f} s after the kill")
        for i in range(args.runs):
            r = restart_inference(pod)
            out["restarts"].append(r["served"])
            out["trains"].append(r["trains"])
            out["stalls"].append(r["stall"])
            out["trainer_restarts"] += r["restarted"]
            print(f"inference restart run {i + 1}: trainer's weights served {r['served']:.1f} s after "
                  f"stopProcess (stop {r['stop']:.1f} s, start -> /health {r['health']:.1f} s, -> served "
                  f"{r['push']:.1f} s); trainer restarted: {r['restarted']}, its next step "
                  f"{r['trains']:.1f} s after stopProcess, {r['stall']:.1f} s after inference was back")
        done = True
    finally:
        pod.close()
        shutil.rmtree(pod.run_path, ignore_errors=True)
        if not done:
            print(f"kept for its logs: {ws}/logs/ and {pod.log_path}", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="steady-state steps measured after step 1")
    ap.add_argument("--runs", type=int, default=2, help="kill -9 and inference restarts, each")
    ap.add_argument("--workspace", type=Path,
                    help="a new or empty directory, kept (default: a temporary one, removed)")
    ap.add_argument("--env", action="store_true",
                    help="also build the AReaL environment fresh (~3 min, downloads)")
    ap.add_argument("--smoke", action="store_true",
                    help="the smoke stack (fake trainer, stand-in) instead of the real trainer: checks the script")
    args = ap.parse_args()
    if args.steps < 1 or args.runs < 0:
        ap.error("--steps must be >= 1 and --runs >= 0")
    if args.smoke and args.env:
        ap.error("--env measures the AReaL environment, which --smoke does not use")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops what this started
    if args.workspace and any((args.workspace / d).exists() for d in ("areal", ".podkit")):
        ap.error(f"--workspace {args.workspace} holds a previous run (areal/, .podkit/): it would resume, "
                 "not launch cold; pass a new directory")
    tmp = None if args.workspace else Path(tempfile.mkdtemp(prefix="podkit-bench-rehearse-"))
    ws = args.workspace.resolve() if args.workspace else tmp / "ws"
    python = sys.executable if args.smoke else areal_python()
    t0 = time.perf_counter()
    ws.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        r = subprocess.run([python, str(ROOT / "rehearse" / "assets.py"), str(ws / "rehearsal")],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"rehearse/assets.py failed:\n{r.stderr[-3000:]}")
    assets_s = time.perf_counter() - t0
    load = os.getloadavg()[0]
    print("SMOKE STACK (fake trainer, SGLang stand-in): these figures are not the real trainer's"
          if args.smoke else f"AReaL python {python}; tiny model and data built in {assets_s:.1f} s")
    print(f"workspace {ws}; {os.cpu_count()} CPUs, load average {load:.2f} before the boot")
    after = run_pod(python, ws, args, kill_runs=args.runs, mode="reattach")
    before = None
    if args.runs:  # the baseline, in this run: trainer.on_inference_restart restart (what podkit did before)
        base_ws = ws.parent / f"{ws.name}-restart"
        base_ws.mkdir(parents=True, exist_ok=True)
        if (ws / "rehearsal").exists():  # the same tiny model and data
            shutil.copytree(ws / "rehearsal", base_ws / "rehearsal")
        before = run_pod(python, base_ws, args, kill_runs=0, mode="restart")
        if tmp is None:
            print(f"the baseline's workspace, kept: {base_ws}")
    cold, step_s = after["cold"], after["step"]
    kills = after["kills"]
    if kills:
        k = statistics.median(kills)
        print(f"kill -9 -> next step           median {k:6.1f} s (n={len(kills)}, max {max(kills):.1f})")
        print(f"ratio kill-recovery/cold-launch {k / cold:.2f}x (baseline: cold launch -> step 1, this run)")
        print(f"ratio kill-recovery/step        {k / step_s:.1f}x (baseline: steady-state s/step, this run)")
    for label, r in (("reattach (now)", after), ("restart (before)", before)):
        if not r or not r["restarts"]:
            continue
        m, t = statistics.median(r["restarts"]), statistics.median(r["trains"])
        print(f"{label}: inference restart -> served    median {m:6.1f} s (n={len(r['restarts'])}, "
              f"max {max(r['restarts']):.1f}); trainer restarts: {r['trainer_restarts']} of {len(r['restarts'])}")
        print(f"{label}: inference restart -> next step median {t:6.1f} s (max {max(r['trains']):.1f})")
        print(f"{label}: ratio restart->next-step/step        {t / r['step']:.1f}x "
              "(baseline: that pod's steady-state s/step, this run)")
        print(f"{label}: ratio restart->next-step/cold-launch {t / r['cold']:.2f}x "
              "(baseline: that pod's cold launch -> step 1, this run)")
        b = statistics.median(r["stalls"])
        print(f"{label}: inference back (/health) -> next step median {b:6.1f} s (max {max(r['stalls']):.1f}): "
              f"ratio {b / r['step']:.1f}x (baseline: that pod's steady-state s/step; the goal is < 2 steps)")
    if before and before["trains"] and after["trains"]:
        ratio = statistics.median(after["trains"]) / statistics.median(before["trains"])
        print(f"ratio restart->next-step reattach/restart {ratio:.2f}x "
              "(baseline: trainer.on_inference_restart restart, this run)")
    print(f"ratio cold-launch/step {cold / step_s:.1f}x (baseline: steady-state s/step, this run); "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.env:
        env_s, size = build_env()
        ours = du(Path(sys.prefix))
        print(f"AReaL environment fresh build {env_s:6.1f} s, {size / 2**30:.2f} GiB (du -sb)")
        print(f"ratio build/cold-launch {env_s / cold:.1f}x (baseline: cold launch -> step 1, this run)")
        print(f"ratio size/podkit-venv  {size / ours:.1f}x (baseline: podkit's own venv {sys.prefix}, "
              f"{ours / 2**30:.2f} GiB, du -sb)")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
