"""The run's money across its pods: what every pod of the run has cost, wherever it ran, gathered for the cost meter
(costguard.Meter), which sums it with its own ledger (spend.run_total) into the spend the budget acts on.

Each pod's meter writes its own figures to the run's record (runrecord.py, kind "pods": `pods/<pod>.json`,
written by that pod alone) after each look at RunPod; they go to the remote at most every PUSH_S (each push is an
rclone start beside the trainer; every fifth look when looks are more often), and at the pod's stop, saying it
stopped. So a replacement pod without the volume, a migrated pod and a cluster's head all read the run's other
pods from the record; a cluster's head also reads its nodes' ledgers on the shared volume
(`.podkit/node-<rank>/cost.json`), fresh each minute. For each other
pod of the run whose figures are not fresh (a lost pod, an earlier one), RunPod is asked what became of it (`GET
/v2/pods/{id}`) and what it billed (`GET /v2/billing/pods?podId=`); a pod-scoped key may be refused both, and the
part then says so and how it was estimated.

The record's guards (guardrecord.py) are kept in step with the volume's guard file by the same thread, on a
single pod and a cluster's head: a replacement takes the run's `guard set` budget from the record at its start.

Every entry is data: one not named by its pod, of another run, with amounts that are not amounts, or stamped ahead
of this clock, is not read. Nothing here raises into the meter.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from podkit import log, records
from podkit.money import ledger, spend

_log = log.get("costguard")
POD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # RunPod's pod ids: what goes into a request's path
PUSH_S = 300.0  # the pod's own figures reach the remote this often (an rclone start beside the trainer)
TICK_S = 2.0  # the record thread looks at the guard file this often (a stat)
SYNC_S = 30.0  # one rclone call of the record's sync at most this long: the meter's reads go on meanwhile
AHEAD_S = 300.0  # an entry stamped further ahead of this clock is not a read of it
ASK_MAX = 8  # other pods asked about at one look: a run relaunches a few times, a cluster has a few nodes
REFUSED_S = 600.0  # a key RunPod refused other pods' reads is not tried again for this long


def figures(entry: dict, now: float) -> list[dict]:
    """A pod's own entry of the run's record (or a node's ledger), checked, as spend.run_total's observations: the
    pod's own figures and those it carries of earlier pods; [] for one that is not to be believed."""
    pod, run = entry.get("pod"), entry.get("run")
    if not isinstance(pod, str) or not POD_ID.match(pod) or not isinstance(run, str) or not run:
        return []
    if "_name" in entry and entry["_name"] != f"{pod}.json":
        return []  # a pod's own object is named by it: another name claiming it is not its
    t = spend._time(entry.get("read_at")) or spend._time(entry.get("time"))
    source = entry.get("source")
    spent, rate = spend._money(entry.get("spent")), spend._rate(entry.get("per_hour"))
    if t is None or t > now + AHEAD_S or source not in spend.SOURCES or (spent is None) != (source == "unknown") \
            or entry.get("per_hour") is not None and rate is None:
        return []
    out = [{"pod": pod, "run": run, "spent": spent, "source": source, "per_hour": rate, "time": t,
            "stopped": entry.get("stopped") is True, "started": spend._time(entry.get("started"))}]
    for other, item in spend.carried(entry).items():
        if other != spend.EARLIER and POD_ID.match(other) and (item["time"] or 0) <= now + AHEAD_S:
            out.append({**item, "pod": other, "run": run, "stopped": False})
    return out


class RunMeter:
    """The run's other pods, for this pod's cost meter. `book()` makes the run's record (remote.book; None while the
    run's names are not known: asked again at each look). `siblings`: a cluster head's nodes' state dirs. `head`:
    this pod sums the run (a single pod, a cluster's rank 0); a cluster's other nodes only write their own figures.
    `workspace`: the guard file's, kept in step with the record's guards (guardrecord.py) on the head."""

    def __init__(self, book, pod: str, run: str, say=None, siblings=(), head: bool = True,
                 workspace: Path | None = None, every_s: float = 60.0, push_every_s: float = PUSH_S) -> None:
        self.make_book, self.pod, self.run = book, pod, run
        self.say = say or _log.info
        self.siblings, self.head, self.workspace = [Path(d) for d in siblings], head, workspace
        self.fresh_s = 2 * push_every_s + 3 * every_s  # a figure pushed, pulled and read within this is fresh
        self.push_every_s = push_every_s
        self.book = None
        self.seen: dict[str, dict] = {}  # pod -> what RunPod said of it at the last look that asked
        self.ended: dict[str, float] = {}  # pod -> when a look first saw it not running (kept in cost.json's parts)
        self.settled: set[str] = set()  # stopped or gone, its bill read after the lag: nothing more to learn
        self.refused = ("", 0.0)  # (why, until: time.monotonic()): RunPod refused this key other pods' reads
        self.pushed = 0.0  # time.monotonic() of the last sync
        self.failing = ""  # what the last sync with the remote said ("" once one works)
        self.stopping = False  # the pod stops: its figures say so from now on
        self.facts: dict = {}  # what RunPod said of this pod: its data center, when it was made
        self.said: set[str] = set()
        self.guards_sig: object = "unread"
        self.lock = threading.Lock()  # the meter's thread and the record's: one sync at a time

    # -- the record ---------------------------------------------------------------------------------------------
    def record(self):
        if self.book is None:
            try:
                self.book = self.make_book()
            except Exception as e:  # noqa: BLE001 - a record that cannot be made is said, and asked for again
                self._once("book", f"the run's record cannot be opened ({type(e).__name__}: {e}): the run's spend is "
                           "this pod's and what its volume carries")
        return self.book

    def begin(self, prev: dict | None = None) -> None:
        """At the meter's start, before its first look: what the last look knew of the other pods (cost.json's
        total), the record pulled (the run's other pods, its guards), and the guards taken from it."""
        for p in (prev or {}).get("parts") or []:
            if p.get("ended"):
                self.ended[p["pod"]] = p["ended"]
        self.sync(pull=self.head)  # a cluster's other nodes only write their own

    def sync(self, pull: bool = False) -> None:
        """This pod's entries pushed and (`pull`) the others' pulled, each one bounded rclone call; on the head the
        guards then kept in step. A failure is said once, and tried again at the next."""
        book = self.record()
        if book is None:
            return
        with self.lock:
            ok = book.sync(SYNC_S) if pull else book.push(SYNC_S)
            self.pushed = time.monotonic()
            if not ok and not self.failing:
                self.say(f"{book.problem}: the run's other pods and guards are what was read before; tried again "
                         "every few minutes, said again once it works")
            elif ok and self.failing:
                self.say(f"the run's record is reached again ({book.where})")
            self.failing = "" if ok else book.problem or "?"
            if self.head and self.workspace is not None:
                self.guards()

    def guards(self) -> None:
        from podkit.money import guardfile, guardrecord

        try:
            st = os.lstat(guardfile.path(self.workspace))
            self.guards_sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            self.guards_sig = None
        try:
            guardrecord.sync(self.book, self.workspace, self.run, self.say)
        except Exception as e:  # noqa: BLE001 - the guards in the file hold whatever the record holds
            self._once("guards", f"the run's guards could not be kept in step with its record ({type(e).__name__}: "
                       f"{e}): the guard file's hold")

    def tick(self) -> None:
        """The record thread's look: the pod's figures pushed every PUSH_S (and the others' pulled), the guards at
        once when the guard file changed."""
        if time.monotonic() - self.pushed >= self.push_every_s:
            self.sync(pull=self.head)
            return
        if self.head and self.workspace is not None and self.book is not None:
            from podkit.money import guardfile

            try:
                st = os.lstat(guardfile.path(self.workspace))
                sig: object = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                sig = None
            if sig != self.guards_sig:
                with self.lock:
                    self.guards()

    def start(self) -> RunMeter:
        def loop() -> None:
            while True:
                time.sleep(TICK_S)
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - the record's sync must not end the meter; the next tick tries
                    pass
        threading.Thread(target=loop, name="run-record", daemon=True).start()
        return self

    def mine(self, ledger: dict, stopped: bool = False) -> None:
        """This pod's figures into the record (the mirror: pushed by the record thread, or by final())."""
        book = self.record()
        if book is None:
            return
        keep = {k: ledger.get(k) for k in ("spent", "source", "per_hour", "started", "why", "since")}
        book.own("pods", {**keep, "read_at": ledger.get("time"), "stopped": stopped or self.stopping,
                          "carried": ledger.get("carried") or {}, **self.facts}, push_s=0)

    def final(self, ledger: dict | None, timeout_s: float) -> bool:
        """At the pod's stop: its figures, saying it stopped, pushed within `timeout_s`."""
        if ledger is None or self.record() is None:
            return False
        self.stopping = True  # a look of the meter meanwhile writes it stopped too
        self.mine(ledger, stopped=True)
        return self.book.push(max(0.1, timeout_s))  # not waiting on a sync in flight: the stop's time is short

    # -- the other pods -------------------------------------------------------------------------------------------
    def observations(self, now: float) -> list[dict]:
        """Every figure of this run's other pods: their entries in the record, the nodes' ledgers."""

        out = []
        book = self.record()
        for e in book.entries("pods") if book is not None else []:
            found = figures(e, now)
            if not found and e.get("run") == self.run and e.get("pod") != self.pod:
                self._once(f"bad:{e.get('_name')}", f"the run's record holds an entry of pods that is not a pod's "
                           f"figures ({str(e.get('_name'))[:80]}): not counted")
            out += found
        for d in self.siblings:
            c = ledger.checked(records.COST.read(d))
            if c is not None and c.get("run") == self.run:
                out += figures({**c, "read_at": c["time"]}, now)
        return [o for o in out if o["run"] == self.run]

    def ask(self, client, obs: list[dict], mine: dict, now: float) -> dict:
        """What RunPod says of each other pod of the run whose figures are not fresh: {pod: seen}."""
        from podkit import runpod

        started = spend._time(mine.get("started")) or now
        newest: dict[str, float] = {}
        for o in obs + [{"pod": p, **i} for p, i in spend.carried(mine).items()]:
            if o["pod"] != self.pod and POD_ID.match(o["pod"]):
                newest[o["pod"]] = max(newest.get(o["pod"], 0.0), o.get("time") or 0.0)
        seen: dict[str, dict] = {}
        asked = 0
        for pod, t in sorted(newest.items(), key=lambda kv: -kv[1]):
            # fresh (a cluster's node): its own figures say enough, once RunPod was asked what it is
            fresh = t >= started and now - t < self.fresh_s and pod in self.seen
            if fresh and pod not in self.settled:
                continue
            if pod in self.settled:
                seen[pod] = self.seen[pod]
                continue
            why, until = self.refused
            if client is None or time.monotonic() < until or asked >= ASK_MAX:
                seen[pod] = {"state": None, "why": why or ("not asked at this look" if client else "no RunPod key"),
                             "ended": self.ended.get(pod)}
                continue
            asked += 1
            seen[pod] = self.seen[pod] = self._ask(client, runpod, pod, now)
        return seen

    def _ask(self, client, runpod, pod: str, now: float) -> dict:
        out: dict = {"state": None, "why": None, "price": None, "bill": None, "bill_why": None}
        created = None
        try:
            got = client.pod(pod)
        except runpod.ApiError as e:
            out["why"] = e.message or f"HTTP {e.status}"
            if e.status in (401, 403):
                self.refused = (out["why"], time.monotonic() + REFUSED_S)
                self._once("refused", f"RunPod refuses this pod's key the run's other pods ({out['why']}): their "
                           "spend is their last record, and their time after it estimated")
        else:
            state = runpod.pod_state(got) if got is not None else "gone"
            out["state"] = {"starting": "running", "error": "running", "unknown": None}.get(state, state)
            if out["state"] is None:
                out["why"] = f"RunPod shows it as {str((got or {}).get('status'))[:40]!r}"
            out["price"] = runpod.pod_cost(got) if out["state"] == "running" else None
            created = (got or {}).get("createdAt")
        if out["state"] in ("stopped", "gone"):
            self.ended.setdefault(pod, now)
        out["ended"] = self.ended.get(pod)
        try:
            out["bill"] = client.pod_billing(pod, created)
        except runpod.ApiError as e:
            out["bill_why"] = e.message or f"HTTP {e.status}"
        if out["state"] in ("stopped", "gone") and (out["bill"] is not None and now - out["ended"] >= spend.LAG_S
                                                    or out["bill_why"] and out["why"] is None):
            self.settled.add(pod)  # nothing more to learn of it: its part stays as counted now
        return out

    def total(self, client, mine: dict, now: float, prev: dict | None = None) -> dict | None:
        """The run's spend across its pods, for this pod's ledger `mine` (None on a cluster's other nodes); `prev`:
        the last look's (never gone below)."""
        if not self.head:
            return None
        obs = self.observations(now)
        seen = self.ask(client, obs, mine, now)
        run = spend.run_total(mine, obs, seen, now, spend.checked_total(prev))
        for p in run["parts"]:
            if p["ended"]:
                self.ended.setdefault(p["pod"], p["ended"])
            if p["pod"] not in self.said:
                self.said.add(p["pod"])
                self.say(f"the run's spend counts pod {p['pod']}: {spend.cents(p['spent'])} ({spend.sureness(p)})")
        return run

    def _once(self, key: str, msg: str) -> None:
        if key not in self.said:
            self.said.add(key)
            try:
                self.say(msg)
            except Exception:  # noqa: BLE001 - stdout gone: the meter goes on
                pass


def for_pod(cfg, say) -> RunMeter:
    """The log listener's: the run's record by its names (remote.book: on checkpoint.remote, else the volume), a
    cluster head's nodes (`.podkit/node-<rank>/` on the shared volume), this pod and run."""
    from podkit.remote import remote

    rank, nodes = cfg.cluster.rank if cfg.multi_node else 0, cfg.cluster.nodes if cfg.multi_node else 1
    siblings = [cfg.workspace_path / ".podkit" / f"node-{r}" for r in range(1, nodes)] if rank == 0 else []
    every = cfg.guard.cost_every_s
    return RunMeter(lambda: remote.book(cfg), os.environ.get("RUNPOD_POD_ID", ""), ledger.run_id(), say,
                    siblings=siblings, head=rank == 0, workspace=cfg.workspace_path, every_s=every,
                    push_every_s=min(PUSH_S, 5 * every))  # every fifth look at most: an rclone start beside the trainer
