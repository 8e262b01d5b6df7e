"""The checkpoint remote (checkpoint.remote, issue 49) against a real S3 endpoint on loopback (`rclone serve s3` over a
temporary directory, tests/s3server.py), each figure against a baseline measured in the same run.

    python bench/remote.py [--size-mib 1024] [--runs 3] [--kind smoke|areal] [--seconds 30] [--steps 8] [--every-s 0]

1. Upload: podkit's upload of one checkpoint of --size-mib MiB in 8 files (remote.Remote.upload of a Local: the
   files' sha256 for the manifest, hashed while `rclone copy --checksum` copies them, their stamps compared before
   and after, the manifest) against a bare `rclone copy` of the same files to the same server, in pairs whose
   order alternates (target <= 1.1x). The sha256 pass alone is timed too: what the hashes cost, overlapped.
2. Step time: the trainer's mean step time with the remote on (the log listener's uploader uploading each new
   checkpoint as it trains) against the remote off, pods in alternating order (target <= 1.05x). --kind smoke: the
   fake trainer (configs/smoke.yaml with no sleep between steps, so the step is its own work, and a checkpoint
   every 10 steps, over --seconds of training); --kind areal: AReaL's real trainer on CPU (configs/cpu-rehearsal.yaml,
   a recover checkpoint every step, over --steps steps). The uploading pods run at --every-s
   (checkpoint.remote_every_s; 0, the default here: each checkpoint as soon as it is whole, an upload always
   running); the trainer's time lost per upload is printed, and what it comes to at the setting's default of 60 s.
   The loopback server stands for another machine: it runs at the lowest priority, so its CPU is not the pod's.
3. Restore: boot to the first step on an empty workspace that restores the run's checkpoint from the remote,
   against the same run's warm volume booted again (its checkpoint there, nothing to restore): the start-up
   timeline of `podkit status` (bench/startup.py), with the restore phase. --kind areal shares one compile cache
   among all its pods (outside the workspaces), so the two differ by the checkpoint, not by the compiles.

Uploads and restores go through the pods' own programs (the log listener's uploader, the boot's restore stage).
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from podkit.remote import mover, remote  # noqa: E402
from rehearse import ROOT, Pod, areal_python, free_port, wait_for  # noqa: E402  (src/ and tests/ on the path)
from s3server import Server  # noqa: E402
from startup import show, timeline  # noqa: E402

BUCKET = "bench"
FIRST_GEN_S = 120  # the first pod's wait for a first checkpoint, then for its first generation (seconds now)


# -- 1. upload ------------------------------------------------------------------------------------------------------
class Timed(remote.Remote):
    """remote.Remote, its rclone calls timed by verb (the breakdown of an upload)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.took: dict[str, float] = {}

    def rclone(self, *args: str, timeout: float | None = None) -> bytes:
        t = time.monotonic()
        try:
            return super().rclone(*args, timeout=timeout)
        finally:
            self.took[args[0]] = self.took.get(args[0], 0.0) + time.monotonic() - t


def checkpoint_files(root: Path, size: int, files: int = 8) -> list[str]:
    """`files` files of random bytes (as a DCP save's shards), `size` bytes in all."""
    root.mkdir(parents=True)
    names = [f"__{i}_0.distcp" for i in range(files)]
    for name in names:
        with open(root / name, "wb") as f:
            for _ in range(size // files >> 20):
                f.write(os.urandom(1 << 20))
    return names


def upload(server: Server, root: Path, size_mib: int, runs: int) -> None:
    src = root / "ckpt"
    names = checkpoint_files(src, size_mib << 20)
    env = remote.environment(f"s3://{BUCKET}/x", {**os.environ, **server.env(BUCKET)})
    t0 = time.monotonic()
    remote.hashes(src, names)
    hashed = time.monotonic() - t0
    ours, bare, parts = [], [], []
    for i in range(runs):
        rem = Timed(f"s3://{BUCKET}/podkit", f"up{i}/t", environ=env)

        def podkit_upload(i=i, rem=rem) -> float:
            t = time.monotonic()
            rem.upload(remote.Local("fake", src, i + 1, names, None))
            took = time.monotonic() - t
            parts.append((took, {**rem.took, "the rest (hashes past the copy, stamps)": took - sum(rem.took.values())}))
            return took

        def bare_copy(i=i) -> float:
            t = time.monotonic()
            subprocess.run([mover.binary(), "copy", str(src), f"{remote.S3_NAME}:{BUCKET}/bare{i}"], env=env,
                           check=True, stdin=subprocess.DEVNULL)
            return time.monotonic() - t

        for label, fn, out in (("podkit", podkit_upload, ours), ("bare", bare_copy, bare))[::1 if i % 2 == 0 else -1]:
            os.sync()  # the previous upload's writes on the server's disk are not this one's to pay
            out.append(fn())
            print(f"run {i}: {label:<6} {out[-1]:6.2f} s", flush=True)
        for d in (server.root / BUCKET).iterdir():  # outside the timing: the disk is not filled run after run
            shutil.rmtree(d, ignore_errors=True)
    a, b = statistics.median(ours), statistics.median(bare)
    mib = size_mib
    print(f"upload of {mib} MiB in 8 files, podkit Remote.upload   median {a:6.2f} s ({mib / a:6.1f} MiB/s; min "
          f"{min(ours):.2f}, max {max(ours):.2f}, n={runs})")
    print(f"bare `rclone copy` (baseline)             median {b:6.2f} s ({mib / b:6.1f} MiB/s; min {min(bare):.2f}, "
          f"max {max(bare):.2f}, n={runs})")
    print(f"the files' sha256 alone                          {hashed:6.2f} s (one pass, for the breakdown)")
    mid = sorted(parts, key=lambda p: p[0])[len(parts) // 2][1]
    print("podkit's median upload: " + ", ".join(f"{k} {v:.2f} s" for k, v in mid.items()))
    print(f"ratio podkit/bare {a / b:.3f}x (target <= 1.1x)", flush=True)


# -- pods ------------------------------------------------------------------------------------------------------------
def pod_for(kind: str, python: str, ws: Path, log: Path, assets: Path | None, env: dict[str, str]) -> Pod:
    pod = Pod(python, ws, log)
    if kind == "smoke":
        pod.env.update(PODKIT_CONFIG=str(ROOT / "configs" / "smoke.yaml"), PODKIT_METRICS_PORT=str(free_port()),
                       PODKIT_INFERENCE_STARTUP_DELAY_S="0.5", PODKIT_TRAINER_STEP_INTERVAL_S="0",
                       PODKIT_TRAINER_CHECKPOINT_EVERY="10")
    else:  # one Inductor/Triton cache for every pod of the run, as the tests share one: each pod's first steps
        # do not compile again, and an empty workspace differs from a warm one by its checkpoint, not its compiles
        cache = ws.parent / "compile-cache"
        pod.env.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
        if assets and not (ws / "rehearsal").exists():
            shutil.copytree(assets, ws / "rehearsal")
    pod.env.update(PODKIT_PAGE_PORT=str(free_port()), **env)
    return pod


def history(pod: Pod) -> list[tuple[int, float]]:
    try:
        lines = (pod.state / "history.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            rec = json.loads(ln)
            out.append((rec["step"], rec["time"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def uploads(pod: Pod) -> int:
    """Generations this pod's uploader made (its lines in the pod's output)."""
    return pod.log_path.read_text(errors="replace").count("[podkit:remote] checkpoint of step")


# -- 2. step time with uploads running ------------------------------------------------------------------------------
def step_time(kind: str, python: str, ws: Path, log: Path, assets, env, seconds: float, steps: int) -> tuple[float, int]:
    """The mean seconds per step over the window (after a warm-up), and the uploads made by then."""
    pod = pod_for(kind, python, ws, log, assets, env)
    try:
        pod.boot()
        warm = 20 if kind == "smoke" else 2
        wait_for(lambda: pod.progress().get("step", 0) >= warm, 600, f"step {warm}")
        start, before = pod.progress()["step"], uploads(pod)
        t0 = time.monotonic()
        if kind == "smoke":
            time.sleep(seconds)
        else:
            wait_for(lambda: pod.progress().get("step", 0) >= start + steps, 120 + 60 * steps, f"step {start + steps}")
        marks = [(s, t) for s, t in history(pod) if s >= start]
        (s1, t1), (s2, t2) = marks[0], marks[-1]
        return (t2 - t1) / (s2 - s1), uploads(pod) - before, time.monotonic() - t0
    finally:
        pod.close()


def steps(kind, python, root, assets, server, runs, seconds, n, every_s) -> None:
    # the loopback server stands for a machine elsewhere: at the lowest priority, its own CPU is not the pod's
    server.kill()
    server.nice = mover.NICE
    server.start()
    on, off, made, windows = [], [], [], []
    for i in range(runs):
        on_env = {**server.env(BUCKET, f"steps{i}"), "PODKIT_CHECKPOINT_REMOTE_POLL_S": "0.5",
                  "PODKIT_CHECKPOINT_REMOTE_EVERY_S": str(every_s)}  # a prefix of its own: nothing to restore
        for label in (("on", "off") if i % 2 == 0 else ("off", "on")):
            ws = root / f"steps-{label}{i}"
            t, ups, window = step_time(kind, python, ws, root / f"steps-{label}{i}.log", assets,
                                       on_env if label == "on" else {}, seconds, n)
            (on if label == "on" else off).append(t)
            if label == "on":
                made.append(ups)
                windows.append(window)
            print(f"run {i}: remote {label:<3} {t * 1000:8.1f} ms a step" +
                  (f" ({ups} uploads in {window:.0f} s)" if label == "on" else ""), flush=True)
            shutil.rmtree(ws, ignore_errors=True)
    a, b = statistics.median(on), statistics.median(off)
    print(f"step time, uploads running  median {a * 1000:8.1f} ms ({kind}, checkpoint.remote_every_s {every_s:g}; "
          f"uploads per window {made})")
    print(f"step time, no remote (baseline) median {b * 1000:8.1f} ms (n={runs} each)")
    print(f"ratio with/without uploads {a / b:.3f}x (target <= 1.05x)", flush=True)
    if sum(made) and a > b:
        # the trainer's seconds lost per upload: its slowdown over the windows, shared by their uploads
        lost = (a / b - 1) * statistics.median(windows) / statistics.median(made)
        print(f"the trainer's time lost per upload ~{lost:.2f} s: at one upload a minute (checkpoint.remote_every_s "
              f"60, the default) ~{1 + lost / 60:.3f}x", flush=True)
    server.kill()
    server.nice = 0
    server.start()


# -- 3. restore to the first step -----------------------------------------------------------------------------------
def restore(kind, python, root, assets, server, runs) -> None:
    env = {**server.env(BUCKET, "restore"), "PODKIT_CHECKPOINT_REMOTE_POLL_S": "0.5"}
    volume = root / "restore-volume"
    pod = pod_for(kind, python, volume, root / "restore-first.log", assets, env)
    try:  # the run's first pod: trains until a generation of it is on the remote
        t0 = time.monotonic()
        pod.boot()
        saved = wait_for(lambda: pod.progress().get("checkpoint_step") and time.monotonic(), FIRST_GEN_S,
                         "a first checkpoint")
        wait_for(lambda: list((server.root / BUCKET / "restore").rglob(remote.MANIFEST)), FIRST_GEN_S,
                 "a generation uploaded")
        print(f"first generation on the remote {time.monotonic() - saved:.1f} s after the first checkpoint "
              f"({time.monotonic() - t0:.1f} s after the boot)", flush=True)
    finally:
        pod.close()
    empty, warm = [], []
    for i in range(runs):
        for label in (("empty", "warm") if i % 2 == 0 else ("warm", "empty")):
            ws = volume if label == "warm" else root / f"restore-empty{i}"
            p = pod_for(kind, python, ws, root / f"restore-{label}{i}.log", assets, env)
            try:
                p.boot()
                t = timeline(p)
            finally:
                p.close()
            (empty if label == "empty" else warm).append(t["total_s"])
            took = next((ph["took_s"] for ph in t["phases"] if ph["phase"] == "restore"), 0.0)
            print(f"run {i}: " + show(label, t) + f"  restore {took:.2f} s", flush=True)
            if label == "empty":
                shutil.rmtree(ws, ignore_errors=True)
    a, b = statistics.median(empty), statistics.median(warm)
    print(f"empty workspace, restored from the remote  median {a:6.1f} s to the first step ({kind})")
    print(f"warm volume (baseline)                      median {b:6.1f} s (n={runs} each)")
    print(f"ratio empty/warm {a / b:.2f}x", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="the uploaded checkpoint's size")
    ap.add_argument("--runs", type=int, default=3, help="pairs of each comparison")
    ap.add_argument("--kind", choices=("smoke", "areal"), default="smoke", help="the trainer of parts 2 and 3")
    ap.add_argument("--seconds", type=float, default=30, help="smoke: the step-time window of each pod")
    ap.add_argument("--steps", type=int, default=8, help="areal: the step-time window of each pod")
    ap.add_argument("--every-s", type=float, default=0.0, help="checkpoint.remote_every_s of the pods with uploads "
                    "(0: each checkpoint as soon as it is whole, the most uploads)")
    ap.add_argument("--only", choices=("upload", "steps", "restore"), action="append", help="parts to run (all)")
    args = ap.parse_args()
    parts = args.only or ["upload", "steps", "restore"]
    python = areal_python() if args.kind == "areal" else sys.executable
    root = Path(tempfile.mkdtemp(prefix="podkit-bench-remote-"))
    server = Server(root / "s3", [BUCKET])
    try:
        server.start()
        assets = None
        if args.kind == "areal" and parts != ["upload"]:
            assets = root / "assets"
            r = subprocess.run([python, str(ROOT / "rehearse" / "assets.py"), str(assets)], capture_output=True,
                               text=True)
            if r.returncode:
                raise SystemExit(f"rehearse/assets.py failed:\n{r.stderr[-3000:]}")
        if "upload" in parts:
            upload(server, root, args.size_mib, args.runs)
        if "steps" in parts:
            steps(args.kind, python, root, assets, server, args.runs, args.seconds, args.steps, args.every_s)
        if "restore" in parts:
            restore(args.kind, python, root, assets, server, args.runs)
    finally:
        server.kill()
        if not os.environ.get("PODKIT_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
