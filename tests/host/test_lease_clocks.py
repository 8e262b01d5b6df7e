"""The workspace lease between two real processes that hold and contend for it: pods whose clocks
disagree (each process's clock faked through lease.SKEW_ENV), a pod on another host (a mount namespace
with a boot id and a UTS namespace with a hostname of its own), and containers on one host that share
the host's hostname file (pid namespaces of their own, no /etc/hostname mount)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PODKIT, free_port, smoke_env, wait_for
from lease_pods import can_unshare, on_another_host, spawn
from podkit.host import lease, proc, supervisord

pytestmark = pytest.mark.timeout(120)

# Takes the lease, says so, then renews it every half second until killed.
HOLDER = """
import sys, time
from pathlib import Path
from podkit.host import lease
state = Path(sys.argv[1])
assert lease.acquire(state, float(sys.argv[2])) is None, lease.read(state)
print("held", flush=True)
while True:
    time.sleep(0.5)
    assert lease.renew(state)
"""

# Asks for the lease five times a second, as a waiting boot does (one process: its watch goes on),
# and says when (the host's monotonic clock) it took it.
CONTENDER = """
import sys, time
from pathlib import Path
from podkit.host import lease
state, ttl, until = Path(sys.argv[1]), float(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < until:
    if lease.acquire(state, ttl) is None:
        print("took", time.monotonic(), flush=True)
        break
    time.sleep(0.2)
else:
    print("waited", flush=True)
"""


@pytest.mark.parametrize("skew_s", [-600, 600], ids=["10 minutes slow", "10 minutes fast"])
def test_a_live_holder_whose_clock_is_off_keeps_the_workspace_until_it_stops_renewing(procs, tmp_path, skew_s):
    """The holder, on another host, has a clock 10 minutes off: its dates were compared with the reader's,
    and the reader took the workspace at once from a pod that was training. The reader now watches the
    renewals: it waits while they come, and takes over a lease's length after the last one."""
    if not can_unshare("--uts", "--mount"):
        pytest.skip("cannot make UTS and mount namespaces here (needs root)")
    state = tmp_path / ".podkit"
    state.mkdir()
    ttl = 3
    holder = spawn(procs, on_another_host(tmp_path, [sys.executable, "-c", HOLDER, str(state), str(ttl)]), skew_s)
    assert holder.stdout.readline().strip() == "held"
    held = lease.read(state)
    assert held["host"] == "pod-on-another-host" and abs(held["since"] - time.time() - skew_s) < 5, held
    contender = spawn(procs, [sys.executable, "-c", CONTENDER, str(state), str(ttl), "30"], 0)
    time.sleep(3 * ttl)  # three leases' length of renewals
    assert contender.poll() is None, f"taken from a live holder: {contender.stdout.read()}"
    assert lease.read(state)["host"] == "pod-on-another-host"
    holder.kill()  # its host dies: no release, no more renewals
    holder.wait(10)
    killed = time.monotonic()
    line = contender.stdout.readline().split()
    assert line and line[0] == "took", line
    assert ttl - 1 <= float(line[1]) - killed <= ttl + 2, f"taken {float(line[1]) - killed:.1f}s after the holder died"
    assert lease.read(state)["host"] == os.uname().nodename
    assert contender.wait(10) == 0


def test_a_crashed_container_on_this_host_lapses_a_lease_after_its_last_renewal(procs, tmp_path):
    """Another pid namespace on this host (another container, or this one before a crash) holds the lease:
    its pid means nothing here (pid 1 is someone else), so the host's own boot clock tells how long ago it
    renewed. Renewing, it keeps the workspace; killed, it lapses a lease's length later."""
    if not can_unshare("--pid", "--mount-proc", "--fork"):
        pytest.skip("cannot make a pid namespace here (needs root)")
    state = tmp_path / ".podkit"
    state.mkdir()
    ttl = 2
    holder = spawn(procs, ["unshare", "--pid", "--mount-proc", "--kill-child=KILL", sys.executable, "-c", HOLDER,
                           str(state), str(ttl)], 0)
    assert holder.stdout.readline().strip() == "held"
    assert lease.read(state)["pid"] == 1, "the container's PID 1, as it sees itself"
    until = time.monotonic() + 3 * ttl
    while time.monotonic() < until:
        assert lease.acquire(state, ttl) is not None, "taken from a live container"
        time.sleep(0.2)
    holder.kill()  # unshare, and with it (--kill-child) the container's only process
    holder.wait(10)
    wait_for(lambda: not lease.live(lease.read(state), ttl), ttl + 2, what="the lease to lapse")
    assert lease.acquire(state, ttl) is None and lease.read(state)["pid"] == os.getpid()


def container_without_hostname_mount(procs, env: dict, out: Path) -> subprocess.Popen:
    """`podkit boot` as PID 1 of a pid namespace of its own, sharing everything else with the host:
    hostname, boot id, /etc/hostname (no mount of its own)."""
    argv = ["unshare", "--pid", "--mount-proc", "--kill-child=TERM", *PODKIT, "boot"]
    return procs.spawn(argv, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_two_containers_sharing_the_hosts_hostname_file_do_not_both_train(procs, tmp_path):
    """Two containers on one host, neither with an /etc/hostname mount of its own: the second took the
    first's lease for a dead one (its own PID 1 started at another time) and both trained into one
    checkpoint directory. It waits in safe mode naming the first, and boots by itself once the first stops."""
    if not can_unshare("--pid", "--mount-proc", "--fork"):
        pytest.skip("cannot make pid and mount namespaces here (needs root)")
    ws = tmp_path / "ws"
    ws.mkdir()
    procs.workspaces.add(str(ws))
    first_out, second_out = tmp_path / "first.log", tmp_path / "second.log"
    first = container_without_hostname_mount(
        procs, smoke_env(ws, free_port(), PODKIT_RUN_DIR=str(tmp_path / "run-a"), PODKIT_DEVICES=""), first_out)
    wait_for(lambda: "exec supervisord" in first_out.read_text(), 60, what="the first container's boot")
    held = lease.read(ws / ".podkit")
    assert held["pid"] == 1 and held["container"] == lease.container(), held
    second = container_without_hostname_mount(
        procs, smoke_env(ws, free_port(), PODKIT_RUN_DIR=str(tmp_path / "run-b"), PODKIT_DEVICES=""), second_out)
    wait_for(lambda: "SAFE MODE" in second_out.read_text() or "exec supervisord" in second_out.read_text(), 60,
             what="the second container's boot to wait or go on")
    assert "is in use by another pod" in second_out.read_text(), second_out.read_text()[-2000:]
    time.sleep(6)  # past safe mode's next look at the lease
    assert lease.read(ws / ".podkit") == held or lease.read(ws / ".podkit")["token"] == held["token"]
    assert "exec supervisord" not in second_out.read_text()
    for child in proc.children(first.pid):  # the first container's PID 1: it stops, releasing the lease
        os.kill(child.pid, signal.SIGTERM)
    first.wait(60)
    wait_for(lambda: "exec supervisord" in second_out.read_text(), 40, what="the second container to boot by itself")
    assert lease.read(ws / ".podkit")["token"] != held["token"]
    # Its supervisord answers, so it has its SIGTERM handler: a namespace's PID 1 ignores signals it has none for.
    wait_for(lambda: supervisord.process_info(tmp_path / "run-b" / "supervisor.sock", "trainer"), 30,
             what="the second container's supervisord to answer")
    for child in proc.children(second.pid):
        os.kill(child.pid, signal.SIGTERM)
    second.wait(60)


def test_a_renewal_never_writes_over_the_lease_a_replacement_took_a_moment_before(tmp_path, monkeypatch):
    """The stalled pod's listener read its own lease, then the replacement took the workspace, then the listener's
    write landed: a rename over the file put the stalled pod's lease back (two pods training on one workspace;
    seen as tests/faults/test_leftovers.py's lost-lease test failing under load). The renewal keeps the taker's."""
    state = tmp_path / ".podkit"
    state.mkdir()
    assert lease.acquire(state, 60) is None  # ours (this test process holds it)
    before = lease.read(state)
    assert lease.renew(state) and lease.read(state)["beat"] == before["beat"] + 1  # a renewal as ever
    taker = {"host": "replacement-pod", "boot_id": "x", "pid": 4242, "start": 1, "since": time.time(),
             "renewed": time.time(), "token": "abc", "beat": 0}
    real_rename = os.rename

    def taken_between(src, dst):  # the replacement takes the workspace after the listener's read
        if Path(src).name == lease.NAME:
            (state / lease.NAME).write_text(__import__("json").dumps(taker))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", taken_between)
    assert lease.renew(state) is False
    monkeypatch.setattr(os, "rename", real_rename)
    assert lease.read(state)["host"] == "replacement-pod" and lease.lost(state) == lease.who(taker)
    assert sorted(p.name for p in state.iterdir()) == [lease.NAME], "no temp file left"
