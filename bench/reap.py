"""Holder discovery with many processes around: podkit's /proc scan against `lsof FILES` and
`fuser FILES`, in the same run, on stand-in device files (never /dev).

    python bench/reap.py [--idle 500] [--runs 7]

Starts --idle idle processes plus 4 holders (2 by fd, 2 by mmap), checks that all three methods
find the same holder set, prints each median and the ratios (target: lsof/podkit >= 5).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from podkit.host import gpu  # noqa: E402

HOLDER = str(ROOT / "tests" / "holder.py")


def median_time(fn, runs: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="podkit-bench-reap-"))
    files = []
    for i in range(4):
        f = tmp / f"nvidia{i}"
        f.write_bytes(b"\0" * 4096)
        files.append(str(f))
    started: list[subprocess.Popen] = []
    try:
        for _ in range(args.idle):
            started.append(subprocess.Popen(["sleep", "600"]))
        holders = set()
        for i, mode in enumerate(["fd", "fd", "mmap", "mmap"]):
            p = subprocess.Popen([sys.executable, HOLDER, mode, files[i]], stdout=subprocess.PIPE, text=True)
            started.append(p)
            holders.add(int(p.stdout.readline().split("pid: ")[1].split(")")[0]))
        nprocs = len([n for n in os.listdir("/proc") if n.isdigit()])

        def ours():
            return {h.pid for h in gpu.holders(files)[0]}

        def lsof():
            out = subprocess.run(["lsof", "-t", *files], capture_output=True, text=True).stdout
            return {int(x) for x in out.split()}

        def fuser():
            out = subprocess.run(["fuser", *files], capture_output=True, text=True).stdout
            return {int("".join(c for c in tok if c.isdigit())) for tok in out.split()}

        results = {name: median_time(fn, args.runs) for name, fn in
                   (("podkit /proc scan", ours), ("lsof FILES", lsof), ("fuser FILES", fuser))}
        sets = {name: r[1] for name, r in results.items()}
        same = all(s == holders for s in sets.values())
        print(f"{nprocs} processes on the machine, {len(holders)} holders of {len(files)} stand-in device files")
        for name, (t, found) in results.items():
            print(f"{name:<18} median {t * 1000:8.1f} ms  found {len(found)}")
        base = results["podkit /proc scan"][0]
        print(f"ratio lsof/podkit  {results['lsof FILES'][0] / base:.1f}x (target >= 5x)")
        print(f"ratio fuser/podkit {results['fuser FILES'][0] / base:.1f}x")
        print(f"same holder set from all three: {same}")
        return 0 if same else 1
    finally:
        for p in started:
            p.send_signal(signal.SIGKILL)
        for p in started:
            p.wait()


if __name__ == "__main__":
    raise SystemExit(main())
