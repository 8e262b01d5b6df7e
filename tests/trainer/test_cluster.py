"""A multi-node run on a simulated cluster: two nodes on this machine (127.0.0.2 and 127.0.0.3: Ray
rewrites 127.0.0.1), each a `podkit up` of configs/cpu-cluster.yaml with its own run dir and Ray node,
sharing one workspace as a RunPod network volume would. AReaL 1.0.4's own Ray launcher places the
server task and the FSDP rank; the server task runs podkit's generating STAND-IN for SGLang (a tiny
causal LM; not SGLang). Everything else is real: supervisord, Ray, AReaL's launcher and GRPO trainer.
Each failure ends trained or explained, never hung."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from areal_stack import PYTHON, compile_cache, compile_env, example_remote, repo_env
from conftest import PODKIT, ROOT, alive, free_port, wait_for
from gitserver import git

# A lane of its own, beside the real-trainer lane: most of its minutes wait on the cluster (a node joining,
# a rank found dead, a node gone), not compute.
pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("cluster"), pytest.mark.timeout(1500),  # 365 s on a quiet machine, 732 s on one 2x slower
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(sh rehearse/env.sh))")]
ADDRS = ("127.0.0.2", "127.0.0.3")


class Cluster:
    def __init__(self, procs, root: Path, assets: Path, **env: str) -> None:  # noqa: F811
        self.procs, self.root = procs, root
        self.ws = root / "ws"
        self.ws.mkdir(parents=True)
        import shutil

        shutil.copytree(assets, self.ws / "rehearsal")
        procs.workspaces.add(str(self.ws))  # cleanup finds every process of this cluster by it, Ray's too
        port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        self.env.update({"PYTHONPATH": str(ROOT / "src"), "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-cluster.yaml"),
                         "PODKIT_WORKSPACE": str(self.ws), "PODKIT_CLUSTER_RAY_PORT": str(port), **env})
        self.nodes: dict[int, subprocess.Popen] = {}

    def start(self, rank: int, **own: str) -> subprocess.Popen:
        """Node `rank`'s `podkit up`; `own`: settings of this node alone (rank 0's waits for nodes)."""
        out = open(self.root / f"node{rank}.log", "ab")  # noqa: SIM115 - closed with the test's tmp dir
        env = {**self.env, "PODKIT_CLUSTER_RANK": str(rank), "PODKIT_CLUSTER_NODE_ADDR": ADDRS[rank],
               "PODKIT_RUN_DIR": str(self.root / f"run{rank}"), **own}
        self.nodes[rank] = self.procs.spawn([PYTHON, "-m", "podkit", "up"], env=env, stdout=out,
                                            stderr=subprocess.STDOUT)
        return self.nodes[rank]

    def podkit(self, rank: int, *args: str) -> subprocess.CompletedProcess:
        """A podkit verb as node `rank` runs it (its config and rank): how its HEALTHCHECK and status run."""
        env = {**self.env, "PODKIT_CLUSTER_RANK": str(rank), "PODKIT_CLUSTER_NODE_ADDR": ADDRS[rank],
               "PODKIT_RUN_DIR": str(self.root / f"run{rank}")}
        return subprocess.run([PYTHON, "-m", "podkit", *args], env=env, capture_output=True, text=True, timeout=60)

    def stop(self, rank: int, timeout: float = 180) -> int:
        p = self.nodes[rank]
        p.send_signal(signal.SIGTERM)
        return p.wait(timeout)

    def record(self, name: str) -> dict:
        try:
            return json.loads((self.ws / ".podkit" / name).read_text())
        except (OSError, ValueError):
            return {}

    def progress(self) -> dict:
        return self.record("progress.json")

    def log(self) -> str:
        return (self.ws / "logs" / "trainer.log").read_text(errors="replace")

    def finished(self, timeout: float = 300) -> dict:
        return self.wait(lambda: (self.record("cluster.json").get("state") == "finished") and self.progress(),
                         timeout, what="the cluster's run to finish")

    def wait(self, cond, timeout: float, what: str):
        """wait_for, and on a timeout what the run said last: CI keeps only the tail of its output, and a
        scenario of minutes that timed out says nothing of why without it."""
        try:
            return wait_for(cond, timeout, interval=1, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.said()}") from None

    def said(self, lines: int = 25) -> str:
        """The records and the last lines of podkit's and AReaL's launcher's own, from each node's log."""
        keep = ("[podkit:", "RayLauncher", "ERROR", "Error:", "exited:", "(raylet)")
        out = [f"progress.json: {json.dumps(self.progress())[:600]}",
               f"cluster.json: {json.dumps(self.record('cluster.json'))[:400]}"]
        for log in sorted(self.root.glob("node*.log")):
            text = log.read_text(errors="replace").splitlines()
            out.append(f"--- {log.name}, its last {lines} lines of note:")
            out += [line[:240] for line in text if any(k in line for k in keep)][-lines:]
        return "\n".join(out)

    def ours(self, needle: str) -> list[int]:
        """Processes of this cluster (by its workspace in their environment) whose command has `needle`."""
        mark = f"PODKIT_WORKSPACE={self.ws}".encode()
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
                cmd = open(f"/proc/{name}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if mark in env and needle.encode() in cmd:
                out.append(int(name))
        return out


@pytest.fixture
def cluster(procs, tmp_path, assets, tmp_path_factory):  # noqa: F811
    made: list[Cluster] = []
    shared = compile_env(compile_cache(tmp_path_factory))

    def make(**env: str) -> Cluster:
        c = Cluster(procs, tmp_path / f"c{len(made)}", assets, **{**shared, **env})
        made.append(c)
        return c

    yield make
    for c in made:
        for p in c.nodes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in c.nodes.values():
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                pass


def _sigign(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    return 0


# examples/my-repo's A40 YAML on the simulated cluster: the CPU overrides and grpo-cpu-cluster.yaml's own.
CLUSTER_OVERRIDES = ("++allocation_mode=sglang:d1+fsdp:d1 ++cluster.n_nodes=2 ++cluster.n_gpus_per_node=1 "
                     "'++rollout.scheduling_spec=[{cpu: 1, mem: 2}]' '++actor.scheduling_spec=[{cpu: 1, mem: 2}]'")


def test_a_two_node_cluster_trains_your_repo_through_a_dead_rank_a_dead_server_and_a_node_that_leaves(
        cluster, tmp_path):
    """One cluster start, the scenarios in turn (each cluster start costs minutes of CPU): a worker started
    before its head waits for it; the user's repo (examples/my-repo, trainer.entry) trains on the two nodes
    through AReaL's Ray launcher, one commit for the whole run (the branch moves after rank 0 synced, and
    node 1, joining again later, does not move the shared checkout); a SIGKILLed trainer rank is found dead
    and the run resumes from its checkpoint (AReaL's launcher alone would wait for ever); a killed SGLang
    server (the stand-in) is recovered by AReaL's recover run; a node that leaves is named while the run
    waits, and the run resumes when it returns and finishes. (podkit's own example trains on one pod in
    tests/trainer/test_rehearsal.py; on a cluster it takes the same launcher, and `make rehearse` runs it.)"""
    remote = example_remote(tmp_path / "remote")
    synced = remote.head()
    env = repo_env(remote)
    env["PODKIT_TRAINER_OVERRIDES"] += f" {CLUSTER_OVERRIDES} total_train_steps=24"  # room to leave before the end, on a busy machine too
    env["PODKIT_TRAINER_EPISODE_FAILURE_WINDOW_S"] = "20"  # a dead server: the rank stops sooner than in 60 s
    c = cluster(**env)
    c.start(1)  # a worker before its head: it waits for it
    time.sleep(2)
    c.start(0, PODKIT_CLUSTER_JOIN_TIMEOUT_S="10", PODKIT_CLUSTER_NODE_LOST_S="5")  # rank 0's settings
    c.wait(lambda: c.record("sync.json").get("new") == synced, 60, what="rank 0's sync")
    moved = remote.commit("NOTES.md", "the branch moved on after rank 0 synced\n")
    # A trainer rank SIGKILLed, once the uninterrupted run has stepped: its log-probs agree with the server's.
    gaps = []
    p = c.wait(lambda: (gaps.append((p := c.progress()).get("on_policy_logp_gap")) or
                        ((p.get("checkpoint_step") or 0) >= 2 and p)), 300, what="step 2's checkpoint")
    gaps = [g["max_abs"] for g in gaps if g]
    assert gaps and max(gaps) < 1e-3, gaps
    assert p["code"] == {"entry": "train.py", "commit": synced, "dirty": False}, p
    # Each node reports itself: node 1's HEALTHCHECK and status read its own supervisord and records.
    health = c.podkit(1, "status", "--health")
    assert health.returncode == 0 and health.stdout.strip() == "healthy", health.stdout + health.stderr
    own = [json.loads(c.podkit(r, "status", "--json").stdout)["supervisord"]["pid"] for r in (0, 1)]
    assert own[0] != own[1] and all(own), own
    hb = json.loads((c.ws / ".podkit" / "ranks" / "0.json").read_text())
    assert hb["pid"] in c.ours("ray::"), hb  # the rank is a Ray worker of this cluster
    os.kill(hb["pid"], signal.SIGKILL)
    p = c.wait(lambda: (p := c.progress()).get("pid") not in (None, hb["pid"]) and p.get("resumed_at") and p, 300,
               what="the run resumed after the dead rank, by a new rank")
    assert p["resumed_at"] >= 2, p
    assert "dead-rank" in c.log() and c.record("cluster.json")["restarts"] >= 1
    # The SGLang server killed, as the resumed run waits for its first rollouts (or trains on them): every
    # episode fails to reach it, and trainer.max_episode_failures in a row over episode_failure_window_s (20 s
    # here) stop the rank, which AReaL's launcher alone would leave waiting for rollouts for ever (or the
    # step's weight update fails). AReaL's recover run (recover.mode auto) resumes the run, from the same step
    # when none was saved since: a new rank (its pid), not a higher step, is what tells.
    servers = c.wait(lambda: len(s := c.ours("podkit.programs.standin_lm")) == 1 and s, 60,
                     what="the one server of the resumed run")
    first_resume, rank, before = p["resumed_at"], p["pid"], len(c.log())
    os.kill(servers[0], signal.SIGKILL)
    p = c.wait(lambda: (p := c.progress()).get("pid") not in (None, rank) and p.get("resumed_at") is not None
               and p.get("step", 0) > p["resumed_at"] and p, 300, what="a step of the run resumed after the server died")
    assert p["resumed_at"] >= first_resume and not alive(servers[0]), p
    after = c.log()[before:]
    tripped = [ln for ln in after.splitlines() if "rollout episodes in a row failed" in ln]
    assert tripped or "Training failed with exception" in after, after[-3000:]  # one of the two ended the rank
    assert all("inference unreachable at 127.0.0." in ln for ln in tripped), tripped
    print(f"the server killed: {'the episodes watch stopped the rank' if tripped else 'the weight update failed'}")
    # Node 1 leaves: whatever AReaL placed on it is gone, and the run waits for it, naming it.
    assert c.stop(1) == 0
    rec = c.wait(lambda: (r := c.record("cluster.json")).get("state") == "waiting-for-nodes" and
                 "still missing" in c.log() and r, 180, what="the run to wait, naming the node")
    assert rec["missing"][0]["rank"] == 1 and rec["missing"][0]["addr"] == ADDRS[1], rec
    assert "node rank 1 (127.0.0.3)" in rec["why"]
    d = subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(c.ws)], capture_output=True, text=True,
                       timeout=60, env={**c.env, "PODKIT_CLUSTER_RANK": "0", "PODKIT_CLUSTER_NODE_ADDR": ADDRS[0]})
    found = {f["id"]: f for f in json.loads(d.stdout)["findings"]}
    assert d.returncode == 1 and "127.0.0.3" in " ".join(found["cluster_node_missing"]["evidence"]), d.stdout
    step = c.progress().get("step")
    time.sleep(10)  # a node gone for good: the run waits, explained, and does not step
    assert c.record("cluster.json")["state"] == "waiting-for-nodes" and c.progress().get("step") == step
    c.start(1)  # it comes back, after the branch moved: it does not sync
    p = c.finished()
    assert p["stopped"]["by"] == "done" and p["step"] == 24 and p["resumed_at"], p
    assert "not synced here, so every node runs one commit" in (c.root / "node1.log").read_text()
    assert moved != synced and git("rev-parse", "HEAD", cwd=c.ws / "repo") == synced
    assert p["code"]["commit"] == synced, p
    log = c.log()
    assert "AReaL's trainer job completed" in log and "Job trainer:0 completed" in log
    # The server task ran the stand-in on its node's cluster address, not the machine's outbound one.
    assert "Found 1 rollout servers: 127.0.0." in log, log[-3000:]
    raylets = c.ours("raylet/raylet")
    assert len(raylets) == 2
    for pid in raylets:
        assert not _sigign(pid) & (1 << (signal.SIGINT - 1)), "Ray inherited SIGINT ignored: ray.cancel would not work"
    # The launcher exited 0 and supervisord left it stopped; node 1 stops cleanly, Ray's workers with it.
    assert c.stop(0) == 0 and c.stop(1) == 0
    assert wait_for(lambda: not c.ours("ray::") and not c.ours("standin_lm"), 30, what="Ray's workers gone")
