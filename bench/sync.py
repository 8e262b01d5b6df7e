"""Sync costs against plain git, in the same run, on local bare repositories.

    python bench/sync.py [--commits 3000] [--runs 7]

1. No-op sync (DEST already at REF) against a bare `git fetch origin main` of the same checkout
   (target <= 1.2x). The sync runs in-process, as it does inside `podkit boot`.
2. First sync (shallow, depth 1) against a full `git clone` of a repo with --commits commits.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from podkit import log  # noqa: E402
from podkit.boot import sync  # noqa: E402

ENV = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
           GIT_COMMITTER_EMAIL="b@b")


def git(*args, cwd=None, stdin=None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=ENV, input=stdin, capture_output=True, check=True,
                          text=True).stdout


def make_repo(root: Path, commits: int) -> Path:
    """A bare repo with `commits` commits touching a few files, via fast-import (seconds, not minutes)."""
    bare = root / "big.git"
    git("init", "-q", "--bare", "-b", "main", str(bare))
    lines = []
    for i in range(1, commits + 1):
        body = f"step = {i}\n" + "x" * (i % 200) + "\n"
        lines += ["commit refs/heads/main", f"mark :{i}", f"committer b <b@b> {1700000000 + i} +0000",
                  f"data {len(f'c{i}')}", f"c{i}"]
        if i > 1:
            lines.append(f"from :{i - 1}")
        lines += [f"M 644 inline src/file{i % 50}.py", f"data {len(body)}", body]
    git("fast-import", "--quiet", cwd=bare, stdin="\n".join(lines) + "\n")
    return bare


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commits", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    log.set_level("warning")
    tmp = Path(tempfile.mkdtemp(prefix="podkit-bench-sync-"))
    bare = make_repo(tmp, args.commits)
    dest = tmp / "repo"
    sync.update(str(bare), "main", dest)

    noop = timed(lambda: sync.update(str(bare), "main", dest), args.runs)
    fetch = timed(lambda: git("fetch", "-q", "origin", "main", cwd=dest), args.runs)
    print(f"no-op sync        median {noop * 1000:7.1f} ms")
    print(f"bare git fetch    median {fetch * 1000:7.1f} ms")
    print(f"ratio no-op/fetch {noop / fetch:.2f}x (target <= 1.2x)")

    def first_sync():
        d = tmp / "first"
        shutil.rmtree(d, ignore_errors=True)
        sync.update(f"file://{bare}", "main", d)

    def full_clone():
        d = tmp / "full"
        shutil.rmtree(d, ignore_errors=True)
        git("clone", "-q", f"file://{bare}", str(d))

    shallow = timed(first_sync, max(3, args.runs // 2))
    full = timed(full_clone, max(3, args.runs // 2))
    print(f"first sync (depth 1)  median {shallow * 1000:7.1f} ms")
    print(f"full clone ({args.commits} commits) median {full * 1000:7.1f} ms")
    print(f"ratio full/shallow {full / shallow:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
