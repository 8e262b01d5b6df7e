"""The training repo for `make rehearse REPO=...`: prints the URL podkit's sync stage clones.

    python rehearse/repo.py REPO OUT_DIR

A URL (or a path to a git repository) is printed as it is. A directory that is not the top of a git
repository (examples/my-repo, a tree being edited) is rehearsed as its files are now: they are
committed, as one snapshot, to the branch main of OUT_DIR/repo.git (a bare repository, made again
each time), whose path is printed. Nothing in the directory is changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "workspace")


def git(*args: str, cwd: Path) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "podkit rehearse", "GIT_AUTHOR_EMAIL": "rehearse@podkit.invalid",
           "GIT_COMMITTER_NAME": "podkit rehearse", "GIT_COMMITTER_EMAIL": "rehearse@podkit.invalid"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=120)


def snapshot(src: Path, out: Path) -> str:
    bare = out / "repo.git"
    shutil.rmtree(bare, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "--bare", "-b", "main", str(bare), cwd=out)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(src, tree, ignore=SKIP, symlinks=True)
        git("init", "-q", "-b", "main", cwd=tree)
        git("add", "-A", cwd=tree)
        git("commit", "-q", "-m", f"rehearsal snapshot of {src}", cwd=tree)
        git("push", "-q", str(bare), "main", cwd=tree)
    return str(bare)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    repo, out = argv
    path = Path(repo).expanduser()
    if path.is_dir() and not (path / ".git").exists() and not (path / "HEAD").is_file():
        print(snapshot(path.resolve(), Path(out).resolve()))
    elif path.exists():
        print(path.resolve())
    else:
        print(repo)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
