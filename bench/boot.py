"""Boot overhead: `podkit boot` (smoke config) until supervisord accepts commands, against a bare
`supervisord` started with the same supervisord.conf and environment, in the same run.

    python bench/boot.py [--runs N]

Prints each median and the ratio podkit/bare (target <= 1.5). Both runs end as soon as supervisord
answers getState over its unix socket; the programs' own start-up is not part of the figure.
`--cold` clears podkit's config parse cache before each run (a first boot or an edited config).
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
import xmlrpc.client
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.append(str(ROOT / "tests"))  # harness.py: free ports as the tests take them

from harness import free_port  # noqa: E402
from podkit import config, records  # noqa: E402
from podkit.boot import boot, render  # noqa: E402
from podkit.host.supervisord import rpc  # noqa: E402


def wait_accepting(sock: Path, p: subprocess.Popen, timeout: float = 30) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            rpc(sock).supervisor.getState()
            return
        except (OSError, xmlrpc.client.Error):
            time.sleep(0.002)
    stop(p)  # never leave a boot behind (one waiting in safe mode answers nothing)
    raise SystemExit(f"supervisord did not answer on {sock} within {timeout:.0f}s; see the workspace's logs")


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(30)


def timed(argv, env, sock: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_accepting(sock, p)
    elapsed = time.perf_counter() - t0
    stop(p)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true", help="clear the config parse cache before each podkit boot "
                    "(a first boot, or an edited config)")
    args = ap.parse_args()
    # Byte-compile podkit as `pip install` does in the image: an editable install under
    # PYTHONDONTWRITEBYTECODE would otherwise recompile every module on every start.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "src" / "podkit")], check=True)
    ws = Path(tempfile.mkdtemp(prefix="podkit-bench-boot-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    # Every run boots the same workspace in quick succession: that is a boot storm to the crash-loop
    # guard, which would hold the sixth boot in safe mode. The bench measures boots, not the guard.
    env.update(PODKIT_CONFIG=str(ROOT / "configs" / "smoke.yaml"), PODKIT_WORKSPACE=str(ws),
               PODKIT_INFERENCE_PORT=str(free_port()), PODKIT_METRICS_PORT=str(free_port()),
               PODKIT_GUARD_MAX_BOOTS=str(2 * args.runs + 10))
    cfg = config.load(environ=env)
    (ws / "logs").mkdir(parents=True, exist_ok=True)
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    bare_env = render.environment(cfg, base=env)
    bare_argv = boot.supervisord_argv(bare_env)
    podkit_argv = [str(Path(sys.executable).with_name("podkit")), "boot"]  # as /entrypoint runs it
    results: dict[str, list[float]] = {"podkit boot": [], "bare supervisord": []}
    timed(bare_argv, bare_env, cfg.socket_path)  # warm the page cache for both
    cache = records.CONFIG_CACHE.path(ws / ".podkit")
    for _ in range(args.runs):
        if args.cold:
            cache.unlink(missing_ok=True)
        results["podkit boot"].append(timed(podkit_argv, env, cfg.socket_path))
        results["bare supervisord"].append(timed(bare_argv, bare_env, cfg.socket_path))
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:<17} median {med[k] * 1000:7.1f} ms  (min {min(v) * 1000:.1f}, max {max(v) * 1000:.1f}, "
              f"n={len(v)})")
    ratio = med["podkit boot"] / med["bare supervisord"]
    print(f"ratio podkit/bare {ratio:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
