"""An adversarial pass over issue 34's and 37's fixes (setup, weights --from, the start-up timeline, the
weight-update deadline, trainer.entry links, the lease, the stop budget, a worker outside its cluster):
hostile or unlucky inputs a real volume, machine or user produces, each kept as the scenario it broke."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import ROOT, wait_for
from podkit import config, records

pytestmark = pytest.mark.timeout(120)


def _cfg(tmp_path, yaml="a40-1gpu.yaml", **env):
    return config.load(ROOT / "configs" / yaml, environ={"PODKIT_WORKSPACE": str(tmp_path), **env})


def test_a_busy_server_whose_log_has_no_weight_update_in_view_is_not_updating_nor_restarted(tmp_path, monkeypatch):
    """A log whose last 64 KiB hold no update line (a server answering requests between two steps, or one
    that never updated) read as 'an update in flight': the generation check stayed off and, past
    weight_update_deadline_s, the healthy server was restarted. A missing log is no update either."""
    from podkit.judge import health
    from podkit.programs import watchdog

    cfg = _cfg(tmp_path, PODKIT_WATCHDOG_WEIGHT_UPDATE_DEADLINE_S="10", PODKIT_TRAINER_WEIGHT_UPDATE_TIMEOUT_S="10",
               PODKIT_WATCHDOG_GENERATION_PROBE_S="0")
    log = cfg.log_dir / "sglang.log"
    log.parent.mkdir(parents=True)
    assert not health.updating(log), "a missing log"
    w = watchdog.Watchdog(cfg)
    restarts = []
    monkeypatch.setattr(w, "restart", restarts.append)
    with open(log, "w") as f:
        f.write(f"[2026-11-25 14:00:00] {health.START_MARK}sglang\n")
        f.write("[2026-11-25 14:00:01] Update engine weights online from disk begin. path=/ckpt/1\n")
        f.write("[2026-11-25 14:00:02] Update weights end.\n")
        f.writelines(f"[2026-11-25 14:00:03] Prefill batch. #new-seq: 1, #new-token: {i}\n" for i in range(3000))
    assert not health.updating(log)
    assert all(w.check_generation(1000.0 + t) for t in (0, 11, 30)) and restarts == []
    assert records.WATCHDOG.read(cfg.state_dir) == []


# Takes the lease saying it renews every 2 s (a pod's listener says every minute), then renews that often.
SLOW_HOLDER = """
import sys, time
from pathlib import Path
from podkit.host import lease
state = Path(sys.argv[1])
assert lease.acquire(state, 1, renew_s=2) is None, lease.read(state)
print("held", flush=True)
while True:
    time.sleep(2)
    assert lease.renew(state)
"""


@pytest.mark.parametrize("where", ["another host", "another container on this host"])
def test_a_lease_s_shorter_than_the_renewal_never_takes_the_workspace_from_a_live_pod(procs, tmp_path, where):
    """guard.lease_s may be 30 while the listener renews once a minute: a pod on another host (or another
    container here) lapsed between two renewals and a second pod took the workspace from a live one. Scaled
    down: renewals every 2 s, a lease of 1 s; the lease lapses only after two renewals are missed."""
    from lease_pods import can_unshare, on_another_host, spawn
    from podkit.host import lease

    if not can_unshare("--uts", "--mount", "--pid", "--mount-proc", "--fork"):
        pytest.skip("cannot make namespaces here (needs root)")
    state = tmp_path / ".podkit"
    state.mkdir()
    argv = [sys.executable, "-c", SLOW_HOLDER, str(state)]
    argv = on_another_host(tmp_path, argv) if where == "another host" else \
        ["unshare", "--pid", "--mount-proc", "--kill-child=KILL", *argv]
    holder = spawn(procs, argv, 0)
    assert holder.stdout.readline().strip() == "held"
    until = time.monotonic() + 7
    while time.monotonic() < until:
        assert lease.acquire(state, 1) is not None, f"taken from a live holder: {lease.read(state)}"
        time.sleep(0.2)
    assert "lapses after 9s" in lease.describe(lease.read(state), 1)
    holder.kill()
    holder.wait(10)
    killed = time.monotonic()
    wait_for(lambda: lease.acquire(state, 1) is None, 20, what="the lease to lapse")
    assert 2 <= time.monotonic() - killed <= 12


def test_a_setup_command_naming_a_link_that_loops_is_run_not_a_bug(tmp_path):
    """`pip install -r deps.txt` where deps.txt is a link to itself (a checkout's mistake): the key's
    Path.resolve raised RuntimeError ('Symlink loop'), shown as a bug in podkit; pip is what says what is
    wrong with the file, in the stage's error."""
    from podkit.boot import setup
    from podkit.errors import StageError

    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / "deps.txt").symlink_to("deps.txt")
    cfg = _cfg(tmp_path / "ws", "smoke.yaml", PODKIT_REPO_SETUP="cat deps.txt")
    with pytest.raises(StageError) as e:
        setup.run(cfg)
    assert "exited 1" in str(e.value) and "deps.txt" in str(e.value), e.value


def test_a_pipe_or_link_in_setup_logs_place_neither_blocks_the_boot_nor_is_written_through(tmp_path):
    """setup.log as a FIFO (planted, or a tool's leftover): opening it to append blocked the setup stage for
    ever (no reader; repo.setup_timeout_s runs only once the command has started). As a link, the build's
    output went into the file it names. Each is moved aside as setup.log.1 and a fresh log is written."""
    import os
    import threading

    from podkit.boot import setup

    cfg = _cfg(tmp_path / "ws", "smoke.yaml", PODKIT_REPO_SETUP="echo built")
    (tmp_path / "ws" / "repo").mkdir(parents=True)
    logs = cfg.log_dir
    logs.mkdir(parents=True)
    os.mkfifo(logs / "setup.log")
    done = []
    t = threading.Thread(target=lambda: done.append(setup.run(cfg)), daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # let the blocked open go, so the thread ends
        os.close(os.open(logs / "setup.log", os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("the setup stage blocked opening a FIFO in setup.log's place")
    assert done and done[0]["python"]
    assert "built" in (logs / "setup.log").read_text()
    assert not (logs / "setup.log.1").is_symlink()
    other = tmp_path / "someone-elses.txt"
    other.write_text("")
    (logs / "setup.log").unlink()
    (logs / "setup.log").symlink_to(other)
    cfg = _cfg(tmp_path / "ws", "smoke.yaml", PODKIT_REPO_SETUP="echo built again")
    assert setup.run(cfg)["python"]
    assert other.read_text() == "" and "built again" in (logs / "setup.log").read_text()


def test_weights_from_a_directory_with_many_paths_to_one_weights_file_copies_it_once(tmp_path):
    """Twenty links (and a hard link) to one weights file inside the model directory: each was copied as a
    file of its own (21 copies of the weights on the volume). Each file is copied once; its other paths are
    hard links to that copy, and read the same."""
    import os

    from podkit.boot import weights

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(4 << 20))
    for i in range(20):
        (src / f"alias-{i}.safetensors").symlink_to("model.safetensors")
    os.link(src / "model.safetensors", src / "hard.safetensors")
    dest = weights.copy_in(_cfg(tmp_path / "ws"), src)
    files = sorted(dest.iterdir())
    assert len(files) == 23
    assert all(p.read_bytes() == (src / "model.safetensors").read_bytes() for p in files if p.suffix == ".safetensors")
    inodes = {p.stat().st_ino for p in files if p.suffix == ".safetensors"}
    assert len(inodes) == 1, f"{len(inodes)} copies of one weights file"


def test_an_entry_module_whose_parent_packages_init_links_out_of_the_checkout_is_refused(tmp_path):
    """`trainer.entry: mypkg.train:main` with mypkg/train.py in the checkout and mypkg/__init__.py a link
    to a file outside it: importing mypkg.train runs that __init__.py first, and it was accepted."""
    from podkit.areal import checks

    repo, outside = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "mypkg" / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "evil.py").write_text("print('not the repo')\n")
    (repo / "mypkg" / "__init__.py").symlink_to(outside / "evil.py")
    (repo / "mypkg" / "sub" / "__init__.py").write_text("")
    (repo / "mypkg" / "sub" / "train.py").write_text("def main(argv): pass\n")
    (repo / "mypkg" / "train.py").write_text("def main(argv): pass\n")
    for entry in ("mypkg.train:main", "mypkg.sub.train:main"):
        cfg = config.load(ROOT / "configs/a40-4gpu.yaml", environ={
            "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_REPO_URL": "https://example.invalid/me/repo",
            "PODKIT_REPO_DEST": str(repo), "PODKIT_TRAINER_ENTRY": entry})
        found = [what for key, what, _ in checks.entry(cfg) if key == "trainer.entry"]
        assert found and f"leads to {outside / 'evil.py'}, outside the checkout" in found[0], (entry, found)


@pytest.mark.parametrize("skew", ["ten minutes", "nan", "inf"])
def test_a_clock_skew_hook_that_is_not_a_number_neither_stops_the_lease_nor_dates_it_nonsense(tmp_path, skew):
    """PODKIT_TEST_CLOCK_SKEW_S left set to what is not a finite number of seconds: the lease's take raised
    ValueError (a boot's preflight, the listener's renewal every minute), or wrote NaN/Infinity dates."""
    import math
    import subprocess

    state = tmp_path / ".podkit"
    state.mkdir()
    code = ("import sys; from pathlib import Path; from podkit.host import lease; s = Path(sys.argv[1]); "
            "assert lease.acquire(s, 60) is None and lease.renew(s); print(lease.read(s)['since'])")
    r = subprocess.run([sys.executable, "-c", code, str(state)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "PODKIT_TEST_CLOCK_SKEW_S": skew})
    assert r.returncode == 0, r.stderr[-2000:]
    since = float(r.stdout)
    assert math.isfinite(since) and abs(since - time.time()) < 60, since


def test_a_process_run_from_an_activated_old_env_keeps_it_from_pruning(procs, tmp_path):
    """A shell with an old environment activated (VIRTUAL_ENV, its bin first on PATH) runs `python` by name:
    its command line names no path and its interpreter maps the image's binary (the env's bin/python is a
    link to it), so the env was pruned under a running process."""
    import json
    from pathlib import Path

    from test_setup import checkout, podkit_setup, ready_envs

    checkout(tmp_path, "1.0")
    one = Path(json.loads(podkit_setup(tmp_path).stdout)["python"]).parent.parent
    user = procs.spawn(["python", "-c", "import time; time.sleep(120)"],
                       env={"PATH": f"{one / 'bin'}:/usr/bin:/bin", "VIRTUAL_ENV": str(one)})
    checkout(tmp_path, "2.0")
    podkit_setup(tmp_path)
    checkout(tmp_path, "3.0")
    r = podkit_setup(tmp_path)
    assert one.name in ready_envs(tmp_path) and f"pid {user.pid} runs from it" in r.stderr, r.stderr


def test_two_pods_that_see_one_dead_holder_lapse_at_once_do_not_both_take_the_workspace(tmp_path, monkeypatch):
    """Two waiting pods watch one dead holder's lease lapse. Pod A sets it aside and takes the workspace just
    after pod B judged the dead one lapsed: B then set A's fresh lease aside as if it were the dead one and took
    the workspace too (two trainers into one checkpoint directory). B now sees that what it moved was not what
    it judged, puts it back, and waits behind A."""
    import json

    from podkit.host import lease

    state = tmp_path / ".podkit"
    state.mkdir()
    dead = {"host": "pod-that-died", "boot_id": "x", "pid": 4242, "start": 1, "beat": 7, "token": "dead"}
    (state / "lease.json").write_text(json.dumps(dead))
    a = {"host": "pod-a", "boot_id": "y", "pid": 99, "start": 1, "beat": 0, "token": "pod-a", "renew_s": 60}
    real_live = lease.live

    def judged_then_a_takes_it(holder, ttl_s):
        alive = real_live(holder, ttl_s)
        if holder.get("token") == "dead":  # B's judgement, then A's take between it and B's rename
            alive = False
            (state / "lease.json").rename(state / "lease.json.old")
            (state / "lease.json").write_text(json.dumps(a))
        return alive

    monkeypatch.setattr(lease, "live", judged_then_a_takes_it)
    held = lease.acquire(state, 300)
    assert held is not None and held.get("token") == "pod-a", held
    assert lease.read(state)["token"] == "pod-a"

