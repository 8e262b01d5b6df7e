"""The run at a glance: the page of a run with 100,000 steps of history, served over HTTP to a logged-in
browser's request (targets: <= 50 ms and <= 300 KB), against the baseline of `podkit status`'s own read of the
same records (status.collect, in process), in the same run; the ratio is page / status.

    python bench/page.py [--steps 100000] [--runs 21] [--raw] [--flood-seconds 5] [--clients 16] [--no-planted]

The records are a run's as the trainer and the boot leave them: the history appended step by step through
records.HISTORY (its bound compacts it as it goes; the appends are timed too: the trainer pays them), the
progress with a failure, the loop bound's starts and ends, a boot, the logs. No supervisord answers (its
socket is gone) and nothing listens on inference's port: both refuse at once, for the page and the baseline
alike. Each request is a new connection with the session cookie, after one more step was appended (the
page reads what was appended since its last request); doctor's findings are computed first, in the page's
own background thread, as they are by the time a person refreshes. `--raw` writes the history's lines
directly, never compacted (a file past its bound: the page reads its last 2 MiB, ~27,000 lines).

`--flood-seconds N` (default 5; 0: skip) then times, in the same run, a real `podkit run page` (a process of its
own, as supervisord runs it) behind a token over 2,000 steps: the owner's request with the session cookie
one after another, alone (the baseline), while --clients (16) clients post wrong tokens as fast as the page
answers, and while twice as many connections trickle a header line every half second (ratios: each over
alone); then the page drawn in process (Source.page, a core's time) on honest records and on planted ones (a
loop record of 300,000 starts and ends, a 15 MiB watchdog reason and a 15 MiB exception), each beside
`podkit status`'s read of the same records (ratio: planted / honest). `--no-planted`: the flood only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.append(str(ROOT / "tests"))  # harness.py: free ports as the tests take them (never one twice)

from harness import free_port, wait_for  # noqa: E402
from podkit import config, records  # noqa: E402
from podkit.views import page, status  # noqa: E402

TOKEN = "bench-page-token-0123456789abcdef"
FLOOD_TOKEN = "bench-flood-token-5f0c2a9e71d84b36"
STEP_S = 3.0  # a real step's pace: 100,000 steps are ~3.5 days


def workspace(root: Path, steps: int, raw: bool = False) -> tuple[Path, list[float]]:
    """The records of a run `steps` long; returns the workspace and each history append's seconds."""
    ws = root / "ws"
    state, logs = ws / ".podkit", ws / "logs"
    state.mkdir(parents=True)
    logs.mkdir()
    now = time.time()
    start = now - steps * STEP_S - 600  # the last step a few minutes ago
    records.BOOTS.write(state, [{"time": start, "pid": 1, "outcome": "supervisord", "stages": {},
                                 "took_s": {"preflight": 0.2, "reap": 1.1, "sync": 3.4, "setup": 0.1, "render": 0.1}}])
    records.CURRENT.write(state, {"run_dir": str(root / "run"), "socket": str(root / "run" / "gone.sock"),
                                  "supervisord_pid": 1, "started": start + 5,
                                  "inference": {"host": "127.0.0.1", "port": free_port()}})
    rng = random.Random(0)
    took, fail_at = [], steps // 3
    with open(records.HISTORY.path(state), "a") as raw_file:
        for step in range(1, steps + 1):
            t = start + 60 + step * STEP_S + (240 if step > fail_at else 0)
            reward = min(1.0, 0.1 + 0.8 * step / steps + rng.gauss(0, 0.05))
            loss = math.exp(-step / steps) + rng.random() * 0.1
            if raw:
                raw_file.write(json.dumps({"step": step, "time": round(t, 3), "reward": round(reward, 6),
                                           "loss": round(loss, 6)}) + "\n")
                continue
            t0 = time.perf_counter()
            records.HISTORY.append(state, step, reward, loss, now=t)
            took.append(time.perf_counter() - t0)
    last = start + 60 + steps * STEP_S + 240
    records.PROGRESS.write(state, {"kind": "areal", "step": steps, "time": last, "loss": 0.4, "reward": 0.9,
                                   "checkpoint_step": steps - steps % 50, "first_step_time": start + 63,
                                   "code": {"entry": "train.py", "commit": "0123456789abcdef01234567", "dirty": False},
                                   "run": "gsm8k/bench", "stopped": {
                                       "by": "script-error", "time": start + 60 + fail_at * STEP_S, "step": fail_at,
                                       "message": "KeyError: 'question'\n  at train.py:42", "hint": "the data's field"}})
    records.TRAINER_LOOP.write(state, {"boot": start + 5, "started": [start + 20, start + 60 + fail_at * STEP_S + 200],
                                       "ends": [{"time": start + 60 + fail_at * STEP_S, "by": "script-error",
                                                 "family": "failure", "step": fail_at, "what": "KeyError: 'question'",
                                                 "new": True}]})
    for name in ("trainer", "sglang", "watchdog"):
        with open(logs / f"{name}.log", "w") as f:
            for i in range(20_000):
                f.write(f"[2026-11-27 12:00:00] {name} line {i}: step {i} loss 0.{i % 997:03d} and some more words\n")
    return ws, took


def get(port: int, cookie: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/", headers={"Cookie": cookie})
    r = c.getresponse()
    body = r.read()
    c.close()
    return (time.perf_counter() - t0) * 1000, r.status, len(body)


def flood_history(state: Path, steps: int, now: float) -> None:
    with open(records.HISTORY.path(state), "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "time": now - steps * 3 + step * 3, "reward": 0.5, "loss": 1.0}) + "\n")
    records.PROGRESS.write(state, {"kind": "areal", "step": steps, "time": now})


def owner(port: int, cookie: str, seconds: float) -> list[float]:
    """The owner's requests one after another: each one's ms to a 200 (inf: refused or failed)."""
    took, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/", headers={"Cookie": cookie})
            r = c.getresponse()
            r.read()
            c.close()
            ok = r.status == 200
        except OSError:
            ok = False
        took.append((time.perf_counter() - t0) * 1000 if ok else float("inf"))
        time.sleep(0.05)
    return took


def wrong(port: int, stop: threading.Event, sent: list) -> None:
    while not stop.is_set():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/login", "token=wrong-token-0123456789abcdefgh",
                      {"Content-Type": "application/x-www-form-urlencoded"})
            sent.append(c.getresponse().status)
            c.close()
        except OSError:
            sent.append(0)


def trickle(port: int, stop: threading.Event, sent: list) -> None:
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            while not stop.is_set():
                s.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.5)
        except OSError:
            sent.append(0)


def under(attack, port: int, cookie: str, clients: int, seconds: float) -> tuple[list[float], list]:
    stop, sent = threading.Event(), []
    threads = [threading.Thread(target=attack, args=(port, stop, sent), daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    try:
        return owner(port, cookie, seconds), sent
    finally:
        stop.set()
        for t in threads:
            t.join(15)


def line(name: str, took: list[float]) -> str:
    ok = [t for t in took if t != float("inf")]
    if not ok:
        return f"{name:34s} none of {len(took)} served"
    return (f"{name:34s} median {statistics.median(ok):7.1f} ms  max {max(ok):7.1f} ms  served {len(ok)}/{len(took)}")


def planted(root: Path) -> list:
    """Seconds of a core per page, its size, and `podkit status`'s read of the same records (which the page
    calls), on honest records and then on planted ones."""
    out = []
    for kind in ("honest", "planted"):
        ws = root / kind
        state = ws / ".podkit"
        state.mkdir(parents=True)
        now = time.time()
        flood_history(state, records.HISTORY.MAX_LINES, now)
        if kind == "planted":
            huge = "x" * (15 << 20)
            (state / "trainer-loop.json").write_text(json.dumps({
                "boot": now - 50_000, "started": [now - 40_000 + i * 0.1 for i in range(150_000)],
                "ends": [{"time": now - 40_000 + i * 0.2, "by": "script-error", "what": "boom"} for i in range(150_000)]}))
            (state / "watchdog.json").write_text(json.dumps([{"time": now - 100, "action": "restart",
                                                              "program": "trainer", "reason": huge}]))
            records.PROGRESS.write(state, {"kind": "areal", "step": 10_000, "time": now, "stopped": {
                "by": "script-error", "time": now - 5, "step": 9_000, "message": huge}})
        cfg = config.load(None, environ={"PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(root / "run")})
        source = page.Source(cfg, environ={})
        source.page()
        runs, base = [], []
        for _ in range(5):
            t0 = time.process_time()
            body = source.page()
            runs.append(time.process_time() - t0)
            t0 = time.process_time()
            status.collect(ws, state)
            base.append(time.process_time() - t0)
        out += [statistics.median(runs), len(body), statistics.median(base)]
    return out


def flood(args) -> None:
    """The owner under a wrong-token flood and a trickle (baseline: the owner alone), then the page on planted
    records (baseline: honest ones, and status's read of each), all in this run (issue 48)."""
    root = Path(tempfile.mkdtemp(prefix="podkit-bench-flood-"))
    proc = None
    try:
        ws = root / "ws"
        (ws / ".podkit").mkdir(parents=True)
        flood_history(ws / ".podkit", 2000, time.time())
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        env.update({"PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(root / "run"), "PODKIT_PAGE_PORT": str(port),
                    "PODKIT_PAGE_TOKEN": FLOOD_TOKEN, "PODKIT_METRICS_PORT": "0", "PYTHONPATH": str(ROOT / "src")})
        with open(root / "page.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "podkit", "run", "page"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        wait_for(lambda: b"serving the run at a glance" in (root / "page.log").read_bytes(), 60, what="the page")
        cookie = f"{page.COOKIE}={page.Session(FLOOD_TOKEN).cookie()}"
        alone = owner(port, cookie, args.flood_seconds)
        flooded, codes = under(wrong, port, cookie, args.clients, args.flood_seconds)
        slow, _ = under(trickle, port, cookie, args.clients * 2, args.flood_seconds)
        print(line("the owner alone (baseline)", alone))
        print(line(f"the owner, {args.clients} wrong-token clients", flooded)
              + f"  (wrong tries answered: {len(codes)}, {codes.count(429)} of them 429)")
        print(line(f"the owner, {args.clients * 2} trickling connections", slow))
        base = statistics.median([t for t in alone if t != float("inf")])
        for name, took in (("wrong-token flood", flooded), ("trickle", slow)):
            ok = [t for t in took if t != float("inf")]
            print(f"ratio {name}/alone (median) {statistics.median(ok) / base:.2f}x" if ok else f"{name}: none served")
        if args.no_planted:
            return
        honest, hsize, hstatus, bad, bsize, bstatus = planted(root)
        print(f"page on honest records (baseline)  {honest * 1000:7.1f} ms of a core, {hsize / 1024:.0f} KB "
              f"(status's read of them {hstatus * 1000:.1f} ms)")
        print(f"page on planted records            {bad * 1000:7.1f} ms of a core, {bsize / 1024:.0f} KB "
              f"(status's read of them {bstatus * 1000:.1f} ms)")
        print(f"ratio planted/honest {bad / honest:.2f}x; the page's own part (page - status) "
              f"{(honest - hstatus) * 1000:.1f} -> {(bad - bstatus) * 1000:.1f} ms")
        print(json.dumps({"alone_ms": round(base, 1), "flood_max_ms": round(max(flooded), 1),
                          "trickle_max_ms": round(max(slow), 1), "honest_ms": round(honest * 1000, 1),
                          "planted_ms": round(bad * 1000, 1), "planted_kb": round(bsize / 1024, 1)}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        if not os.environ.get("PODKIT_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--raw", action="store_true", help="the history written past its bound, never compacted")
    ap.add_argument("--flood-seconds", type=float, default=5.0, help="each flood's length (0: no flood)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--no-planted", action="store_true", help="the flood only, not the planted records (a page "
                    "before issue 48 takes ~26 s a request on them)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="podkit-bench-page-"))
    try:
        ws, took = workspace(root, args.steps, args.raw)
        hist = records.HISTORY.path(ws / ".podkit")
        print(f"history: {args.steps} steps {'written raw' if args.raw else 'appended'}, "
              f"{len(hist.read_bytes().splitlines())} lines on disk ({hist.stat().st_size / 1024:.0f} KB)"
              + (f"; an append: median {statistics.median(took) * 1e6:.0f} us, max {max(took) * 1000:.1f} ms "
                 "(a compaction)" if took else ""))
        cfg = config.load(None, environ={"PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(root / "run"),
                                         "PODKIT_TRAINER_MAX_STEPS": str(args.steps * 6 // 5)})
        source = page.Source(cfg, environ={"PODKIT_PAGE_TOKEN": TOKEN})
        port = free_port()
        httpd = page.server("127.0.0.1", port, source, TOKEN)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        cookie = f"{page.COOKIE}={page.Session(TOKEN).cookie()}"
        first, code, size = get(port, cookie)
        assert code == 200, code
        wait_for(lambda: source.findings.value is not None, 120, what="doctor's findings")
        times, sizes, state = [], [], ws / ".podkit"
        step, t = args.steps, time.time()
        for _ in range(args.runs):
            step += 1
            if args.raw:  # past its bound, as a writer that never compacts leaves it
                with open(records.HISTORY.path(state), "a") as f:
                    f.write(json.dumps({"step": step, "time": t, "reward": 0.9, "loss": 0.4}) + "\n")
            else:
                records.HISTORY.append(state, step, 0.9, 0.4, now=t)
            ms, code, size = get(port, cookie)
            assert code == 200, code
            times.append(ms)
            sizes.append(size)
        base = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            status.collect(ws, state)
            base.append((time.perf_counter() - t0) * 1000)
        httpd.shutdown()
        body = source.page().decode()
        drawn = [int(n) for n in re.findall(r'data-points="(\d+)"', body)]
        med, b = statistics.median(times), statistics.median(base)
        print(f"page (first request: the whole history read)  {first:7.1f} ms")
        print(f"page                 median {med:7.1f} ms  (min {min(times):.1f}, max {max(times):.1f}, n={args.runs}); "
              f"{max(sizes) / 1024:.1f} KB; points drawn per chart: {drawn}")
        print(f"podkit status's read median {b:7.1f} ms  (min {min(base):.1f}, max {max(base):.1f}, n={args.runs}) "
              "(baseline)")
        print(f"ratio page/status {med / b:.2f}x")
        met = med <= 50 and max(sizes) <= 300 * 1024
        print(f"target: <= 50 ms and <= 300 KB: {'met' if met else 'NOT met'}")
        print(json.dumps({"page_ms": round(med, 1), "first_ms": round(first, 1), "kb": round(max(sizes) / 1024, 1),
                          "status_ms": round(b, 1)}))
    finally:
        if not os.environ.get("PODKIT_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
    if args.flood_seconds > 0:
        flood(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
