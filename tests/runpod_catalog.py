"""The stub's templates, network volumes, GPU catalog and pod bills: the endpoints other than pods and
clusters. A bill is read from the pods' billed stretches and charges (tests/runpod_pods.py) in time buckets."""

from __future__ import annotations

import copy
import datetime as dt
import time
from urllib.parse import unquote

from runpod_pods import GPU_TYPES, PORT
from runpod_shapes import format_ts, parse_ts, problem
from runpod_wire import Answer, Request


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def _bucket_floor(t: dt.datetime, size: str) -> dt.datetime:
    """The start of the billing bucket (BillingBucketSize, UTC; weeks from Monday) that holds `t`."""
    t = t.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    if size == "hour":
        return t
    t = t.replace(hour=0)
    if size == "week":
        return t - dt.timedelta(days=t.weekday())
    return t if size == "day" else t.replace(day=1) if size == "month" else t.replace(month=1, day=1)


def _bucket_step(t: dt.datetime, size: str, back: bool = False) -> dt.datetime:
    """The next bucket's start after the bucket starting at `t` (or the one before it, `back`)."""
    n = -1 if back else 1
    if size in ("hour", "day", "week"):
        return t + n * dt.timedelta(**{"hour": {"hours": 1}, "day": {"days": 1}, "week": {"weeks": 1}}[size])
    if size == "year":
        return t.replace(year=t.year + n)
    months = t.year * 12 + t.month - 1 + n
    return t.replace(year=months // 12, month=months % 12 + 1)


class Catalog:
    """The template, network volume, GPU catalog and billing endpoints, mixed into RunPodV2Stub."""

    # -- templates, volumes, catalog ----------------------------------------------------------------

    def list_templates(self, req: Request, params: dict, query: dict) -> Answer:
        return Answer(200, {"templates": list(self.templates.values())})

    def create_template(self, req: Request, params: dict, query: dict) -> Answer:
        body = req.body
        if any(t["name"] == body["name"] for t in self.templates.values()):
            return self._rule(req, f"name: a template named {body['name']!r} exists (names are unique)")
        bad = [p for p in body.get("ports", []) if not PORT.match(p)]
        if bad:
            return self._rule(req, f"ports: {bad[0]!r} is not <port>/tcp or <port>/http")
        self._count["template"] += 1
        tid = f"stubtpl{self._count['template']:03d}"
        tpl = {"id": tid, "name": body["name"], "image": body["image"], "args": "", "disk": 50, "ports": [],
               "env": {}, "registry": None, "mounts": {}, "serverless": False, "public": False, "category": "NVIDIA",
               "startSsh": True, "startJupyter": True, "allowedCudaVersions": []}
        tpl.update(copy.deepcopy(body))
        self.templates[tid] = tpl
        return Answer(201, tpl)

    def get_template(self, req: Request, params: dict, query: dict) -> Answer:
        tpl = self.templates.get(params["id"])
        return Answer(200, tpl) if tpl else Answer(404, problem(404, "template not found"))

    def update_template(self, req: Request, params: dict, query: dict) -> Answer:
        tpl = self.templates.get(params["id"])
        if tpl is None:
            return Answer(404, problem(404, "template not found"))
        if any(t["name"] == req.body.get("name") and t is not tpl for t in self.templates.values()):
            return self._rule(req, f"name: a template named {req.body['name']!r} exists (names are unique)")
        tpl.update(copy.deepcopy(req.body))
        return Answer(200, tpl)

    def delete_template(self, req: Request, params: dict, query: dict) -> Answer:
        if self.templates.pop(params["id"], None) is None:
            return Answer(404, problem(404, "template not found"))
        return Answer(204)

    def list_volumes(self, req: Request, params: dict, query: dict) -> Answer:
        return Answer(200, {"networkVolumes": list(self.volumes.values())})

    def get_volume(self, req: Request, params: dict, query: dict) -> Answer:
        vol = self.volumes.get(params["id"])
        return Answer(200, vol) if vol else Answer(404, problem(404, "network volume not found"))

    def create_volume(self, req: Request, params: dict, query: dict) -> Answer:
        self._count["volume"] += 1
        vol = {"type": "STANDARD"} | req.body | {"id": f"stubvol{self._count['volume']:03d}"}
        self.volumes[vol["id"]] = vol
        return Answer(201, vol)

    def list_gpu_types(self, req: Request, params: dict, query: dict) -> Answer:
        include, product = query.get("include", []), query.get("product")
        if bool(include) != bool(product):
            return self._rule(req, "product is required with include=AVAILABILITY, and valid only with it")
        return Answer(200, {"gpus": [self._gpu_type(gid, include) for gid in GPU_TYPES]})

    def _gpu_type(self, gid: str, include: list) -> dict:
        name, memory, price, max_count = GPU_TYPES[gid]
        gpu = {"id": gid, "name": name, "pool": None, "manufacturer": "NVIDIA", "memory": memory,
               "secure": True, "community": False, "price": {"secure": price, "community": 0.0},
               "maxCount": {"secure": max_count, "community": 0}}
        if include:
            gpu["availability"] = self.gpu_availability.get(gid, "HIGH")
        return gpu

    def get_gpu_type(self, req: Request, params: dict, query: dict) -> Answer:
        include, product = query.get("include", []), query.get("product")
        if bool(include) != bool(product):
            return self._rule(req, "product is required with include=AVAILABILITY, and valid only with it")
        gid = unquote(params["id"])  # "NVIDIA%20A40": the id is a name
        if gid not in GPU_TYPES:
            return Answer(404, problem(404, f"GPU type {gid!r} not found"))
        return Answer(200, self._gpu_type(gid, include))

    def list_pod_billing(self, req: Request, params: dict, query: dict) -> Answer:
        """listPodBilling: each pod's bill per bucket of the window (only buckets it billed in), as the
        document's parameters describe: startTime snapped down and endTime up to bucket boundaries (defaults:
        30 days ago, now), or lastN buckets ending with the current one; podId narrows to one pod."""
        size = query.get("bucketSize", "day")
        if "lastN" in query and ("startTime" in query or "endTime" in query):
            return self._rule(req, "lastN is mutually exclusive with startTime/endTime")
        now = dt.datetime.now(dt.UTC)
        if "lastN" in query:
            end = _bucket_step(_bucket_floor(now, size), size)
            start = end
            for _ in range(query["lastN"]):
                start = _bucket_step(start, size, back=True)
        else:
            start = _bucket_floor(parse_ts(query["startTime"]) if "startTime" in query else
                                  now - dt.timedelta(days=30), size)
            end = parse_ts(query["endTime"]) if "endTime" in query else now
            end = end if _bucket_floor(end, size) == end else _bucket_step(_bucket_floor(end, size), size)
        if end <= start:
            return self._rule(req, "endTime must be after startTime")
        pod = query.get("podId")
        amounts: dict[tuple[str, dt.datetime], float] = {}
        open_now = {pid: [(m.billing_since, time.time(), m.price)] for pid, m in self._meta.items()
                    if m.billing_since is not None}
        for pid in set(self.ledger) | set(open_now) | set(self.charges):
            if pod is not None and pid != pod:
                continue
            for t0, t1, rate in self.ledger.get(pid, []) + open_now.get(pid, []):
                a, b = max(start, _utc(t0)), min(end, _utc(t1))
                bucket = _bucket_floor(a, size) if a < b else b
                while bucket < b:
                    nxt = _bucket_step(bucket, size)
                    seconds = (min(b, nxt) - max(a, bucket)).total_seconds()
                    amounts[pid, bucket] = amounts.get((pid, bucket), 0.0) + rate * seconds / 3600
                    bucket = nxt
            for t, usd in self.charges.get(pid, []):
                if start <= _utc(t) < end:
                    key = (pid, _bucket_floor(_utc(t), size))
                    amounts[key] = amounts.get(key, 0.0) + usd
        rows = [{"startTime": format_ts(b), "endTime": format_ts(_bucket_step(b, size)), "podId": pid,
                 "totalAmount": round(v, 6), "gpuAmount": round(v, 6), "cpuAmount": 0, "diskAmount": 0}
                for (pid, b), v in sorted(amounts.items(), key=lambda kv: (kv[0][1], kv[0][0])) if v > 0]
        total = round(sum(r["totalAmount"] for r in rows), 6)
        return Answer(200, {"records": rows, "metadata": {
            "query": {"startTime": format_ts(start), "endTime": format_ts(end), "bucketSize": size, "podId": pod},
            "recordCount": len(rows), "uniquePodCount": len({r["podId"] for r in rows}),
            "totals": {"totalAmount": total, "gpuAmount": total, "cpuAmount": 0, "diskAmount": 0}}})
