"""Nothing the trainer or the setup command started outlives it: what they start inherits a mark in its
environment (proc.OWNER_ENV: program and workspace), and whatever carries it, in any session or group,
is stopped TERM -> grace -> KILL when the program ends, at its next start and at boot. Another
workspace's marked processes and podkit itself are never touched. Every process here is started by
the test and killed by pid if a test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PODKIT, alive, free_port, smoke_env, wait_for
from podkit.host import proc

pytestmark = pytest.mark.timeout(60)

# A reward server that has gone its own way: a session of its own, deaf to SIGTERM.
DEAF = ("import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(600)")
POLITE = "import os, time; os.setsid(); print('ready', flush=True); time.sleep(600)"
# A daemon as a training script or setup.sh starts one: forked twice, reparented, deaf to SIGTERM. Its
# starter returns once the daemon is up (its pid file written), as a start script waits for its server:
# without that wait the daemon may be stopped before it has written its pid.
DAEMON = """import os, signal, sys, time
if os.fork():
    for _ in range(300):
        if os.path.exists(sys.argv[1]):
            break
        time.sleep(0.05)
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
# The trainer program (programs.run) with the fake trainer's module swapped for one that starts the
# daemon; as supervisord starts it, in a process group of its own.
TRAINER = """import os, signal, sys, threading
from podkit import config, programs
from podkit.judge import ending

def main(cfg):
    stop = threading.Event()
    ending.SIGNALS.forward = lambda *_: stop.set()  # as the real trainers take their stop signal
    if os.environ.get("START_DAEMON"):
        import subprocess
        env = {"PATH": os.environ["PATH"]} if os.environ.get("CLEAN_ENV") else None  # no mark inherited
        subprocess.run([sys.executable, os.environ["DAEMON"], os.environ["PIDFILE"]], check=True, env=env)
        print("daemon started", flush=True)
        stop.wait()
    return 0  # no supervisord here: a stop asked by whoever runs it, or an end; never counted

sys.modules["leftover_trainer"] = sys.modules[__name__]
programs.TABLE[("trainer", "fake")] = "leftover_trainer"
sys.exit(programs.run("trainer", config.load()))
"""


def mark(workspace: Path, program: str = "trainer") -> dict[str, str]:
    """The environment of a process that `program` of a single pod on `workspace` started."""
    return {**os.environ, proc.OWNER_ENV: proc.owner_mark(workspace / ".podkit", program)}


def start(procs, code: str, env: dict[str, str]) -> subprocess.Popen:
    p = procs.spawn([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def read_pid(path: Path, procs) -> int:
    pid = int(wait_for(lambda: path.exists() and path.read_text(), 10, what="the daemon's pid file"))
    procs.track(pid)
    return pid


def test_a_marked_process_in_its_own_session_is_stopped_and_another_workspaces_is_left(procs, tmp_path):
    """The deaf one gets SIGKILL after the grace, the polite one goes on SIGTERM; an identical process
    of another workspace, and the caller, which carries the same mark, are not touched."""
    ours, theirs = tmp_path / "ws", tmp_path / "other-ws"
    deaf, polite = start(procs, DEAF, mark(ours)).pid, start(procs, POLITE, mark(ours)).pid
    other = start(procs, DEAF, mark(theirs))
    caller = subprocess.run(
        [sys.executable, "-c", "import json, os, sys; from podkit.host import proc; "
         "ts = proc.stop_marked(sys.argv[1], {'trainer': 'left'}, grace_s=0.5, kill_wait_s=5); "
         "print(json.dumps({'me': os.getpid(), 'stopped': {t.pid: t.signal for t in ts}}))", str(ours / ".podkit")],
        env=mark(ours), capture_output=True, text=True, timeout=30)
    out = json.loads(caller.stdout)
    assert {int(k): v for k, v in out["stopped"].items()} == {deaf: "SIGKILL", polite: "SIGTERM"}
    assert not alive(deaf) and not alive(polite) and alive(other.pid)
    other.kill()


def run_trainer(procs, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"trainer-{len(procs.started)}.log"
    e = smoke_env(tmp_path / "ws", free_port(), DAEMON=str(tmp_path / "reward_server.py"),
                  PIDFILE=str(tmp_path / "daemon.pid"), **env)
    (tmp_path / "reward_server.py").write_text(DAEMON)
    (tmp_path / "ws").mkdir(exist_ok=True)
    p = procs.spawn([sys.executable, "-c", TRAINER], env=e, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
                    start_new_session=True)
    return p, out


def test_a_setsid_child_of_the_trainer_that_ignores_sigterm_is_gone_after_the_stop(procs, tmp_path):
    """supervisord's stop reaches the trainer's process group only; the daemon its script started in
    a session of its own is stopped (SIGKILL: it ignores SIGTERM) before the trainer program exits."""
    p, out = run_trainer(procs, tmp_path, START_DAEMON="1")
    daemon = read_pid(tmp_path / "daemon.pid", procs)
    wait_for(lambda: "daemon started" in out.read_text(), 10, what="the trainer to go on")
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0
    assert not alive(daemon)
    assert f"WARNING: stopped pid {daemon} ({sys.executable} {tmp_path / 'reward_server.py'}" in out.read_text()
    assert "left running by the trainer, which has ended, with SIGKILL" in out.read_text()


def test_a_daemon_with_a_clean_environment_is_found_by_ancestry_and_gone_after_the_stop(procs, tmp_path):
    """A script that double-forks a setsid daemon with env={"PATH": ...} passes on no mark: the trainer program is
    a child subreaper, so the daemon is re-parented to it and stopped, by ancestry, when it ends."""
    p, out = run_trainer(procs, tmp_path, START_DAEMON="1", CLEAN_ENV="1")
    daemon = read_pid(tmp_path / "daemon.pid", procs)
    wait_for(lambda: "daemon started" in out.read_text(), 10, what="the trainer to go on")
    assert proc.OWNER_ENV.encode() not in Path(f"/proc/{daemon}/environ").read_bytes(), "the daemon carries no mark"
    assert proc.read_stat(daemon).ppid == p.pid, "re-parented to the trainer program, not to PID 1"
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0
    assert not alive(daemon)
    assert f"WARNING: stopped pid {daemon} ({sys.executable} {tmp_path / 'reward_server.py'}" in out.read_text()


def test_what_a_killed_trainer_left_is_stopped_at_its_next_start(procs, tmp_path):
    """A trainer SIGKILLed (supervisord's last resort) runs no cleanup: its next start finds the daemon
    by its mark and stops it before training."""
    p, _ = run_trainer(procs, tmp_path, START_DAEMON="1")
    daemon = read_pid(tmp_path / "daemon.pid", procs)
    p.kill()
    p.wait(10)
    assert alive(daemon), "a daemon in a session of its own outlives its killed trainer"
    p2, out = run_trainer(procs, tmp_path, PODKIT_TRAINER_RESTART_DELAY_S="1")
    assert p2.wait(15) == 0
    assert not alive(daemon)
    assert f"stopped pid {daemon} (" in out.read_text()
    assert "left running by the trainer's previous start" in out.read_text()


def test_a_daemon_left_by_repo_setup_is_gone_once_setup_ends(procs, tmp_path):
    """repo.setup may start a server and return (exit 0): it is stopped, named with its pid and command
    line, and the setup still succeeds."""
    (tmp_path / "ws" / "repo").mkdir(parents=True)
    daemon_py, pidfile = tmp_path / "reward_server.py", tmp_path / "daemon.pid"
    daemon_py.write_text(DAEMON)
    env = {**smoke_env(tmp_path / "ws", free_port()), "PODKIT_REPO_SETUP": f"{sys.executable} {daemon_py} {pidfile}"}
    r = subprocess.run([*PODKIT, "setup", "--json"], capture_output=True, text=True, env=env, timeout=50)
    daemon = read_pid(pidfile, procs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not alive(daemon)
    assert f"stopped pid {daemon} ({sys.executable} {daemon_py}" in r.stdout + r.stderr
    assert "left running by repo.setup, which has ended" in r.stdout + r.stderr


def test_a_daemon_repo_setup_starts_with_a_clean_environment_is_gone_once_setup_ends(procs, tmp_path):
    """`env -i` strips the mark: the command runs below a child subreaper (podkit.host.subreap), which finds the
    daemon by ancestry, stops it, and says so through the stage."""
    (tmp_path / "ws" / "repo").mkdir(parents=True)
    daemon_py, pidfile = tmp_path / "reward_server.py", tmp_path / "daemon.pid"
    daemon_py.write_text(DAEMON)
    env = {**smoke_env(tmp_path / "ws", free_port()),
           "PODKIT_REPO_SETUP": f"env -i PATH=/usr/bin:/bin {sys.executable} {daemon_py} {pidfile}"}
    r = subprocess.run([*PODKIT, "setup", "--json"], capture_output=True, text=True, env=env, timeout=50)
    daemon = read_pid(pidfile, procs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not alive(daemon)
    assert f"stopped pid {daemon} ({sys.executable} {daemon_py}" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "left running by repo.setup, which has ended, with SIGKILL" in r.stdout + r.stderr


def test_boot_stops_what_the_previous_runs_trainer_and_setup_left_and_dry_run_only_names_it(procs, tmp_path):
    """The reap stage finds this workspace's marked processes (trainer's and setup's) whatever their
    session; `podkit reap --dry-run` names them and stops nothing; the boot stops them. Another
    workspace's stays."""
    ws = tmp_path / "ws"
    ws.mkdir()
    procs.workspaces.add(str(ws))
    trainer_left, setup_left = start(procs, DEAF, mark(ws)).pid, start(procs, DEAF, mark(ws, "setup")).pid
    other = start(procs, DEAF, mark(tmp_path / "other-ws"))
    env = smoke_env(ws, free_port(), PODKIT_REAP_GRACE_S="0.5")
    dry = subprocess.run([*PODKIT, "reap", "--dry-run", "--json"], capture_output=True, text=True, env=env,
                         timeout=30)
    report = json.loads(dry.stdout)
    assert {t["pid"]: t["outcome"] for t in report["leftovers"]} == {trainer_left: "would-kill",
                                                                      setup_left: "would-kill"}
    assert alive(trainer_left) and alive(setup_left)
    out = tmp_path / "boot.log"
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: "exec supervisord" in out.read_text(), 30, what="boot to reach supervisord")
    assert not alive(trainer_left) and not alive(setup_left) and alive(other.pid)
    other.kill()
    text = out.read_text()
    assert f"WARNING: stopped pid {trainer_left} (" in text and "left running by the previous run's trainer" in text
    assert f"WARNING: stopped pid {setup_left} (" in text and "left running by a previous repo.setup" in text
    p.send_signal(signal.SIGTERM)
    p.wait(30)


def test_the_mark_names_the_workspace_by_its_real_path_and_a_clusters_node_apart(tmp_path):
    """A workspace reached through a link is the same workspace; a sibling is not, nor is another node's
    state dir on a cluster's shared workspace (simulated nodes share one machine)."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ws")
    node0 = proc.owner_mark(tmp_path / "ws" / ".podkit", "trainer")
    assert proc.owner_mark(tmp_path / "link" / ".podkit", "trainer") == node0
    assert node0 not in (proc.owner_mark(tmp_path / "ws2" / ".podkit", "trainer"),
                         proc.owner_mark(tmp_path / "ws" / ".podkit" / "node-1", "trainer"),
                         proc.owner_mark(tmp_path / "ws" / ".podkit", "setup"))
