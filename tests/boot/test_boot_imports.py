"""What `podkit boot` imports on its way to exec supervisord: the container's start-up figure
(bench/boot.py) is guarded here. The boot path may load only podkit's stage modules and light stdlib;
never torch, AReaL, SGLang, the RunPod SDK, or the heavy stdlib that the other verbs use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(60)

# The modules the boot sequence is made of (docs/architecture.md: Layout). A new one here is a decision,
# not an accident.
BOOT_MODULES = {"podkit", "podkit.cli", "podkit.config", "podkit.errors", "podkit.log", "podkit.records",
                "podkit.settings",  # the settings table config.py loads against
                "podkit.boot", "podkit.boot.boot", "podkit.boot.guard", "podkit.boot.preflight", "podkit.boot.reap",
                "podkit.boot.render", "podkit.boot.safemode",
                "podkit.boot.restore",  # the restore stage; its rclone half (podkit.remote.remote) only with a remote
                "podkit.host", "podkit.host.gpu", "podkit.host.lease", "podkit.host.pid1", "podkit.host.proc",
                "podkit.judge", "podkit.judge.ending",  # how the last run ended, in its kind's words (boot history)
                "podkit.programs",
                "podkit.areal", "podkit.areal.checks", "podkit.areal.discovery",
                "podkit.areal.identity",  # the run's names: the reap stage clears its records
                "podkit.areal.userconf"}  # the user's AReaL YAML and overrides as data (stdlib; identity reads them)
NEVER = {"torch", "areal", "sglang", "transformers", "runpod", "requests", "supervisor", "numpy", "argparse",
         "subprocess", "dataclasses", "shutil", "socket", "tempfile", "typing", "asyncio", "logging", "email",
         "http", "xmlrpc", "urllib.request", "difflib", "podkit.boot.sync", "podkit.views.status", "podkit.views.doctor",
         "podkit.programs.watchdog", "podkit.deploy"}

PROBE = """
import json, os, sys
def execve(path, argv, env):  # where boot hands over to supervisord
    print(json.dumps({"argv": argv, "modules": sorted(sys.modules)}))
    sys.stdout.flush()
    os._exit(0)
os.execve = execve
from podkit.cli import main
main(["boot"])
"""


def boot_modules(tmp_path, **env) -> dict:
    e = {"PATH": "/usr/bin:/bin", "PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"),
         "PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_RUN_DIR": str(tmp_path / "run"), **env}
    r = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_boot_reaches_supervisord_importing_only_the_boot_path(tmp_path):
    """The smoke config boots to the exec of supervisord with exactly the boot modules loaded."""
    out = boot_modules(tmp_path)
    assert out["argv"][1:3] == ["-m", "podkit.host.pid1"] and out["argv"][3].endswith("supervisord")
    mods = set(out["modules"])
    assert {m for m in mods if m.startswith("podkit")} == BOOT_MODULES
    assert not {m for m in mods if m.split(".")[0] in NEVER or m in NEVER}


def test_boot_with_a_repo_to_sync_adds_only_the_git_plumbing(tmp_path):
    """With repo.url set, sync's git plumbing joins the boot path (a local bare remote here)."""
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(remote)], check=True, timeout=30)
    seed = tmp_path / "seed"
    subprocess.run(["git", "clone", "-q", str(remote), str(seed)], check=True, timeout=30, capture_output=True)
    (seed / "train.py").write_text("print('hi')\n")
    for argv in (["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                 ["push", "-q", "origin", "HEAD:main"]):
        subprocess.run(["git", "-C", str(seed), *argv], check=True, timeout=30, capture_output=True)
    mods = set(boot_modules(tmp_path, PODKIT_REPO_URL=str(remote))["modules"])
    assert {m for m in mods if m.startswith("podkit")} == BOOT_MODULES | {"podkit.boot.sync", "podkit.host.pidlock"}
    assert not {m for m in mods if m.split(".")[0] in {"torch", "areal", "sglang", "runpod", "requests"}}
