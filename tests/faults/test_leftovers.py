"""What a dead run leaves behind, and the processes around a pod: a killed supervisord's programs, pid
files that now name someone else, a second pod on the same workspace, a stray SIGTERM, a closed
terminal, a checkpoint that does not load. Real supervisord, real processes, the smoke stack."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import PODKIT, alive, free_port, smoke_env, wait_for
from podkit import records
from podkit.host import lease, proc, supervisord

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def served_version(port: int):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_model_info", timeout=5) as r:
            return json.loads(r.read())["weight_version"]
    except OSError:
        return None


def test_a_killed_supervisords_programs_are_stopped_by_the_next_boot_even_with_reaping_off(stack_factory):
    """supervisord -9: its programs live on (the stand-in keeps its port). With GPU reaping off
    (reap.enabled never, no devices), the next boot still stops exactly those processes, by the
    process groups the run recorded, and the new stand-in gets the port. The trainer is frozen as
    soon as supervisord is gone (stuck, as a trainer can be), and so is the watchdog: a program that writes a
    line after its supervisord died dies of the broken pipe, the smoke trainer writes twice a second, and on a
    busy machine the watchdog's next line can come before the test looks."""
    s = stack_factory().start()
    s.wait_step(3)
    old = {name: s.pid(name) for name in ("sglang", "trainer", "watchdog", "logs")}
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    # Only now: a stopped member when its group is orphaned would get the kernel's SIGHUP.
    for name in ("trainer", "watchdog"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(old[name], signal.SIGSTOP)
    time.sleep(1)
    old = {name: pid for name, pid in old.items() if alive(pid)}  # the log listener ends with its stdin
    assert {"sglang", "watchdog"} <= set(old), "the leftovers this test needs"
    again = stack_factory(PODKIT_INFERENCE_PORT=str(s.port))
    again.port = s.port
    again.env["PODKIT_INFERENCE_PORT"] = str(s.port)
    again.start()
    out = again.stdout()
    for name, pid in old.items():
        assert f"stopped {pid} (" in out, (name, out[-3000:])
        assert not alive(pid)
    if "trainer" in old:  # unless it wrote in the few ms before it was frozen: continued, it acts on SIGTERM
        assert re.search(rf"stopped {old['trainer']} \(.*\) after SIGTERM", out), out[-3000:]
    assert "skipped: reap.enabled is never" in out
    new = wait_for(lambda: again.pid("sglang"), 30, what="the new stand-in")
    assert new != old["sglang"]
    wait_for(lambda: again.status()["inference"]["phase"] == "ready", 30, what="the new stand-in to serve the port")
    assert again.stop() == 0


def test_a_pid_file_and_a_run_record_naming_someone_else_are_never_trusted(procs, tmp_path):
    """The pid file says supervisord, and the run record names a pid that now belongs to another
    process (its start time differs): neither is stopped; the pid file is removed."""
    bystander = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)", "supervisord", "-n"])
    procs.track(bystander.pid)
    ws = tmp_path / "ws"
    ws.mkdir()
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "supervisord.pid").write_text(f"{bystander.pid}\n")
    start = proc.starttime(bystander.pid)
    records.RUN.write(run, {"supervisord": [bystander.pid, start + 12345]}, mode=0o600)
    records.group("trainer").write(run, {"program": "trainer", "pgid": bystander.pid, "start": start + 12345},
                                   mode=0o600)
    env = smoke_env(ws, free_port(), PODKIT_RUN_DIR=str(run))
    probe = ("import os, sys\nos.execve = lambda *a: (print('REACHED'), sys.stdout.flush(), os._exit(0))\n"
             "from podkit.cli import main\nmain(['boot'])")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert "REACHED" in r.stdout, r.stdout + r.stderr
    assert alive(bystander.pid) and "removed stale pid file" in r.stdout
    assert not (run / "supervisord.pid").exists()


def test_a_second_pod_on_the_workspace_waits_naming_the_holder_then_boots_by_itself(stack_factory, procs):
    """Two pods, one volume: the second waits in safe mode naming the first (host, pid, since); when
    the first stops, it releases the lease and the second boots without anyone's help."""
    first = stack_factory().start()
    second_run = first.workspace.parent / "run2"
    env = smoke_env(first.workspace, free_port(), PODKIT_RUN_DIR=str(second_run))
    out = first.workspace.parent / "second.log"
    second = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: "SAFE MODE" in out.read_text(), 30, what="the second pod to wait")
    text = out.read_text()
    assert f"is in use by another pod (host {os.uname().nodename}, pid {first.proc.pid}, since" in text
    assert second.poll() is None
    assert first.stop() == 0
    wait_for(lambda: "exec supervisord" in out.read_text(), 40, what="the second pod to boot by itself")
    assert lease.read(first.workspace / ".podkit")["pid"] == second.pid
    wait_for(lambda: supervisord.process_info(second_run / "supervisor.sock", "trainer"), 30,
             what="the second pod's supervisord to answer")
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0


def in_container(procs, tmp_path, name: str, env: dict, out: Path) -> subprocess.Popen:
    """`podkit boot` in a stand-in container on host networking: a pid namespace of its own (podkit is
    its PID 1) and a mount namespace where /etc/hostname is bind-mounted from a file of its own, as
    Docker does; the hostname and boot id are everyone's."""
    src = tmp_path / "containers" / name / "hostname"
    src.parent.mkdir(parents=True)
    src.write_text(os.uname().nodename + "\n")
    argv = ["unshare", "--pid", "--mount-proc", "--propagation", "private", "--kill-child=TERM",
            "sh", "-c", 'mount --bind "$0" /etc/hostname && exec "$@"', str(src), *PODKIT, "boot"]
    return procs.spawn(argv, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def test_two_containers_with_one_hostname_do_not_both_train_on_one_workspace(procs, tmp_path):
    """Containers on host networking share the host's name and boot id, and each sees only its own pids:
    the second took the first's lease for a dead one (its own PID 1 has another start time) and both
    trained into one checkpoint directory. It waits, naming the holder."""
    if subprocess.run(["unshare", "--pid", "--mount-proc", "--fork", "true"], capture_output=True).returncode:
        pytest.skip("cannot make pid and mount namespaces here (needs root)")
    ws = tmp_path / "ws"
    ws.mkdir()
    procs.workspaces.add(str(ws))
    first_out, second_out = tmp_path / "first.log", tmp_path / "second.log"
    first = in_container(procs, tmp_path, "a", smoke_env(ws, free_port(), PODKIT_RUN_DIR=str(tmp_path / "run-a"),
                                                         PODKIT_DEVICES=""), first_out)
    wait_for(lambda: "exec supervisord" in first_out.read_text(), 60, what="the first container's boot")
    held = lease.read(ws / ".podkit")
    assert held["pid"] == 1, held  # its PID 1, as the entrypoint of a container
    second = in_container(procs, tmp_path, "b", smoke_env(ws, free_port(), PODKIT_RUN_DIR=str(tmp_path / "run-b"),
                                                          PODKIT_DEVICES=""), second_out)
    wait_for(lambda: "SAFE MODE" in second_out.read_text() or "exec supervisord" in second_out.read_text(), 60,
             what="the second container's boot to wait or go on")
    assert "is in use by another pod" in second_out.read_text(), second_out.read_text()[-2000:]
    assert lease.read(ws / ".podkit") == held and held["container"].endswith("/containers/a/hostname"), held
    for p in (second, first):  # each container's PID 1 (unshare itself waits on it)
        for child in proc.children(p.pid):
            os.kill(child.pid, signal.SIGTERM)
        p.wait(60)


def test_a_lease_from_another_host_is_honoured_until_it_lapses(procs, tmp_path):
    """A pod on another host holds the workspace: this boot waits, naming it, and takes over by itself
    once the lease has gone unrenewed for guard.lease_s while it watched (the other pod died with its
    host). Its dates say nothing: "renewed" is dated an hour ago, by a clock that may be off by as much."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    other = {"host": "pod-on-another-host", "boot_id": "x", "pid": 4242, "start": 1, "since": time.time() - 3600,
             "renewed": time.time() - 3600, "token": "abc"}
    (ws / ".podkit" / "lease.json").write_text(json.dumps(other))
    env = smoke_env(ws, free_port(), PODKIT_GUARD_LEASE_S="30")
    out = tmp_path / "boot.log"
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: "SAFE MODE" in out.read_text(), 30, what="the boot to wait")
    waiting = time.monotonic()
    assert "host pod-on-another-host, pid 4242" in out.read_text() and "lapses after 30s" in out.read_text()
    for _ in range(2):  # the other pod renews (its count goes up): the wait starts over
        time.sleep(12)
        other["beat"] = other.get("beat", 0) + 1
        (ws / ".podkit" / "lease.json").write_text(json.dumps(other))
    renewed = time.monotonic()
    assert "exec supervisord" not in out.read_text(), "taken while it was renewed"
    wait_for(lambda: "exec supervisord" in out.read_text(), 60, what="the boot to take over")
    assert time.monotonic() - renewed >= 25 and time.monotonic() - waiting >= 50, "taken before it lapsed"
    sock = records.CURRENT.read(ws / ".podkit")["socket"]
    wait_for(lambda: supervisord.process_info(sock, "trainer"), 30, what="supervisord to answer")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


def test_a_pod_that_lost_its_lease_stops_training_without_writing_a_checkpoint(stack_factory):
    """This pod stalled past its lease and a pod on another host took the workspace: at its next step the
    trainer writes nothing more on the volume (no checkpoint, not even its progress record, which is the
    holder's now), stops (not restarted, not "finished"), and says who holds it."""
    s = stack_factory(PODKIT_TRAINER_CHECKPOINT_EVERY="3").start()
    s.wait_step(3)
    state = s.workspace / ".podkit"
    wait_for(lambda: (s.progress().get("checkpoint_step") or 0) >= 3, 30, what="a first checkpoint")
    other = {"host": "replacement-pod", "boot_id": "x", "pid": 4242, "start": 1, "since": time.time(),
             "renewed": time.time(), "token": "abc"}
    (state / "lease.json").write_text(json.dumps(other))
    wait_for(lambda: "lost the workspace to host replacement-pod, pid 4242" in s.log("trainer"), 60,
             what="the trainer to stop")
    ckpts = sorted(p.name for p in (s.workspace / "checkpoints").rglob("*") if p.is_file())
    prog = s.progress()
    assert prog.get("stopped") is None, "the holder's progress record is not this pod's to write"
    wait_for(lambda: s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 30, what="its exit")
    time.sleep(2)
    assert s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", "left stopped, not restarted"
    assert sorted(p.name for p in (s.workspace / "checkpoints").rglob("*") if p.is_file()) == ckpts
    assert s.progress() == prog, "nothing written after the loss"
    assert json.loads((state / "lease.json").read_text())["host"] == "replacement-pod", "never taken back"
    assert s.stop() == 0


def test_a_stray_sigterm_to_the_trainer_checkpoints_and_it_restarts_but_a_stop_ends_it(stack_factory):
    """Only a finished run (or supervisord's stop) ends the trainer: someone's `kill -TERM` makes it
    checkpoint, exit 75 and come back, resuming; `podkit ctl stop trainer` leaves it stopped."""
    s = stack_factory().start()
    s.wait_step(4)
    trainer = s.pid("trainer")
    os.kill(trainer, signal.SIGTERM)
    new = wait_for(lambda: (p := s.pid("trainer")) not in (0, trainer) and p, 40, what="the trainer to come back")
    assert "stopped by a SIGTERM that supervisord did not send (someone's kill), and restarted to resume at " \
           "step" in s.log("trainer")
    assert s.progress()["stopped"]["by"] == "stray SIGTERM", s.progress()
    wait_for(lambda: "resumed from checkpoint" in s.log("trainer").split(f"starting trainer (pid {new})")[-1], 30,
             what="the restarted trainer to resume")
    ctl = [os.path.join(os.path.dirname(sys.executable), "supervisorctl"),
           "-c", os.path.join(s.current()["run_dir"], "supervisorctl.conf")]
    subprocess.run([*ctl, "stop", "trainer"], check=True, timeout=60, capture_output=True)
    info = s.rpc().supervisor.getProcessInfo("trainer")
    assert info["statename"] == "STOPPED" and "stopped cleanly at step" in s.log("trainer")
    time.sleep(2)
    assert s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "STOPPED"
    assert s.stop() == 0


def test_sighup_to_podkit_up_stops_the_stack_it_owns(tmp_path, procs):
    """A closed terminal sends SIGHUP: `podkit up` stops supervisord and its programs, leaving none."""
    ws = tmp_path / "ws"
    env = smoke_env(ws, free_port())
    env.pop("PODKIT_CONFIG")
    procs.workspaces.add(str(ws))
    p = procs.spawn([*PODKIT, "up", "--smoke", "--workspace", str(ws)], env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
    wait_for(lambda: records.PROGRESS.read(ws / ".podkit").get("step", 0) >= 2, 60, what="training")
    current = records.CURRENT.read(ws / ".podkit")
    sup = current["supervisord_pid"]
    kids = proc.descendants(sup)
    p.send_signal(signal.SIGHUP)
    assert p.wait(30) == 0
    wait_for(lambda: not alive(sup) and not any(alive(k) for k in kids), 20, what="the whole stack gone")


def test_a_checkpoint_that_does_not_load_is_neither_resumed_from_nor_pushed(stack_factory):
    """The newest checkpoint is torn after the stop: the next run resumes from the one before it, and
    inference is given that one, with that step as its weight_version."""
    s = stack_factory(PODKIT_TRAINER_CHECKPOINT_EVERY="3").start()
    s.wait_step(7)
    assert s.stop() == 0
    ckpts = s.workspace / "checkpoints"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    steps = sorted(int(p.name[5:13]) for p in ckpts.glob("step-*.pt"))
    assert len(steps) >= 2 and latest.name == f"step-{steps[-1]:08d}.pt"
    latest.write_bytes(latest.read_bytes()[:100])  # torn by a disk that failed after the rename
    again = stack_factory(PODKIT_TRAINER_CHECKPOINT_EVERY="1000").start()
    wait_for(lambda: "resumed from checkpoint" in again.log("trainer"), 60, what="resume")
    assert f"resumed from checkpoint step-{steps[-2]:08d}.pt" in again.log("trainer")
    wait_for(lambda: served_version(again.port) == str(steps[-2]), 30, what="the loadable checkpoint served")
    assert again.stop() == 0


@pytest.mark.parametrize("planted", ["fifo", "directory", "a year ahead", "Infinity", "a minute ahead"])
def test_a_planted_lease_neither_blocks_the_boot_nor_holds_the_workspace_for_ever(tmp_path, planted):
    """A FIFO at lease.json would block the boot's read for ever (no safe mode, a pod billing); a directory
    could not be set aside: each is a lease that lapsed. A renewal dated far ahead (or Infinity) would hold
    the workspace until then: dates are the holder's clock, never compared, so any of them is honoured
    while it may be renewed, and lapses once it has gone unrenewed for the lease's length."""
    import threading

    state = tmp_path / ".podkit"
    state.mkdir()
    path = state / "lease.json"
    other = {"host": "pod-on-another-host", "boot_id": "x", "pid": 4242, "start": 1, "since": time.time(),
             "token": "abc"}
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "directory":
        (path / "x").mkdir(parents=True)
        (state / "lease.json.old" / "y").mkdir(parents=True)
    else:
        ahead = {"a year ahead": time.time() + 365 * 86400, "a minute ahead": time.time() + 60}.get(planted)
        path.write_text(json.dumps({**other, "renewed": ahead if ahead else float("inf")}))
    got = []
    t = threading.Thread(target=lambda: got.append(lease.acquire(state, 2, pid=os.getpid())), daemon=True)
    t.start()
    t.join(10)
    assert got, "the lease read blocked"
    if planted in ("fifo", "directory"):
        assert got[0] is None and lease.read(state)["pid"] == os.getpid(), "taken over"
        return
    assert got[0]["host"] == "pod-on-another-host", "honoured while it may be renewed"
    time.sleep(2.2)
    assert lease.acquire(state, 2, pid=os.getpid()) is None and lease.read(state)["pid"] == os.getpid(), \
        "lapsed, unrenewed for the lease's length"
