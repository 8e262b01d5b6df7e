"""The setup stage: the training repo's requirements installed by real pip (offline: a wheel in the repo,
--no-index) into a venv on the volume that inherits the trainer's packages, once per change of the
dependency files; a failure waits in safe mode; an unreachable index falls back to the last good env."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import PODKIT, ROOT, free_port, smoke_env, wait_for, wheel
from podkit import config, records
from podkit.areal.patches import AREAL_VERSION
from podkit.boot import setup
from podkit.host import proc

pytestmark = pytest.mark.timeout(180)
INSTALL = "pip install --no-index -r requirements.txt"


def checkout(tmp_path: Path, version: str = "1.0") -> Path:
    repo = tmp_path / "ws" / "repo"
    w = wheel(repo / "wheels", version=version)
    (repo / "requirements.txt").write_text(f"./wheels/{w.name}\n")
    (repo / "train.py").write_text("import podkit_demo_dep\n")
    return repo


def cfg_for(tmp_path: Path, command: str = INSTALL):
    return config.load(ROOT / "configs" / "smoke.yaml", environ={
        "PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_REPO_SETUP": command})


def podkit_setup(tmp_path: Path, command: str = INSTALL) -> subprocess.CompletedProcess:
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": command}
    return subprocess.run([*PODKIT, "setup", "--json"], capture_output=True, text=True, env=env, timeout=150)


def test_setup_installs_the_repos_requirement_once_and_the_next_boot_reuses_it(tmp_path):
    checkout(tmp_path)
    t0 = time.monotonic()
    first = podkit_setup(tmp_path)
    built = time.monotonic() - t0
    assert first.returncode == 0, first.stderr
    rec = json.loads(first.stdout)
    py = rec["python"]
    assert py.startswith(str(tmp_path / "ws" / "envs" / "setup-"))
    # The requirement is in the env, and so is what the trainer's Python had (torch: inherited, not copied).
    r = subprocess.run([py, "-c", "import podkit_demo_dep, torch, sys; print(podkit_demo_dep.VERSION, sys.prefix)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["1.0", str(Path(py).parent.parent)], r.stderr
    assert not list(Path(py).parent.parent.glob("lib/python*/site-packages/torch"))
    # Installed into the env, never into the trainer's own Python.
    assert subprocess.run([sys.executable, "-c", "import podkit_demo_dep"], capture_output=True).returncode != 0
    t0 = time.monotonic()
    again = podkit_setup(tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["python"] == py, again.stderr
    assert "reusing" in again.stderr and time.monotonic() - t0 < built
    # A changed dependency file is a new env; the old one is kept.
    checkout(tmp_path, version="2.0")
    newer = json.loads(podkit_setup(tmp_path).stdout)["python"]
    assert newer != py and Path(py).exists()
    assert setup.python_for(cfg_for(tmp_path)) == (newer, "")


def test_an_unreachable_index_falls_back_to_the_last_good_environment_with_a_warning(tmp_path):
    checkout(tmp_path)
    good = json.loads(podkit_setup(tmp_path).stdout)["python"]
    (tmp_path / "ws" / "repo" / "requirements.txt").write_text("podkit-demo-missing==9\n")
    offline = f"pip install --index-url http://127.0.0.1:{free_port()}/simple --retries 1 --timeout 2 -r requirements.txt"
    r = podkit_setup(tmp_path, offline)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["python"] == good and rec["fallback"] is True, rec
    assert "package index looks unreachable" in r.stderr


def test_a_failing_setup_waits_in_safe_mode_naming_the_command_and_its_last_lines(procs, tmp_path):
    checkout(tmp_path)
    command = "echo building-the-thing; echo 'error: no such compiler' >&2; exit 3"
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": command}
    procs.workspaces.add(str(tmp_path / "ws"))
    boot = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    safe = wait_for(lambda: records.SAFE_MODE.read(tmp_path / "ws" / ".podkit"), 60, what="safe mode")
    assert safe["stage"] == "setup", safe
    assert "exited 3" in safe["message"] and "error: no such compiler" in safe["message"], safe
    assert command in safe["message"] and "setup.log" in safe["hint"], safe
    time.sleep(1)
    assert boot.poll() is None  # waits, explaining itself: no restart loop
    # Half-installed, so never used: no env is marked ready, and the trainer would run the image's Python.
    assert not list((tmp_path / "ws" / "envs").glob(f"setup-*/{setup.READY}"))
    assert setup.python_for(cfg_for(tmp_path, command)) == (None, "")


def test_a_planted_setup_record_is_not_run(tmp_path):
    checkout(tmp_path)
    cfg = cfg_for(tmp_path)
    cfg.state_dir.mkdir(parents=True)
    records.SETUP.write(cfg.state_dir, {"python": "/tmp/evil/bin/python", "key": "x"})
    py, why = setup.python_for(cfg)
    assert py is None and "not a ready environment" in why


def ready_envs(tmp_path: Path) -> list[str]:
    return sorted(e.name for e in (tmp_path / "ws" / "envs").glob("setup-*") if (e / setup.READY).is_file())


def test_a_dependency_file_whose_name_is_not_utf8_is_hashed_like_any_other(tmp_path):
    repo = checkout(tmp_path)
    odd = os.fsencode(repo) + b"/requirements-caf\xe9.txt"  # Latin-1, as an old checkout may have it
    with open(odd, "w") as f:
        f.write("# notes\n")
    first = podkit_setup(tmp_path)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    with open(odd, "w") as f:
        f.write("# other notes\n")
    second = podkit_setup(tmp_path)  # a dependency file like any other: its change is a new environment
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["key"] != json.loads(first.stdout)["key"]


def big_wheel(path: Path, name: str, mib: int) -> Path:
    """A wheel whose one file unpacks to `mib` MiB (it zips to almost nothing)."""
    data = b"\0" * (mib << 20)
    files = {f"{name}/__init__.py": b"", f"{name}/blob.bin": data,
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t).digest()).rstrip(b'=').decode()},{len(t)}"
              for n, t in files.items()]
    files[f"{name}-1.0.dist-info/RECORD"] = ("\n".join([*record, f"{name}-1.0.dist-info/RECORD,,"]) + "\n").encode()
    whl = path / f"{name}-1.0-py3-none-any.whl"
    path.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for n, t in files.items():
            z.writestr(n, t)
    return whl


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare(1) to mount a small tmpfs")
def test_a_setup_that_fills_the_disk_says_so_and_gives_the_space_back(tmp_path):
    """The whole workspace (checkout, envs, logs, records) on a 16 MiB tmpfs, in a mount namespace of its own:
    a good env first, then a requirement that unpacks to 40 MiB. The failure names the full disk, where and
    what is free, with pip's last lines (setup.log could not take them); the half-built env is gone, the good
    one and a file of someone else's on the volume are kept."""
    src = checkout(tmp_path / "src")
    big = big_wheel(src / "wheels", "podkit_demo_big", 40)
    ws = tmp_path / "ws"
    ws.mkdir()
    envs = ws / "envs"
    env = {**smoke_env(ws, free_port()), "PODKIT_REPO_SETUP": INSTALL}
    script = (f"mount -t tmpfs -o size=16m tmpfs {ws} || exit 99; cp -a {src} {ws}/repo; mkdir {envs}; "
              f"echo mine > {envs}/notes.txt; {' '.join(PODKIT)} setup --json >/dev/null || exit 98; "
              f"echo ./wheels/{big.name} >> {ws}/repo/requirements.txt; {' '.join(PODKIT)} setup; echo rc=$?; "
              f"ls -A {envs}; df -k {ws} | tail -1")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=170)
    if r.returncode == 99 or "unshare failed" in r.stderr:
        pytest.skip(f"no tmpfs mount in a user namespace here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert "rc=1" in out, r.stdout + r.stderr
    assert re.search(rf"ran out of disk space \({envs} had \d+ MiB free when it began\); the half-built environment "
                     rf"is removed; free now: {ws} \(the environments\): 1[56] MiB free of 16 MiB", r.stderr), r.stderr
    assert "bug in podkit" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "No space left on device" in r.stderr and "Installing collected packages" in r.stderr  # pip's last lines
    listed = out[out.index("rc=1") + 1:-1]
    assert "notes.txt" in listed and "last-good.json" in listed, listed
    assert len([n for n in listed if n.startswith("setup-")]) == 1, listed  # the good one; the full one is gone
    assert int(out[-1].split()[2]) < 1024, out[-1]  # KiB used: the space is back


def test_a_setup_that_times_out_says_after_how_long_which_setting_and_its_last_lines(procs, tmp_path):
    checkout(tmp_path)
    # Workers beside it, as a build has: the kill ends them all, and none is then reported as a leftover.
    command = ("for i in 1 2 3 4 5 6 7 8; do sleep 60 & done; "
               "python -c \"import time; print('resolving torch==2.9.1'); time.sleep(60)\"; echo never")
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": command, "PODKIT_REPO_SETUP_TIMEOUT_S": "2"}
    procs.workspaces.add(str(tmp_path / "ws"))
    out = tmp_path / "boot.out"
    with open(out, "w") as f:
        boot = procs.spawn([*PODKIT, "boot"], env=env, stdout=f, stderr=subprocess.STDOUT)
    safe = wait_for(lambda: records.SAFE_MODE.read(tmp_path / "ws" / ".podkit"), 30, what="safe mode")
    assert safe["stage"] == "setup" and "timed out after 2s (repo.setup_timeout_s)" in safe["message"], safe
    assert "resolving torch==2.9.1" in safe["message"] and "PODKIT_REPO_SETUP_TIMEOUT_S" in safe["hint"], safe
    assert boot.poll() is None
    assert not list((tmp_path / "ws" / "envs").glob("setup-*"))  # the half-built env is not left
    assert "left running" not in out.read_text(), out.read_text()  # what the kill ended is no leftover


def test_old_environments_are_pruned_to_the_current_and_the_last_good_one_but_never_one_in_use(procs, tmp_path):
    envs = tmp_path / "ws" / "envs"
    checkout(tmp_path, "1.0")
    one = Path(json.loads(podkit_setup(tmp_path).stdout)["python"])
    # Not podkit's: an env-looking directory without its marker, a file, a link to the first env.
    (envs / "setup-0123456789abcdef").mkdir()
    (envs / "setup-0123456789abcdef" / "data").write_text("someone's")
    (envs / "notes.txt").write_text("mine")
    (envs / "setup-fedcba9876543210").symlink_to(one.parent.parent)
    # A process runs from the first env while two more are built, started through a link to the volume (as
    # /workspace may be one): its command line names the env by the link.
    (tmp_path / "volume").symlink_to(tmp_path / "ws")
    user = procs.spawn([str(tmp_path / "volume" / one.relative_to(tmp_path / "ws")), "-c", "import time; time.sleep(120)"])
    checkout(tmp_path, "2.0")
    two = Path(json.loads(podkit_setup(tmp_path).stdout)["python"])
    checkout(tmp_path, "3.0")
    r = podkit_setup(tmp_path)
    three = Path(json.loads(r.stdout)["python"])
    assert {one.parent.parent.name, two.parent.parent.name, three.parent.parent.name} <= set(ready_envs(tmp_path))
    assert f"pid {user.pid} runs from it" in r.stderr, r.stderr
    user.send_signal(signal.SIGKILL)
    user.wait(10)
    r = podkit_setup(tmp_path)  # reused: and now the first env goes
    assert r.returncode == 0 and "reusing" in r.stderr and "removed the old environment" in r.stderr, r.stderr
    assert ready_envs(tmp_path) == sorted([two.parent.parent.name, three.parent.parent.name])
    assert (envs / "setup-0123456789abcdef" / "data").read_text() == "someone's"
    assert (envs / "notes.txt").read_text() == "mine" and (envs / "setup-fedcba9876543210").is_symlink()
    # Going back to the second commit's requirements reuses its env; the third stays as the one before.
    checkout(tmp_path, "2.0")
    assert json.loads(podkit_setup(tmp_path).stdout)["python"] == str(two)
    assert ready_envs(tmp_path) == sorted([two.parent.parent.name, three.parent.parent.name])


def test_setup_log_is_bounded_and_keeps_the_build_before(tmp_path, monkeypatch):
    checkout(tmp_path)
    monkeypatch.setattr(setup, "LOG_MAX_BYTES", 64 << 10)
    chatty = "python -c \"[print('line %d ' % i + 'x' * 90) for i in range(20000)]\"; exit 1"  # 2 MB
    cfg = cfg_for(tmp_path, chatty)
    log = cfg.log_dir / "setup.log"
    for _ in range(3):
        with pytest.raises(setup.StageError) as e:
            setup.run(cfg)
        assert "line 19999 " in e.value.message
        assert log.stat().st_size <= (64 << 10) + 200 and log.with_name("setup.log.1").stat().st_size <= 64 << 10
        assert "line 19999 " in log.read_text()
    assert sorted(p.name for p in log.parent.glob("setup.log*")) == ["setup.log", "setup.log.1"]
    cfg = cfg_for(tmp_path, "echo the next build")
    setup.run(cfg)
    assert log.read_text().endswith("the next build\n") and "line 19999 " in log.with_name("setup.log.1").read_text()


def test_a_requirement_that_moves_torch_under_the_trainer_is_refused_naming_both_versions(tmp_path):
    repo = checkout(tmp_path)
    w = wheel(repo / "wheels", "torch", "0.0.1")
    (repo / "requirements.txt").write_text(f"./wheels/{w.name}\n")
    r = podkit_setup(tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"torch 0.0.1 where podkit runs torch {metadata.version('torch')}" in r.stderr, r.stderr
    assert "take torch out of the repo's requirements" in r.stderr, r.stderr
    assert not list((tmp_path / "ws" / "envs").glob("setup-*"))  # not used, and not left taking space


def test_a_requirement_that_moves_areal_waits_in_safe_mode_and_doctor_says_so(procs, tmp_path):
    repo = checkout(tmp_path)
    w = wheel(repo / "wheels", "areal", "9.9.9")
    (repo / "requirements.txt").write_text(f"./wheels/{w.name}\n")
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": INSTALL}
    procs.workspaces.add(str(tmp_path / "ws"))
    boot = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    safe = wait_for(lambda: records.SAFE_MODE.read(tmp_path / "ws" / ".podkit"), 90, what="safe mode")
    assert safe["stage"] == "setup" and f"areal 9.9.9 where podkit runs areal {AREAL_VERSION}" in safe["message"], safe
    assert f"patches are for areal {AREAL_VERSION}" in safe["message"], safe
    assert boot.poll() is None
    d = subprocess.run([*PODKIT, "doctor", "--workspace", str(tmp_path / "ws")], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")})
    assert "the setup stage failed" in d.stdout and "areal 9.9.9" in d.stdout and AREAL_VERSION in d.stdout, d.stdout


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare(1) to mount a small tmpfs")
def test_a_setup_that_exits_0_on_a_disk_it_filled_is_named_a_full_disk_not_a_bug(tmp_path):
    """The command fills the volume with a file of its own and exits 0: the env cannot be marked ready. A
    stage error naming the full disk (before: an OSError, which the boot calls "a bug in podkit"); the
    command's file is left, the env it could not finish is removed."""
    src = checkout(tmp_path / "src")
    ws = tmp_path / "ws"
    ws.mkdir()
    command = f"head -c 64M /dev/zero > {ws}/filler; exit 0"
    env = {**smoke_env(ws, free_port()), "PODKIT_REPO_SETUP": command}
    script = (f"mount -t tmpfs -o size=16m tmpfs {ws} || exit 99; cp -a {src} {ws}/repo; "
              f"{' '.join(PODKIT)} setup; echo rc=$?; ls -A {ws}/envs; ls {ws}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=170)
    if r.returncode == 99 or "unshare failed" in r.stderr:
        pytest.skip(f"no tmpfs mount in a user namespace here: {r.stderr.strip()[-200:]}")
    out = r.stdout.splitlines()
    assert "rc=1" in out, r.stdout + r.stderr
    assert "ran out of disk space" in r.stderr and f"free now: {ws} (the environments): 0 MiB free" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "bug in podkit" not in r.stderr, r.stderr
    assert not [n for n in out if n.startswith("setup-")] and "filler" in out, out


def test_a_directory_where_setup_log_1_goes_is_left_and_the_log_is_still_bounded(tmp_path, monkeypatch):
    checkout(tmp_path)
    monkeypatch.setattr(setup, "LOG_MAX_BYTES", 64 << 10)
    cfg = cfg_for(tmp_path, "python -c \"[print('x' * 99) for i in range(5000)]\"")
    (cfg.log_dir / "setup.log.1").mkdir(parents=True)
    (cfg.log_dir / "setup.log.1" / "notes").write_text("someone's")
    (cfg.log_dir / "setup.log").write_text("the build before\n")
    assert setup.run(cfg)["python"]
    assert (cfg.log_dir / "setup.log").stat().st_size <= (64 << 10) + 200
    assert (cfg.log_dir / "setup.log.1" / "notes").read_text() == "someone's"


def test_a_ready_env_that_moved_torch_since_is_refused_on_reuse_and_left_as_it_is(tmp_path):
    repo = checkout(tmp_path)
    py = json.loads(podkit_setup(tmp_path).stdout)["python"]
    w = wheel(repo / "wheels", "torch", "0.0.2")  # a pip install by hand into the env (or an env built before the check)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", str(w)], check=True, capture_output=True, timeout=120)
    r = podkit_setup(tmp_path)
    assert r.returncode == 1 and "torch 0.0.2 where podkit runs torch" in r.stderr, r.stderr
    assert "is left as it is" in r.stderr and Path(py).exists(), r.stderr


def test_a_build_killed_half_way_is_pruned_but_one_still_being_built_is_not(tmp_path):
    checkout(tmp_path)
    envs = tmp_path / "ws" / "envs"
    dead, live = envs / "setup-00000000000000aa", envs / "setup-00000000000000bb"
    for env, pid in ((dead, 2**22 + 1), (live, os.getpid())):  # a pid no kernel hands out; this test's own
        (env / "lib").mkdir(parents=True)
        start = proc.starttime(pid)
        (env / setup.BUILT_BY).write_text(json.dumps({"pid": pid, "starttime": start if start is not None else 1}))
    assert setup.run(cfg_for(tmp_path))["python"]
    assert not dead.exists() and (live / setup.BUILT_BY).is_file()
