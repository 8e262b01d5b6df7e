"""s/step of a user's training repo (examples/my-repo, trainer.entry train.py) against podkit's GSM8K
example (no trainer.entry), both through the same bootstrap and hooks, in the same run: each run boots
configs/cpu-rehearsal.yaml on a fresh workspace, alternating A (example) and B (my-repo, synced from a
local bare remote, with rehearse/cpu-overrides on its YAML), and takes the median seconds per step
after the first. The two scripts train different data and rewards with the same tiny model and batch
shape, so the ratio shows what running a user's script costs (it should be ~1: the same hooks).

    python bench/entry.py [--steps 6] [--runs 2] [--smoke]

--smoke boots the smoke stack instead (the fake-data trainer, which runs no script: B only syncs the
repo), in seconds: the suite's check that this script still runs (tests/house/test_bench.py). Its ratio is
not the real trainer's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rehearse import ROOT, Pod, areal_python, steady  # noqa: E402

EXAMPLE = ROOT / "examples" / "my-repo"


def overrides() -> str:
    lines = (ROOT / "rehearse" / "cpu-overrides").read_text().splitlines()
    return " ".join(ln for ln in lines if ln.strip() and not ln.startswith("#"))


def one(python: str, root: Path, name: str, assets: Path | None, repo: str | None, steps: int) -> dict:
    ws = root / name
    ws.mkdir(parents=True)
    if assets:
        shutil.copytree(assets, ws / "rehearsal")
    pod = Pod(python, ws, root / f"{name}-boot.log", "cpu-rehearsal.yaml" if assets else "smoke.yaml")
    if repo:
        pod.env.update(PODKIT_REPO_URL=repo)
    if repo and assets:
        pod.env.update(PODKIT_TRAINER_ENTRY="train.py", PODKIT_TRAINER_AREAL_CONFIG="config.yaml",
                       PODKIT_TRAINER_OVERRIDES=overrides())
    try:
        pod.boot()
        return steady(pod, steps)
    finally:
        pod.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="steps timed after the first")
    ap.add_argument("--runs", type=int, default=2, help="A/B pairs")
    ap.add_argument("--smoke", action="store_true", help="the smoke stack: checks the script, not the trainer")
    args = ap.parse_args()
    python = sys.executable if args.smoke else areal_python()
    root = Path(tempfile.mkdtemp(prefix="podkit-bench-entry-"))
    assets = None if args.smoke else root / "assets"
    if assets:
        r = subprocess.run([python, str(ROOT / "rehearse" / "assets.py"), str(assets)], capture_output=True,
                           text=True)
        if r.returncode:
            raise SystemExit(f"rehearse/assets.py failed:\n{r.stderr[-3000:]}")
    repo = subprocess.run([python, str(ROOT / "rehearse" / "repo.py"), str(EXAMPLE), str(root / "remote")],
                          capture_output=True, text=True, check=True).stdout.split()[0]  # "URL REF": its branch main
    print("SMOKE STACK (fake trainer, SGLang stand-in): the ratio is not the real trainer's" if args.smoke
          else f"AReaL python {python}", f"; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; {root}",
          sep="")
    a, b = [], []
    for i in range(args.runs):
        for label, into, remote in (("example", a, None), ("my-repo", b, repo)):
            t0 = time.time()
            got = one(python, root, f"{label}-{i}", assets, remote, args.steps)
            into.append(got["step"])
            print(f"run {i + 1} {label:<8} cold launch -> step 1 {got['cold']:6.1f} s, "
                  f"{got['step']:.2f} s/step over steps {got['first']}-{got['last']} ({time.time() - t0:.0f} s)")
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"median s/step: example (no trainer.entry) {ma:.2f}, examples/my-repo (trainer.entry) {mb:.2f}; "
          f"ratio my-repo / example = {mb / ma:.2f}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
