"""From pod start to first step: each phase of the start-up timeline (`podkit status`'s `startup`), on a
cold workspace (nothing cached: a new volume) against a warm one (the same workspace booted again: the
compile caches, the model and the checkout are there), in the same run. The baseline is the cold start;
the ratio is warm / cold of the time from the boot to the trainer's first step.

    python bench/startup.py [--kind areal|smoke] [--runs 2]

`--kind areal` (the default) boots configs/cpu-rehearsal.yaml: AReaL's real trainer on CPU with the
generating stand-in for SGLang (tiny model), whose first step compiles through inductor and Triton
(caches under <workspace>/cache). `--kind smoke` boots the smoke stack (fake trainer, SGLang's
stand-in): no compile, so it shows podkit's own phases only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rehearse import ROOT, Pod, areal_python, free_port, wait_for  # noqa: E402


def timeline(pod: Pod) -> dict:
    """The start-up timeline once the trainer has made its first step since this boot."""
    def ready():
        r = subprocess.run([pod.python, "-m", "podkit", "status", "--json"], env=pod.env, capture_output=True,
                           text=True, timeout=60)
        try:
            t = json.loads(r.stdout).get("startup") or {}
        except ValueError:
            return None
        return t if t.get("total_s") else None

    return wait_for(ready, 900, "the first step")


def boot(python: str, ws: Path, log: Path, kind: str) -> dict:
    pod = Pod(python, ws, log)
    if kind == "smoke":
        pod.env.update(PODKIT_CONFIG=str(ROOT / "configs" / "smoke.yaml"), PODKIT_METRICS_PORT=str(free_port()),
                       PODKIT_INFERENCE_STARTUP_DELAY_S="0.5", PODKIT_TRAINER_STEP_INTERVAL_S="0.1")
    try:
        pod.boot()
        return timeline(pod)
    finally:
        pod.close()


def show(label: str, t: dict) -> str:
    phases = "  ".join(f"{p['phase']} {p['took_s']:.1f}" for p in t["phases"] if p["took_s"] >= 0.05)
    return f"{label:<5} {t['total_s']:7.1f} s to the first step   ({phases})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("areal", "smoke"), default="areal")
    ap.add_argument("--runs", type=int, default=2, help="cold/warm pairs")
    args = ap.parse_args()
    python = areal_python() if args.kind == "areal" else sys.executable
    root = Path(tempfile.mkdtemp(prefix="podkit-bench-startup-"))
    assets = None
    if args.kind == "areal":
        assets = root / "assets"
        r = subprocess.run([python, str(ROOT / "rehearse" / "assets.py"), str(assets)], capture_output=True,
                           text=True)
        if r.returncode:
            raise SystemExit(f"rehearse/assets.py failed:\n{r.stderr[-3000:]}")
    cold, warm = [], []
    try:
        for i in range(args.runs):
            ws = root / f"ws{i}"
            ws.mkdir()
            if assets:
                shutil.copytree(assets, ws / "rehearsal")
            for label, out in (("cold", cold), ("warm", warm)):  # the warm boot reuses the cold one's workspace
                t = boot(python, ws, root / f"{label}{i}.log", args.kind)
                out.append(t)
                print(show(label, t), flush=True)
    finally:
        if not os.environ.get("PODKIT_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
    c = statistics.median(t["total_s"] for t in cold)
    w = statistics.median(t["total_s"] for t in warm)
    print(f"cold start (baseline) median {c:.1f} s, warm start median {w:.1f} s (n={args.runs} each, {args.kind})")
    print(f"ratio warm/cold {w / c:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
