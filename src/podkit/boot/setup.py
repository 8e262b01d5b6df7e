"""The setup stage: the training repo's own requirements, installed once into an environment on the volume.

repo.setup is a shell command run in the checkout (`pip install -r requirements.txt`, `sh setup.sh`)
inside a virtual environment that inherits every package of the trainer's Python (the image's torch,
AReaL, SGLang: a .pth file names its site-packages, so nothing is installed twice). The environment is
keyed by the command and the checkout's dependency files (requirements*.txt, pyproject.toml, setup.py,
setup.cfg, and any file the command names): a later boot with the same key reuses it in seconds, a new
commit that changes no dependency file too.

It is built in place (a venv's scripts name its path) and marked ready only when the command
succeeded: one without the mark is half-installed, never used, and built again. A failure waits in safe mode naming the command and its
last lines; a failure that looks like an unreachable package index falls back, with a warning, to the
last environment that was built successfully. The trainer runs the Python that .podkit/setup.json
names (areal/launch.py).

A build that failed, timed out or filled the disk is removed at once (it is this build's own directory):
a full volume gets its space back for the safe mode, the logs and the checkpoints. An environment that
moves what podkit pins under the trainer (areal, for which its patches are written; torch, the image's)
is refused, naming the package and both versions. After each success, <workspace>/envs keeps the current
environment and the one before it; older ones podkit built (its marker in them) go, unless a process
still runs from one. setup.log holds the last build's output, bounded, with the one before as setup.log.1.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from podkit import config, log, records
from podkit.errors import StageError
from podkit.host import pid1, proc

_log = log.get("setup")
DEPENDENCY_FILES = ("pyproject.toml", "setup.py", "setup.cfg")
READY = ".podkit-setup-ready"
BUILT_BY = ".podkit-setup-env"  # podkit's mark on an environment it is building: its builder (pid, start time)
ENV_NAME = re.compile(r"setup-[0-9a-f]{16}")
# pip's and uv's words for an index it cannot reach (not for a package that does not exist).
OFFLINE = re.compile(r"Failed to establish a new connection|Temporary failure in name resolution|Network is "
                     r"unreachable|Connection refused|Read timed out|ProxyError|Max retries exceeded|"
                     r"Could not fetch URL|No route to host|Name or service not known", re.I)
DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]", re.I)
TAIL_LINES = 15
TAIL_BYTES = 20000
# setup.log's bound: past it the log becomes setup.log.1 (replacing the one before) and starts again, so a
# chatty setup that fails at every boot costs at most twice this on the volume.
LOG_MAX_BYTES = 16 << 20
# What podkit pins under the trainer: areal (its patches name areal's lines) and torch (the image's build).
PINNED = ("areal", "torch")


def envs_dir(cfg) -> Path:
    return cfg.workspace_path / "envs"


def dependency_files(checkout: Path, command: str) -> list[Path]:
    found = {p for p in checkout.glob("requirements*.txt") if p.is_file()}
    found |= {checkout / n for n in DEPENDENCY_FILES if (checkout / n).is_file()}
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for w in words:  # `-r deps/train.txt`, `sh tools/setup.sh`
        p = Path(os.path.realpath(checkout / w))  # not Path.resolve: a link that loops raises RuntimeError
        if p.is_file() and str(p).startswith(str(checkout.resolve()) + os.sep):
            found.add(p)
    return sorted(found)


def key(checkout: Path, command: str, python: str) -> str:
    # File names and the command as the file system and the environment gave them: bytes that need not be
    # UTF-8 (os.fsencode gives a UTF-8 name's same bytes, so keys made before are unchanged).
    h = hashlib.sha256(b"\0".join([os.fsencode(command), os.fsencode(os.path.realpath(python)), sys.version.encode()]))
    for p in dependency_files(checkout, command):
        h.update(b"\0" + os.fsencode(os.path.relpath(p, checkout.resolve())) + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def site_packages(python: str) -> list[str]:
    out = subprocess.run([python, "-c", "import site, sys; print('\\n'.join(site.getsitepackages() + "
                          "[p for p in sys.path if p.endswith('site-packages')]))"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return list(dict.fromkeys(p for p in out.splitlines() if p.strip()))


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def usable(env: Path) -> bool:
    return (env / READY).is_file() and os.access(env_python(env), os.X_OK)


class Built:
    """What a build did: its exit code (None: stopped at repo.setup_timeout_s), its last lines, and the
    error that stopped setup.log's writes (a full disk), if any."""

    def __init__(self, rc: int | None, tail: list[str], log_error: OSError | None) -> None:
        self.rc, self.tail, self.log_error = rc, tail, log_error


class SetupLog:
    """setup.log for one build: the build before it kept as setup.log.1, and bounded (LOG_MAX_BYTES) by
    the same turn. Its last bytes are kept in memory too: they are the failure's message even when the
    disk is too full to write them."""

    def __init__(self, path: Path) -> None:
        self.path, self.error, self.last = path, None, bytearray()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.out = None
        self._turn(only_if_used=True)

    def _turn(self, only_if_used: bool = False) -> None:
        if self.out:
            self.out.close()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        try:
            st = os.lstat(self.path)
            # Not a regular file (a FIFO would block the open for ever, a link would be written through):
            # moved aside as setup.log.1 like a used log.
            if not only_if_used or st.st_size or not stat.S_ISREG(st.st_mode):
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except FileNotFoundError:
            pass
        except OSError:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC  # setup.log.1 cannot be replaced (a directory?)
        try:  # whatever is still there is not opened through a link, nor waited on
            self.out = os.fdopen(os.open(self.path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644), "ab")
        except OSError as e:  # a full disk: the build goes on, its last lines in memory
            self.out, self.error = None, e

    def write(self, data: bytes, keep: bool = True) -> None:
        if keep:
            self.last += data
            del self.last[:-TAIL_BYTES]
        if self.error:
            return  # a full disk: the rest is dropped, the last lines are in memory
        try:
            if self.out.tell() and self.out.tell() + len(data) > LOG_MAX_BYTES:
                self._turn()
                self.out.write(f"[podkit:setup] {self.path.name} reached {LOG_MAX_BYTES >> 20} MiB; the output "
                               f"before this is in {self.path.name}.1\n".encode())
            self.out.write(data)
            self.out.flush()
        except OSError as e:
            self.error = e

    def tail(self) -> list[str]:
        return [ln for ln in self.last.decode(errors="replace").splitlines() if ln.strip()]

    def close(self) -> None:
        try:
            if self.out:
                self.out.close()
        except OSError as e:
            self.error = self.error or e


def build(cfg, env: Path, command: str, python: str, log_path: Path) -> Built:
    """The venv and the command in it, in `env` (this build's own directory, marked as podkit's)."""
    env.mkdir(exist_ok=True)  # what the removal before could not take is built over
    (env / BUILT_BY).write_text(json.dumps({"pid": os.getpid(), "starttime": proc.starttime(os.getpid())}))
    inherit_pip = _has_pip(python)
    subprocess.run([python, "-m", "venv", *(["--without-pip"] if inherit_pip else []), str(env)],
                   check=True, capture_output=True, timeout=300)
    if inherit_pip:  # the inherited pip, run by this venv's Python, installs into this venv
        for name in ("pip", "pip3"):
            shim = env / "bin" / name
            shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
            shim.chmod(0o755)
    site = subprocess.run([str(env_python(env)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    # Inherit the trainer's packages (the image's, or the AReaL environment's when that is itself a venv).
    Path(site, "_podkit_inherit.pth").write_text("\n".join(site_packages(python)) + "\n")
    env_vars = {**os.environ, "VIRTUAL_ENV": str(env), "PATH": f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1",
                # A Python installer's last lines reach the log before a timeout's kill (no stdio buffer).
                "PYTHONUNBUFFERED": "1",
                # What the command leaves running (a daemon in a session of its own) is found by it.
                proc.OWNER_ENV: proc.owner_mark(cfg.state_dir, "setup")}
    env_vars.pop("PYTHONHOME", None)
    out = SetupLog(log_path)
    out.write(f"[podkit:setup] {time.strftime('%Y-%m-%d %H:%M:%S')} $ ".encode() + os.fsencode(command) + b"\n",
              keep=False)
    r, w = os.pipe()
    # Below a child subreaper (subreap.py): what the command leaves, whatever its session or environment, is
    # stopped when it ends, and named here from the report.
    report = env / ".podkit-left.json"  # in the env being built: there, and podkit's
    report.unlink(missing_ok=True)
    try:
        child = subprocess.Popen([sys.executable, "-m", "podkit.host.subreap", "--report", str(report), "--", "/bin/sh",
                                  "-c", command], cwd=cfg.repo.dest, env=env_vars, stdout=w,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    rc = None
    try:
        rc = _pump(child, r, out, time.monotonic() + cfg.repo.setup_timeout_s)
    except BaseException:  # a stop signal during the install: nothing of it may outlive the boot
        _kill(child)
        raise
    finally:
        try:
            _tell_left(report, quiet=rc is None)  # what a kill (the timeout, a stop) ended is no leftover
            stop_leftovers(cfg, "left running by repo.setup, which has ended")
        finally:
            os.close(r)
            out.close()
    return Built(rc, out.tail(), out.error)


def _tell_left(report: Path, quiet: bool = False) -> None:
    """What the command's subreaper stopped, named as stop_leftovers names what carries the mark."""
    try:
        left = json.loads(report.read_text()) if report.exists() and not quiet else []
    except (OSError, ValueError):
        left = []
    finally:
        report.unlink(missing_ok=True)
    for t in left if isinstance(left, list) else []:
        if isinstance(t, dict) and t.get("outcome") != "vanished":
            target = proc.Target(int(t.get("pid") or 0), cmdline=str(t.get("cmdline") or ""),
                                 reason=str(t.get("reason") or ""), state=str(t.get("state") or ""))
            target.outcome, target.signal = str(t.get("outcome") or ""), str(t.get("signal") or "")
            _log.warn(proc.told(target))


def _pump(child: subprocess.Popen, r: int, out: SetupLog, deadline: float) -> int | None:
    """The command's output into the log until it exits (None: killed at the deadline). A daemon it left
    holding the pipe does not keep the stage waiting: what is in the pipe when the command ends is read."""
    closed = False  # every writer closed its end: only the command's exit is waited for
    poll = select.poll()
    poll.register(r, select.POLLIN)
    while child.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill(child)
            _drain(r, out, poll)
            return None
        if closed:
            time.sleep(min(left, 0.2))
        elif poll.poll(min(left, 0.5) * 1000):
            data = os.read(r, 1 << 16)
            out.write(data)
            closed = not data
    _drain(r, out, poll)
    return child.returncode


def _kill(child: subprocess.Popen) -> None:
    """The command's process group, killed and gone: first its subreaper is asked (SIGTERM: it stops the
    command's whole tree, every session of it), then the group is killed. What the kill already ended is not
    reported after as "left running" (a member dies a moment after the signal)."""
    start = proc.starttime(child.pid) or 0
    try:
        child.send_signal(signal.SIGTERM)
        child.wait(5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone already
    child.wait()
    until = time.monotonic() + 2
    while time.monotonic() < until and proc.group_members(child.pid, start):
        time.sleep(0.02)


def _drain(r: int, out: SetupLog, poll, most: int = 4 << 20) -> None:
    while most > 0 and poll.poll(0):
        data = os.read(r, 1 << 16)
        if not data:
            return
        out.write(data)
        most -= len(data)


def stop_leftovers(cfg, reason: str) -> None:
    """Stop whatever carries this workspace's setup mark: the setup command's daemons, in any session."""
    proc.tell(proc.stop_marked(cfg.state_dir, {"setup": reason}, reap_children=pid1.collect_children), _log)


def _has_pip(python: str) -> bool:
    """pip comes with the inherited packages when the trainer's Python has it; else ensurepip."""
    return subprocess.run([python, "-c", "import pip"], capture_output=True, timeout=60).returncode == 0


def _record(cfg, env: Path, k: str, command: str, fallback: bool = False) -> dict:
    commit = records.SYNC.read(cfg.state_dir).get("new") or ""
    rec = {"key": k, "python": str(env_python(env)), "command": command, "commit": commit, "time": time.time(),
           "fallback": fallback}
    records.SETUP.write(cfg.state_dir, rec)
    return rec


def run(cfg, python: str | None = None) -> dict | None:
    """The stage. Returns .podkit/setup.json's record, or None when repo.setup is empty."""
    command = cfg.repo.setup.strip()
    if not command:
        records.SETUP.path(cfg.state_dir).unlink(missing_ok=True)  # the trainer runs the image's Python
        return None
    python = python or sys.executable
    checkout = Path(cfg.repo.dest)
    if not checkout.is_dir():
        raise StageError("setup", f"repo.setup is set but there is no checkout at {checkout}",
                         "set repo.url (the sync stage brings the checkout) or clear repo.setup")
    root = envs_dir(cfg)
    try:
        return _run(cfg, command, python, checkout, root)
    except OSError as e:  # the volume's word (full, read-only, a file it cannot read): a stage error, not a bug
        if _full(e):
            raise _disk_full(cfg, command, root, None, None, removed=False) from e
        raise StageError("setup", f"repo.setup could not be run: {e}",
                         f"check that {root} and the checkout {checkout} are readable and writable") from e


def _run(cfg, command: str, python: str, checkout: Path, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    k = key(checkout, command, python)
    env = root / f"setup-{k}"
    if usable(env):
        _log.info(f"reusing {env} (repo.setup `{command}` with these dependency files ran before)")
        _refuse_moved_pins(command, python, env, built=False)
        return _succeeded(cfg, root, env, k, command)
    shutil.rmtree(env, ignore_errors=True)  # ours, not marked ready: a build that failed or was killed
    log_path = cfg.log_dir / "setup.log"
    _log.info(f"running repo.setup `{command}` in {checkout}, into {env} (output: {log_path})")
    t0 = time.monotonic()
    free_before = _free(root)
    try:
        done = build(cfg, env, command, python, log_path)
    except (OSError, subprocess.SubprocessError) as e:
        _remove_failed(env)
        if _full(e):
            raise _disk_full(cfg, command, root, free_before, None) from e
        raise StageError("setup", f"could not make the environment for repo.setup in {root}: {e}",
                         "check that the volume is writable and has room") from e
    if done.log_error and not _full(done.log_error):
        _log.warn(f"setup.log could not be written ({done.log_error}); the last lines are kept in memory only")
    if done.rc == 0 and not (done.log_error and _full(done.log_error)):
        try:
            _refuse_moved_pins(command, python, env, built=True)
            (env / READY).write_bytes(os.fsencode(command) + b"\n")
        except OSError as e:  # the disk filled as the command ended (what else it wrote is not ours to take)
            _remove_failed(env)
            if _full(e):
                raise _disk_full(cfg, command, root, free_before, None) from e
            raise
        except BaseException:
            _remove_failed(env)
            raise
        (env / BUILT_BY).unlink(missing_ok=True)
        _log.info(f"repo.setup done in {time.monotonic() - t0:.0f}s; the trainer runs {env_python(env)}")
        return _succeeded(cfg, root, env, k, command)
    _remove_failed(env)
    said = "\n".join(done.tail[-TAIL_LINES:]) or "(it printed nothing)"
    if done.log_error and _full(done.log_error) or done.rc and DISK_FULL.search("\n".join(done.tail)):
        raise _disk_full(cfg, command, root, free_before, said)
    if done.rc is None:
        limit = cfg.repo.setup_timeout_s
        raise StageError("setup", f"repo.setup `{command}` timed out after {limit:g}s (repo.setup_timeout_s) and "
                         f"was stopped; its last lines:\n{said}",
                         f"if it needs longer, raise repo.setup_timeout_s ({config.env_name('repo', 'setup_timeout_s')}"
                         f"={limit * 2:g}, say); else find where it hangs in {log_path} and restart the pod")
    last = _last_good(root)
    if last and OFFLINE.search("\n".join(done.tail)):
        _log.warn(f"repo.setup `{command}` failed (exit {done.rc}) and the package index looks unreachable: using "
                  f"the last environment that was set up, {last}; the trainer may miss what this commit needs")
        rec = _record(cfg, last, last.name.removeprefix("setup-"), command, fallback=True)
        prune(cfg, root, last)
        return rec
    raise StageError("setup", f"repo.setup `{command}` exited {done.rc}; its last lines:\n{said}",
                     f"fix it in the repo (or repo.setup) and restart the pod; the whole output is in {log_path}")


def _succeeded(cfg, root: Path, env: Path, k: str, command: str) -> dict:
    last = records.LAST_GOOD_SETUP.read(root)
    if last.get("env") != env.name:  # the one before stays, for the fallback and for going back
        records.LAST_GOOD_SETUP.write(root, {"env": env.name, "previous": last.get("env"), "time": time.time()})
    rec = _record(cfg, env, k, command)
    prune(cfg, root, env)
    return rec


def _last_good(root: Path) -> Path | None:
    name = records.LAST_GOOD_SETUP.read(root).get("env")
    env = root / name if isinstance(name, str) and ENV_NAME.fullmatch(name) else None
    return env if env and usable(env) else None


# --- full disk ------------------------------------------------------------------------------------


def _full(e: BaseException) -> bool:
    said = getattr(e, "stderr", None) or b""  # `python -m venv`'s own words, when it failed
    said = said if isinstance(said, str) else said.decode(errors="replace")
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or bool(DISK_FULL.search(f"{e}\n{said}"))


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB" if n < 10 << 30 else f"{n / 2**30:.1f} GiB"


def _disk_full(cfg, command: str, root: Path, free_before: int | None, said: str | None,
               removed: bool = True) -> StageError:
    """Where an install writes, and what each place has free now: the environment (the volume), and the
    container disk's temp files and pip's cache (a torch wheel fills those too)."""
    places: dict[Path, list[str]] = {}
    for path, what in ((root, "the environments"), (Path(tempfile.gettempdir()), "temp files"),
                       (Path.home() / ".cache", "pip's cache")):
        places.setdefault(_mount_point(path), []).append(what)
    free = "; ".join(f"{m} ({', '.join(w)}): {_space(m)}" for m, w in places.items())
    before = f" ({root} had {_mib(free_before)} free when it began)" if free_before is not None else ""
    gone = "the half-built environment is removed; " if removed else ""
    lines = f"; its last lines:\n{said}" if said else ""
    return StageError(
        "setup", f"repo.setup `{command}` ran out of disk space{before}; {gone}free now: {free}{lines}",
        f"make room where it ran short (on the volume: `du -sh {cfg.workspace_path}/*`, old checkpoints; on the "
        f"container disk: `pip cache purge`) or give the pod more disk, then restart the pod; the output is in "
        f"{cfg.log_dir / 'setup.log'}")


def _space(path: Path) -> str:
    try:
        du = shutil.disk_usage(path)
    except OSError as e:
        return f"unknown ({e.strerror})"
    return f"{_mib(du.free)} free of {_mib(du.total)}"


def _remove_failed(env: Path) -> None:
    """This build's own directory, made by this stage a moment ago: useless now, and possibly GBs."""
    shutil.rmtree(env, ignore_errors=True)
    if env.exists():
        _log.warn(f"could not remove the failed build {env} entirely; the next boot tries again")


# --- what podkit pins -----------------------------------------------------------------------------


def versions(python: str | Path) -> dict[str, str | None]:
    """PINNED's versions as `python` finds them (its own site-packages first, then what it inherits)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # podkit's own Python (the image's): no start-up
        from importlib import metadata

        def version(n: str) -> str | None:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                return None
        return {n: version(n) for n in PINNED}
    code = ("import json, sys, importlib.metadata as m\nv = {}\nfor n in sys.argv[1:]:\n    try: v[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: v[n] = None\nprint(json.dumps(v))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
    out = subprocess.run([str(python), "-c", code, *PINNED], capture_output=True, text=True, timeout=120, env=env,
                         check=True)
    return json.loads(out.stdout)


def moved_pins(python: str, env: Path) -> list[tuple[str, str, str]]:
    """(package, podkit's version, the environment's) for each pinned package the environment changes."""
    from podkit.areal.patches import AREAL_VERSION  # a constant; nothing of AReaL is imported

    base, mine = versions(python), versions(env_python(env))
    out = []
    for name in PINNED:
        want = base.get(name) or (AREAL_VERSION if name == "areal" else None)
        have = mine.get(name)
        if want and have and have != want:
            out.append((name, want, have))
    return out


def _refuse_moved_pins(command: str, python: str, env: Path, built: bool) -> None:
    try:
        moved = moved_pins(python, env)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise StageError("setup", f"could not read the package versions of {env_python(env)}: {e}",
                         f"the environment may be broken: remove {env} and restart the pod") from e
    if not moved:
        return
    what = "; ".join(f"{n} {have} where podkit runs {n} {want}"
                     + (f" (podkit's AReaL patches are for areal {want})" if n == "areal" else " (the image's)")
                     for n, want, have in moved)
    names = ", ".join(n for n, _, _ in moved)
    raise StageError("setup", f"repo.setup `{command}` moved what podkit pins under the trainer: its environment "
                     f"has {what}",
                     f"take {names} out of the repo's requirements (or pin {', '.join(f'{n}=={w}' for n, w, _ in moved)}): "
                     "the trainer must run the versions podkit is written and tested against; "
                     + ("the environment was not used and is removed" if built else
                        f"the environment {env} was built before this check and is left as it is"))


# --- pruning --------------------------------------------------------------------------------------


def prune(cfg, root: Path, current: Path) -> None:
    """Environments podkit built that are neither the current one nor the last good one before it, and
    that no process runs from: removed. Anything without podkit's marker is left alone. A cluster's other
    nodes leave it to rank 0 (they share the volume, not the process table). Never fails the stage."""
    if cfg.node:
        return
    try:
        _prune(root, current)
    except OSError as e:
        _log.warn(f"could not prune {root} ({e}); the old environments stay until the next setup")


def _prune(root: Path, current: Path) -> None:
    last = records.LAST_GOOD_SETUP.read(root)
    keep = {current.name, *(v for v in (last.get("env"), last.get("previous")) if isinstance(v, str))}
    old = [e for e in root.iterdir() if e.name not in keep and _ours(e)]
    if not old:
        return
    used = in_use(old)
    if used is None:
        _log.info(f"not pruning {root}: the process table could not be read whole, so an old environment may be "
                  "in use")
        return
    for env in old:
        if env in used:
            _log.info(f"keeping {env}: pid {used[env]} runs from it")
            continue
        free = _free(root)
        shutil.rmtree(env, ignore_errors=True)
        freed = (_free(root) or 0) - (free or 0)
        _log.info(f"removed the old environment {env} ({_mib(max(freed, 0))} freed; kept: "
                  f"{', '.join(sorted(keep & {e.name for e in root.iterdir()}))})")


def _ours(env: Path) -> bool:
    """A directory podkit built: its name, and a marker file of podkit's in it (not a link). One still
    being built by a live podkit is not ours to take."""
    if not ENV_NAME.fullmatch(env.name) or env.is_symlink() or not env.is_dir():
        return False
    if _plain_file(env / READY):
        return True
    if not _plain_file(env / BUILT_BY):
        return False
    try:
        builder = json.loads((env / BUILT_BY).read_text())
        return not proc.same_process(int(builder["pid"]), builder["starttime"])
    except (OSError, ValueError, KeyError, TypeError):
        return True  # the marker is ours and its builder unknown: a build killed as it began


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def in_use(envs: list[Path]) -> dict[Path, int] | None:
    """{env: a pid running from it}: a process whose command line, working directory, open files, mapped
    files, VIRTUAL_ENV or PATH are in one. None when some process could not be read (nothing is then removed); podkit itself
    and its ancestors (PID 1: the boot, supervisord) run the image's Python and are not read."""
    prefixes = {env: os.fsencode(env.resolve()) + b"/" for env in envs}
    found: dict[Path, int] = {}
    skip = proc.protected_pids()
    for pid in proc.all_pids():
        if pid in skip:
            continue
        base = f"/proc/{pid}/"
        try:
            cwd = os.readlink(base + "cwd")
            seen = [os.fsencode(cwd), proc.read_all(base + "maps")]
            # A command line may name the env through a link (/workspace -> the volume) or from its working
            # directory: its paths' folders resolved (not the file: the env's bin/python links to the image's).
            seen += [os.path.join(os.path.realpath(os.path.dirname(a)), os.path.basename(a))
                     for a in (os.path.join(os.fsencode(cwd), a) for a in proc.read_all(base + "cmdline").split(b"\0")
                               if b"/" in a)]
            # An activated env (a shell's VIRTUAL_ENV, its bin first on PATH) runs `python` by name.
            for var in proc.read_all(base + "environ").split(b"\0"):
                name, _, value = var.partition(b"=")
                if name in (b"VIRTUAL_ENV", b"PATH"):
                    seen += [os.path.realpath(v) + b"/" for v in value.split(b":") if v.startswith(b"/")]
            for fd in os.listdir(base + "fd"):
                try:
                    seen.append(os.fsencode(os.readlink(base + "fd/" + fd)))
                except OSError:
                    pass
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except OSError:
            return None
        for env, prefix in prefixes.items():
            if env not in found and any(prefix in s or s + b"/" == prefix for s in seen):
                found[env] = pid
    return found


def python_for(cfg) -> tuple[str | None, str]:
    """The trainer's Python from .podkit/setup.json: (path or None for the image's, why not when None).
    The record is data: a path outside <workspace>/envs, or one without the ready marker, is not run."""
    rec = records.SETUP.read(cfg.state_dir)
    if not rec.get("python") or not cfg.repo.setup.strip():
        return None, ""
    py = Path(rec["python"])
    root = envs_dir(cfg).resolve()
    env = py.parent.parent
    if env.parent.resolve() != root or not ENV_NAME.fullmatch(env.name) or not usable(env):
        return None, f"setup.json names {py}, which is not a ready environment under {root}"
    return str(py), ""
