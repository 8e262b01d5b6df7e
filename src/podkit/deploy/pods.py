"""What RunPod's answers say about a pod or a cluster: its state (through runpod.STATUSES, the one map),
its volumes, GPUs, run and maximum run time, and the lines that show it to a person. Pure."""

from __future__ import annotations

from podkit import config
from podkit import runpod as api
from podkit.deploy.bodies import CLUSTER_NODES_ENV, STOP_AT_ENV
from podkit.money import ledger


def created_order(pod: dict) -> tuple[bool, float, str]:
    """Created first comes first, by the time createdAt says (RFC 3339 or Go's format, any offset: never compared
    as text); a pod whose createdAt is missing or cannot be read comes after those that have one."""
    made = api.started_at({"startedAt": pod.get("createdAt")})
    return made is None, made if made is not None else 0.0, str(pod.get("id"))


def maybe_live(pod: dict) -> bool:
    """Not a pod RunPod documents as stopped, in error or gone (a status it does not document may be live)."""
    return api.pod_state(pod) not in ("stopped", "error", "gone")


def running(pod: dict | None) -> bool:
    """RUNNING with its runtime up (RunPod says RUNNING before the container has started)."""
    return api.pod_state(pod) == "running" and pod.get("runtime") is not None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def mounted_volumes(pod: dict) -> set[str]:
    network = _list(_dict(pod.get("mounts")).get("network"))
    return {m.get("volumeId") for m in network if isinstance(m, dict) and isinstance(m.get("volumeId"), str)}


def gpu_count(pod: dict) -> int:
    n = (pod.get("gpu") or {}).get("count") if isinstance(pod.get("gpu"), dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def how_to_reach(pod: dict) -> list[str]:
    lines = []
    direct = _dict(_dict(pod.get("ssh")).get("direct"))
    if direct.get("host") and direct.get("port"):
        lines.append(f"ssh {direct.get('username') or 'root'}@{direct['host']} -p {direct['port']}")
    for p in _list(_dict(pod.get("runtime")).get("ports")):
        if not isinstance(p, dict):
            continue
        if not lines and p.get("private") == 22 and p.get("public") and p.get("ip"):
            lines.append(f"ssh root@{p['ip']} -p {p['public']}")
        elif p.get("type") == "http":
            lines.append(f"https://{pod['id']}-{p.get('private')}.proxy.runpod.net")
    lines.append(f"logs: podkit deploy logs {pod.get('id')} --follow (every line prefixed with its program), or "
                 "over SSH: podkit status; tail -f /workspace/logs/trainer.log")
    return lines


def pod_line(pod: dict) -> str:
    rt = _dict(pod.get("runtime"))
    gpus = [g for g in _list(rt.get("gpus")) if isinstance(g, dict)]
    util = f", GPU util {'/'.join(str(g.get('util', '?')) for g in gpus)}%" if gpus else ""
    vols = ", ".join(sorted(mounted_volumes(pod)))
    return (f"{pod.get('id')} {pod.get('name')}: {pod.get('status')}, {gpu_count(pod)}x "
            f"{_dict(pod.get('gpu')).get('id', '?')}, uptime {rt.get('uptime') or 0}s{util}"
            + (f", network volume {vols}" if vols else ""))


def run_of(pod: dict) -> str:
    env = pod.get("env") if isinstance(pod.get("env"), dict) else {}
    raw = env.get(ledger.RUN_ENV)
    return raw if isinstance(raw, str) and ledger.RUN_ID.match(raw) else ""


def carried_stop_at(pod: dict) -> float:
    """The pod's maximum run time (its guard.stop_pod_at, from its env)."""
    env = pod.get("env") if isinstance(pod.get("env"), dict) else {}
    try:
        value = float(str(env.get(STOP_AT_ENV, "")))
    except ValueError:
        return 0.0
    return value if config.is_stop_time(value) else 0.0


def run_nodes(members: list[dict]) -> int | None:
    """The node count the run was made for: cluster.nodes in its pods' env (set at create)."""
    counts = {str((p.get("env") or {}).get(CLUSTER_NODES_ENV, "")) for p in members if isinstance(p.get("env"), dict)}
    counts = {int(n) for n in counts if n.isdigit()}
    return min(counts) if counts else None


def cluster_summary(c: dict, members: list[dict] | None = None) -> list[str]:
    comp = c.get("compute") or {}
    pods = c.get("pods") or {}
    states = ", ".join(f"{n} {s}" for s, n in sorted((pods.get("byStatus") or {}).items())) or "none placed yet"
    line = (f"{c.get('id')} {c.get('name')}: {comp.get('podCount')} x {comp.get('gpuCountPerPod')} "
            f"{comp.get('gpuTypeId')}, nodes: {states}")
    if c.get("dataCenterId"):
        line += f", in {c['dataCenterId']}"
    lines = [line]
    primary = c.get("primary") or {}
    if primary.get("sshEndpoint"):
        host, _, port = primary["sshEndpoint"].rpartition(":")
        lines.append(f"  rank 0 (pod {primary.get('podId')}): ssh root@{host} -p {port}")
    made_for = run_nodes(members or [])
    extra = sorted((p for p in members or [] if _rank(p) is not None and made_for is not None
                    and _rank(p) >= made_for), key=_rank)
    if extra:
        lines.append(f"  {len(extra)} node(s) beyond the run's {made_for} (the cluster was scaled up): "
                     + ", ".join(f"rank {_rank(p)} pod {p.get('id')}" for p in extra)
                     + f". They take no part in the run (a node with NODE_RANK >= {made_for} waits in safe mode, "
                     "saying so) and bill until the cluster is deleted; a run on more nodes is a new cluster made "
                     "for them (--nodes and a config for that shape)")
    return lines


def _rank(pod: dict) -> int | None:
    rank = (pod.get("cluster") or {}).get("rank") if isinstance(pod.get("cluster"), dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None
