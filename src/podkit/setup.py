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
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from podkit import log, pid1, proc, records
from podkit.errors import StageError

_log = log.get("setup")
DEPENDENCY_FILES = ("pyproject.toml", "setup.py", "setup.cfg")
READY = ".podkit-setup-ready"
# pip's and uv's words for an index it cannot reach (not for a package that does not exist).
OFFLINE = re.compile(r"Failed to establish a new connection|Temporary failure in name resolution|Network is "
                     r"unreachable|Connection refused|Read timed out|ProxyError|Max retries exceeded|"
                     r"Could not fetch URL|No route to host|Name or service not known", re.I)
TAIL_LINES = 15


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
        p = (checkout / w).resolve()
        if p.is_file() and str(p).startswith(str(checkout.resolve()) + os.sep):
            found.add(p)
    return sorted(found)


def key(checkout: Path, command: str, python: str) -> str:
    h = hashlib.sha256(f"{command}\0{os.path.realpath(python)}\0{sys.version}".encode())
    for p in dependency_files(checkout, command):
        h.update(f"\0{os.path.relpath(p, checkout.resolve())}\0".encode())
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


def build(cfg, env: Path, command: str, python: str, log_path: Path) -> tuple[int, list[str]]:
    """The venv and the command in it, in `env` (a temporary path). (exit code, last lines of output)."""
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
                # What the command leaves running (a daemon in a session of its own) is found by it.
                proc.OWNER_ENV: proc.owner_mark(cfg.state_dir, "setup")}
    env_vars.pop("PYTHONHOME", None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        out.write(f"\n[podkit:setup] {time.strftime('%Y-%m-%d %H:%M:%S')} $ {command}\n".encode())
        out.flush()
        child = subprocess.Popen(["/bin/sh", "-c", command], cwd=cfg.repo.dest, env=env_vars, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = child.wait(timeout=cfg.repo.setup_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = 124
        except BaseException:  # a stop signal during the install: nothing of it may outlive the boot
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        finally:
            stop_leftovers(cfg, "left running by repo.setup, which has ended")
    return rc, _tail(log_path)


def stop_leftovers(cfg, reason: str) -> None:
    """Stop whatever carries this workspace's setup mark: the setup command's daemons, in any session."""
    proc.tell(proc.stop_marked(cfg.state_dir, {"setup": reason}, reap_children=pid1.collect_children), _log)


def _has_pip(python: str) -> bool:
    """pip comes with the inherited packages when the trainer's Python has it; else ensurepip."""
    return subprocess.run([python, "-c", "import pip"], capture_output=True, timeout=60).returncode == 0


def _tail(path: Path) -> list[str]:
    try:
        text = path.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return []
    lines = text.splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("[podkit:setup] ")), default=-1) + 1
    return [ln for ln in lines[start:] if ln.strip()]


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
    root.mkdir(parents=True, exist_ok=True)
    k = key(checkout, command, python)
    env = root / f"setup-{k}"
    if usable(env):
        _log.info(f"reusing {env} (repo.setup `{command}` with these dependency files ran before)")
        return _record(cfg, env, k, command)
    shutil.rmtree(env, ignore_errors=True)  # ours, not marked ready: a build that failed or was killed
    _log.info(f"running repo.setup `{command}` in {checkout}, into {env} (output: {cfg.log_dir / 'setup.log'})")
    t0 = time.monotonic()
    try:
        rc, tail = build(cfg, env, command, python, cfg.log_dir / "setup.log")
    except (OSError, subprocess.SubprocessError) as e:
        raise StageError("setup", f"could not make the environment for repo.setup in {root}: {e}",
                         "check that the volume is writable and has room") from e
    if rc == 0:
        (env / READY).write_text(f"{command}\n")
        records.LAST_GOOD_SETUP.write(root, {"env": env.name, "time": time.time()})
        _log.info(f"repo.setup done in {time.monotonic() - t0:.0f}s; the trainer runs {env_python(env)}")
        return _record(cfg, env, k, command)
    last = _last_good(root)
    said = "\n".join(tail[-TAIL_LINES:])
    if last and OFFLINE.search("\n".join(tail)):
        _log.warn(f"repo.setup `{command}` failed (exit {rc}) and the package index looks unreachable: using the "
                  f"last environment that was set up, {last}; the trainer may miss what this commit needs")
        return _record(cfg, last, last.name.removeprefix("setup-"), command, fallback=True)
    raise StageError("setup", f"repo.setup `{command}` exited {rc}; its last lines:\n{said}",
                     f"fix it in the repo (or repo.setup) and restart the pod; the whole output is in "
                     f"{cfg.log_dir / 'setup.log'}")


def _last_good(root: Path) -> Path | None:
    name = records.LAST_GOOD_SETUP.read(root).get("env")
    env = root / name if isinstance(name, str) and re.fullmatch(r"setup-[0-9a-f]{16}", name) else None
    return env if env and usable(env) else None


def python_for(cfg) -> tuple[str | None, str]:
    """The trainer's Python from .podkit/setup.json: (path or None for the image's, why not when None).
    The record is data: a path outside <workspace>/envs, or one without the ready marker, is not run."""
    rec = records.SETUP.read(cfg.state_dir)
    if not rec.get("python") or not cfg.repo.setup.strip():
        return None, ""
    py = Path(rec["python"])
    root = envs_dir(cfg).resolve()
    env = py.parent.parent
    if env.parent.resolve() != root or not re.fullmatch(r"setup-[0-9a-f]{16}", env.name) or not usable(env):
        return None, f"setup.json names {py}, which is not a ready environment under {root}"
    return str(py), ""
