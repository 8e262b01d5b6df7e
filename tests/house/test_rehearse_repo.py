"""`make rehearse REPO=<path>` trains the path as it is (rehearse/repo.py): a git checkout at its own HEAD on
its own branch, with its uncommitted edits and new files, never its ignored ones; the checkout itself is
left as it was. REF is for a URL."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(60)


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=30).stdout.strip()


def repo_py(*args: str) -> tuple[str, str, str]:
    r = subprocess.run([sys.executable, str(ROOT / "rehearse" / "repo.py"), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    url, ref = r.stdout.split()
    return url, ref, r.stderr


def test_a_checkout_on_a_feature_branch_rehearses_its_head_with_its_uncommitted_edit(tmp_path):
    co = tmp_path / "AReaL"
    co.mkdir()
    git("init", "-q", "-b", "main", cwd=co)
    git("config", "user.email", "me@example.invalid", cwd=co)
    git("config", "user.name", "me", cwd=co)
    (co / "train.py").write_text("main\n")
    (co / ".gitignore").write_text("*.log\n")
    git("add", "-A", cwd=co)
    git("commit", "-qm", "main", cwd=co)
    git("checkout", "-qb", "feature", cwd=co)
    (co / "train.py").write_text("feature\n")
    git("commit", "-qam", "feature", cwd=co)
    head = git("rev-parse", "HEAD", cwd=co)
    (co / "train.py").write_text("feature, edited\n")  # not committed
    (co / "reward.py").write_text("new\n")             # not added
    (co / "run.log").write_text("ignored\n")
    before = git("status", "--porcelain", cwd=co)
    url, ref, said = repo_py(str(co), str(tmp_path / "out"), "main")
    assert ref == "main" and f"at {head[:12]} (feature) with its uncommitted changes" in said, said
    assert git("show", "main:train.py", cwd=url) == "feature, edited"
    assert git("ls-tree", "--name-only", "main", cwd=url).split() == [".gitignore", "reward.py", "train.py"]
    assert git("rev-parse", "main^", cwd=url) == head  # the run's commit leads back to the checkout's HEAD
    assert git("status", "--porcelain", cwd=co) == before and git("rev-parse", "--abbrev-ref", "HEAD", cwd=co) == \
        "feature"
    # Clean: the checkout's own commit, as it is.
    git("checkout", "-q", "--", "train.py", cwd=co)
    (co / "reward.py").unlink()
    url, _, _ = repo_py(str(co), str(tmp_path / "out"))
    assert git("rev-parse", "main", cwd=url) == head


def test_a_url_takes_ref_and_a_plain_directory_is_one_snapshot(tmp_path):
    assert repo_py("https://example.invalid/me/r.git", str(tmp_path / "out"), "v2")[:2] == \
        ("https://example.invalid/me/r.git", "v2")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "train.py").write_text("x\n")
    url, ref, _ = repo_py(str(tmp_path / "tree"), str(tmp_path / "out"), "v2")
    assert ref == "main" and git("show", "main:train.py", cwd=url) == "x"


def test_two_directories_rehearsed_on_one_workspace_are_two_repos_and_one_is_always_the_same(tmp_path):
    """Every directory was rehearsed from OUT_DIR/repo.git: to the run's identity (areal/identity.py compares the
    repo) two different repos on one workspace were one, and one resumed the other's checkpoint. Each directory
    has its own bare repository now, the same one each time."""
    from podkit.areal.identity import repo_of

    urls = {}
    for name in ("mine", "theirs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(f"{name}\n")
        urls[name] = repo_py(str(tmp_path / name), str(tmp_path / "out"))[0]
    assert repo_of(urls["mine"]) != repo_of(urls["theirs"]), urls
    assert repo_py(str(tmp_path / "mine"), str(tmp_path / "out"))[0] == urls["mine"]
    assert git("show", "main:train.py", cwd=urls["theirs"]) == "theirs"


def test_a_shallow_clone_rehearses_its_head_and_its_edit_and_one_git_cannot_read_is_refused_in_one_line(tmp_path):
    """`git clone --depth 1` was refused by the bare repository ("shallow update not allowed") with a traceback:
    it rehearses now, and the sync stage can clone what it made. A checkout git cannot read says why, in one
    line, without a traceback (the make target stops on it)."""
    src = tmp_path / "src"
    src.mkdir()
    git("init", "-q", "-b", "main", cwd=src)
    for n in range(3):
        (src / "train.py").write_text(f"v{n}\n")
        git("add", "-A", cwd=src)
        git("-c", "user.name=me", "-c", "user.email=me@example.invalid", "commit", "-qm", f"v{n}", cwd=src)
    shallow = tmp_path / "shallow"
    git("clone", "-q", "--depth", "1", f"file://{src}", str(shallow), cwd=tmp_path)
    assert git("rev-parse", "--is-shallow-repository", cwd=shallow) == "true"
    (shallow / "train.py").write_text("mine\n")
    url, ref, said = repo_py(str(shallow), str(tmp_path / "out"))
    clone = tmp_path / "clone"
    git("clone", "-q", "-b", ref, url, str(clone), cwd=tmp_path)  # as the sync stage clones it
    assert (clone / "train.py").read_text() == "mine\n" and "with its uncommitted changes" in said, said
    broken = tmp_path / "broken"
    (broken / ".git").mkdir(parents=True)  # a .git with nothing in it
    r = subprocess.run([sys.executable, str(ROOT / "rehearse" / "repo.py"), str(broken), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"rehearse: cannot rehearse {broken}: `git ") and len(r.stderr.splitlines()) == 1, \
        r.stderr
