"""`podkit run trainer` on rank 0 of a multi-node run: AReaL's Ray launcher, watched.

1. Wait for every node (`podkit-node-<rank>`, each with its GPUs) in Ray; a node that has not joined
   within cluster.join_timeout_s is named (log, notification, cluster.json) and still waited for.
2. Check that every node sees the shared volume: a nonce written here is read by a task on each node.
3. Run the driver (ray_driver.py: AReaL's `ray_main`) in a session of its own, and watch it:
   - a dead trainer rank (its heartbeat, <state_dir>/ranks/<rank>.json, older than cluster.rank_timeout_s):
     AReaL's launcher would wait for ever (a forked child keeps the dead worker's connection open), so
     the driver is stopped and started again, and AReaL resumes from its recover checkpoint;
   - a node gone from Ray for cluster.node_lost_s: its bundle cannot be placed again, so the driver
     would hang; it is stopped, and the run waits, naming the node, until the node is back;
   - SIGTERM (supervisord stopping the trainer): every rank is asked to stop after its step
     (cluster-stop.json on the shared volume, read by each rank's heartbeat thread) and writes its
     recover checkpoint; the driver ends with the trainer job.
   A stopped driver gets SIGINT first: AReaL's launcher then cancels its SGLang task gracefully (which
   kills the server's process tree) and its trainer tasks, as it does for Ctrl-C.
4. The exit code is the run's: 0 when rank 0's progress says it finished, SIGTERM's as for one pod.

Imports Ray: the AReaL environment only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from podkit import log, notify, records
from podkit.areal import checks, command, ray_node
from podkit.areal.heartbeat import RUN_ENV, heartbeat_dir, heartbeats
from podkit.host import proc
from podkit.judge import ending, verdict
from podkit.programs import refused

_log = log.get("trainer")
POLL_S = 2.0
DRIVER_STOP_S = 30.0  # SIGINT to SIGKILL for a driver being stopped
QUICK_RESTARTS = 3  # restarts in a row without a new step before the program exits and supervisord decides


# --- on each node, for the volume check ------------------------------------------------------------


def read_nonce(path: str) -> tuple[str, str]:
    """A Ray task on one node: what this node reads at the shared volume's path."""
    try:
        return socket.gethostname(), Path(path).read_text()
    except OSError as e:
        return socket.gethostname(), f"unreadable: {e.strerror}"


# --- rank 0 ---------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, cfg) -> None:
        self.cfg, self.c = cfg, cfg.cluster
        self.state_dir = cfg.state_dir
        self.stopping = threading.Event()
        self.record = records.CLUSTER.read(self.state_dir) or {}
        self.lost_since: dict[int, float] = {}
        self.addr_of: dict[int, str] = {n["rank"]: n["addr"] for n in self.record.get("nodes") or []
                                        if isinstance(n, dict) and isinstance(n.get("rank"), int)
                                        and isinstance(n.get("addr"), str)}
        self.told: set[tuple] = set()

    def note(self, state: str, why: str = "", **fields) -> None:
        if self.record.get("state") != state:
            self.record["since"] = time.time()
        self.record.update(state=state, why=why, time=time.time(), **fields)
        try:
            records.CLUSTER.write(self.state_dir, self.record)
        except OSError as e:
            _log.warn(f"cannot write {records.CLUSTER.name} ({e.strerror})")

    def tell_once(self, key: tuple, event: str, text: str, level: str = "warn") -> None:
        if key in self.told:
            return
        self.told.add(key)
        getattr(_log, level)(text)
        notify.send(event, text, self.state_dir)

    # Ray's view -----------------------------------------------------------------------------------

    def alive(self) -> dict[int, dict]:
        """rank -> the live Ray node that announced it (its address and GPUs)."""
        import ray

        out = {}
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            for r in range(self.c.nodes):
                if n.get("Resources", {}).get(ray_node.node_resource(r)):
                    out[r] = {"addr": n.get("NodeManagerAddress", "?"), "gpus": n["Resources"].get("GPU", 0)}
                    self.addr_of[r] = out[r]["addr"]
        self.record["nodes"] = [{"rank": r, "addr": a} for r, a in sorted(self.addr_of.items())]
        return out

    def missing(self) -> list[dict]:
        alive, want = self.alive(), self.gpus_per_node()
        out = []
        for r in range(self.c.nodes):
            if r not in alive:
                out.append({"rank": r, "addr": self.addr_of.get(r, "never joined"), "why": "not in the Ray cluster"})
            elif want and alive[r]["gpus"] < want:
                out.append({"rank": r, "addr": alive[r]["addr"],
                            "why": f"has {alive[r]['gpus']:g} GPU(s) in Ray, the run needs {want}"})
        return out

    def gpus_per_node(self) -> int:
        return self.c.gpus or checks.cluster_shape(self.cfg)["cluster.n_gpus_per_node"] or 0

    @staticmethod
    def describe(missing: list[dict]) -> str:
        return "; ".join(f"node rank {m['rank']} ({m['addr']}) {m['why']}" for m in missing)

    def wait_for_nodes(self, after: str) -> bool:
        """Until every node is in; False when stopping. Past join_timeout_s the missing nodes are named."""
        t0, told = time.monotonic(), 0.0
        while not self.stopping.is_set():
            missing = self.missing()
            if not missing:
                return True
            waited = time.monotonic() - t0
            self.note("waiting-for-nodes", f"{after}: {self.describe(missing)}", missing=missing)
            if waited >= self.c.join_timeout_s:
                self.tell_once(("missing", after, tuple(m["rank"] for m in missing)), "cluster",
                               f"{after}, still missing after {waited:.0f}s: {self.describe(missing)}. The run waits "
                               "for it and resumes from its checkpoint when it joins (its `ray` program connects to "
                               f"{self.c.head}:{self.c.ray_port}); `podkit ctl stop trainer` ends the wait", "error")
            elif waited - told >= 30 or told == 0:
                _log.info(f"{after}: waiting for {self.describe(missing)} ({waited:.0f}s)")
                told = waited or 0.001
            self.stopping.wait(POLL_S)
        return False

    def check_volume(self) -> list[str]:
        """Problems with the shared volume, one per node that does not see what rank 0 wrote."""
        import ray

        nonce = uuid.uuid4().hex
        path = self.state_dir / f".volume-check-{nonce}"
        path.write_text(nonce)
        task = ray.remote(num_cpus=0)(read_nonce)
        try:
            futures = {r: task.options(resources={ray_node.node_resource(r): 0.001}).remote(str(path))
                       for r in range(self.c.nodes)}
            problems = []
            for r, f in futures.items():
                try:
                    host, seen = ray.get(f, timeout=120)
                except Exception as e:  # noqa: BLE001 - Ray's task and timeout errors alike name the node
                    problems.append(f"node rank {r}: the check did not run ({type(e).__name__}: {e})")
                    continue
                if seen != nonce:
                    problems.append(f"node rank {r} ({host}) does not see the workspace {self.cfg.workspace_path} "
                                    f"rank 0 writes to: {path} reads {seen[:60]!r}")
            return problems
        finally:
            path.unlink(missing_ok=True)

    # the driver -----------------------------------------------------------------------------------

    def dead_ranks(self, run: str) -> list[str]:
        out, now = [], time.time()
        for hb in heartbeats(self.state_dir, run):
            # Only silence counts, even for a rank seen dead here: AReaL's own recover run (a failed task)
            # kills the ranks and starts new ones, whose heartbeats replace these within the timeout.
            age = now - hb["time"]
            if age > self.c.rank_timeout_s:
                gone = "" if proc.same_process(hb.get("pid") or 0, hb.get("start") or 0) else ", its process gone"
                out.append(f"rank {hb.get('rank')} (pid {hb.get('pid')} on {hb.get('node') or hb.get('host')}) has not "
                           f"said it is alive for {age:.0f}s (cluster.rank_timeout_s {self.c.rank_timeout_s:.0f}){gone}")
        return out

    def lost_nodes(self) -> list[dict]:
        now, alive = time.time(), self.alive()
        lost = []
        for r in range(self.c.nodes):
            if r in alive:
                self.lost_since.pop(r, None)
                continue
            since = self.lost_since.setdefault(r, now)
            if now - since >= self.c.node_lost_s:
                lost.append({"rank": r, "addr": self.addr_of.get(r, "?"), "why": f"gone from Ray for {now - since:.0f}s",
                             "since": since})
        return lost

    def stop_driver(self, driver: subprocess.Popen, why: str) -> int:
        _log.warn(f"stopping AReaL's launcher: {why}")
        if driver.poll() is None:
            try:
                os.kill(driver.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                driver.wait(DRIVER_STOP_S)
            except subprocess.TimeoutExpired:
                _log.warn(f"the launcher did not end within {DRIVER_STOP_S:.0f}s of SIGINT: killing it")
        proc.kill_groups([[driver.pid, self.driver_start]])
        return driver.wait()

    def run_driver(self, run: str) -> tuple[int, str]:
        """One run of AReaL's launcher; (exit code, why podkit stopped it or "")."""
        cfg = self.cfg
        argv = [sys.executable, "-m", "podkit.areal.ray_driver", command.bootstrap_script(), "--config",
                cfg.trainer.areal_config, *overrides(cfg)]
        env = environment(cfg, run)
        _log.info(f"starting AReaL's Ray launcher (run {run}): {' '.join(argv[2:])}")
        # Its own session (supervisord's group stop must not SIGTERM it: SIGINT is its clean stop), and
        # dead with this launcher (PDEATHSIG); recorded, so a start after a SIGKILLed launcher clears it.
        driver = subprocess.Popen(argv, env=env, start_new_session=True,  # noqa: PLW1509
                                  preexec_fn=command.set_pdeathsig)
        self.driver_start = proc.starttime(driver.pid) or 0
        records.TORCHRUN.write(self.cfg.run_path, {"groups": [[driver.pid, self.driver_start]]}, mode=0o600)
        asked_stop = False
        while driver.poll() is None:
            if self.stopping.is_set() and not asked_stop:
                asked_stop = True
                records.CLUSTER_STOP.write(self.state_dir, {"run": run, "time": time.time()})
                _log.info("SIGTERM: every rank stops after its step, with a recover checkpoint")
                grace = max(5.0, float(os.environ.get("PODKIT_TRAINER_STOP_GRACE_S", cfg.trainer.stop_grace_s)) - 10)
                timer = threading.Timer(grace, lambda: driver.poll() is None and os.kill(driver.pid, signal.SIGINT))
                timer.daemon = True  # the launcher's exit must not wait for it
                timer.start()
            if not asked_stop:
                dead = self.dead_ranks(run)
                if dead:
                    return self.stop_driver(driver, "; ".join(dead)), "dead-rank: " + "; ".join(dead)
                lost = self.lost_nodes()
                if lost:
                    return self.stop_driver(driver, self.describe(lost)), "node-lost"
            time.sleep(POLL_S)
        return driver.wait(), ""

    def free(self, timeout: float = 60.0) -> None:
        """Until the stopped run's tasks have given their GPUs back (AReaL's placement waits only 30 s)."""
        import ray

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and not self.stopping.is_set():
            total, avail = ray.cluster_resources().get("GPU", 0), ray.available_resources().get("GPU", 0)
            if avail >= total:
                return
            time.sleep(1)

    def main(self) -> int:
        import ray

        if not self.wait_for_head():
            return 1
        ray.init(address=f"{self.c.head}:{self.c.ray_port}", logging_level="ERROR", log_to_driver=False)
        # After ray.init: its core worker installs a SIGTERM handler that ends the process at once.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, ending.SIGNALS.on_signal)
        if not self.wait_for_nodes("the cluster is forming"):
            return 0
        problems = self.check_volume()
        if problems:
            for p in problems:
                _log.error(p)
            self.note("volume-not-shared", "; ".join(problems))
            _log.error("every node must see the same workspace (a RunPod network volume at /workspace on each "
                       "node): the trainer stays stopped until it does, then `podkit ctl start trainer`")
            return 0
        restarts, last_step = 0, records.PROGRESS.read(self.state_dir).get("step")
        while True:
            run = uuid.uuid4().hex[:12]
            self.note("running", f"AReaL's Ray launcher on {self.c.nodes} nodes", run=run, missing=[],
                      restarts=restarts)
            started, kills = time.time(), ending.oom_kills()
            rc, why = self.run_driver(run)
            if not why:
                return self.outcome(rc, started, kills and kills[0])
            step = records.PROGRESS.read(self.state_dir).get("step")
            restarts = 1 if step != last_step else restarts + 1
            last_step = step
            if restarts > QUICK_RESTARTS:
                why = (f"{restarts - 1} restarts of AReaL's launcher without a new step (the last: {why}); the "
                       "trainer stays stopped: `podkit doctor`, then `podkit ctl start trainer`")
                self.note("gave-up", why)
                self.tell_once(("gave-up", run), "cluster", why, "error")
                return 0  # supervisord would start it again into the same failure
            if why == "node-lost":
                self.tell_once(("lost", run), "cluster", f"the run stopped {records.at_step(step)}: "
                               f"{self.describe(self.lost_nodes() or [{'rank': '?', 'addr': '?', 'why': 'lost'}])}; "
                               "it resumes from its checkpoint when the node is back")
                if not self.wait_for_nodes(f"a node was lost {records.at_step(step)}"):
                    return self.outcome(rc, started, kills and kills[0])
            else:
                _log.warn(f"{why}: AReaL's launcher would wait for ever; restarting it from the recover checkpoint")
                self.note("restarting", why, restarts=restarts)
            self.free()
            if self.stopping.is_set():
                return self.outcome(rc, started, kills and kills[0])

    def wait_for_head(self) -> bool:
        why = ray_node.wait_for_head(self.cfg, self.stopping)
        if why and not self.stopping.is_set():
            _log.error(f"{why} (on rank 0 that is this node's `ray` program: see logs/ray.log)")
        return not why

    def outcome(self, rc: int, started: float, oom_before=None) -> int:
        """How the run ended, judged as one pod's is (verdict.judge), and the exit code for supervisord."""
        heartbeat = heartbeat_dir(self.state_dir)
        for p in heartbeat.glob("*.json"):
            p.unlink(missing_ok=True)
        records.CLUSTER_STOP.path(self.state_dir).unlink(missing_ok=True)
        end = verdict.judge(self.cfg, rc, started, oom_before=oom_before)
        if not end.stored and end.kind.name != ending.ENDED:
            ending.store(self.state_dir, end.rec)
        if end.family == ending.FINISHED:
            self.note("finished", f"training finished {records.at_step(end.step)}")
        elif end.family in (ending.FINAL, ending.STOP):  # a refusal in its own words; a stop, by whom
            self.note("stopped", (end.first() if end.family == ending.FINAL else "") or end.words()[:300])
        else:
            self.note("failed", f"AReaL's launcher exited {rc}: {end.words()[:300]}")
        return ending.exit_code(end, rc)


def overrides(cfg) -> list[str]:
    """One pod's overrides, with what a cluster needs shared: the disk weight updates go from a trainer
    node to an SGLang node, and name_resolve is how the nodes find each other."""
    root = cfg.workspace_path / "areal"
    shared = [f"++cluster.fileroot={root / 'updates'}", "++cluster.name_resolve.type=nfs",
              f"++cluster.name_resolve.nfs_record_root={cfg.state_dir / 'name_resolve'}"]
    own = [o for o in command.overrides(cfg) if not o.startswith(("++cluster.fileroot=", "++cluster.name_resolve."))]
    return [*shared, *own]


def environment(cfg, run: str) -> dict[str, str]:
    """One pod's trainer env, less the SPMD server address (AReaL's launcher gives each task its own)."""
    env = command.environment(cfg)
    for var in ("AREAL_SPMD_MODE", "AREAL_LLM_SERVER_ADDRS"):
        env.pop(var)
    env.update({RUN_ENV: run, "PODKIT_RAY_ADDRESS": f"{cfg.cluster.head}:{cfg.cluster.ray_port}"})
    if cfg.inference.kind == "standin-lm":
        from podkit.areal.ray_driver import STANDIN_ENV

        env[STANDIN_ENV] = "1"
    return env


def main(cfg) -> int:
    if refused(cfg, checks.cluster(cfg), _log):
        return 2
    for d in (cfg.workspace_path / "areal" / "updates", cfg.state_dir / "name_resolve", heartbeat_dir(cfg.state_dir)):
        d.mkdir(parents=True, exist_ok=True)
    for pid in command.clear_leftovers(cfg.run_path):
        _log.warn(f"killed pid {pid}, left by a previous launcher that was killed")
    c = Cluster(cfg)
    # Its stop signal (noted by ending.SIGNALS since the program's first line, or here for a bare launcher) asks
    # every rank to stop after its step.
    ending.SIGNALS.forward = lambda *_: c.stopping.set()
    if ending.SIGNALS.cfg is None:
        ending.SIGNALS.cfg = cfg
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ending.SIGNALS.on_signal)
    if ending.SIGNALS.at is not None:
        c.stopping.set()
    return c.main()
