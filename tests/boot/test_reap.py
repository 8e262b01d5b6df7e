"""The reap stage against real processes holding stand-in device files in a temp dir (never /dev)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import PODKIT, alive, free_port, hold, smoke_env, wait_for
from podkit.areal import discovery
from podkit.boot import reap
from podkit.host import gpu, proc

pytestmark = pytest.mark.timeout(60)
def podkit_reap(devices_glob, *extra):
    r = subprocess.run([*PODKIT, "reap", "--devices", devices_glob, "--grace", "1", "--json", *extra],
                       capture_output=True, text=True, timeout=45)
    assert r.returncode in (0, 1), r.stderr
    return r, json.loads(r.stdout)  # --json: data on stdout, the log lines on stderr


def pids_of(report, outcome="killed"):
    return {h["pid"] for h in report["holders"] if h["outcome"] == outcome}


def test_holder_by_open_fd_is_killed_and_reported(procs, devices):
    """An open fd on a device file: SIGTERM kills it; the log line names pid, command and device."""
    pid, _ = hold(procs, "fd", devices / "nvidia0")
    r, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {pid} and not alive(pid)
    h = report["holders"][0]
    assert h["how"] == ["fd"] and h["signal"] == "SIGTERM"
    assert f"killed {pid} (" in r.stderr and f"held {devices}/nvidia0) after SIGTERM" in r.stderr


def test_holder_by_mmap_only_is_found(procs, devices):
    """A process that mapped the device and closed its fd still holds it (as CUDA does)."""
    pid, _ = hold(procs, "mmap", devices / "nvidia1")
    fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert str(devices / "nvidia1") not in fds, "the stand-in must hold by mapping only"
    _, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {pid} and report["holders"][0]["how"] == ["mmap"]


def test_holder_in_another_process_group_is_found(procs, devices):
    """Process groups and sessions do not hide a holder."""
    pid, _ = hold(procs, "fd", devices / "nvidia0", flags=["--new-group"])
    assert os.getpgid(pid) == pid != os.getpgid(0)
    _, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {pid}


def test_double_forked_orphan_is_found_and_killed(procs, devices):
    """A holder re-parented away from its starter (double fork + setsid) is still found."""
    pid, _ = hold(procs, "fd", devices / "nvidia2", flags=["--orphan"])
    assert proc.read_stat(pid).ppid != os.getpid()
    _, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {pid}
    wait_for(lambda: not alive(pid), 5, what="orphan gone")


def test_holder_ignoring_sigterm_gets_sigkill_after_the_grace(procs, devices):
    """SIGTERM ignored: SIGKILL once the grace is over, reported as such."""
    pid, _ = hold(procs, "fd", devices / "nvidia0", flags=["--ignore-term"])
    t0 = time.monotonic()
    r, report = podkit_reap(f"{devices}/nvidia*")
    h = report["holders"][0]
    assert h["pid"] == pid and h["outcome"] == "killed" and h["signal"] == "SIGKILL"
    assert h["seconds"] >= 1.0 and time.monotonic() - t0 < 20
    assert "after SIGKILL" in r.stderr


def test_a_stopped_holder_acts_on_its_sigterm_without_waiting_out_the_grace(procs, devices):
    """A holder stopped (^Z, a debugger, SIGSTOP) that handles SIGTERM itself, as a trainer does to
    checkpoint: it is continued after the SIGTERM, so it exits by its own handler, not by SIGKILL."""
    pid, _ = hold(procs, "fd", devices / "nvidia0", flags=["--handle-term"])
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: proc.read_stat(pid).state == "T", 5, what="the holder stopped")
    r, report = podkit_reap(f"{devices}/nvidia*", "--grace", "10")
    h = report["holders"][0]
    assert h["pid"] == pid and h["outcome"] == "killed" and h["signal"] == "SIGTERM", report
    assert h["seconds"] < 5 and not alive(pid)


def test_holder_with_children_takes_its_process_group_along(procs, devices):
    """Children in the holder's own group (nothing else there) are stopped with it."""
    pid, kids = hold(procs, "fd", devices / "nvidia0", flags=["--new-group", "--children", "2"])
    _, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {pid, *kids}
    assert {h["reason"] for h in report["holders"] if h["pid"] in kids} == {f"group of {pid}"}
    wait_for(lambda: not any(alive(p) for p in [pid, *kids]), 5, what="the whole group gone")


def test_several_holders_of_several_devices(procs, devices):
    """Each holder is reported with every device it holds."""
    a, _ = hold(procs, "fd", devices / "nvidia0", devices / "nvidia1")
    b, _ = hold(procs, "mmap", devices / "nvidia2")
    c, _ = hold(procs, "fd", devices / "nvidiactl")
    _, report = podkit_reap(f"{devices}/nvidia*")
    by_pid = {h["pid"]: h for h in report["holders"]}
    assert set(by_pid) == {a, b, c}
    assert by_pid[a]["devices"] == [str(devices / "nvidia0"), str(devices / "nvidia1")]
    assert not any(alive(p) for p in (a, b, c))


def test_unrelated_process_survives(procs, devices, tmp_path):
    """A process holding some other file, even in the same directory, is left alone."""
    other = tmp_path / "dev" / "other"
    other.write_bytes(b"\0" * 4096)
    bystander, _ = hold(procs, "fd", other)
    holder, _ = hold(procs, "fd", devices / "nvidia0")
    _, report = podkit_reap(f"{devices}/nvidia*")
    assert pids_of(report) == {holder}
    assert alive(bystander)


def test_a_glob_that_matches_more_than_device_files_stops_no_holder_of_the_rest(procs, devices, tmp_path):
    """PODKIT_DEVICES=<dir>/* (or a link named nvidia9 to a checkpoint): only GPU device files steer the
    reap; the holder of anything else is left alone, and the check that boot runs refuses the glob."""
    from podkit import config
    from podkit.areal import checks

    ckpt = devices / "step-40.pt"
    ckpt.write_bytes(b"\0" * 4096)
    (devices / "nvidia9").symlink_to(ckpt)
    trainer, _ = hold(procs, "fd", ckpt)
    holder, _ = hold(procs, "fd", devices / "nvidia0")
    r, report = podkit_reap(f"{devices}/*")
    assert pids_of(report) == {holder} and alive(trainer), report
    assert str(ckpt) not in report["devices"] and "not GPU device files" in r.stderr
    cfg = config.load(environ={"PODKIT_DEVICES": f"{devices}/*", "PODKIT_WORKSPACE": str(tmp_path / "ws")})
    problem = checks.devices(cfg)[0]
    assert problem[0] == "devices" and str(ckpt) in problem[1], problem
    assert checks.devices(config.load(environ={"PODKIT_DEVICES": f"{devices}/nvidia*"}))  # nvidia9 leads to it
    (devices / "nvidia9").unlink()
    assert checks.devices(config.load(environ={"PODKIT_DEVICES": f"{devices}/nvidia*"})) == []


def test_the_runner_holding_a_device_is_never_killed(devices):
    """podkit never counts itself or its ancestors: here the test runner holds the file."""
    with open(devices / "nvidia0", "rb"):
        r, report = podkit_reap(f"{devices}/nvidia*")
        assert report["holders"] == [] and alive(os.getpid())
        holders, _ = gpu.holders(gpu.match_devices(f"{devices}/nvidia*"))
        assert os.getpid() not in {h.pid for h in holders}


def test_no_holders_is_a_fast_noop(devices):
    """Nothing holds the files: nothing is signalled, and the scan is quick."""
    report = reap.free_gpus(f"{devices}/nvidia*", grace_s=1, kill_wait_s=1, gpu_timeout_s=0)
    assert report.holders == [] and report.scan_seconds < 2


def test_glob_matching_nothing_is_a_noop(tmp_path):
    """A pod without device files (or a typo) finds nothing and says so."""
    r, report = podkit_reap(f"{tmp_path}/none*")
    assert r.returncode == 0 and report["devices"] == [] and report["holders"] == []
    assert "no device files match" in r.stderr


def test_dry_run_kills_nothing(procs, devices):
    """--dry-run reports what it would kill and leaves it running."""
    pid, _ = hold(procs, "fd", devices / "nvidia0")
    r, report = podkit_reap(f"{devices}/nvidia*", "--dry-run")
    assert pids_of(report, "would-kill") == {pid} and alive(pid)
    assert f"would kill {pid}" in r.stderr


def test_podkit_finds_the_same_holders_as_fuser_and_lsof(procs, devices):
    """The /proc scan agrees with the tools the seeds used (fuser -m style and lsof) on the same files."""
    a, _ = hold(procs, "fd", devices / "nvidia0")
    b, _ = hold(procs, "mmap", devices / "nvidia1")
    files = [str(devices / f"nvidia{i}") for i in range(3)]
    ours = {h.pid for h in gpu.holders(files)[0]}
    fuser = subprocess.run(["fuser", *files], capture_output=True, text=True, timeout=30)
    fuser_pids = {int("".join(c for c in tok if c.isdigit())) for tok in fuser.stdout.split()}
    lsof = subprocess.run(["lsof", "-t", *files], capture_output=True, text=True, timeout=30)
    lsof_pids = {int(x) for x in lsof.stdout.split()}
    assert ours == fuser_pids == lsof_pids == {a, b}


def test_stale_supervisor_socket_and_pid_file_are_removed(tmp_path):
    """A dead supervisord's socket and pid file are cleared; nothing answering means stale."""
    import socket as socketmod

    run = tmp_path / "run"
    run.mkdir()
    s = socketmod.socket(socketmod.AF_UNIX)
    s.bind(str(run / "supervisor.sock"))
    s.close()  # bound, never listening: what a killed supervisord leaves
    (run / "supervisord.pid").write_text("999999\n")
    done = reap.previous_run(run, stop_live=False, grace_s=1, kill_wait_s=1)
    assert not (run / "supervisor.sock").exists() and not (run / "supervisord.pid").exists()
    assert len(done) == 2


def test_stale_name_resolve_records_of_our_trial_are_cleared(tmp_path):
    """AReaL's discovery records of this experiment/trial go; other trials' stay."""
    root = tmp_path / "name_resolve"
    ours = discovery.trial_dir(str(root), "podkit", "run")
    other = discovery.trial_dir(str(root), "podkit", "other")
    (ours / "gen_servers").mkdir(parents=True)
    (ours / "gen_servers" / "1").write_text("10.0.0.9:30000")
    (other / "gen_servers").mkdir(parents=True)
    assert discovery.clear(str(root), "podkit", "run")
    assert not ours.exists() and other.exists()


def test_boot_clears_stale_name_resolve_records_of_its_trial(stack_factory, tmp_path):
    """A dead run's server address under AReaL's name_resolve root is gone before the trainer starts."""
    root = tmp_path / "name_resolve"
    stale = discovery.trial_dir(str(root), "podkit", "run") / "gen_servers"
    stale.mkdir(parents=True)
    (stale / "0").write_text("127.0.0.1:1")
    s = stack_factory(PODKIT_TRAINER_NAME_RESOLVE_ROOT=str(root)).start()
    assert not stale.exists() and "cleared stale name_resolve records" in s.stdout()
    assert s.stop() == 0


def test_gpu_memory_check_reads_nvidia_smi(tmp_path, monkeypatch):
    """Where nvidia-smi exists its per-GPU memory and compute mode are read (a stand-in nvidia-smi
    script here, as this machine has no GPU)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '0, 3, Default'\necho '1, 0, Exclusive_Process'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    gpus = gpu.wait_free(timeout_s=1)
    assert gpus == [{"index": 0, "memory_used_mib": 3, "compute_mode": "Default"},
                    {"index": 1, "memory_used_mib": 0, "compute_mode": "Exclusive_Process"}]


def test_boot_reaps_only_when_asked_off_the_entrypoint(procs, devices, tmp_path):
    """`podkit boot` as a workstation process skips the reap (a holder survives) unless
    PODKIT_REAP_ENABLED=always, which frees the stand-in devices before supervisord starts."""
    pid, _ = hold(procs, "fd", devices / "nvidia0")
    for setting, survives in (("auto", True), ("always", False)):
        ws = tmp_path / f"ws-{setting}"
        ws.mkdir()
        env = smoke_env(ws, free_port(), PODKIT_DEVICES=f"{devices}/nvidia*", PODKIT_REAP_ENABLED=setting,
                        PODKIT_REAP_GRACE_S="1")
        out = tmp_path / f"boot-{setting}.log"
        p = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
        wait_for(lambda out=out: "exec supervisord" in out.read_text(), 30, what="boot to reach supervisord")
        assert alive(pid) == survives
        if survives:
            assert "skipped: podkit is not the container's entrypoint" in out.read_text()
        else:
            assert f"killed {pid} (" in out.read_text()
        p.send_signal(signal.SIGTERM)
        p.wait(30)
