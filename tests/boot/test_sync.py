"""The sync stage with real git and local bare repositories as remotes: every case ends in a usable
checkout or a clear error, and nothing a user wrote is lost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import PODKIT, wait_for
from gitserver import HTTPRemote, Remote, git
from podkit.areal import identity
from podkit.boot import sync
from podkit.boot.sync import SyncError

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def remote(tmp_path):
    r = Remote(tmp_path)
    r.commit("train.py", "print('v1')\n")
    r.commit(n=2)
    return r


def do_sync(remote_url, dest, **kw):
    kw.setdefault("retries", 1)
    kw.setdefault("backoff_s", 0.05)
    kw.setdefault("timeout_s", 20)
    return sync.update(remote_url, kw.pop("ref", "main"), dest, **kw)


def test_missing_dest_is_cloned_shallow(remote, tmp_path):
    """No checkout yet: a shallow clone at REF, mode cloned."""
    dest = tmp_path / "repo"
    r = do_sync(remote.url, dest)
    assert (r.mode, r.changed, r.old, r.new) == ("cloned", True, None, remote.head())
    assert git("rev-parse", "HEAD", cwd=dest) == remote.head()
    assert git("rev-list", "--count", "HEAD", cwd=dest) == "1", "default depth is 1"
    assert git("symbolic-ref", "--short", "HEAD", cwd=dest) == "main"


def test_sync_at_ref_twice_is_a_noop(remote, tmp_path):
    """Boot twice: the second sync changes nothing."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    r = do_sync(remote.url, dest)
    assert (r.mode, r.changed, r.old, r.new) == ("unchanged", False, remote.head(), remote.head())


def test_new_remote_commit_is_fetched_and_checked_out(remote, tmp_path):
    """DEST a clone of URL: fetch and move to REF; the result names old and new."""
    dest = tmp_path / "repo"
    old = do_sync(remote.url, dest).new
    new = remote.commit()
    r = do_sync(remote.url, dest)
    assert (r.mode, r.changed, r.old, r.new) == ("updated", True, old, new)
    assert git("rev-parse", "HEAD", cwd=dest) == new


def test_uncommitted_changes_are_stashed_with_a_name_and_can_be_restored(remote, tmp_path):
    """Edits to tracked files are stashed (named, timestamped), never lost; the tree moves to REF."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / "train.py").write_text("print('my experiment')\n")
    new = remote.commit("other.py", "x = 1\n")
    r = do_sync(remote.url, dest)
    assert r.mode == "updated" and git("rev-parse", "HEAD", cwd=dest) == new
    assert any("stashed as 'podkit-sync-" in n for n in r.notes)
    stash = git("stash", "list", cwd=dest)
    assert "podkit-sync-" in stash
    git("stash", "pop", cwd=dest)
    assert (dest / "train.py").read_text() == "print('my experiment')\n"


def test_uncommitted_changes_at_ref_are_left_in_place(remote, tmp_path):
    """Nothing new upstream: a boot leaves the user's edits as they are (no stash, no checkout)."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / "train.py").write_text("print('tuned on the pod')\n")
    r = do_sync(remote.url, dest)
    assert r.mode == "unchanged" and (dest / "train.py").read_text() == "print('tuned on the pod')\n"
    assert git("stash", "list", cwd=dest) == ""


def test_untracked_files_stay_where_they_are(remote, tmp_path):
    """Untracked files (outputs, notes) are left in the tree untouched."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / "notes.txt").write_text("keep me\n")
    remote.commit()
    assert do_sync(remote.url, dest).mode == "updated"
    assert (dest / "notes.txt").read_text() == "keep me\n"


def test_local_commits_are_kept_on_a_backup_branch(remote, tmp_path):
    """A commit made on the pod and not on the remote survives on podkit/backup-<time>."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / "mine.py").write_text("y = 2\n")
    git("add", "mine.py", cwd=dest)
    git("commit", "-q", "-m", "local work", cwd=dest)
    mine = git("rev-parse", "HEAD", cwd=dest)
    remote.commit()
    r = do_sync(remote.url, dest)
    branches = git("branch", "--list", "podkit/backup-*", "--format=%(refname:short) %(objectname)", cwd=dest)
    assert branches.split()[1] == mine
    assert any("local commits kept on branch podkit/backup-" in n for n in r.notes)


def test_a_directory_that_is_not_a_repo_is_moved_aside_and_recloned(remote, tmp_path):
    """DEST exists without .git: moved to DEST.broken-<time> with its content, then cloned."""
    dest = tmp_path / "repo"
    dest.mkdir()
    (dest / "precious.txt").write_text("do not delete\n")
    r = do_sync(remote.url, dest)
    assert r.mode == "recovered" and git("rev-parse", "HEAD", cwd=dest) == remote.head()
    aside = list(tmp_path.glob("repo.broken-*"))
    assert len(aside) == 1 and (aside[0] / "precious.txt").read_text() == "do not delete\n"
    assert not list(tmp_path.glob("repo.other-*")), "not a repo at all: broken, not another repo"


def test_an_empty_directory_such_as_a_mount_point_is_cloned_into(remote, tmp_path):
    """An empty DEST is not 'broken': clone into it."""
    dest = tmp_path / "repo"
    dest.mkdir()
    assert do_sync(remote.url, dest).mode == "cloned"
    assert not list(tmp_path.glob("repo.broken-*"))


def test_a_clone_of_another_repo_is_moved_aside_as_other_and_kept(remote, tmp_path):
    """DEST is a checkout of some other repository: not broken, the user's work. It is moved aside as
    DEST.other-<time> with its files and history, the note names the repo it is a clone of, and URL is
    cloned fresh."""
    other = Remote(tmp_path, "other.git")
    theirs = other.commit("other.py", "z = 3\n")
    dest = tmp_path / "repo"
    git("clone", "-q", other.url, str(dest))
    (dest / "wip.txt").write_text("my work on the other repo\n")
    r = do_sync(remote.url, dest)
    assert r.mode == "recovered" and git("rev-parse", "HEAD", cwd=dest) == remote.head()
    (aside,) = tmp_path.glob("repo.other-*")
    assert not list(tmp_path.glob("repo.broken-*"))
    assert (aside / "other.py").read_text() == "z = 3\n" and (aside / "wip.txt").read_text() == \
        "my work on the other repo\n"
    assert git("rev-parse", "HEAD", cwd=aside) == theirs
    (note,) = [n for n in r.notes if str(aside) in n]
    assert f"is a clone of another repo ({other.url})" in note and "kept, nothing deleted" in note, note


def test_one_repo_is_one_repo_in_every_url_form(tmp_path):
    """https, http, ssh://, git+ssh, scp-like, with credentials, a port, '.git', a trailing '/' or
    another case of the host: one repo. Another owner or name is another repo. A local path and its
    file:// URL are the directory's realpath."""
    forms = ["https://github.com/me/r.git", "http://github.com/me/r", "git@github.com:me/r.git",
             "ssh://git@github.com/me/r", "ssh://git@GitHub.com:22/me/r.git/", "git+ssh://git@github.com/me/r.git",
             "https://x-access-token:tok@github.com/me/r.git/", "https://user@GITHUB.COM:443/me/r/",
             "github.com:me/r.git"]
    assert {identity.repo_of(u) for u in forms} == {"github.com/me/r"}
    assert identity.repo_of("git@github.com:me/other.git") != identity.repo_of(forms[0])
    assert identity.repo_of("https://gitlab.com/me/r.git") != identity.repo_of(forms[0])
    bare = tmp_path / "train.git"
    bare.mkdir()
    (tmp_path / "link.git").symlink_to(bare)
    local = {identity.repo_of(u) for u in (str(bare), f"{bare}/", f"file://{bare}", str(tmp_path / "link.git"))}
    assert local == {str(bare.resolve()).removesuffix(".git")}
    assert identity.repo_of("") == ""


def test_the_same_repo_switched_from_https_to_ssh_keeps_the_checkout_and_follows_the_url(
        remote, tmp_path, monkeypatch, capsys):
    """The user switches repo.url from https to ssh (and back): one repo, so no move aside. origin takes
    the configured URL, the checkout updates as usual: edits left in place while nothing is new, stashed
    by name when the tree moves; untracked files stay."""
    https, ssh = "https://example.invalid/me/r.git", "ssh://git@example.invalid/me/r"
    # Both forms reach the local bare repo: git rewrites them (the sync's git inherits GIT_CONFIG_GLOBAL).
    cfg = tmp_path / "gitconfig"
    cfg.write_text(f'[url "{remote.url}"]\n\tinsteadOf = {https}\n\tinsteadOf = {ssh}\n')
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(cfg))
    dest = tmp_path / "repo"
    first = do_sync(https, dest).new
    (dest / "train.py").write_text("print('my experiment')\n")
    (dest / "notes.txt").write_text("keep me\n")

    r = do_sync(ssh, dest)
    assert (r.mode, r.old, r.new) == ("unchanged", first, first)
    assert git("config", "--get", "remote.origin.url", cwd=dest) == ssh
    assert (dest / ".git" / "podkit-synced").read_text().split("\n")[1] == ssh
    assert (dest / "train.py").read_text() == "print('my experiment')\n", "nothing new: the edit stays in place"
    assert "URL changed form" in capsys.readouterr().out

    new = remote.commit("other.py", "x = 1\n")
    r = do_sync(https, dest)
    assert (r.mode, r.old, r.new) == ("updated", first, new) and git("rev-parse", "HEAD", cwd=dest) == new
    assert git("config", "--get", "remote.origin.url", cwd=dest) == https
    assert not list(tmp_path.glob("repo.*-*")), "the same repo is never moved aside"
    assert (dest / "notes.txt").read_text() == "keep me\n"
    assert any("stashed as 'podkit-sync-" in n for n in r.notes)
    git("stash", "pop", cwd=dest)
    assert (dest / "train.py").read_text() == "print('my experiment')\n"


def slow_upload_pack(tmp_path) -> dict:
    """Env whose global git config makes every served fetch hang before sending its pack."""
    hook = tmp_path / "slow-pack"
    hook.write_text("#!/bin/sh\nsleep 30\nexec \"$@\"\n")
    hook.chmod(0o755)
    cfg = tmp_path / "gitconfig"
    cfg.write_text(f"[uploadpack]\n\tpackObjectsHook = {hook}\n")
    return dict(os.environ, GIT_CONFIG_GLOBAL=str(cfg), GIT_CONFIG_NOSYSTEM="1")


def kill_when_fetching(proc, dest_parent, marker: str) -> None:
    wait_for(lambda: any(marker in p.name for p in dest_parent.iterdir()), 20, what="the clone to start")
    time.sleep(1.0)  # well inside the fetch: the served side is sleeping in its pack hook
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_a_boot_killed_mid_clone_leaves_no_half_repo_and_the_next_sync_clones(remote, tmp_path):
    """SIGKILL of `podkit sync` during the clone: DEST never appears half-made; the next sync cleans
    its own temp dir and clones."""
    dest = tmp_path / "repo"
    p = subprocess.Popen([*PODKIT, "sync", "--repo", remote.url, "--dest", str(dest)], env=slow_upload_pack(tmp_path),
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_fetching(p, tmp_path, ".repo.podkit-clone")
    assert not dest.exists()
    r = do_sync(remote.url, dest)
    assert r.mode == "cloned" and not (tmp_path / ".repo.podkit-clone").exists()


def test_a_half_finished_git_clone_in_dest_is_moved_aside_and_recloned(remote, tmp_path):
    """A plain `git clone` killed part-way (the seed's start command) leaves DEST/.git with no commit:
    it is moved aside, never deleted, and cloned fresh."""
    dest = tmp_path / "repo"
    # file:// forces the pack protocol (a plain path clones locally, without upload-pack).
    p = subprocess.Popen(["git", "clone", f"file://{remote.url}", str(dest)], env=slow_upload_pack(tmp_path),
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_fetching(p, tmp_path, "repo")
    assert (dest / ".git").exists()
    r = do_sync(remote.url, dest)
    assert r.mode == "recovered" and git("rev-parse", "HEAD", cwd=dest) == remote.head()
    assert len(list(tmp_path.glob("repo.broken-*"))) == 1


def test_a_stale_index_lock_from_a_killed_git_is_removed(remote, tmp_path):
    """index.lock with no git holding it is a leftover: removed, and the sync goes on."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / ".git" / "index.lock").write_text("")
    remote.commit()
    r = do_sync(remote.url, dest)
    assert r.mode == "updated" and not (dest / ".git" / "index.lock").exists()
    assert any("stale lock" in n for n in r.notes)


def test_a_lock_held_by_a_live_git_is_not_removed(remote, tmp_path):
    """A lock some running process holds open is left alone and the sync says who holds it."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    lock = dest / ".git" / "index.lock"
    holder = subprocess.Popen(["sleep", "30"], stdin=open(lock, "w"))
    try:
        with pytest.raises(SyncError, match=r"in use by \d+ \(sleep\)"):
            do_sync(remote.url, dest)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


def test_unreachable_remote_path_goes_offline_with_the_existing_checkout(remote, tmp_path):
    """The remote disappears: bounded retries, then the existing checkout is used (mode offline)."""
    dest = tmp_path / "repo"
    head = do_sync(remote.url, dest).new
    remote.bare.rename(tmp_path / "gone.git")
    r = do_sync(remote.url, dest, retries=2)
    assert (r.mode, r.changed, r.old, r.new) == ("offline", False, head, head)


def test_unreachable_loopback_port_goes_offline_with_the_existing_checkout(remote, tmp_path):
    """A remote on a loopback port where nothing listens: offline with the checkout we have."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/train.git"
    dest = tmp_path / "repo"
    git("clone", "-q", remote.url, str(dest))
    git("remote", "set-url", "origin", url, cwd=dest)
    r = do_sync(url, dest, retries=2)
    assert r.mode == "offline" and r.new == remote.head()


def test_unreachable_remote_without_a_checkout_is_a_clear_error(tmp_path):
    """No checkout and no remote: a SyncError naming the URL (boot turns it into safe mode)."""
    missing = tmp_path / "nowhere.git"
    with pytest.raises(SyncError) as e:
        do_sync(str(missing), tmp_path / "repo", retries=2)
    assert "failed after 2 attempt(s)" in e.value.message and str(missing) in e.value.hint
    r = subprocess.run([*PODKIT, "sync", "--repo", str(missing), "--dest", str(tmp_path / "repo")],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PODKIT_REPO_RETRIES="1"))
    assert r.returncode == 1 and "podkit: error:" in r.stderr and "Traceback" not in r.stderr


def test_a_remote_that_never_answers_is_bounded_by_the_timeout(tmp_path):
    """Accepts the connection, never answers: each attempt stops at the timeout, retries are bounded."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted = []
    def accept():
        try:
            while True:
                accepted.append(srv.accept())
        except OSError:
            pass  # closed at the end of the test

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncError, match="took longer than 2s"):
            do_sync(f"http://127.0.0.1:{srv.getsockname()[1]}/x.git", tmp_path / "repo", timeout_s=2, retries=2)
    finally:
        # Wake accept() before closing: a thread left blocked on a closed fd number would accept on
        # whatever socket reuses that number next (another test's server) and reset its connections.
        srv.shutdown(socket.SHUT_RDWR)
        acceptor.join(5)
        srv.close()
        for conn, _ in accepted:
            conn.close()
    assert time.monotonic() - t0 < 15 and len(accepted) >= 2


def test_auth_refused_is_reported_without_pointless_retries(remote, tmp_path):
    """401 from the remote: one attempt, an error that says to set a token."""
    http = HTTPRemote(remote.bare.parent, mode="deny")
    try:
        with pytest.raises(SyncError, match="authentication refused") as e:
            do_sync(http.url("train.git"), tmp_path / "repo", retries=3)
        assert "GIT_TOKEN" in e.value.hint
    finally:
        http.close()


def test_a_token_reaches_git_without_argv_config_or_logs(remote, tmp_path, capsys):
    """GIT_TOKEN authenticates the clone, and appears in no process's command line, not in
    .git/config, and not in podkit's output."""
    token = "tok-5f3a9c-secret"
    http = HTTPRemote(remote.bare.parent, token=token)
    try:
        dest = tmp_path / "repo"
        r = sync.update(http.url("train.git"), "main", dest, retries=1, timeout_s=30, environ={"GIT_TOKEN": token})
        assert r.mode == "cloned" and r.new == remote.head()
        remote.commit()
        assert sync.update(http.url("train.git"), "main", dest, retries=1, timeout_s=30,
                           environ={"GITHUB_TOKEN": token}).mode == "updated"
    finally:
        http.close()
    assert http.requests > 0 and http.seen_cmdlines
    assert not [c for c in http.seen_cmdlines if token in c]
    assert token not in (dest / ".git" / "config").read_text()
    out = capsys.readouterr()
    assert token not in out.out + out.err
    assert not list(tmp_path.glob("podkit-askpass-*"))


def test_a_token_inside_the_url_is_stripped_before_it_is_stored(remote, tmp_path):
    """https://user:token@host/... works, and .git/config keeps only the clean URL."""
    token = "inline-token-77"
    http = HTTPRemote(remote.bare.parent, token=token)
    try:
        url = http.url("train.git").replace("http://", f"http://x-access-token:{token}@")
        dest = tmp_path / "repo"
        assert do_sync(url, dest).mode == "cloned"
    finally:
        http.close()
    assert token not in (dest / ".git" / "config").read_text()
    assert git("config", "--get", "remote.origin.url", cwd=dest) == http.url("train.git")


def test_two_boots_at_once_take_turns_on_the_lock(remote, tmp_path):
    """A second sync of the same DEST waits for the first (bounded), then finds nothing to do."""
    dest = tmp_path / "repo"
    with sync.Lock(dest, timeout_s=1):
        p = subprocess.Popen([*PODKIT, "sync", "--repo", remote.url, "--dest", str(dest), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert p.poll() is None, "the second sync must wait for the lock"
        assert not dest.exists()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and json.loads(out)["mode"] == "cloned"
    with sync.Lock(dest, timeout_s=1), pytest.raises(SyncError, match="another sync holds"):
        do_sync(remote.url, dest, lock_timeout_s=0.5)


def test_ref_can_be_a_tag_or_a_commit(remote, tmp_path):
    """REF may be a tag or a full commit hash: checked out detached."""
    first = git("rev-list", "--max-parents=0", "main", cwd=remote.bare)
    git("tag", "v1", first, cwd=remote.work)
    git("push", "-q", "origin", "v1", cwd=remote.work)
    r = do_sync(remote.url, tmp_path / "by-tag", ref="v1")
    assert r.new == first and git("rev-parse", "HEAD", cwd=tmp_path / "by-tag") == first
    r = do_sync(remote.url, tmp_path / "by-commit", ref=remote.head(), depth=0)
    assert r.new == remote.head()


def test_submodules_are_updated(remote, tmp_path):
    """A repo with a submodule gets it checked out."""
    lib = Remote(tmp_path, "lib.git")
    lib.commit("lib.py", "LIB = 1\n")
    git("-c", "protocol.file.allow=always", "submodule", "add", "-q", lib.url, "lib", cwd=remote.work)
    git("commit", "-q", "-m", "add lib", cwd=remote.work)
    git("push", "-q", "origin", "HEAD:main", cwd=remote.work)
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    assert (dest / "lib" / "lib.py").read_text() == "LIB = 1\n"


def test_an_untracked_file_that_the_remote_later_adds_is_moved_aside_and_kept(remote, tmp_path):
    """The user created notes.md; the remote then commits its own notes.md. The checkout goes on to
    the new commit and the user's file is kept beside the checkout, with its content."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    (dest / "notes.md").write_text("my notes\n")
    new = remote.commit("notes.md", "the project's notes\n")
    r = do_sync(remote.url, dest)
    assert r.mode == "updated" and r.new == new
    assert (dest / "notes.md").read_text() == "the project's notes\n"
    kept = list(tmp_path.glob("repo.untracked-*/notes.md"))
    assert len(kept) == 1 and kept[0].read_text() == "my notes\n"
    assert any("moved aside (kept)" in n and "notes.md" in n for n in r.notes)


def test_a_ref_the_remote_does_not_have_is_not_found_and_not_offline(remote, tmp_path):
    """A reachable remote without the ref: with a checkout of another ref this is an error, not
    'offline' (the old checkout is not that ref); without a checkout, the same error."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    with pytest.raises(sync.RefNotFound, match="has no branch, tag or commit 'mian'"):
        do_sync(remote.url, dest, ref="mian", retries=3)
    with pytest.raises(sync.RefNotFound, match="'v9'"):
        do_sync(remote.url, tmp_path / "fresh", ref="v9", retries=3)


def test_a_git_failure_is_a_podkit_error_carrying_gits_own_words(remote, tmp_path):
    """A broken .git/config makes every git command fail: the error is a SyncError with git's lines,
    not a raw exception and not only git's last line."""
    dest = tmp_path / "repo"
    do_sync(remote.url, dest)
    remote.commit()
    (dest / ".git" / "config").write_text("[core\n\tbroken = \n")
    with pytest.raises(SyncError) as e:
        do_sync(remote.url, dest)
    assert "bad config line 1" in e.value.message


def test_boot_with_a_missing_ref_waits_in_safe_mode_naming_it(remote, tmp_path, procs):
    """At boot, 'ref not found' is safe mode (the checkout of the old ref is not trained)."""
    from conftest import free_port, smoke_env

    ws = tmp_path / "ws"
    ws.mkdir()
    do_sync(remote.url, ws / "repo")
    env = smoke_env(ws, free_port(), PODKIT_REPO_URL=remote.url, PODKIT_REPO_REF="release-9")
    out = tmp_path / "boot.log"
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: "SAFE MODE" in out.read_text(), 30, what="safe mode")
    assert "the sync stage failed" in out.read_text() and "no branch, tag or commit 'release-9'" in out.read_text()
    assert "OFFLINE" not in out.read_text()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
