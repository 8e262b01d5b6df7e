"""The real trainer's stack for tests: `podkit boot` of configs/cpu-rehearsal.yaml in the AReaL
environment ($AREAL_PYTHON, built by `make test`), with the tiny model and data of rehearse/assets.py,
against podkit's generating STAND-IN for SGLang (not SGLang). The fixtures `assets` and `rehearsal`
(conftest.py) build on it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from conftest import PODKIT, ROOT, Stack, wait_for
from gitserver import Remote, git

PYTHON = os.environ.get("AREAL_PYTHON")
def areal_run(*argv, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    assert PYTHON, "CI must run the real trainer: `make test` sets AREAL_PYTHON"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **kw.pop("env", {})}
    return subprocess.run([PYTHON, *argv], capture_output=True, text=True, timeout=timeout, env=env, **kw)


# Scripts that only read AReaL's code, run in one AReaL process one after another (each process pays AReaL's
# imports, 7 CPU-s): each with its own argv, cwd, environment, sys.path and globals, its stdout captured apart.
# What one leaves behind in a module (a patch applied) the next sees: order them so nothing reads a change.
BATCH = """
import contextlib, io, json, os, sys, traceback
out = {}
for name, code, argv, cwd, env in json.loads(sys.stdin.read()):
    saved = (sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ))
    buf, rc, err = io.StringIO(), 0, ""
    try:
        sys.argv = ["-c", *argv]
        sys.path.insert(0, "")
        os.environ.update(env)
        os.chdir(cwd or saved[2])
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"<{name}>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        rc, err = 1, traceback.format_exc()
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
        os.environ.clear()
        os.environ.update(saved[3])
    out[name] = {"rc": rc, "stdout": buf.getvalue(), "stderr": err}
print("BATCH " + json.dumps(out))
"""


def areal_batch(scripts: list[tuple[str, str, list[str], str | None, dict[str, str]]],
                timeout: float = 300) -> dict[str, subprocess.CompletedProcess]:
    """BATCH over (name, code, argv, cwd, env): each script's result as areal_run's would be."""
    r = areal_run("-c", BATCH, input=json.dumps(scripts), timeout=timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("BATCH ")), None)
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return {name: subprocess.CompletedProcess([name], o["rc"], o["stdout"], o["stderr"])
            for name, o in json.loads(line[6:]).items()}


def build_assets(tmp_path_factory) -> Path:
    """The tiny model and data, built once per test run: under pytest-xdist the workers share the run's
    base temp dir, and the first to take the lock builds them. Tests copy them, never change them."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "rehearsal-assets"
    root.mkdir(exist_ok=True)
    out = root / "rehearsal"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".ready").exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that died halfway
            r = areal_run(str(ROOT / "rehearse" / "assets.py"), str(out))
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
            (root / ".ready").touch()
    return out


def compile_cache(tmp_path_factory) -> Path:
    """One torch inductor and Triton cache for every real-trainer stack of a test run, as a pod keeps its
    own on the volume (compile_env: the tests run torch.compile'd code eagerly)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compile-cache"
    d.mkdir(exist_ok=True)
    return d


def compile_env(cache: Path) -> dict[str, str]:
    # TORCHDYNAMO_DISABLE: AReaL's torch.compile'd log-prob gather runs eagerly in the tests. Its compile is
    # AReaL's, not podkit's (15 CPU-s once, then 2 s at every rank's start on CPU); `make rehearse` compiles it
    # as a pod does. Ray's workers inherit it from their raylet.
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHDYNAMO_DISABLE": "1"}


class Rehearsal(Stack):
    """configs/cpu-rehearsal.yaml booted by `podkit boot` in the AReaL environment."""

    boot_timeout = 60.0

    def __init__(self, procs, workspace: Path, assets: Path, **env: str) -> None:
        super().__init__(procs, workspace, **env)
        self.python = PYTHON
        self.env.update({"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
                         "PYTHONPATH": str(ROOT / "src"), "PODKIT_TRAINER_STALE_WEIGHTS_CHECK_S": "2",
                         **env})
        for k in ("PODKIT_INFERENCE_STARTUP_DELAY_S", "PODKIT_TRAINER_STEP_INTERVAL_S",
                  "PODKIT_TRAINER_CHECKPOINT_EVERY"):
            self.env.pop(k, None)
        workspace.mkdir(parents=True, exist_ok=True)
        if not (workspace / "rehearsal").exists():
            shutil.copytree(assets, workspace / "rehearsal")

    def wait_fresh_step(self, step: int, after: float, timeout: float = 240) -> dict:
        """A step at least `step` completed by a trainer process started after `after`."""
        return wait_for(lambda: ((p := self.progress()).get("step") or 0) >= step and (p.get("time") or 0) > after
                        and p, timeout, interval=0.5, what=f"trainer step {step}")

    def podkit(self, *args: str) -> subprocess.CompletedProcess:
        """podkit's own CLI from its own venv (no torch, no AReaL): what a user runs in the pod."""
        return subprocess.run([*PODKIT, *args, "--workspace", str(self.workspace)], capture_output=True, text=True,
                              env=self.env, timeout=60)

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


# --- examples/my-repo as the training repo (trainer.entry) --------------------------------------------

EXAMPLE = ROOT / "examples" / "my-repo"
CPU_OVERRIDES = " ".join(ln for ln in (ROOT / "rehearse" / "cpu-overrides").read_text().splitlines()
                         if ln.strip() and not ln.startswith("#"))


def example_remote(root: Path, with_files=None, **changes: str) -> Remote:
    """examples/my-repo as a bare remote's main branch, with files changed or added."""
    root.mkdir(parents=True, exist_ok=True)
    remote = Remote(root)
    # Not the bytecode a test's import of examples/my-repo left there: a user's repo has none committed.
    shutil.copytree(EXAMPLE, remote.work, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    if with_files:
        with_files(remote.work)
    for path, text in changes.items():
        (remote.work / path).parent.mkdir(parents=True, exist_ok=True)
        (remote.work / path).write_text(text)
    git("add", "-A", cwd=remote.work)
    git("commit", "-q", "-m", "my training repo", cwd=remote.work)
    git("push", "-q", "origin", "HEAD:main", cwd=remote.work)
    return remote


def repo_env(remote: Remote, **env: str) -> dict[str, str]:
    return {"PODKIT_REPO_URL": remote.url, "PODKIT_TRAINER_ENTRY": "train.py",
            "PODKIT_TRAINER_AREAL_CONFIG": "config.yaml", "PODKIT_TRAINER_OVERRIDES": CPU_OVERRIDES, **env}


# The bootstrap, then the judge, in one process, entry after entry: every way out of the script is recorded, and
# the end is judged on it (verdict.gather, verdict.decide).
JUDGED = """
import json, os, sys, time
sys.path.insert(0, os.environ["SRC"])
from podkit import config
from podkit.judge import verdict
from podkit.areal import bootstrap
out = []
for entry in sys.argv[1:]:
    os.environ["PODKIT_TRAINER_ENTRY"] = entry
    started = time.time()
    try:
        rc = bootstrap.main(["--config", "x.yaml"])
    except BaseException as e:  # what torchrun's rank would die of
        rc = 1
    end = verdict.decide(verdict.gather(config.load(), rc, started))
    out.append({"entry": entry, "rc": rc, **{k: end.get(k) for k in ("by", "message", "hint", "asked")}})
print(json.dumps(out))
"""
