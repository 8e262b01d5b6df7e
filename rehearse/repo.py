"""The training repo for `make rehearse REPO=...`: prints the URL podkit's sync stage clones and its ref.

    python rehearse/repo.py REPO OUT_DIR [REF]

A URL, or a path to a bare repository, is printed as it is, with REF (default main). A directory is
rehearsed as its files are now, on the branch main of OUT_DIR/<its name>-<hash of its path>.git (a bare
repository, made again each time; one per directory, so two directories are two repos to the run's identity):
- a git checkout at its own HEAD, whatever branch or tag it is on: that commit itself when nothing is
  changed, else a snapshot commit of its working tree (uncommitted edits and new files that are not
  ignored) whose parent is HEAD, so the run's recorded commit leads back to it; a shallow clone
  (`git clone --depth 1`) too: the bare repository takes its shallow history (receive.shallowUpdate);
- any other directory (examples/my-repo, a tree being edited): one snapshot commit of its files.
Nothing in the directory is changed (the checkout's own index, branches and stashes stay as they are). A
checkout git cannot read is refused in one line, with git's own reason, exit 2.
"""

from __future__ import annotations

import hashlib
import os
import re
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


def bare_for(src: Path, out: Path) -> Path:
    """The bare repository a directory is rehearsed from: one per source path, so that the run's recorded
    repo (its identity, areal/identity.py) tells two directories apart on one workspace, and a checkpoint of
    one is not resumed by the other."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", src.name)[:40] or "repo"
    return out / f"{name}-{hashlib.sha256(str(src).encode()).hexdigest()[:10]}.git"


def snapshot(src: Path, out: Path) -> str:
    bare = bare_for(src, out)
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


def checkout(src: Path, out: Path) -> str:
    """A git checkout as it is: HEAD, or a commit of its working tree on top of HEAD (a throwaway index)."""
    run = lambda *a, **kw: subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True,  # noqa: E731
                                          check=True, timeout=300, **kw).stdout.strip()
    head = run("rev-parse", "HEAD")
    where = run("rev-parse", "--abbrev-ref", "HEAD")
    commit = head
    if run("status", "--porcelain", "--untracked-files=normal"):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index"),
                   "GIT_AUTHOR_NAME": "podkit rehearse", "GIT_AUTHOR_EMAIL": "rehearse@podkit.invalid",
                   "GIT_COMMITTER_NAME": "podkit rehearse", "GIT_COMMITTER_EMAIL": "rehearse@podkit.invalid"}
            run("read-tree", "HEAD", env=env)
            run("add", "-A", env=env)
            tree = run("write-tree", env=env)
            commit = run("commit-tree", tree, "-p", head, "-m",
                         f"rehearsal snapshot of {src} at {head[:12]} ({where}) with its uncommitted changes", env=env)
    bare = bare_for(src, out)
    shutil.rmtree(bare, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "--bare", "-b", "main", str(bare), cwd=out)
    git("config", "receive.shallowUpdate", "true", cwd=bare)  # a shallow clone's history is all it has
    run("push", "-q", str(bare), f"{commit}:refs/heads/main")
    print(f"rehearsing {src} at {head[:12]} ({where})" + (f" with its uncommitted changes as {commit[:12]}"
                                                          if commit != head else ""), file=sys.stderr)
    return str(bare)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    repo, out, ref = argv[0], argv[1], argv[2] if len(argv) == 3 and argv[2] else "main"
    path = Path(repo).expanduser()
    try:
        if path.is_dir() and (path / ".git").exists():
            print(checkout(path.resolve(), Path(out).resolve()), "main")
        elif path.is_dir() and not (path / "HEAD").is_file():
            print(snapshot(path.resolve(), Path(out).resolve()), "main")
        elif path.exists():
            print(path.resolve(), ref)
        else:
            print(repo, ref)
    except subprocess.CalledProcessError as e:  # git's own reason, in one line: never a traceback
        said = (e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")).strip()
        last = said.splitlines()[-1] if said else f"exit {e.returncode}"
        print(f"rehearse: cannot rehearse {path}: `git {' '.join(map(str, e.cmd[1:4]))} ...` says: {last}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
