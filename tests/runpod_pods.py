"""The stub's pods and the clusters made of them: their lifecycle (PROVISIONING, STARTING, RUNNING on being
polled; the actions each status allows), placement, billed stretches, the Pod as RunPod shows it, and the
pod, cluster and log endpoints, as the document's descriptions say."""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import socket
import time
from dataclasses import dataclass, field

from runpod_shapes import format_ts, now_ts, parse_ts, problem
from runpod_wire import Answer, Handler, Request

# createPod's 400 when a GPU cannot be placed: RunPod gives capacity no code of its own, only this detail.
CAPACITY_DETAIL = ("There are no longer any instances available with the requested specifications. "
                   "Please refresh and try again.")
SSH_PUBLIC_PORT = 22022  # the public port of every pod's 22/tcp; each pod has an IP of its own (203.0.113.0/24)
DEFAULT_DATA_CENTER = "EU-SE-1"
DATA_CENTERS = (DEFAULT_DATA_CENTER, "US-TX-3", "CA-MTL-1")  # where the scheduler looks, in order, without dataCenterIds
# Which actions a status allows, as podAction's description says.
ACTIONS = {"PROVISIONING": ["stop", "terminate"], "STARTING": ["stop", "terminate"],
           "RUNNING": ["stop", "restart", "terminate"], "EXITED": ["start", "terminate"],
           "ERROR": ["start", "terminate"], "TERMINATED": []}
# GPU types the stub places (GET /v2/catalog/gpus answers these): id -> (name, memory GB, $/h secure, max count)
GPU_TYPES = {
    "NVIDIA A40": ("A40", 48, 0.40, 10),  # podkit's GPU: RunPod's A40 hosts go up to 10
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 80, 2.69, 8),
    "NVIDIA H100 PCIe": ("H100 PCIe", 80, 2.39, 8),
    "NVIDIA H100 NVL": ("H100 NVL", 94, 2.59, 8),
    "NVIDIA H200": ("H200 SXM", 141, 3.59, 8),
    "NVIDIA A100-SXM4-80GB": ("A100 SXM", 80, 1.49, 8),
    "NVIDIA A100 80GB PCIe": ("A100 PCIe", 80, 1.39, 8),
    "NVIDIA L40S": ("L40S", 48, 0.86, 8),
    "NVIDIA RTX A6000": ("RTX A6000", 48, 0.49, 8),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 24, 0.69, 8),
}
BILLED = ("PROVISIONING", "STARTING", "RUNNING")  # the statuses whose pod shows a cost, and bills it
PORT = re.compile(r"^(\d{1,5})/(tcp|http)$")

MISSING = object()  # show_status: the pod is shown without a status field
KEEPALIVE = b": keep-alive\n\n"


@dataclass
class PodMeta:
    """What the stub keeps of a pod beside its stored fields: its IP, price, progress and open bill."""
    ip: str
    price: float
    made: float = field(default_factory=time.monotonic)
    polls_needed: int = 1
    polls: int = 0
    running_since: float | None = None
    start_ssh: bool = True
    billing_since: float | None = None  # wall clock: the open stretch of its bill, at `price`


class Pods:
    """The pod and cluster endpoints and the pod model, mixed into RunPodV2Stub (which holds the state)."""

    # -- pods --------------------------------------------------------------------------------------

    def _new_id(self) -> str:
        if self.new_pod_ids:
            return self.new_pod_ids.pop(0)
        self._count["pod"] += 1
        return f"stubpod{self._count['pod']:03d}"

    def _store_pod(self, pod: dict, start_ssh: bool = True) -> None:
        self._count["ip"] = self._count["ip"] % 250 + 1
        gpu = pod.get("gpu")
        price = GPU_TYPES.get(gpu["id"], ("", 0, 1.0, 8))[2] * gpu.get("count", 1) if gpu else 0.08
        self.pods[pod["id"]] = pod
        self._meta[pod["id"]] = PodMeta(ip=f"203.0.113.{self._count['ip']}", price=round(price, 2),
                                        polls_needed=self.polls_until_running, start_ssh=start_ssh,
                                        made=self.clock())
        self._bill(pod["id"], open_=pod["status"] in BILLED)

    def _drop_pod(self, pod_id: str) -> None:
        self._bill(pod_id, open_=False)
        self.pods.pop(pod_id)
        self._meta.pop(pod_id)

    def _bill(self, pod_id: str, open_: bool) -> None:
        """Opens the pod's billed stretch (if none is open) or closes it into the ledger."""
        meta, now = self._meta[pod_id], time.time()
        if open_ and meta.billing_since is None:
            meta.billing_since = now
        elif not open_ and meta.billing_since is not None:
            self.ledger.setdefault(pod_id, []).append((meta.billing_since, now, meta.price))
            meta.billing_since = None

    def _enter(self, pod_id: str, status: str) -> None:
        pod, meta = self.pods[pod_id], self._meta[pod_id]
        if status == "RUNNING" and (pod["status"] != "RUNNING" or meta.running_since is None):
            meta.running_since = time.monotonic()
            pod["startedAt"] = now_ts()
        if status != "RUNNING":
            meta.running_since = None
        if status in ("PROVISIONING", "STARTING"):
            meta.polls = 0
        pod["status"] = status
        self._bill(pod_id, open_=status in BILLED)

    def _poll(self, pod_id: str) -> None:
        """A GET that shows the pod: a PROVISIONING or STARTING pod moves on."""
        pod, meta = self.pods[pod_id], self._meta[pod_id]
        if pod["status"] not in ("PROVISIONING", "STARTING"):
            return
        meta.polls += 1
        if meta.polls >= meta.polls_needed:
            self._enter(pod_id, "RUNNING")
            meta.polls = meta.polls_needed
        elif meta.polls >= meta.polls_needed - 1:
            pod["status"] = "STARTING"

    def _view(self, pod_id: str) -> dict:
        pod, meta = copy.deepcopy(self.pods[pod_id]), self._meta[pod_id]
        status = pod["status"]
        running = status == "RUNNING"
        ports = []
        for i, spec in enumerate(pod.get("ports") or []):
            m = PORT.match(spec)
            if m:
                private, kind = int(m.group(1)), m.group(2)
                public = (SSH_PUBLIC_PORT if private == 22 else 40000 + i) if kind == "tcp" else None
                ports.append({"private": private, "public": public, "type": kind,
                              "ip": meta.ip if kind == "tcp" else None})
        pod["actions"] = list(ACTIONS[status])
        user = f"{pod_id}-64411eb2"
        proxy = {"host": "ssh.runpod.io", "port": 22, "username": user, "command": f"ssh {user}@ssh.runpod.io"}
        direct = {"host": meta.ip, "port": SSH_PUBLIC_PORT, "username": "root",
                  "command": f"ssh root@{meta.ip} -p {SSH_PUBLIC_PORT}"}
        pod["ssh"] = {"proxy": None if status == "PROVISIONING" else proxy,
                      "direct": direct if running and "22/tcp" in (pod.get("ports") or []) else None}
        pod["cost"] = meta.price if status in BILLED else 0.0  # "0.0 when EXITED or TERMINATED"
        pod["runtime"] = None
        if running:
            seen = 0 if pod_id in self.gpus_lost else (pod.get("gpu") or {}).get("count", 0)
            gpus = [{"util": 0, "memoryUtil": 0} for _ in range(seen)]
            pod["runtime"] = {"uptime": int(time.monotonic() - (meta.running_since or time.monotonic())),
                              "gpus": gpus, "cpu": {"util": 0}, "memory": {"util": 0}, "ports": ports}
        order = ["id", "name", "status", "actions", "image", "args", "disk", "mounts", "ports", "env", "registry",
                 "gpu", "cpu", "cloud", "dataCenterId", "cudaVersion", "ssh", "template", "cost", "locked",
                 "globalNetworking", "cluster", "runtime", "createdAt", "startedAt"]
        return {k: pod[k] for k in order if k in pod} | {k: v for k, v in pod.items() if k not in order}

    def _find_pod(self, pod_id: str) -> dict | Answer:
        if pod_id not in self.pods:
            return Answer(404, problem(404, "pod not found"))
        return self.pods[pod_id]

    def list_pods(self, req: Request, params: dict, query: dict) -> Answer:
        include = query.get("includeClusterPods", False)
        now = self.clock()
        ids = [pid for pid, p in self.pods.items() if (include or "cluster" not in p)
               and (pid in self._listed or now - self._meta[pid].made >= self.list_lag_s)]
        self._listed.update(ids)
        for pid in ids:
            self._poll(pid)
        return Answer(200, {"pods": [self._shown(pid) for pid in ids]},
                      scripted=any(pid in self.shown_status for pid in ids))

    def _shown(self, pod_id: str) -> dict:
        view = self._view(pod_id)
        if pod_id in self.shown_status:
            status = self.shown_status[pod_id]
            if status is MISSING:
                view.pop("status")
            else:
                view["status"] = status
        return view

    def create_pod(self, req: Request, params: dict, query: dict) -> Answer:
        body = req.body
        if ("gpu" in body) == ("cpu" in body):
            return self._rule(req, "supply exactly one of gpu or cpu")
        template = None
        if "templateId" in body:
            template = self.templates.get(body["templateId"])
            if template is None:
                return Answer(404, problem(404, f"template {body['templateId']!r} not found"))
        base = {k: copy.deepcopy(template[k]) for k in ("image", "args", "disk", "ports", "env", "registry")} \
            if template else {}
        conf = base | {k: body[k] for k in ("image", "args", "disk", "ports", "env", "registry") if k in body}
        bad = [p for p in conf.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        mounts = body.get("mounts", template["mounts"] if template else {})
        dcs = body.get("dataCenterIds") or []
        answer = self._check_mounts(req, mounts, dcs, cpu="cpu" in body)
        if isinstance(answer, Answer):
            return answer
        gpu = None
        if "gpu" in body:
            g = body["gpu"]
            if g["id"] not in GPU_TYPES:
                return self._rule(req, f"gpu.id: {g['id']!r} is not a GPU type (GET /v2/catalog/gpus lists them)")
            if g.get("count", 1) > GPU_TYPES[g["id"]][3]:
                return self._rule(req, f"gpu.count: at most {GPU_TYPES[g['id']][3]} x {g['id']} on one pod")
            gpu = {"id": g["id"], "count": g.get("count", 1)}
        # Placement: a network volume's data center, else the first of dataCenterIds (or, without them, of every
        # data center: "omit ... to let the scheduler choose") with a GPU free.
        free = [dc for dc in ([answer] if answer else dcs or DATA_CENTERS) if dc not in self.full]
        if self.capacity_failures > 0 or not free:
            self.capacity_failures = max(0, self.capacity_failures - 1)
            return Answer(400, problem(400, CAPACITY_DETAIL))
        data_center = free[0]
        allowed = (body.get("gpu") or {}).get("allowedCudaVersions")
        pid = self._new_id()
        gn = body.get("globalNetworking", False)
        pod = {"id": pid, "name": body["name"], "image": conf["image"], "args": conf.get("args", ""),
               "disk": conf.get("disk", 50), "ports": conf.get("ports", []), "env": conf.get("env", {}),
               "registry": conf.get("registry"), "status": "PROVISIONING", "mounts": mounts,
               "cloud": body.get("cloud", "SECURE"), "dataCenterId": data_center,
               "cudaVersion": (max(allowed, key=lambda v: tuple(map(int, v.split(".")))) if allowed else "12.8")
               if gpu else None,
               "template": body.get("templateId"), "locked": False,
               "globalNetworking": {"enabled": True, "ip": f"10.99.0.{self._count['ip'] + 1}",
                                    "internalDns": f"{pid}.runpod.internal"} if gn else {"enabled": False},
               "createdAt": now_ts(), "startedAt": None}
        if gpu:
            pod["gpu"] = gpu
        else:
            pod["cpu"] = {**body["cpu"], "memory": body["cpu"]["vcpuCount"] * 4}
        self._store_pod(pod, start_ssh=body.get("startSsh", template["startSsh"] if template else False))
        return Answer(201, self._view(pid))

    def _check_mounts(self, req: Request, mounts: dict, dcs: list[str], cpu: bool) -> Answer | str | None:
        """A rule the document states for mounts broken: 400. Else the data center a network volume sets."""
        if "persistent" in mounts and "network" in mounts:
            return self._rule(req, "mounts: at most one of persistent or network")
        if cpu and "persistent" in mounts:
            return self._rule(req, "mounts.persistent: not allowed on a CPU pod")
        if mounts.get("network") == []:
            return self._rule(req, "mounts.network: an empty list is not allowed")
        for m in mounts.get("network", []):
            vol = self.volumes.get(m["volumeId"])
            if vol is None:
                return self._rule(req, f"mounts.network: network volume {m['volumeId']!r} not found")
            if dcs and vol["dataCenter"] not in dcs:
                return self._rule(req, f"mounts.network: network volume {m['volumeId']!r} is in "
                                       f"{vol['dataCenter']}, not in dataCenterIds {dcs}")
            return vol["dataCenter"]
        return None

    def get_pod(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, Answer):
            return found
        self._poll(params["id"])
        return Answer(200, self._shown(params["id"]), scripted=params["id"] in self.shown_status)

    def update_pod(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, Answer):
            return found
        if "cluster" in found:
            return Answer(409, problem(409, "pod belongs to a cluster: manage it through /v2/clusters/{id}"))
        body = req.body
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        if "mounts" in body and body["mounts"]:
            new, old = body["mounts"], found["mounts"]
            if any(kind not in old for kind in new):
                return self._rule(req, "mounts: the mount kind is fixed at create")
            if "network" in new and (not new["network"] or new["network"][0]["volumeId"]
                                     != old["network"][0]["volumeId"]):
                return self._rule(req, "mounts.network: the volumeId of a network mount cannot change")
            found["mounts"] = copy.deepcopy(new)
        for k in ("name", "image", "args", "disk", "ports", "env", "registry", "locked"):
            if k in body:
                found[k] = copy.deepcopy(body[k])
        if "templateId" in body:
            found["template"] = body["templateId"]
        if "globalNetworking" in body:
            found["globalNetworking"] = {"enabled": body["globalNetworking"]} | (
                {"ip": "10.99.0.2", "internalDns": f"{found['id']}.runpod.internal"} if body["globalNetworking"]
                else {})
        return Answer(200, self._view(found["id"]))

    def delete_pod(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, Answer):
            return found
        if "cluster" in found:
            return Answer(409, problem(409, "pod belongs to a cluster: delete the cluster instead"))
        self._drop_pod(found["id"])
        self.terminated.add(found["id"])
        return Answer(204)

    def pod_action(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_pod(params["id"])
        if isinstance(found, Answer):
            return found
        action, status = req.body["action"], found["status"]
        if "cluster" in found:
            return Answer(409, problem(409, "pod belongs to a cluster: manage it through /v2/clusters/{id}"))
        if action not in ACTIONS[status]:
            return Answer(409, problem(409, f"cannot {action} a pod that is {status} "
                                            f"(allowed: {', '.join(ACTIONS[status]) or 'none'})"))
        if found["locked"] and action in ("stop", "restart"):
            return Answer(409, problem(409, f"pod is locked: cannot {action} it"))
        if action == "terminate":
            self._drop_pod(found["id"])
            self.terminated.add(found["id"])
            return Answer(204)
        self._enter(found["id"], "EXITED" if action == "stop" else "STARTING")
        self._meta[found["id"]].polls_needed = 1
        return Answer(200, self._view(found["id"]))


    # -- clusters ----------------------------------------------------------------------------------

    def _members(self, cluster_id: str) -> list[dict]:
        return sorted((p for p in self.pods.values() if p.get("cluster", {}).get("id") == cluster_id),
                      key=lambda p: p["cluster"]["rank"])

    def _new_member(self, cluster: dict, rank: int) -> str:
        pid = self._new_id()
        conf = cluster["_container"]
        roles = {"SLURM": ("SLURM_CONTROLLER", "SLURM_COMPUTE"), "RAY": ("RAY_HEAD", "RAY_WORKER")}
        membership = {"id": cluster["id"], "rank": rank, "ip": f"10.65.0.{rank + 2}"}
        if cluster["type"] in roles:
            membership["role"] = roles[cluster["type"]][0 if rank == 0 else 1]
        pod = {"id": pid, "name": f"{cluster['name']}-{rank}", "image": conf.get("image", ""),
               "args": conf.get("args", ""), "disk": conf.get("disk", 50), "ports": conf.get("ports", []),
               "env": conf.get("env", {}), "registry": None, "status": "PROVISIONING",
               "mounts": copy.deepcopy(conf.get("mounts", {})),
               "gpu": {"id": cluster["compute"]["gpuTypeId"], "count": cluster["compute"]["gpuCountPerPod"]},
               "cloud": "SECURE", "dataCenterId": cluster["dataCenterId"], "cudaVersion": "12.8", "template": None,
               "locked": False, "globalNetworking": {"enabled": False}, "cluster": membership,
               "createdAt": now_ts(), "startedAt": None}
        self._store_pod(copy.deepcopy(pod), start_ssh=conf.get("startSsh", False))
        return pid

    def _cluster_view(self, cluster_id: str) -> dict:
        cluster = self.clusters[cluster_id]
        out = {k: copy.deepcopy(v) for k, v in cluster.items() if not k.startswith("_")}
        members = [self._view(p["id"]) for p in self._members(cluster_id)]
        by_status: dict[str, int] = {}
        for p in members:
            by_status[p["status"]] = by_status.get(p["status"], 0) + 1
        out["pods"] = {"total": len(members), "byStatus": by_status}
        primary = next((p for p in members if p["cluster"]["rank"] == 0), None)
        if primary:
            out["primary"] = {"podId": primary["id"], "status": primary["status"]}
            if primary["ssh"]["direct"]:
                out["primary"]["sshEndpoint"] = f"{primary['ssh']['direct']['host']}:{SSH_PUBLIC_PORT}"
        return out

    def create_cluster(self, req: Request, params: dict, query: dict) -> Answer:
        body = req.body
        compute = body["compute"]
        if compute["gpuTypeId"] not in GPU_TYPES:
            return self._rule(req, f"compute.gpuTypeId: {compute['gpuTypeId']!r} is not a GPU type")
        if compute["gpuCountPerPod"] > GPU_TYPES[compute["gpuTypeId"]][3]:
            return self._rule(req, f"compute.gpuCountPerPod: at most {GPU_TYPES[compute['gpuTypeId']][3]}")
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        dcs = body.get("dataCenterIds") or []
        answer = self._check_mounts(req, body.get("mounts", {}), dcs, cpu=False)
        if isinstance(answer, Answer):
            return answer
        self._count["cluster"] += 1
        cid = f"cluster_{self._count['cluster']:03d}"
        cluster = {"id": cid, "name": body["name"], "type": body["type"], "compute": dict(compute),
                   "dataCenterId": answer or (dcs[0] if dcs else DEFAULT_DATA_CENTER),
                   "network": {"cidr": "10.65.0.0/16", "vxlanId": 4100 + self._count["cluster"], "vxlanPort": 4789},
                   "createdAt": now_ts(),
                   "_container": {k: copy.deepcopy(v) for k, v in body.items()
                                  if k in ("image", "args", "disk", "ports", "env", "mounts", "startSsh")}}
        self.clusters[cid] = cluster
        for rank in range(compute["podCount"]):
            self._new_member(cluster, rank)
        return Answer(201, self._cluster_view(cid))

    def _find_cluster(self, cluster_id: str) -> dict | Answer:
        if cluster_id not in self.clusters:
            return Answer(404, problem(404, "cluster not found"))
        return self.clusters[cluster_id]

    def list_clusters(self, req: Request, params: dict, query: dict) -> Answer:
        return Answer(200, {"clusters": [self._cluster_view(cid) for cid in self.clusters]})

    def get_cluster(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, Answer):
            return found
        for p in self._members(params["id"]):
            self._poll(p["id"])
        return Answer(200, self._cluster_view(params["id"]))

    def update_cluster(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, Answer):
            return found
        found["name"] = req.body["name"]
        return Answer(200, self._cluster_view(params["id"]))

    def delete_cluster(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, Answer):
            return found
        for p in self._members(params["id"]):
            self._drop_pod(p["id"])
            self.terminated.add(p["id"])
        del self.clusters[params["id"]]
        self.deleted_clusters.add(params["id"])
        return Answer(204)

    def list_cluster_pods(self, req: Request, params: dict, query: dict) -> Answer:
        found = self._find_cluster(params["id"])
        if isinstance(found, Answer):
            return found
        members = self._members(params["id"])
        for p in members:
            self._poll(p["id"])
        return Answer(200, {"pods": [self._view(p["id"]) for p in members]})

    # -- logs --------------------------------------------------------------------------------------

    def _stamps(self, pod_id: str) -> list[tuple[dt.datetime, str]]:
        """The ts of each line of stub.logs[pod_id], given to a line when first seen: strictly increasing."""
        stamps = self._log_ts.setdefault(pod_id, [])
        for _ in range(len(self.logs.get(pod_id, [])) - len(stamps)):
            t = max(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.log_clock_s),
                    self._last_ts + dt.timedelta(microseconds=1))
            self._last_ts = t
            stamps.append((t, format_ts(t, micro=True)))
        return stamps

    def stream_logs(self, h: Handler, req: Request, params: dict, query: dict, op: dict) -> None:
        pod_id = params["id"]
        with self._lock:
            if pod_id not in self.pods:
                return self._send(h, op, Answer(404, problem(404, "pod not found")))
            source = query.get("source")
            stamps, lines = self._stamps(pod_id), list(self.logs.get(pod_id, []))
            picked = [(t, ts, s, line) for (t, ts), (s, line) in zip(stamps, lines, strict=True)
                      if source in (None, s)]
            if "last-event-id" in req.headers:
                after = parse_ts(req.headers["last-event-id"])
                picked = [e for e in picked if e[0] > after]
            elif "since" in query:
                since = parse_ts(query["since"])
                picked = [e for e in picked if e[0] >= since]
            else:
                tail = query.get("tail", 100)
                picked = picked[len(picked) - tail:] if tail else []
            seen = len(lines)
            drop, self.drop_logs_after = self.drop_logs_after, None
            follow_until = time.monotonic() + self.follow_s
        h.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                            ("Connection", "keep-alive"), ("X-Accel-Buffering", "no"),
                            ("Transfer-Encoding", "chunked")):
            h.send_header(name, value)
        h.end_headers()
        self._check_response(op, 200, "text/event-stream", None, f"GET {req.path}")
        sent, said = 0, time.monotonic()
        while True:
            for _, ts, s, line in picked:
                if drop is not None and sent >= drop:
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)  # the stream breaks mid-way, as a network does
                    return None
                data = json.dumps({"source": s, "line": line, "ts": ts}, separators=(",", ":"))
                event = f"id: {ts}\ndata: {data}\n\n".encode()
                h.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                h.wfile.flush()
                sent += 1
            if time.monotonic() >= follow_until:
                break
            time.sleep(0.02)
            if self.keepalive_s and time.monotonic() - said >= self.keepalive_s:
                h.wfile.write(b"%x\r\n%s\r\n" % (len(KEEPALIVE), KEEPALIVE))
                h.wfile.flush()
                said = time.monotonic()
            with self._lock:
                if pod_id not in self.pods:
                    break
                stamps, lines = self._stamps(pod_id), list(self.logs.get(pod_id, []))
                picked = [(t, ts, s, line) for (t, ts), (s, line) in list(zip(stamps, lines, strict=True))[seen:]
                          if source in (None, s)]
                seen = len(lines)
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()
        return None
