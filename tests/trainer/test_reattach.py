"""Rank 0's re-attacher (podkit/areal/reattach.py) against podkit's STAND-IN for SGLang (`podkit run sglang`,
not SGLang), restarted as supervisord would restart SGLang: what it pushes, when it falls back and what it
records. The whole path with the real AReaL trainer is in tests/trainer/test_rehearsal.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

from conftest import free_port, smoke_env, wait_for
from podkit import config, records
from podkit.areal import reattach
from podkit.areal.hooks import Progress
from podkit.judge.health import probe

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _no_fallback_left():
    """reattach.GENERATION is the process's: a fallback in one test must not release the next one's requests."""
    yield
    reattach.GENERATION.fell_back.clear()


class Server:
    def __init__(self, procs, tmp_path) -> None:
        self.procs, self.port = procs, free_port()
        self.env = smoke_env(tmp_path / "ws", self.port, PODKIT_INFERENCE_STARTUP_DELAY_S="0")
        self.addr = f"127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> Server:
        self.proc = self.procs.spawn([sys.executable, "-m", "podkit", "run", "sglang"], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: probe("127.0.0.1", self.port), 20, what="the stand-in")
        return self

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def push(self, path, version: str) -> None:
        req = urllib.request.Request(f"http://{self.addr}/update_weights_from_disk", method="POST",
                                     data=json.dumps({"model_path": str(path), "weight_version": version}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    def served(self):
        return reattach.served_version(self.addr, "")


def version_dir(folder, version: int):
    d = folder / f"weight_update_v{version}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w" * 4096)
    return d


def attacher(server: Server, folder, pushed, **env):
    cfg = config.load(environ={**server.env, "PODKIT_TRAINER_STALE_WEIGHTS_CHECK_S": "1", **env})
    progress = Progress(cfg)
    stale = threading.Event()
    a = reattach.Attacher(cfg, progress, server.addr, "", folder, pushed, stale)
    threading.Thread(target=a.run, daemon=True).start()
    return a, progress, stale


def test_a_restarted_server_gets_the_trainers_latest_weights_from_disk_and_the_trainer_goes_on(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    server.push(version_dir(folder, 5), "5")
    a, progress, stale = attacher(server, folder, 5)
    time.sleep(2.5)
    assert server.served() == "5" and "reattach" not in progress.data, "nothing restarted: nothing pushed"

    server.stop()
    server.start()  # as supervisord restarts it: the base weights, weight_version "default"
    wait_for(lambda: server.served() == "5", 20, what="the re-push of version 5")
    wait_for(lambda: (progress.data.get("reattach") or {}).get("count") == 1, 10, what="the record")
    last = progress.data["reattach"]["last"]
    assert last["outcome"] == "re-attached" and last["version"] == 5 and last["took_s"] < 10, last
    assert not stale.is_set(), "a re-attach does not stop the trainer"
    on_disk = records.PROGRESS.read(a.cfg.state_dir)["reattach"]  # what status, metrics and doctor read
    assert on_disk["count"] == 1 and on_disk["fell_back"] == 0, on_disk
    a.done.set()


def test_the_trainers_own_push_and_a_re_push_take_turns_and_the_newer_version_is_served(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    server.push(version_dir(folder, 1), "1")
    a, progress, stale = attacher(server, folder, 1)
    order = []

    class Meta:
        version = 2

    def update_weights(meta):  # the trainer's own push, slow: the re-push waits for it
        order.append("trainer starts")
        time.sleep(1.5)
        server.push(version_dir(folder, 2), "2")
        order.append("trainer done")

    server.stop()
    server.start()
    pushing = threading.Thread(target=a.pushing(update_weights), args=(Meta,))
    pushing.start()
    wait_for(lambda: order, 5, what="the trainer's push")
    assert a.attach("a restart during the push") is True
    pushing.join(10)
    assert order == ["trainer starts", "trainer done"] and a.pushed == 2
    assert server.served() == "2", "the re-push must not put an older version back"
    assert not stale.is_set()
    a.done.set()


def test_weights_no_longer_on_disk_fall_back_to_a_trainer_restart_and_say_why(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    d = version_dir(folder, 3)
    server.push(d, "3")
    for f in d.iterdir():
        f.unlink()
    d.rmdir()  # a user cleaned the save directory
    a, progress, stale = attacher(server, folder, 3)
    server.stop()
    server.start()
    wait_for(stale.is_set, 20, what="the fallback")
    last = progress.data["reattach"]["last"]
    assert last["outcome"] == "fell back" and "not on disk" in last["why"] and str(d) in last["why"], last
    assert progress.data["reattach"] == {**progress.data["reattach"], "count": 0, "fell_back": 1}
    assert reattach.fell_back_since(a.cfg.state_dir, time.time() - 60), "the other ranks read it from disk"
    assert reattach.GENERATION.fell_back.is_set(), "rank 0's own requests go on at once"
    assert not reattach.fell_back_since(a.cfg.state_dir, time.time() + 1), "a later trainer's start is not released"
    assert server.served() == "default"


def test_a_server_that_does_not_come_back_in_time_falls_back_once(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    server.push(version_dir(folder, 2), "2")
    a, progress, stale = attacher(server, folder, 2, PODKIT_INFERENCE_READY_TIMEOUT_S="3")
    server.stop()  # and not started again: rank 0's own look finds it down, waits 3 s for it, and falls back
    t0 = time.monotonic()
    wait_for(stale.is_set, 20, what="the fallback")
    assert time.monotonic() - t0 > 2.5
    assert "did not answer within inference.ready_timeout_s (3 s)" in progress.data["reattach"]["last"]["why"]


def test_a_refused_push_falls_back_with_inferences_words(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    d = version_dir(folder, 4)
    server.push(d, "4")
    a, progress, stale = attacher(server, folder, 4)
    (d / "model.safetensors").unlink()  # config.json without weights: SGLang's loader refuses the directory
    server.stop()
    server.start()
    wait_for(stale.is_set, 20, what="the fallback")
    why = progress.data["reattach"]["last"]["why"]
    assert why.startswith("the push of version 4 failed: HTTP 400: Failed to update weights: Cannot find any model "
                          "weights"), why
    assert server.served() == "default"


def test_only_older_weight_update_directories_are_removed(tmp_path):
    folder = tmp_path / "save"
    for v in (1, 2, 3):
        version_dir(folder, v)
    (folder / "weight_update_v0x").mkdir()  # not AReaL's name
    (folder / "keep.txt").write_text("mine")
    elsewhere = version_dir(tmp_path / "elsewhere", 1)
    (folder / "weight_update_v0").symlink_to(elsewhere)  # a link: not followed, not removed
    reattach.keep_latest(folder, 3)
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt", "weight_update_v0", "weight_update_v0x",
                                                        "weight_update_v3"]
    assert (elsewhere / "model.safetensors").exists()
    reattach.keep_latest(tmp_path / "missing", 3)  # no folder: nothing to do


def test_generation_waits_for_the_trainers_weights_and_drops_answers_from_the_base_weights(procs, tmp_path):
    server = Server(procs, tmp_path).start()
    gen = reattach.Generation()
    gen.active, gen.version = True, 0
    assert not gen.pushed, "before the first push the base weights are the trainer's own"
    gen.version = 2
    assert gen.pushed
    assert reattach.answered_from_base({"meta_info": {"weight_version": "default"}})
    assert not reattach.answered_from_base({"meta_info": {"weight_version": "2"}})
    assert not reattach.answered_from_base("not json")
    # Serving "default": the wait ends at its deadline, unsatisfied, and woke rank 0's re-attacher.
    t0 = time.monotonic()
    assert asyncio.run(gen.wait_served(server.addr, time.monotonic() + 1.5, interval_s=0.2)) is False
    assert time.monotonic() - t0 >= 1.4 and gen.wake.is_set()
    folder = tmp_path / "save"
    threading.Timer(0.5, server.push, args=(version_dir(folder, 2), "2")).start()
    assert asyncio.run(gen.wait_served(server.addr, time.monotonic() + 10, interval_s=0.2)) is True


def test_status_metrics_the_timeline_and_doctor_count_re_attaches_apart_from_trainer_restarts(tmp_path):
    from prometheus_client import generate_latest

    from podkit.judge import startup
    from podkit.views import doctor, metrics, status

    cfg = config.load(environ={"PODKIT_WORKSPACE": str(tmp_path)})
    state = cfg.state_dir
    state.mkdir(parents=True)
    now = time.time()
    records.BOOTS.write(state, [{"time": now - 100, "pid": 1, "took_s": {"preflight": 1.0}}])
    records.PROGRESS.write(state, {"kind": "areal", "step": 9, "time": now, "first_step_time": now - 50,
                                   "reattach": {"count": 2, "fell_back": 1, "last": {
                                       "time": now - 5, "outcome": "fell back", "version": 8, "took_s": 40.0,
                                       "why": "inference did not answer within inference.ready_timeout_s (40 s)"}}})
    st = status.collect(tmp_path)
    line = next(ln for ln in status.human(st).splitlines() if "inference restarts" in ln)
    assert "2 re-attached, 1 fell back to a trainer restart" in line and "did not answer within" in line, line
    text = generate_latest(metrics.registry(tmp_path, 600)).decode()
    assert 'podkit_inference_reattaches_total{outcome="reattached"} 2.0' in text
    assert 'podkit_inference_reattaches_total{outcome="fell_back"} 1.0' in text
    t = startup.timeline(state, tmp_path / "logs", {})
    assert (t["reattached"], t["fell_back"]) == (2, 1)
    assert "inference restarted 2 time(s) without a trainer restart, 1 with one" in startup.describe(t)
    found = {f.id: f for f in doctor.examine(cfg, tmp_path)}
    f = found["inference_reattach_fell_back"]
    assert f.severity == "info" and "did not answer within" in f.evidence[0], f.to_dict()

    # A planted record of the wrong shape: read as no record, never a traceback.
    (state / "progress.json").write_text(json.dumps({"step": 3, "reattach": {"count": "many", "last": [1]}}))
    assert "inference restarts" not in status.human(status.collect(tmp_path))
    assert "inference_reattach_fell_back" not in {f.id for f in doctor.examine(cfg, tmp_path)}
    generate_latest(metrics.registry(tmp_path, 600))


def test_a_re_attacher_that_fails_falls_back_rather_than_leave_requests_waiting(procs, tmp_path, monkeypatch):
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    server.push(version_dir(folder, 2), "2")

    def broken(*_a, **_k):
        raise RuntimeError("a bug of its own")

    monkeypatch.setattr(reattach, "served_version", broken)
    a, progress, stale = attacher(server, folder, 2)
    a.wake.set()
    wait_for(stale.is_set, 10, what="the fallback")
    assert progress.data["reattach"]["last"]["why"] == "the re-attacher failed: RuntimeError: a bug of its own"


def test_the_step_hook_and_the_re_attacher_write_progress_together_without_losing_it(tmp_path):
    """Two threads of rank 0 write progress.json: each write is whole, none fails, the file is never missing."""
    progress = records.Progress(tmp_path, "areal")
    assert progress.update(step=0)
    failures, bad_reads, stop = [], [], threading.Event()

    def writer(key):
        n = 0
        while not stop.is_set():
            n += 1
            if not progress.update(**{key: n}):
                failures.append(key)

    def reader():
        while not stop.is_set():
            try:
                json.loads((tmp_path / "progress.json").read_text())
            except (OSError, ValueError) as e:
                bad_reads.append(repr(e))

    threads = [threading.Thread(target=writer, args=("step",)), threading.Thread(target=writer, args=("eval_step",)),
               threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(10)
    assert not failures and not bad_reads[:1], (failures[:3], bad_reads[:3])
    assert not list(tmp_path.glob(".progress.json.*")), "no temp file left"


def test_a_server_down_during_the_trainers_own_push_is_the_fallback_though_the_push_holds_the_lock(procs, tmp_path):
    """The trainer's own push holds the lock while its requests ride out the restart; rank 0's look waited for
    the lock behind it, and the push failed first: a crash of the step instead of the fallback (run 36). The
    fallback is decided without the lock; the push, which rides out a little longer, may still land."""
    server = Server(procs, tmp_path).start()
    folder = tmp_path / "save"
    server.push(version_dir(folder, 2), "2")
    a, progress, stale = attacher(server, folder, 2, PODKIT_INFERENCE_READY_TIMEOUT_S="3")
    released = threading.Event()

    def slow_push(meta):  # the trainer's push, riding out the restart
        released.wait(30)

    push = threading.Thread(target=a.pushing(slow_push), args=(SimpleNamespace(version=None),), daemon=True)
    push.start()
    server.stop()
    t0 = time.monotonic()
    wait_for(stale.is_set, 20, what="the fallback while the trainer's push holds the lock")
    assert time.monotonic() - t0 > 2.5 and push.is_alive()
    assert "went down during the trainer's push" in progress.data["reattach"]["last"]["why"], progress.data
    assert progress.data["reattach"]["fell_back"] == 1
    released.set()
    push.join(10)
