"""How podkit probes SGLang: /health as liveness only (SGLang runs with
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), and a real one-token generation (/health_generate) now and
then, one at a time, never started during a weight update. The smoke stack's stand-in for SGLang (not
SGLang) behaves as SGLang 0.5.10 does here: its /health is a generation unless that variable is 0, a
generation probe is queued behind a weight update in flight, and one whose client gave up stays queued."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest

from conftest import wait_for
from podkit import records

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
STAMP = re.compile(r"^(?:sglang\s+\| )?\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (.*)$")


def events(log: str) -> list[tuple[float, str]]:
    out = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m:
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp(), m.group(2)))
    return out


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def test_generation_probes_never_pile_up_and_a_server_updating_weights_is_left_alone(stack_factory):
    """A generation probe takes 1.5 s and is due every second; each weight update takes 2 s and the watchdog
    restarts an unhealthy server after 5 s. Over two updates and three probes: never two probes in flight, none started
    during an update, no restart; the server runs with /health as liveness and its compile cache on the
    volume."""
    s = stack_factory(PODKIT_WATCHDOG_INTERVAL_S="0.5", PODKIT_WATCHDOG_GENERATION_PROBE_S="1",
                      PODKIT_WATCHDOG_INFERENCE_UNHEALTHY_S="5", PODKIT_INFERENCE_STANDIN_PROBE_S="1.5",
                      PODKIT_INFERENCE_STANDIN_UPDATE_DELAY_S="2", PODKIT_TRAINER_CHECKPOINT_EVERY="4").start()
    wait_for(lambda: s.log("sglang").count("Update weights end.") >= 2, 120, what="two weight updates")
    wait_for(lambda: s.log("sglang").count("health check: a one-token generation queued") >= 3, 60,
             what="three generation probes")
    env = environ(s.pid("sglang"))
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert env["SGLANG_CACHE_DIR"] == str(s.workspace / "cache" / "sglang")
    log = s.log("sglang")
    assert "(2 in flight)" not in log, "a second generation probe while one was queued"
    begin = None
    for t, what in events(log):
        if what.startswith("Update engine weights online from disk begin"):
            begin = t
        elif what == "Update weights end.":
            begin = None
        elif what.startswith("health check:") and begin is not None:
            # The log read and the request race an update that begins between them: a second, no more.
            assert t - begin <= 1, f"a generation probe started {t - begin:.0f}s into a weight update"
    assert records.WATCHDOG.read(s.workspace / ".podkit") == [], "a healthy, busy server was restarted"
    assert s.stop() == 0


def test_a_server_whose_generation_hangs_is_restarted_though_it_answers_health(stack_factory):
    """Live (/health answers) but a one-token generation takes longer than SGLang's own 20 s, so it answers
    503: unhealthy until a probe passes, restarted after inference_unhealthy_s, with few probes sent."""
    s = stack_factory(PODKIT_WATCHDOG_INTERVAL_S="0.5", PODKIT_WATCHDOG_GENERATION_PROBE_S="1",
                      PODKIT_WATCHDOG_INFERENCE_UNHEALTHY_S="6", PODKIT_INFERENCE_STANDIN_PROBE_S="60").start()
    first = s.pid("sglang")
    wait_for(lambda: records.WATCHDOG.read(s.workspace / ".podkit"), 120, what="the watchdog's restart")
    [act] = records.WATCHDOG.read(s.workspace / ".podkit")
    assert act["program"] == "sglang" and "generation check has failed" in act["reason"], act
    wait_for(lambda: s.pid("sglang") not in (0, first), 60, what="a new server")
    before = s.log("sglang").split("Shutting down")[0]
    assert 1 <= before.count("health check: a one-token generation queued") <= 3, before[-2000:]
    assert s.stop() == 0


def test_every_compile_cache_is_on_the_volume_and_a_clusters_areal_cache_is_per_node(tmp_path):
    """SGLang's piecewise CUDA graph cache joins FlashInfer, Triton, TVM-FFI and Inductor under
    <workspace>/cache; on a cluster AReaL's launcher takes Triton's directory from AREAL_CACHE_DIR (/tmp by
    default): on the volume too, one per node, since nodes must not share a Triton directory."""
    from conftest import ROOT
    from podkit import config
    from podkit.areal import command
    from podkit.programs import sglang

    pod = config.load(ROOT / "configs" / "a40-1gpu.yaml", environ={"PODKIT_WORKSPACE": str(tmp_path)})
    env = sglang.environment(pod, environ={})
    assert env["SGLANG_CACHE_DIR"] == str(tmp_path / "cache" / "sglang")
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    trainer = command.environment(pod, environ={})
    assert env["TRITON_CACHE_DIR"] != trainer["TRITON_CACHE_DIR"], "one Triton directory per program"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == trainer["TORCHINDUCTOR_CACHE_DIR"]
    assert "AREAL_CACHE_DIR" not in env
    caches = {}
    for rank in (0, 1):
        node = config.load(ROOT / "configs" / "cpu-cluster.yaml", environ={
            "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_CLUSTER_RANK": str(rank),
            "PODKIT_CLUSTER_NODE_ADDR": f"127.0.0.{rank + 2}", "PODKIT_CLUSTER_HEAD": "127.0.0.2"})
        caches[rank] = command.environment(node, environ={})["AREAL_CACHE_DIR"]
    assert caches == {0: str(tmp_path / "cache" / "areal-node-0"), 1: str(tmp_path / "cache" / "areal-node-1")}


def test_a_weight_update_that_never_ends_is_a_hang_and_the_server_is_restarted(stack_factory):
    """Updates begun and never ended once kept the generation check off for ever (24 begun, 0 probes, 0
    restarts in 120 s). An update in flight for weight_update_deadline_s (0: 5 x the trainer's
    weight_update_timeout_s, 1 s here) is a hang: inference is restarted, as for a failed generation check."""
    s = stack_factory(PODKIT_WATCHDOG_INTERVAL_S="0.5", PODKIT_WATCHDOG_GENERATION_PROBE_S="1",
                      PODKIT_INFERENCE_STANDIN_UPDATE_DELAY_S="600", PODKIT_TRAINER_CHECKPOINT_EVERY="2",
                      PODKIT_TRAINER_WEIGHT_UPDATE_TIMEOUT_S="1").start()
    first = s.pid("sglang")
    wait_for(lambda: records.WATCHDOG.read(s.workspace / ".podkit"), 120, what="the watchdog's restart")
    act = records.WATCHDOG.read(s.workspace / ".podkit")[0]
    assert act["program"] == "sglang" and "weight update has been in flight" in act["reason"], act
    assert "weight_update_deadline_s 5" in act["reason"], act
    wait_for(lambda: s.pid("sglang") not in (0, first), 60, what="a new server")
    hung = s.log("sglang").split("Shutting down")[0].split("Update engine weights online from disk begin", 1)[1]
    assert "Update weights end." not in hung and "health check:" not in hung, hung[-2000:]
    assert s.stop() == 0


def test_back_to_back_weight_updates_are_not_one_long_one_and_an_update_cut_short_by_a_restart_is_over(
        tmp_path, monkeypatch):
    """The deadline runs from the last update's end as the log shows it, not from the first time the watchdog
    saw one in flight: updates that end and begin again between two looks are each given the full deadline.
    An update whose server restarted (podkit's start line after its begin) is not in flight, and a prompt that
    quotes SGLang's line is not an update."""
    from conftest import ROOT
    from podkit import config
    from podkit.judge import health
    from podkit.programs import watchdog

    cfg = config.load(ROOT / "configs" / "a40-1gpu.yaml", environ={
        "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_WATCHDOG_WEIGHT_UPDATE_DEADLINE_S": "10",
        "PODKIT_TRAINER_WEIGHT_UPDATE_TIMEOUT_S": "10",
        "PODKIT_WATCHDOG_GENERATION_PROBE_S": "0"})
    log = cfg.log_dir / "sglang.log"
    log.parent.mkdir(parents=True)
    restarts = []
    w = watchdog.Watchdog(cfg)
    monkeypatch.setattr(w, "restart", restarts.append)

    def say(*lines):
        with open(log, "a") as f:
            f.writelines(f"[2026-11-25 14:00:00] {ln}\n" for ln in lines)

    say(f"{health.START_MARK}sglang", "Update engine weights online from disk begin. path=/ckpt/1")
    assert w.check_generation(1000.0) and health.updating(log)
    say("Update weights end.", "Update engine weights online from disk begin. path=/ckpt/2")
    assert w.check_generation(1008.0) and w.check_generation(1016.0) and restarts == []
    assert not w.check_generation(1018.0) and restarts == ["sglang"]
    [act] = records.WATCHDOG.read(cfg.state_dir)
    assert "in flight for 10s (weight_update_deadline_s 10)" in act["reason"], act
    say("Update engine weights online from disk begin. path=/ckpt/3", f"{health.START_MARK}sglang")
    assert not health.updating(log) and w.check_generation(1100.0) and restarts == ["sglang"]
    say("Receive: obj=GenerateReqInput(text='Update engine weights online from disk begin')")  # a prompt
    assert not health.updating(log)
