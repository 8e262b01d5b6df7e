"""The run's money across its pods (issue 58): the budget acts on what the run has spent wherever it ran, and its
`guard set` guards follow it. A replacement without the volume, a migrated pod, a cluster's two nodes, a lost pod,
and two runs on one volume, each against RunPod's stub (tests/runpod_stub.py, held to RunPod's OpenAPI document)
and, where the run's record lives on the checkpoint remote, a real S3 endpoint (`rclone serve s3`, tests/s3server.py)
on 127.0.0.1. The meters are costguard.Meter with their runmeter.RunMeter, as the log listener makes them; the guards
are set with the `podkit guard` command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import s3server
from conftest import PODKIT, wait_for
from podkit import records
from podkit.money import costguard, guardfile, guardrecord, ledger, runmeter, spend
from podkit.remote import remote, runrecord
from runpod_stub import RunPodV2Stub
from scrape import try_scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
KEY = "rpa_TESTKEY0123456789"
NAMES = ("podkit", "run")  # the smoke config's experiment and trial
server, bucket = s3server.fixtures([f"money-{i:02d}" for i in range(8)])


@pytest.fixture
def runpod_api():
    stub = RunPodV2Stub(key=KEY)
    yield stub
    assert stub.graphql == [] and stub.refused == []
    stub.assert_clean()
    stub.close()


def pod_env(api: RunPodV2Stub, pod: str, run: str = "run-7") -> dict[str, str]:
    return {"RUNPOD_POD_ID": pod, "RUNPOD_API_KEY": KEY, "RUNPOD_API_BASE_URL": api.url, "PODKIT_RUN_ID": run}


class Pod:
    """One pod of a run, as its log listener meters it: its workspace (a volume, or a fresh one), its record (on the
    remote when `store` is (server, bucket)), its cost meter."""

    def __init__(self, api: RunPodV2Stub, workspace: Path, pod: str, run: str = "run-7", store=None,
                 node: str = "", siblings=(), head: bool = True) -> None:
        self.env, self.workspace = pod_env(api, pod, run), workspace
        self.state = workspace / ".podkit" / node if node else workspace / ".podkit"
        self.state.mkdir(parents=True, exist_ok=True)
        self.said: list[str] = []
        rem = None
        if store is not None:
            srv, bkt = store
            renv = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))},
                    **srv.env(bkt)}
            rem = remote.Remote(renv["PODKIT_CHECKPOINT_REMOTE"], "/".join(NAMES), 20, environ=renv)
        self.book = runrecord.RunRecord(self.state, NAMES, rem, pod, run)
        self.runs = runmeter.RunMeter(lambda: self.book, pod, run, self.said.append, siblings=siblings, head=head,
                                      workspace=workspace, every_s=1, push_every_s=5)
        self.meter = costguard.Meter(self.state, 1, say=self.said.append, environ=self.env, runs=self.runs)

    def boot(self) -> Pod:
        """The listener's start: the record pulled and the guards taken from it, before the first look."""
        self.runs.begin((self.meter.last or {}).get("total"))
        return self

    def guard(self, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PODKIT_", "RUNPOD_"))}
        r = subprocess.run([*PODKIT, "guard", *args, "--workspace", str(self.workspace)], capture_output=True,
                           text=True, env={**env, **self.env}, timeout=30)
        assert r.returncode == 0, r.stderr
        return r

    def guards(self) -> dict:
        """The guards in force for this pod's run (guardfile.Live's rule)."""
        by_run, problem = guardfile.read(guardfile.path(self.workspace))
        assert not problem, problem
        return guardfile.resolve(by_run, {"max_spend": 0.0, "stop_pod_at": 0.0}, self.env["PODKIT_RUN_ID"])[0]

    def deadline(self) -> costguard.Deadline:
        return costguard.Deadline(lambda k: self.guards()[k], lambda k: True, self.state, self.said.append,
                                  lambda why: "", spent=self.meter.spent)


def remote_objects(srv, bkt: str, kind: str) -> list[str]:
    d = Path(srv.root) / bkt / "runs" / NAMES[0] / NAMES[1] / "run" / kind
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# -- a replacement without the volume, a migrated pod -----------------------------------------------------------------
def test_a_replacement_without_the_volume_starts_with_the_runs_spend_and_its_guard_set_budget(
        runpod_api, server, bucket, tmp_path):
    """Pod a spends $15 (its bill), and `podkit guard set max_spend=20` is set on it; it stops, and its replacement b
    starts in another data center, on a fresh volume, with the remote: it started at $0 with no budget, and each of
    the watch's relaunches could spend the whole budget again. Now b's first look has the run's $15 (pod a's bill),
    its guard file the run's $20 budget (from the record, said), and $6 more on b crosses it."""
    runpod_api.add_pod(id="pod-a")
    a = Pod(runpod_api, tmp_path / "vol-a", "pod-a", store=(server, bucket)).boot()
    runpod_api.charge("pod-a", 15.0)
    assert a.meter.read()["spent"] >= 15.0
    a.guard("set", "max_spend=20")
    a.runs.sync(pull=True)
    assert remote_objects(server, bucket, "guards"), "the run's guard went up to the record"
    assert a.meter.final(20)  # the pod's stop: its figures, saying it stopped
    assert remote_objects(server, bucket, "pods") == ["pod-a.json"]
    up = Path(server.root) / bucket / "runs" / NAMES[0] / NAMES[1] / "run" / "pods" / "pod-a.json"
    assert json.loads(up.read_text())["stopped"] is True
    runpod_api.set_status("pod-a", "EXITED")

    runpod_api.add_pod(id="pod-b", dataCenterId="EU-RO-1")
    b = Pod(runpod_api, tmp_path / "fresh-b", "pod-b", store=(server, bucket)).boot()
    assert b.guards()["max_spend"] == 20.0
    took = [s for s in b.said if s.startswith("guard.max_spend $20.00: the run's, from the run's record")]
    assert took and "`podkit guard set` on pod pod-a" in took[0], b.said
    first = b.meter.read()
    run = first["total"]
    assert [p["pod"] for p in run["parts"]] == ["pod-a"] and run["parts"][0]["source"] == "billed"
    assert 15.0 <= b.meter.spent() < 15.1 and run["pods"] == 2
    assert "; $15.0" in ledger.words(ledger.cost(b.state, b.env)) and "this run, over 2 pods" in \
        ledger.words(ledger.cost(b.state, b.env))
    assert b.deadline().due(time.time()) == ""
    runpod_api.charge("pod-b", 6.0)
    b.meter.read()
    assert b.deadline().due(time.time()) == "max_spend" and b.meter.spent() >= 21.0


@pytest.mark.parametrize("volume", ["same", "none"])
def test_a_migrated_pod_keeps_the_runs_spend_and_budget(runpod_api, server, bucket, tmp_path, volume):
    """RunPod migrates pod a: it is gone (404) and a new pod with a new id runs in its place, on the same volume or on
    none. The new pod's spend is the run's: pod a's bill once (the volume's cost.json carries it, and the record
    holds it: one part), its own from zero, and the budget set on pod a."""
    runpod_api.add_pod(id="pod-a")
    a = Pod(runpod_api, tmp_path / "vol", "pod-a", store=(server, bucket)).boot()
    runpod_api.charge("pod-a", 7.0)
    a.meter.read()
    a.guard("set", "max_spend=9")
    a.runs.sync(pull=True)
    new = runpod_api.migrate("pod-a")
    b = Pod(runpod_api, tmp_path / ("vol" if volume == "same" else "fresh"), new, store=(server, bucket)).boot()
    rec = b.meter.read()
    assert [p["pod"] for p in rec["total"]["parts"]] == ["pod-a"], "pod a once, however many places hold it"
    part = rec["total"]["parts"][0]
    assert part["source"] == "billed" and 7.0 <= part["spent"] < 7.1, part
    assert 7.0 <= b.meter.spent() < 7.2 and b.guards()["max_spend"] == 9.0
    if volume == "same":
        assert rec["carried"]["pod-a"]["spent"] >= 7.0, "the volume's cost.json carried it too"
    runpod_api.charge(new, 2.5)
    b.meter.read()
    assert b.deadline().due(time.time()) == "max_spend"


# -- a cluster's nodes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["volume", "remote"])
def test_a_clusters_head_meters_every_node_against_the_budget(runpod_api, server, bucket, tmp_path, store):
    """A two-node cluster with a $20 budget: each node spent $12. The head metered only itself ($12 < $20, trains
    on); now its spend is the run's, $24 (its node's ledger on the shared volume, or its entry on the remote), and
    the budget acts on the head. The node meters itself and acts on nothing."""
    runpod_api.add_pod(id="pod-head")
    runpod_api.add_pod(id="pod-node1")
    ws = tmp_path / "shared"
    where = (server, bucket) if store == "remote" else None
    node = Pod(runpod_api, ws, "pod-node1", store=where, node="node-1", head=False).boot()
    siblings = [ws / ".podkit" / "node-1"] if store == "volume" else []
    head = Pod(runpod_api, ws, "pod-head", store=where, siblings=siblings).boot()
    head.guard("set", "max_spend=20")
    runpod_api.charge("pod-head", 12.0)
    runpod_api.charge("pod-node1", 12.0)
    assert node.meter.read()["total"] is None and 12.0 <= node.meter.spent() < 12.1
    node.runs.sync()
    head.runs.sync(pull=True)
    rec = head.meter.read()
    assert [p["pod"] for p in rec["total"]["parts"]] == ["pod-node1"] and rec["total"]["source"] in ("read", "billed")
    assert 24.0 <= head.meter.spent() < 24.2
    assert head.deadline().due(time.time()) == "max_spend"
    assert rec["total"]["per_hour"] == pytest.approx(2 * 2.69, rel=1e-3), "the run's pace: both nodes"


# -- a lost pod ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bill", ["readable", "refused"])
def test_a_lost_pods_minutes_until_runpod_stopped_it_are_in_the_run_total(runpod_api, server, bucket, tmp_path, bill):
    """Pod a ($900/h) records its spend, then is lost: it writes nothing more, and RunPod stops it 4 s later (the
    watch's stop). Its replacement b counts those seconds: RunPod's bill for pod a; refused the bill, pod a's price
    from its last record until RunPod showed it stopped, no later than b's start, said as an estimate."""
    runpod_api.add_pod(id="pod-a")
    runpod_api.set_price("pod-a", 900.0)
    a = Pod(runpod_api, tmp_path / "vol-a", "pod-a", store=(server, bucket)).boot()
    last = a.meter.read()
    a.runs.sync()
    time.sleep(4)  # lost: running, recording nothing
    runpod_api.set_status("pod-a", "EXITED")
    time.sleep(1)
    runpod_api.add_pod(id="pod-b")
    if bill == "refused":
        runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    b = Pod(runpod_api, tmp_path / "fresh-b", "pod-b", store=(server, bucket)).boot()
    rec = b.meter.read()
    [part] = rec["total"]["parts"]
    lost = 900 * 4 / 3600  # $1 for its 4 s unrecorded
    if bill == "readable":  # its whole bill, the 4 s in (its own figure counted from its start to the second)
        assert part["source"] == "billed" and part["spent"] >= lost and part["spent"] > last["spent"], (part, last)
        assert rec["total"]["source"] in ("read", "billed")
    else:
        assert part["spent"] >= last["spent"] + lost - 0.05, (part, last)
        assert part["source"] == "estimated" and "RunPod says it stopped by" in part["why"], part
        assert part["spent"] <= last["spent"] + 900 * 7 / 3600, "no later than b's start"
        assert rec["total"]["source"] == "estimated" and "pod pod-a" in spend.total_sureness(rec)
        assert "its bill cannot be read" in part["why"]
        line = ledger.words(ledger.cost(b.state, b.env))
        assert "this run, over 2 pods (estimated since" in line and "pod pod-a" in line, line


def test_a_pod_runpod_will_not_tell_of_is_estimated_until_its_replacement_started(runpod_api, tmp_path):
    """The pod's key may read neither other pods nor their bills (a pod-scoped key): pod a's part is its last record
    plus its price until this pod started, said with why, and RunPod is not asked again for a while."""
    runpod_api.add_pod(id="pod-a")
    a = Pod(runpod_api, tmp_path / "vol", "pod-a").boot()
    runpod_api.charge("pod-a", 2.0)
    a.meter.read()
    runpod_api.set_status("pod-a", "EXITED")
    time.sleep(1.1)  # its replacement starts after it (RunPod's start times are to the second)
    runpod_api.add_pod(id="pod-b")
    runpod_api.fail("GET", "/v2/pods/pod-a", 403, times=None)
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    b = Pod(runpod_api, tmp_path / "vol", "pod-b").boot()  # the same volume: its mirror of the record, its cost.json
    rec = b.meter.read()
    [part] = rec["total"]["parts"]
    assert part["source"] == "estimated" and "RunPod cannot be asked about it" in part["why"]
    assert "until this pod started" in part["why"] and part["spent"] >= 2.0
    assert sum("RunPod refuses this pod's key the run's other pods" in s for s in b.said) == 1
    asked = len([r for r in runpod_api.requests if r.path == "/v2/pods/pod-a"])
    b.meter.read()
    assert len([r for r in runpod_api.requests if r.path == "/v2/pods/pod-a"]) == asked, "not asked again at once"


# -- two runs on one volume -------------------------------------------------------------------------------------------
def test_another_runs_cost_and_guard_set_on_the_same_volume_change_nothing_of_this_run(runpod_api, tmp_path):
    """Run 8's pod used this volume: its cost.json ($50) and its entry in the record's mirror under the same names;
    then its `guard set max_spend=100` and `guard clear stop_pod_at` on the volume. Run 7's budget of $20 and
    maximum run time stay; its spend shows none of run 8's, before and after its own meter looks."""
    runpod_api.add_pod(id="pod-7")
    ws = tmp_path / "vol"
    seven = Pod(runpod_api, ws, "pod-7", run="run-7")
    records.COST.write(seven.state, {"per_hour": 2.0, "spent": 50.0, "source": "read", "time": time.time(),
                                     "pod": "pod-8", "run": "run-8"})
    runrecord.RunRecord(seven.state, NAMES, None, "pod-8", "run-8").own("pods", {
        "spent": 50.0, "source": "read", "per_hour": 2.0, "read_at": time.time(), "stopped": False})
    assert ledger.cost(seven.state, seven.env) is None, "another run's cost.json is not this run's spend"
    st = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(ws)], capture_output=True, text=True,
                        env={**{k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}, **seven.env},
                        timeout=30)
    assert json.loads(st.stdout)["cost"] is None, st.stdout[-2000:]
    at = int(time.time()) + 7200
    seven.guard("set", "max_spend=20", f"stop_pod_at={at}")
    eight = Pod(runpod_api, ws, "pod-8", run="run-8")
    r = eight.guard("set", "max_spend=100")
    assert "guard.max_spend                $100.00" in r.stdout
    eight.guard("clear", "stop_pod_at")
    eight.guard("clear")
    assert seven.guards() == {"max_spend": 20.0, "stop_pod_at": at}
    seven.boot()
    runpod_api.charge("pod-7", 1.0)
    rec = seven.meter.read()
    assert rec["total"]["parts"] == [] and 1.0 <= seven.meter.spent() < 1.1
    assert seven.guards()["max_spend"] == 20.0 and seven.deadline().due(time.time()) == ""
    shown = json.loads(subprocess.run([*PODKIT, "guard", "show", "--json", "--workspace", str(ws)], text=True,
                                      capture_output=True, env={**os.environ, **seven.env}, timeout=30).stdout)
    assert shown["guards"]["max_spend"]["value"] == 20.0 and shown["guards"]["max_spend"]["stale"] is None


# -- what is read is data -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("planted, why", [
    ({"_name": "pod-x.json"}, "named as another pod"),
    ({"run": "run-8"}, "another run's (not counted in this run)"),
    ({"spent": 1e12}, "an amount that is not one"),
    ({"spent": float("nan")}, "not a number"),
    ({"per_hour": 5000.0}, "a price that is not one"),
    ({"read_at": time.time() + 7200, "time": time.time() + 7200}, "a time ahead of this clock"),
    ({"pod": "../../etc"}, "a pod id that is not one"),
    ({"source": "a guess"}, "a sureness not podkit's"),
])
def test_a_planted_pods_entry_is_not_counted(planted, why):
    now = time.time()
    good = {"pod": "pod-a", "run": "run-7", "spent": 3.0, "source": "read", "per_hour": 1.0, "read_at": now - 60,
            "time": now - 60, "stopped": True, "_name": "pod-a.json"}
    assert runmeter.figures(good, now)[0]["spent"] == 3.0
    found = runmeter.figures({**good, **planted}, now)
    mine = {"pod": "me", "run": "run-7", "spent": 1.0, "source": "read", "time": now, "started": now - 60}
    assert spend.run_total(mine, found, {}, now)["spent"] == 1.0, why


def test_a_guard_in_the_record_is_data_and_the_newer_side_wins():
    """The record's guards: another run's, a key that is no guard, a value the config refuses, a time ahead are not
    read; per key the one set later goes to the other side, a clear as a clear."""
    now = time.time()
    ent = [{"run": "run-7", "key": "max_spend", "value": 20.0, "set_at": now - 60, "pod": "pod-a"},
           {"run": "run-8", "key": "max_spend", "value": 100.0, "set_at": now - 10, "pod": "pod-z"},
           {"run": "run-7", "key": "max_boots", "value": 3, "set_at": now - 10, "pod": "pod-z"},
           {"run": "run-7", "key": "stop_pod_after_s", "value": -5, "set_at": now - 10, "pod": "pod-z"},
           {"run": "run-7", "key": "stop_pod_when_finished", "value": "never", "set_at": now + 3600, "pod": "pod-z"},
           {"run": "run-7", "key": "stop_pod_at", "cleared": True, "set_at": now - 5, "pod": "pod-a"}]
    rec = guardrecord.recorded(ent, "run-7", now)
    assert set(rec) == {"max_spend", "stop_pod_at"} and rec["max_spend"]["value"] == 20.0
    to_file, to_record = guardrecord.decide({"stop_pod_at": {"value": now + 60, "time": now - 30},
                                             "stop_pod_after_s": {"value": 60.0, "time": now - 1}}, rec)
    assert to_file["max_spend"]["value"] == 20.0 and "pod pod-a" in to_file["max_spend"]["from"]
    assert to_file["stop_pod_at"] == {"cleared": True, "time": now - 5, "seq": 0}
    assert set(to_record) == {"stop_pod_after_s"}


# -- the whole pod: its log listener ---------------------------------------------------------------------------------
def test_a_replacement_pods_listener_takes_the_runs_budget_and_spend_from_the_record_and_stops_on_them(
        stack_factory, runpod_api, server, bucket):
    """Two pods of one run, one after the other, as RunPod runs them (the smoke stack, its log listener metering
    every second, the run's record on a real S3 endpoint): pod a spends $15 and gets `podkit guard set
    max_spend=20`, then stops; pod b starts on an empty volume in another data center. b's listener takes the $20
    budget and the run's $15 from the record at its start, and $6 more on b stops b's trainer with its checkpoint,
    then pod b."""
    runpod_api.add_pod(id="pod-a")
    env = {**server.env(bucket), "PODKIT_GUARD_COST_EVERY_S": "1", "PODKIT_CHECKPOINT_REMOTE_TIMEOUT_S": "20",
           "PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S": "6"}
    a = stack_factory("vol-a", **env, **pod_env(runpod_api, "pod-a")).start()
    a.wait_step(3)
    runpod_api.charge("pod-a", 15.0)
    r = subprocess.run([*PODKIT, "guard", "set", "max_spend=20", "--workspace", str(a.workspace)], env=a.env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: remote_objects(server, bucket, "guards"), 60, what="the run's guard on the remote")
    wait_for(lambda: (c := ledger.cost(a.workspace / ".podkit", a.env)) and c["spent"] >= 15, 30,
             what="pod a's spend")
    assert a.stop() == 0
    pods = Path(server.root) / bucket / "runs" / "podkit" / "run" / "run" / "pods" / "pod-a.json"
    last = json.loads(pods.read_text())
    assert last["stopped"] is True and last["spent"] >= 15 and last["run"] == "run-7", last
    runpod_api.set_status("pod-a", "EXITED")

    runpod_api.add_pod(id="pod-b", dataCenterId="EU-RO-1")
    b = stack_factory("fresh-b", **env, **pod_env(runpod_api, "pod-b")).start()
    wait_for(lambda: "guard.max_spend is now $20.00, from the run's record" in b.stdout(), 60,
             what="the run's budget taken from the record")
    c = wait_for(lambda: (c := ledger.cost(b.workspace / ".podkit", b.env)) and c.get("total") and c, 60,
                 what="pod b's run total")
    assert spend.total(c) >= 15 and [p["pod"] for p in c["total"]["parts"]] == ["pod-a"], c
    st = b.status()  # what status, the page and /metrics show as this run's: its total, with how sure it is
    assert st["cost"]["total"]["spent"] >= 15 and st["cost"]["total"]["parts"][0]["source"] == "billed"
    shown = subprocess.run([*PODKIT, "status", "--workspace", str(b.workspace)], capture_output=True, text=True,
                           env=b.env, timeout=30).stdout
    assert re.search(r"^cost: \$2\.69/h, .* spent \(billed\); \$15\.\d\d this run, over 2 pods \((billed|read)\)",
                     shown, re.M), shown
    m = wait_for(lambda: try_scrape(int(b.env["PODKIT_METRICS_PORT"])), 30, what="/metrics")
    assert [v for (name, labels), v in m.items() if name == "podkit_spent_dollars" and ("scope", "run") in labels
            ][0] >= 15
    b.wait_step(1)
    assert "POST /v2/pods/pod-b/action" not in runpod_api.calls(), "under the budget: trains on"
    runpod_api.charge("pod-b", 6.0)
    wait_for(lambda: "POST /v2/pods/pod-b/action" in runpod_api.calls(), 60, what="pod b's stop")
    assert "the run's spend reached its budget ($21." in b.stdout()
    prog = b.progress()
    assert prog["stopped"]["by"] == "SIGTERM" and prog["checkpoint_step"] == prog["step"] > 0
    assert b.stop() == 0


def test_a_clock_stepped_back_between_two_guard_sets_never_brings_the_earlier_budget_back(tmp_path, monkeypatch):
    """`guard set max_spend=50`, the clock stepped back an hour, `guard set max_spend=10`: the second follows the first
    (its count of changes one more), so the run's record never puts $50 back, on this pod or a replacement."""
    from podkit.money import guardfile, guardrecord

    monkeypatch.setenv("PODKIT_RUN_ID", "run-7")
    p = tmp_path / ".podkit" / guardfile.NAME
    p.parent.mkdir(parents=True)
    now = time.time()
    guardfile.update(p, lambda mine: {**mine, "max_spend": guardfile.after(mine, "max_spend", {
        "value": 50.0, "over": 0.0, "time": now})})
    first = guardfile.read(p)[0]["run-7"]["max_spend"]
    rec = {"max_spend": {"value": 50.0, "set_at": now, "by": "pod-a", "seq": first["seq"]}}
    guardfile.update(p, lambda mine: {**mine, "max_spend": guardfile.after(mine, "max_spend", {
        "value": 10.0, "over": 0.0, "time": now - 3600})})  # the clock an hour behind
    second = guardfile.read(p)[0]["run-7"]["max_spend"]
    to_file, to_record = guardrecord.decide({"max_spend": second}, rec)
    assert not to_file and to_record["max_spend"]["value"] == 10.0
    entries = [{"key": "max_spend", "run": "run-7", "set_at": now, "seq": 1, "value": 50.0, "pod": "pod-a"},
               {"key": "max_spend", "run": "run-7", "set_at": now - 3600, "seq": 2, "value": 10.0, "pod": "pod-a"}]
    assert guardrecord.recorded(entries, "run-7")["max_spend"]["value"] == 10.0  # a replacement takes $10
