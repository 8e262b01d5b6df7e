"""The sync stage: bring the training repo to REF without ever causing a restart loop.

Every path ends in a usable checkout or a clear error the boot turns into safe mode; none deletes
what a person wrote. A fresh clone is fetched into a temp dir beside DEST and published by rename,
so a container killed mid-clone never leaves a half repo at DEST. Uncommitted edits stay in place
while DEST is already at REF (they are the user's run), and are stashed (named, timestamped) when
the tree must move; untracked files stay where they are; local commits get a backup branch. A checkout
of the same repo under another URL form (https, ssh, scp-like) follows the configured URL; a checkout of
another repo is moved aside as DEST.other-<time>, a directory that is not a usable clone as
DEST.broken-<time>: never removed.
A token reaches git only through GIT_ASKPASS and the environment: never argv, .git/config or logs.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import selectors
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from podkit import log, records
from podkit.areal.identity import repo_of
from podkit.config import split_credentials
from podkit.errors import StageError
from podkit.host import proc
from podkit.host.pidlock import Busy, PidLock

_log = log.get("sync")
TOKEN_ENV = ("GIT_TOKEN", "GITHUB_TOKEN")
# What "the remote cannot be reached" looks like; any other failure is not a reason to go offline.
UNREACHABLE = re.compile(r"could not resolve host|connection refused|connection timed out|timed out|network is "
                         r"unreachable|unable to access|could not read from remote repository|does not appear to "
                         r"be a git repository|early eof|rpc failed|returned error: 5\d\d|took longer than|"
                         r"failed to connect|no route to host|connection reset|ssl|temporary failure", re.I)
MISSING_REF = re.compile(r"couldn't find remote ref|not our ref|no such remote ref|"
                         r"Server does not allow request for unadvertised object|reference is not a tree", re.I)
AUTH_FAILURE = re.compile(r"Authentication failed|could not read (Username|Password)|terminal prompts disabled|"
                          r"HTTP Basic: Access denied|returned error: 40[13]", re.I)


class SyncError(StageError):
    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__("sync", message, hint)


@dataclass
class Result:
    changed: bool
    old: str | None
    new: str | None
    mode: str  # cloned | updated | unchanged | offline | recovered
    dest: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def is_local(url: str) -> bool:
    return url.startswith(("/", ".", "file://"))


class Git:
    """Runs git with bounded time, no prompts, and credentials only in the environment."""

    def __init__(self, url: str, timeout_s: float, token: str | None = None, username: str | None = None):
        self.timeout_s = timeout_s
        self.token = token
        self._askdir = None
        self.env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C", LANG="C")
        for var in TOKEN_ENV:
            self.env.pop(var, None)
        self.config = ["-c", "credential.helper=", "-c", "http.lowSpeedLimit=1000",
                       "-c", f"http.lowSpeedTime={int(min(60, max(5, timeout_s)))}"]
        if is_local(url):
            self.config += ["-c", "protocol.file.allow=always"]  # submodules of a local superproject
        if token:
            self._askdir = tempfile.mkdtemp(prefix="podkit-askpass-")
            script = Path(self._askdir) / "askpass"
            # The script reads the token from its environment; the file itself holds no secret.
            script.write_text('#!/bin/sh\ncase "$1" in\n  Username*) printf \'%s\\n\' "$_PODKIT_GIT_USER" ;;\n'
                              '  *) printf \'%s\\n\' "$_PODKIT_GIT_TOKEN" ;;\nesac\n')
            script.chmod(stat.S_IRWXU)
            self.env.update(GIT_ASKPASS=str(script), _PODKIT_GIT_TOKEN=token,
                            _PODKIT_GIT_USER=username or "x-access-token")

    def close(self) -> None:
        if self._askdir:
            shutil.rmtree(self._askdir, ignore_errors=True)

    def redact(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text

    def run(self, args: list[str], cwd: Path | None = None, check: bool = True, progress: bool = False,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        timeout = timeout or self.timeout_s
        argv = ["git", *self.config, *args]
        # Own session: a timeout kills git and its helpers (remote-https, ssh) together.
        proc = subprocess.Popen(argv, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        out, err_raw = self._drain(proc, time.monotonic() + max(0.1, timeout), progress)
        if out is None:
            _kill_group(proc)
            raise SyncError(f"git {args[0]} took longer than {timeout:.0f}s and was stopped",
                            "the remote is slow or unreachable; raise PODKIT_REPO_TIMEOUT_S if it is just slow")
        proc.wait()
        err = self.redact(err_raw.decode(errors="replace"))
        res = subprocess.CompletedProcess(argv, proc.returncode, out.decode(errors="replace"), err)
        if check and res.returncode != 0:
            raise GitFailed(args, res.returncode, err)
        return res

    def _drain(self, proc: subprocess.Popen, deadline: float, progress: bool) -> tuple[bytes | None, bytes]:
        """Read stdout and stderr until both close or the deadline passes (then stdout is None).
        One selector loop in this thread: no reader threads, and the deadline bounds a git that hangs."""
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        sel = selectors.DefaultSelector()
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        pending, last = b"", 0.0
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, bytes(bufs[proc.stderr])
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    bufs[key.fileobj] += chunk
                    if progress and key.fileobj is proc.stderr:
                        pending, last = self._show_progress(pending + chunk, last)
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])

    def _show_progress(self, buf: bytes, last: float) -> tuple[bytes, float]:
        *lines, rest = re.split(rb"[\r\n]", buf)
        for line in lines:
            text = self.redact(line.decode(errors="replace").strip())
            now = time.monotonic()
            if text and ("done" in text or now - last >= 2.0):
                _log.info(f"git: {text}")
                last = now
        return rest, last

    def out(self, args: list[str], cwd: Path) -> str:
        return self.run(args, cwd=cwd).stdout.strip()


class GitFailed(SyncError):
    """A git command that failed, with git's own words (its stderr, the last lines that say something)."""

    def __init__(self, args: list[str], code: int, stderr: str) -> None:
        self.args_, self.code, self.stderr = args, code, stderr
        said = [ln.strip() for ln in stderr.strip().splitlines()
                if ln.strip() and not ln.lstrip().startswith(("hint:", "remote: Enumerating", "remote: Counting"))]
        words = " / ".join(said[-6:]) if said else "no message"
        super().__init__(f"git {args[0]} failed ({code}): {words}",
                         "the git message above says why; `podkit sync --json` runs the same stage")


class RefNotFound(SyncError):
    """The remote answers but has no such branch, tag or commit: not offline (the old checkout is not REF)."""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


class Lock(PidLock):
    """One sync per DEST at a time, across boots sharing a volume; the second waits, bounded."""

    def __init__(self, dest: Path, timeout_s: float) -> None:
        super().__init__(dest.parent / f".{dest.name}.podkit-sync.lock", timeout_s, 0o644,
                         waiting=lambda pid: _log.info(f"waiting for another sync of {dest.parent} (pid {pid})"))

    def __enter__(self) -> Lock:
        try:
            return super().__enter__()
        except Busy:
            raise SyncError(f"another sync holds {self.path} for more than {self.wait_s:.0f}s",
                            "another boot is syncing the same volume; wait for it, or raise "
                            "PODKIT_REPO_LOCK_TIMEOUT_S") from None


class Syncer:
    def __init__(self, url: str, ref: str, dest: str | Path, depth: int = 1, timeout_s: float = 300,
                 retries: int = 3, lock_timeout_s: float = 600, backoff_s: float = 1.0,
                 environ: dict | None = None, user: str | None = None, token: str | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.url, url_user, url_token = split_credentials(url)
        user, token = user or url_user, token or url_token
        token = token or next((environ[v] for v in TOKEN_ENV if environ.get(v)), None)
        self.ref, self.dest, self.depth = ref, Path(dest).absolute(), depth
        self.retries, self.lock_timeout_s, self.backoff_s = retries, lock_timeout_s, backoff_s
        self.git = Git(self.url, timeout_s, token, user)
        self.notes: list[str] = []
        self.head: str = ""
        self.branch: str | None = None
        self.remote_sha: str | None = None  # what the remote's REF points at (a tag object for tags)
        self.origin: str | None = None  # DEST's origin URL, as the checkout has it

    # -- the stage ---------------------------------------------------------------------------------------
    def update(self) -> Result:
        try:
            with Lock(self.dest, self.lock_timeout_s):
                return self._update()
        finally:
            self.git.close()

    def _update(self) -> Result:
        self._clear_own_temp()
        state, why = self._inspect()
        if state == "absent":
            return self._clone("cloned")
        if state == "broken":
            _log.warn(f"{self.dest} {why}; it will be moved aside (kept) and cloned fresh")
            return self._clone("recovered")
        if state == "other":
            _log.warn(f"{self.dest} {why}; it will be moved aside (kept) and {self.url} cloned fresh")
            return self._clone("recovered", aside="other", why=why)
        return self._update_existing()

    def _inspect(self) -> tuple[str, str]:
        d = self.dest
        if not d.exists():
            return "absent", ""
        if d.is_dir() and not any(d.iterdir()):
            return "absent", ""  # an empty dir (a fresh mount point): clone into it
        if not (d / ".git").exists():
            return "broken", "exists but is not a git repository"
        head = _read_head(d / ".git") or self._rev_parse_head(d)
        if head is None:
            return "broken", "is a half-finished clone (no commit checked out)"
        self.head, self.branch = head
        origin = _read_marker(d)[1]
        if origin != self.url:  # podkit did not last sync it from this very URL: what git says is origin
            origin = self.git.run(["config", "--get", "remote.origin.url"], cwd=d, check=False).stdout.strip()
        # A usable clone of something else is the user's work, not a broken checkout: told apart, and named.
        if not origin:
            return "other", "is a git repository without an origin remote (not a clone of the repo)"
        if repo_of(origin) != repo_of(self.url):
            return "other", f"is a clone of another repo ({split_credentials(origin)[0]})"
        self.origin = origin
        return "ok", ""

    def _already_there(self, d: Path) -> bool:
        """Is DEST at REF as the remote has it now? Asks `git ls-remote` (git-sync's way): one round
        trip, no pack negotiation, so a boot with nothing new costs less than a fetch."""
        if SHA.match(self.ref):
            return self.head == self.ref  # a commit never moves: no network needed
        want = [f"refs/heads/{self.ref}", f"refs/tags/{self.ref}"]
        out = self._with_retries(f"asking {self.url} for {self.ref}",
                                 lambda: self.git.out(["ls-remote", "origin", *want], cwd=d))
        found = dict(line.split("\t")[::-1] for line in out.splitlines() if "\t" in line)
        self.remote_sha = found.get(want[0]) or found.get(want[1])
        if not self.remote_sha and not _looks_like_sha(self.ref):
            raise self._ref_not_found()
        commit, _, ref, remote = _read_marker(d)
        on_ref = self.branch == self.ref if want[0] in found else True
        return bool(self.remote_sha) and remote == self.remote_sha and ref == self.ref and \
            commit == self.head and on_ref

    def _rev_parse_head(self, d: Path) -> tuple[str, str | None] | None:
        res = self.git.run(["rev-parse", "HEAD^{commit}", "--symbolic-full-name", "HEAD"], cwd=d, check=False)
        lines = res.stdout.split()
        if res.returncode != 0 or len(lines) != 2:
            return None
        return lines[0], (lines[1].removeprefix("refs/heads/") if lines[1].startswith("refs/heads/") else None)

    def _with_retries(self, what: str, fn):
        last: Exception | None = None
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except RefNotFound:
                raise
            except SyncError as e:
                last = e
                detail = e.stderr if isinstance(e, GitFailed) else str(e)
                if AUTH_FAILURE.search(detail):
                    raise SyncError(f"{what}: authentication refused by {self.url}",
                                    "set GIT_TOKEN (or GITHUB_TOKEN) to a token with read access") from None
                if MISSING_REF.search(detail):
                    raise self._ref_not_found() from None
                if attempt < self.retries:
                    delay = min(30.0, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
                    _log.warn(f"{what} failed (attempt {attempt}/{self.retries}): {e}; retrying in {delay:.1f}s")
                    time.sleep(delay)
        assert last is not None
        raise SyncError(f"{what} failed after {self.retries} attempt(s): {last}",
                        f"check that {self.url} is reachable from the pod and PODKIT_REPO_REF={self.ref} exists")

    def _ref_not_found(self) -> RefNotFound:
        return RefNotFound(f"{self.url} has no branch, tag or commit {self.ref!r}",
                           f"PODKIT_REPO_REF={self.ref} is misspelt or not pushed yet: push it, or set the ref "
                           "that exists (the existing checkout is not used: it is not that ref)")

    def _fetch(self, repo: Path) -> tuple[str, str]:
        """Fetch REF (branch, tag or commit) into FETCH_HEAD; returns (commit, kind)."""
        depth = [f"--depth={self.depth}"] if self.depth else []
        shallow = (repo / ".git" / "shallow").exists()
        if not self.depth and shallow:
            depth = ["--unshallow"]
        self._with_retries(f"fetching {self.ref}", lambda: self.git.run(
            ["fetch", "--no-tags", "--progress", *depth, "origin", self.ref], cwd=repo, progress=True))
        head = (repo / ".git" / "FETCH_HEAD").read_text().split("\n", 1)[0]
        kind = "branch" if "\tbranch '" in head else "tag" if "\ttag '" in head else "commit"
        commit = self.remote_sha = head.split("\t", 1)[0]
        if kind != "branch":  # a tag may be an annotated tag object: peel it to its commit
            commit = self.git.out(["rev-parse", "FETCH_HEAD^{commit}"], cwd=repo)
        return commit, kind

    def _checkout(self, repo: Path, commit: str, kind: str) -> None:
        argv = ["checkout", "-q", "-B", self.ref, commit] if kind == "branch" else ["checkout", "-q", "--detach", commit]
        try:
            self.git.run(argv, cwd=repo)
        except GitFailed as e:
            in_the_way = _untracked_in_the_way(e.stderr)
            if not in_the_way:
                raise
            # Files of the user's that the new commit adds: kept, beside the checkout, never overwritten.
            aside = self._move_untracked_aside(repo, in_the_way)
            self.notes.append(f"untracked file(s) that {self.ref} now tracks were moved aside (kept) to {aside}: "
                              + ", ".join(in_the_way[:5]) + (" ..." if len(in_the_way) > 5 else ""))
            _log.warn(self.notes[-1])
            self.git.run(argv, cwd=repo)
        if (repo / ".gitmodules").exists():
            depth = [f"--depth={self.depth}"] if self.depth else []
            self._with_retries("updating submodules", lambda: self.git.run(
                ["submodule", "update", "--init", "--recursive", *depth], cwd=repo, progress=True))
        _write_marker(repo, commit, self.url, self.ref, self.remote_sha)

    # -- clone ---------------------------------------------------------------------------------------------
    def _temp(self) -> Path:
        return self.dest.parent / f".{self.dest.name}.podkit-clone"

    def _clear_own_temp(self) -> None:
        # A clone killed part-way leaves only our temp dir: it never held anything of the user's.
        tmp = self._temp()
        if tmp.exists():
            _log.info(f"removing an unfinished clone left by a killed boot: {tmp}")
            shutil.rmtree(tmp, ignore_errors=True)

    def _clone(self, mode: str, aside: str = "broken", why: str = "") -> Result:
        tmp = self._temp()
        self.git.run(["init", "-q", str(tmp)])
        self.git.run(["remote", "add", "origin", self.url], cwd=tmp)
        _log.info(f"cloning {self.url} at {self.ref} into {self.dest}"
                  + (f" (shallow, depth {self.depth})" if self.depth else ""))
        try:
            commit, kind = self._fetch(tmp)
            self._checkout(tmp, commit, kind)
        except SyncError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if mode == "recovered" and aside == "other":
            self.notes.append(f"{self.dest} {why}: moved aside to {self._move_aside(aside)} "
                              "(kept, nothing deleted)")
            _log.warn(self.notes[-1])
        elif mode == "recovered":
            self.notes.append(f"moved the old {self.dest.name} aside to {self._move_aside(aside)}")
            _log.warn(self.notes[-1])
        _publish(tmp, self.dest)
        _log.info(f"{mode} {self.dest} at {commit[:12]} ({kind} {self.ref})")
        return Result(True, None, commit, mode, str(self.dest), self.notes)

    def _move_aside(self, kind: str) -> Path:
        # kind: broken (not a usable clone) or other (a clone of another repo): the name says which.
        aside = self.dest.with_name(f"{self.dest.name}.{kind}-{_stamp()}")
        try:
            self.dest.rename(aside)
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            # DEST is a mount point: move what is in it instead.
            aside.mkdir()
            for child in self.dest.iterdir():
                shutil.move(str(child), str(aside / child.name))
        return aside

    # -- update --------------------------------------------------------------------------------------------
    def _update_existing(self) -> Result:
        d = self.dest
        self._clear_stale_locks(d)
        if self.origin and self.origin != self.url:
            self._follow_url(d, self.origin)
        old = self.head
        try:
            if self._already_there(d):
                # Uncommitted edits on top of REF are the user's run: left in place.
                _log.info(f"{d} already at {self.ref} ({old[:12]}): nothing to do")
                return Result(False, old, old, "unchanged", str(d), self.notes)
            commit, kind = self._fetch(d)
        except RefNotFound:
            raise  # the remote answered: training the old checkout would train the wrong ref
        except SyncError as e:
            if not UNREACHABLE.search(e.message):
                raise  # not the network: the checkout or git itself is broken; say so, with git's words
            _log.warn("=" * 72)
            _log.warn(f"OFFLINE: {e.message}")
            _log.warn(f"going on with the existing checkout {d} at {old[:12]}; it may not be {self.ref}")
            _log.warn("=" * 72)
            self.notes.append(f"offline: {e.message}")
            return Result(False, old, old, "offline", str(d), self.notes)
        if old == commit and (kind != "branch" or self.branch == self.ref):
            # Already there. Uncommitted edits on top of REF are the user's run: left in place.
            _log.info(f"{d} already at {self.ref} ({commit[:12]}): nothing to do")
            return Result(False, old, commit, "unchanged", str(d), self.notes)
        if self.git.out(["status", "--porcelain", "--untracked-files=no"], cwd=d):
            self._stash(d)
        synced = _read_marker(d)[0]
        if old != commit and old != synced and not self._is_ancestor(d, old, commit):
            branch = f"podkit/backup-{_stamp()}"
            self.git.run(["branch", "-f", branch, old], cwd=d)
            self.notes.append(f"local commits kept on branch {branch} (was at {old[:12]})")
            _log.warn(self.notes[-1])
        self._checkout(d, commit, kind)
        mode = "updated" if old != commit else "unchanged"
        _log.info(f"{mode} {d}: {old[:12]} -> {commit[:12]} ({kind} {self.ref})")
        return Result(old != commit, old, commit, mode, str(d), self.notes)

    def _follow_url(self, d: Path, origin: str) -> None:
        """The same repo under another URL form (https -> ssh...): the configured URL is the one the user
        chose, so origin takes it (clean, as the clone stores it); the checkout is then updated as usual."""
        self.git.run(["remote", "set-url", "origin", self.url], cwd=d)
        commit, _, ref, remote = _read_marker(d)
        if commit:
            _write_marker(d, commit, self.url, ref, remote)
        _log.info(f"the remote's URL changed form ({split_credentials(origin)[0]} -> {self.url}; the same repo, "
                  f"{repo_of(self.url)}): origin follows it")

    def _move_untracked_aside(self, repo: Path, paths: list[str]) -> Path:
        aside = repo.with_name(f"{repo.name}.untracked-{_stamp()}")
        for rel in paths:
            src = (repo / rel).resolve()
            if repo.resolve() not in src.parents:
                raise SyncError(f"git named {rel!r} as in the way, which is outside {repo}", "look at the repo by hand")
            target = aside / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(repo / rel), str(target))
        return aside

    def _is_ancestor(self, d: Path, a: str, b: str) -> bool:
        return self.git.run(["merge-base", "--is-ancestor", a, b], cwd=d, check=False).returncode == 0

    def _stash(self, d: Path) -> None:
        name = f"podkit-sync-{_stamp()}"
        ident = []
        if not self.git.run(["config", "--get", "user.email"], cwd=d, check=False).stdout.strip():
            ident = ["-c", "user.name=podkit", "-c", "user.email=podkit@localhost"]
        self.git.run([*ident, "stash", "push", "-q", "-m", name], cwd=d)
        self.notes.append(f"uncommitted changes stashed as '{name}'; get them back with: "
                          f"git -C {d} stash apply 'stash^{{/{name}}}'")
        _log.warn(self.notes[-1])

    def _clear_stale_locks(self, d: Path) -> None:
        gitdir = d / ".git"
        locks = [p for p in [gitdir / "index.lock", gitdir / "HEAD.lock", gitdir / "config.lock",
                             gitdir / "shallow.lock", gitdir / "packed-refs.lock"] if p.exists()]
        for top, _, names in os.walk(gitdir / "refs"):
            locks += [Path(top) / n for n in names if n.endswith(".lock")]
        if not locks:
            return
        try:
            holders, _ = proc.holding([str(p) for p in locks])
        except TimeoutError as e:
            raise SyncError(f"cannot tell whether git in {d} is in use: {e}", "the machine is overloaded") from None
        if holders:
            names = ", ".join(f"{pid} ({proc.name(pid)})" for pid in sorted(holders))
            raise SyncError(f"git in {d} is in use by {names}", "let that git command finish, then restart")
        for p in locks:
            p.unlink(missing_ok=True)
            self.notes.append(f"removed stale lock {p.relative_to(d)} left by a killed git")
            _log.warn(self.notes[-1])


def _untracked_in_the_way(stderr: str) -> list[str]:
    """The paths git lists after "untracked working tree files would be overwritten by checkout"."""
    if "untracked working tree files would be" not in stderr:
        return []
    lines = stderr.split("would be overwritten by", 1)[1].splitlines()[1:]
    return [ln.strip() for ln in lines if ln.startswith(("\t", "    ")) and ln.strip()]


def _looks_like_sha(ref: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{7,40}", ref))


def _marker(repo: Path) -> Path:
    # The commit podkit last checked out and the URL it came from: a HEAD elsewhere means someone
    # committed or moved it.
    return repo / ".git" / "podkit-synced"


def _write_marker(repo: Path, commit: str, url: str, ref: str | None, remote: str | None) -> None:
    _marker(repo).write_text(f"{commit}\n{url}\n{ref or ''}\n{remote or ''}\n")


def _read_marker(repo: Path) -> tuple[str | None, str | None, str | None, str | None]:
    """(commit, url, ref, remote sha) of podkit's last sync of this checkout."""
    try:
        lines = _marker(repo).read_text().split("\n")
    except OSError:
        lines = []
    lines += [""] * 4
    return tuple(x or None for x in lines[:4])


SHA = re.compile(r"^[0-9a-f]{40}$")


def _read_head(gitdir: Path) -> tuple[str, str | None] | None:
    """(commit, branch) from .git/HEAD and the loose or packed ref, without running git.
    None for anything unusual (a ref that does not exist yet: a clone killed before its first
    commit), which the caller settles with `git rev-parse`."""
    try:
        head = (gitdir / "HEAD").read_text().strip()
    except OSError:
        return None
    if SHA.match(head):
        return head, None
    if not head.startswith("ref: refs/heads/"):
        return None
    ref = head[5:]
    try:
        sha = (gitdir / ref).read_text().strip()
    except OSError:
        sha = ""
        try:
            for line in (gitdir / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    sha = line.split(" ", 1)[0]
                    break
        except OSError:
            return None
    return (sha, ref.removeprefix("refs/heads/")) if SHA.match(sha) else None


def _publish(tmp: Path, dest: Path) -> None:
    try:
        os.rename(tmp, dest)  # atomic; also replaces an empty directory
        return
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.EXDEV, errno.ENOTEMPTY, errno.EEXIST):
            raise
    dest.mkdir(parents=True, exist_ok=True)
    for child in tmp.iterdir():
        shutil.move(str(child), str(dest / child.name))
    tmp.rmdir()


def update(url: str, ref: str, dest: str | Path, **kw) -> Result:
    return Syncer(url, ref, dest, **kw).update()


def run(cfg, ref: str | None = None) -> Result:
    """The stage: the repo of the config at its ref (or `ref`: a cluster node pins rank 0's commit),
    recorded in <workspace>/.podkit/sync.json."""
    r = cfg.repo
    result = update(r.url, ref or r.ref, r.dest, depth=r.depth, timeout_s=r.timeout_s, retries=r.retries,
                    lock_timeout_s=r.lock_timeout_s, user=cfg.secrets.get("repo.user"),
                    token=cfg.secrets.get("repo.token"))
    records.SYNC.write(cfg.state_dir, {"changed": result.changed, "old": result.old, "new": result.new,
                                       "mode": result.mode, "notes": result.notes, "time": time.time()})
    return result
