"""What a multi-node run reads from the shared volume, distrusted: heartbeats and stop requests that are
planted, torn or left by an older run (tests/trainer/test_cluster.py runs the cluster itself)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from conftest import ROOT
from podkit import config, records
from podkit.areal import cluster as areal_cluster
from podkit.areal import heartbeat

pytestmark = pytest.mark.timeout(60)


def cluster_cfg(tmp_path, **env):
    return config.load(ROOT / "configs" / "cpu-cluster.yaml",
                       environ={"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_CLUSTER_RANK": "0",
                                "PODKIT_CLUSTER_NODE_ADDR": "127.0.0.2", "PODKIT_CLUSTER_RANK_TIMEOUT_S": "10", **env})


def test_a_rank_stops_only_when_asked_for_its_own_run(tmp_path, monkeypatch):
    cfg = cluster_cfg(tmp_path)
    monkeypatch.setenv(heartbeat.RUN_ENV, "run-b")
    monkeypatch.setenv("RANK", "3")
    stop_file = records.CLUSTER_STOP.path(cfg.state_dir)
    stop_file.parent.mkdir(parents=True)
    stop_file.write_text(json.dumps({"run": "run-a", "time": time.time()}))  # an older run's request
    asked, done = threading.Event(), threading.Event()
    beating = heartbeat.start_heartbeat(cfg, asked.set, done)
    try:
        beat = heartbeat.heartbeat_dir(cfg.state_dir) / "3.json"
        deadline = time.time() + 10
        while not beat.exists() and time.time() < deadline:
            time.sleep(0.1)
        hb = json.loads(beat.read_text())
        assert hb["rank"] == 3 and hb["pid"] == os.getpid() and hb["run"] == "run-b"
        assert not asked.wait(2.5), "a stop request for another run stopped this one"
        stop_file.write_text("{torn")
        assert not asked.wait(2.5)
        records.CLUSTER_STOP.write(cfg.state_dir, {"run": "run-b", "time": time.time()})
        assert asked.wait(5), "the run's own stop request was not seen"
    finally:
        done.set()
        beating.join(5)
    assert not beating.is_alive()


def test_only_a_fresh_runs_silent_rank_is_dead_and_planted_heartbeats_are_ignored(tmp_path):
    cfg = cluster_cfg(tmp_path)
    d = heartbeat.heartbeat_dir(cfg.state_dir)
    d.mkdir(parents=True)
    now = time.time()
    beat = {"pid": 1, "start": 0, "host": "elsewhere", "node": "10.0.0.9"}
    (d / "0.json").write_text(json.dumps({**beat, "rank": 0, "run": "r1", "time": now - 60}))   # silent: dead
    (d / "1.json").write_text(json.dumps({**beat, "rank": 1, "run": "r1", "time": now - 2}))    # alive
    (d / "2.json").write_text(json.dumps({**beat, "rank": 2, "run": "old", "time": now - 900}))  # another run
    (d / "3.json").write_text("\x00not json")                                                    # torn
    (d / "4.json").write_text(json.dumps({**beat, "rank": "4", "run": "r1", "time": "yesterday"}))  # wrong shape
    os.symlink("/etc/passwd", d / "5.json")                                                       # planted link
    dead = areal_cluster.Cluster(cfg).dead_ranks("r1")
    assert len(dead) == 1 and dead[0].startswith("rank 0 (pid 1 on 10.0.0.9)") and "for 60s" in dead[0], dead


def test_a_planted_cluster_record_cannot_name_nodes_that_are_not_addresses(tmp_path):
    cfg = cluster_cfg(tmp_path)
    cfg.state_dir.mkdir(parents=True)
    records.CLUSTER.path(cfg.state_dir).write_text(json.dumps(
        {"state": "running", "nodes": [{"rank": 1, "addr": "127.0.0.3"}, {"rank": "x", "addr": 5}, "junk"]}))
    assert areal_cluster.Cluster(cfg).addr_of == {1: "127.0.0.3"}
    records.CLUSTER.path(cfg.state_dir).write_text("[1, 2")  # torn: read as empty
    assert areal_cluster.Cluster(cfg).addr_of == {}
