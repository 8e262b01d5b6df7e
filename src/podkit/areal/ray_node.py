"""`podkit run ray`: this node of a multi-node run's Ray cluster, as `ray start --block`.

Rank 0 is the head (GCS on cluster.head:cluster.ray_port); the others wait for the head to accept
connections and join it. Each node announces itself with the resource `podkit-node-<rank>`, which is
how the launcher on rank 0 names a missing node.

Ray starts each worker in a session of its own, so supervisord's group stop reaches the raylet but
not the workers, nor what they forked (DataLoader workers, SGLang's processes). This program stays
Ray's parent: it records every worker's process group as it appears (ray-node.json in the run dir)
and kills what is left of them when Ray has stopped, or at its next start after it was killed.

A worker node that cannot join (the head at cluster.head:ray_port not answering for cluster.join_timeout_s,
or `ray start` ending, or running that long without its raylet, before it joined) is bounded like the
trainer (loopbound.py): each such start in a row waits trainer.restart_delay_s, doubled, first, and after
trainer.max_failures of them the program stays stopped. ray-loop.json says why, naming the head, for status, health, doctor and the cost guard, which
stops a pod that cannot train. `podkit ctl start ray`, or a new boot, counts from zero.

Ray's tasks inherit this environment, which is why what they need is set here, before Ray starts:
NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME (cluster.ifname) and SIGINT at its default. A process started
with SIGINT ignored passes that on through exec, and then `ray.cancel` (which AReaL's launcher uses
to stop its SGLang task) does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.areal.command import clear_leftovers, set_pdeathsig
from podkit.areal.heartbeat import heartbeats
from podkit.host import proc, supervisord
from podkit.judge import loopbound

_log = log.get("ray")


def ray_bin() -> str | None:
    beside = Path(sys.executable).with_name("ray")  # the environment AReaL and Ray are installed in
    return str(beside) if beside.exists() else shutil.which("ray")


def temp_dir(cfg) -> Path:
    """Ray's sessions and sockets: local disk, per node (never the shared volume). Ray puts unix sockets
    ~60 bytes deep in it (sun_path holds 107): a long run dir gets a short directory named by its hash."""
    own = cfg.run_path / "ray"
    if len(os.fsencode(str(own))) <= 40:
        return own
    import hashlib

    digest = hashlib.sha1(os.fsencode(str(cfg.run_path))).hexdigest()[:10]
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"podkit-ray-{digest}"


def node_resource(rank: int) -> str:
    return f"podkit-node-{rank}"


def argv(cfg, ray: str) -> list[str]:
    c = cfg.cluster
    args = [ray, "start", "--block", "--node-ip-address", c.node_addr, "--temp-dir", str(temp_dir(cfg)),
            "--disable-usage-stats", "--resources", json.dumps({node_resource(c.rank): 1})]
    if c.gpus:
        args += ["--num-gpus", str(c.gpus)]
    if c.rank == 0:
        return [*args, "--head", "--port", str(c.ray_port), "--include-dashboard=false"]
    return [*args, "--address", f"{c.head}:{c.ray_port}"]


def environment(cfg, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    if cfg.cluster.ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = cfg.cluster.ifname
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def wait_for_head(cfg, stopping: threading.Event | None = None, interval: float = 2.0) -> str | None:
    """None once the head accepts connections; else why not (a timeout, or `stopping` set)."""
    c = cfg.cluster
    t0, told = time.monotonic(), 0.0
    while not reachable(c.head, c.ray_port):
        if stopping is not None and stopping.is_set():
            return "stopping"
        waited = time.monotonic() - t0
        if waited > c.join_timeout_s:
            return (f"the Ray head at {c.head}:{c.ray_port} did not answer for {waited:.0f}s (cluster.join_timeout_s); "
                    "is rank 0 up, and is the port open between the nodes?")
        if waited - told >= 30:
            _log.info(f"waiting for the Ray head at {c.head}:{c.ray_port} ({waited:.0f}s)")
            told = waited
        time.sleep(interval)
    return None


# `ray start --block` still up this long after its start, with its raylet running: the node joined (a
# worker that cannot register with the head it reached ends within seconds). Ray starts the raylet only once
# it has reached the head's GCS: against a port that answers but is no GCS (cluster.ray_port naming another
# service, a head that hangs) `ray start` retries for many minutes without one, and has not joined.
JOINED_S = 30.0


def raylet_running(root: int) -> bool:
    procs = proc.processes()
    below = set(proc.descendants(root, procs))
    return any(p.pid in below and p.name == "raylet" and not p.gone for p in procs)


class Join(loopbound.Loop):
    """A worker node's starts in a row that did not join the cluster (the trainer's loop bound, for `ray`)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, records.RAY_LOOP, "ray", "joining the cluster", _log)
        self.rec["head"] = f"{cfg.cluster.head}:{cfg.cluster.ray_port}"

    def hold_off(self) -> None:
        self.rec["starts"] = self.count("starts") + 1
        wait = self.wait_s(self.count("failures"))
        self.save()
        if wait > 0:
            _log.info(f"back-off: waiting {wait:.0f}s before this start ({self.count('failures')} of "
                      f"{self.cfg.trainer.max_failures} starts in a row did not join the head at {self.rec['head']})")
            time.sleep(wait)

    def joined(self) -> None:
        self.rec.update(failures=0, gave_up=False, why=None, joined=time.time())
        self.save()

    def failed(self, why: str) -> int:
        """The exit code for supervisord once this start did not join: 1 (restarted), or 0 at the bound (the
        program stays stopped: supervisord's exitcodes)."""
        failures = self.rec["failures"] = self.count("failures") + 1
        limit = self.cfg.trainer.max_failures
        self.rec.update(last_failure=time.time(), why=why)
        if limit and failures >= limit:
            self.rec["gave_up"] = True
            self.save()
            message = (f"this node (rank {self.cfg.cluster.rank}) cannot join its cluster: {failures} starts in a row "
                       f"did not join the Ray head at {self.rec['head']}; the last: {why}")
            hint = ("start rank 0 (its `ray` program is the head), check cluster.head and cluster.ray_port and that "
                    "the port is open between the nodes; then `podkit ctl start ray`")
            _log.error(f"ray stays stopped (trainer.max_failures {limit}): {message} | hint: {hint}")
            self.tell(f"{message} | fix: {hint}", "cluster")
            code = 0
        else:
            self.save()
            _log.error(f"{why} ({failures} of {limit or 'unbounded'} starts in a row that did not join); restarting "
                       f"in {self.delay_s(failures):.0f}s")
            code = 1
        # An exit within startsecs is a failed start to supervisord (its own retries, then FATAL): this bound
        # is the one that counts.
        supervisord.wait_started(self.cfg.socket_path, "ray")
        return code


def main(cfg) -> int:
    ray = ray_bin()
    if not ray:
        _log.error("Ray is not installed in this environment (the AReaL environment has it: rehearse/deps.txt); a "
                   "multi-node run needs it on every node")
        return 2
    c = cfg.cluster
    bound = Join(cfg) if c.rank > 0 else None
    if bound:
        bound.hold_off()
        why = wait_for_head(cfg)
        if why:
            return bound.failed(why)
    temp_dir(cfg).mkdir(parents=True, exist_ok=True)
    for pid in clear_leftovers(cfg.run_path, records.RAY_NODE):
        _log.warn(f"killed pid {pid}, left by this node's previous Ray")
    args = argv(cfg, ray)
    _log.info(f"node rank {c.rank} of {c.nodes} at {c.node_addr}: {' '.join(args[1:])}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # inherited by Ray: see the module's docstring
    # Its own group: supervisord's group stop must not reach the raylet (and this node's trainer ranks
    # with it) before they have finished their step; this program stops Ray itself.
    # Dead with this program even when it is SIGKILLed (Ray's own processes share its fate), so a
    # restarted program does not find the port taken.
    child = subprocess.Popen(args, env=environment(cfg), start_new_session=True,  # noqa: PLW1509
                             preexec_fn=set_pdeathsig)
    groups: dict[int, int] = {child.pid: proc.starttime(child.pid) or 0}
    records.RAY_NODE.write(cfg.run_path, {"groups": [[g, t] for g, t in groups.items()]}, mode=0o600)
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    started, joined, not_joined = time.monotonic(), bound is None, None
    while child.poll() is None and not stop.wait(2.0):
        track(child.pid, groups, cfg.run_path)
        up = time.monotonic() - started
        if joined or child.poll() is not None:  # ended meanwhile: said below, as an end
            continue
        if raylet_running(child.pid):
            if up >= JOINED_S:
                joined = True
                bound.joined()
                _log.info(f"joined the Ray head at {c.head}:{c.ray_port}")
        elif up >= c.join_timeout_s and child.poll() is None:
            not_joined = (f"`ray start` reached {c.head}:{c.ray_port} but did not join it in {up:.0f}s "
                          "(cluster.join_timeout_s; no raylet: something answers on that port, not a Ray head's "
                          "GCS: is cluster.ray_port the head's Ray port?)")
            _log.error(not_joined)
            break
    if child.poll() is None and c.rank > 0:
        let_ranks_checkpoint(cfg)
    if child.poll() is None:
        child.terminate()  # Ray drains, then stops its processes
        try:
            child.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
    rc = child.wait()
    killed = proc.kill_groups(list(groups.items()))
    records.RAY_NODE.path(cfg.run_path).unlink(missing_ok=True)
    if killed:
        _log.info(f"killed {len(killed)} process(es) Ray's workers left")
    _log.info(f"ray exited with {rc}")
    if stop.is_set():
        return 0
    if not_joined:
        return bound.failed(not_joined)
    if not joined:
        return bound.failed(f"`ray start` ended (exit {rc}) {time.monotonic() - started:.0f}s after its start, "
                            f"before it joined the Ray head at {c.head}:{c.ray_port}: ray.log above says why")
    return rc or 1


STOP_WAIT_S = 15.0  # for Ray to drain (it would take up to 30 s); the ranks have checkpointed by then


def track(root: int, groups: dict[int, int], run_dir: Path) -> None:
    """Record each process group led by a descendant of Ray (a worker's session) as it appears."""
    procs = proc.processes()
    fresh = {p.pid: p.starttime for p in procs if p.pid in set(proc.descendants(root, procs))
             and p.pgid == p.pid and p.pid not in groups}
    if fresh:
        groups.update(fresh)
        # A group outlives its leader: a SIGKILLed worker's SGLang server is still in it, holding its GPU.
        alive = {g: t for g, t in groups.items() if proc.group_members(g, t)}
        groups.clear()
        groups.update(alive)
        records.RAY_NODE.write(run_dir, {"groups": [[g, t] for g, t in groups.items()]}, mode=0o600)


def let_ranks_checkpoint(cfg) -> None:
    """A node leaving mid-run (its container stopping): its trainer ranks would die with Ray, mid-step,
    and the run would lose the step. Ask every rank of the run to stop after its step (the request rank
    0's SIGTERM makes, on the shared volume), and wait, up to trainer.stop_grace_s, for this node's."""
    shared = cfg.workspace_path / ".podkit"  # rank 0's records
    rec = records.CLUSTER.read(shared)
    run = rec.get("run")
    if rec.get("state") != "running" or not run:
        return

    def here() -> list[dict]:
        return [hb for hb in heartbeats(shared, run) if hb.get("node") == cfg.cluster.node_addr
                and proc.same_process(hb.get("pid") or 0, hb.get("start") or 0)]

    ranks = here()
    if not ranks:
        return
    _log.info(f"stopping: asking the run's ranks to stop after their step (rank(s) "
              f"{', '.join(str(hb['rank']) for hb in ranks)} run here) before Ray stops")
    try:
        records.CLUSTER_STOP.write(shared, {"run": run, "time": time.time()})
    except OSError as e:
        _log.warn(f"cannot ask the ranks to stop ({e.strerror}): they stop with Ray, mid-step")
        return
    deadline = time.monotonic() + cfg.trainer.stop_grace_s
    while here() and time.monotonic() < deadline:
        time.sleep(1)
