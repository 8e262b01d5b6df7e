"""A cluster rank's heartbeat: every trainer rank of a multi-node run says it is alive, on the shared
volume, and reads rank 0's request to stop. Written by the ranks (hooks.py), read by rank 0's
launcher (cluster.py) and by a node that is leaving (ray_node.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.host import proc

_log = log.get("trainer")
RUN_ENV = "PODKIT_CLUSTER_RUN"  # the driver's run id, in every rank's env: heartbeats of older runs are ignored


def heartbeat_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "ranks"


def node_ip() -> str:
    """The Ray node this rank runs on (the job's PODKIT_ env is rank 0's, whichever node this is)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (a test, a bare run): the heartbeat still names the host
        return ""


def start_heartbeat(cfg, on_stop, done: threading.Event | None = None) -> threading.Thread | None:
    """A rank of a cluster's run says it is alive every few seconds, and stops when asked; until `done`
    (a rank's beats end with its process)."""
    run = os.environ.get(RUN_ENV)
    if not run:
        return None
    rank = int(os.environ.get("RANK", "0"))
    period = max(1.0, min(5.0, cfg.cluster.rank_timeout_s / 6))
    path = heartbeat_dir(cfg.state_dir) / f"{rank}.json"
    me = {"rank": rank, "pid": os.getpid(), "start": proc.starttime(os.getpid()) or 0, "host": socket.gethostname(),
          "node": node_ip(), "run": run}

    done = done or threading.Event()

    def beat() -> None:
        asked = False
        while not done.is_set():
            try:
                records.write_json(path, {**me, "time": time.time()})
            except OSError as e:
                _log.warn(f"cannot write the heartbeat {path} ({e.strerror})")
            stop = records.CLUSTER_STOP.read(cfg.state_dir)
            if not asked and stop.get("run") == run:
                asked = True
                on_stop()
            done.wait(period)

    t = threading.Thread(target=beat, name="podkit-heartbeat", daemon=True)
    t.start()
    return t


def heartbeats(state_dir: Path, run: str) -> list[dict]:
    """The run's ranks' heartbeats; a planted, torn or older run's file is left out."""
    out = []
    for p in sorted(heartbeat_dir(state_dir).glob("*.json")):
        hb = records.Record(p.name, records.RANK_SHAPE).read(p.parent)
        if hb.get("run") == run and isinstance(hb.get("time"), (int, float)):
            out.append(hb)
    return out
