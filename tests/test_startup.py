"""The start-up timeline: every phase from the boot to the trainer's first step, with its duration, in
`podkit status`, /metrics and the bundle's status.json, and doctor naming the slowest phase of a slow
start with the caches that were cold. Real supervisord, the smoke stack (SGLang's stand-in prints
SGLang's own start-up lines)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from types import SimpleNamespace

import pytest

from conftest import PODKIT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ORDER = ["preflight", "reap", "sync", "setup", "render", "supervisord", "inference_started", "weights_loaded",
         "graphs_captured", "inference_ready", "first_step"]


def test_status_shows_each_phase_from_the_boot_to_the_first_step(stack_factory):
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="2").start()
    s.wait_step(2)
    t = s.status()["startup"]
    names = [p["phase"] for p in t["phases"]]
    assert [n for n in names if n != "trainer_started"] == ORDER, names
    took = {p["phase"]: p["took_s"] for p in t["phases"]}
    assert took["weights_loaded"] + took["graphs_captured"] >= 1.0, took  # the stand-in's 2 s start-up
    assert 0 < t["total_s"] < 60 and abs(sum(took.values()) - t["total_s"]) < 0.01
    human = subprocess.run([*PODKIT, "status", "--workspace", str(s.workspace)], capture_output=True, text=True,
                           env=s.env, timeout=60).stdout
    assert "start-up: preflight +" in human and "s from boot to the first step" in human, human
    assert s.stop() == 0


def test_doctor_names_the_slowest_phase_of_a_slow_start_and_the_cache_that_was_cold(tmp_path):
    from podkit import doctor

    boot = time.time() - 2000
    (tmp_path / "cache" / "flashinfer").mkdir(parents=True)
    (tmp_path / "cache" / "flashinfer" / "sm86.so").write_text("x")  # written during this boot: cold
    warm = tmp_path / "cache" / "sglang" / "old"
    warm.mkdir(parents=True)
    os.utime(warm, (boot - 3600, boot - 3600))  # from an earlier boot: warm
    phases = [{"phase": "render", "at": boot + 1, "took_s": 1.0},
              {"phase": "graphs_captured", "at": boot + 900, "took_s": 899.0},
              {"phase": "first_step", "at": boot + 1000, "took_s": 100.0}]
    pod = SimpleNamespace(ws=tmp_path, st={"startup": {"phases": phases, "total_s": 1000.0, "boot": boot}})
    f = doctor.check_startup_slow(pod, time.time())
    assert f.id == "startup_slow" and "longest phase was graphs captured (899s)" in f.title
    cold = [e for e in f.evidence if e.startswith("cold this boot")]
    assert any("cache/flashinfer" in e for e in cold) and not any("cache/sglang" in e for e in cold), cold
    pod.st["startup"]["total_s"] = 200.0
    assert doctor.check_startup_slow(pod, time.time()) is None
    assert json.dumps(f.to_dict())


def planted_log(ws, *lines):
    """A boot on record a minute ago and inference's log since its start, with `lines` in it."""
    from podkit import health, records

    boot = time.time() - 60
    records.BOOTS.write(ws / ".podkit", [{"time": boot, "took_s": {"preflight": 1.0, "reap": 0.5}}])
    (ws / "logs").mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot + 30))
    (ws / "logs" / "sglang.log").write_text("\n".join([f"{health.START_MARK}sglang", *lines,
                                                        f"[{stamp}] Load weight end. mem usage=1 GB"]) + "\n")
    return boot


def test_a_malformed_stamp_in_the_inference_log_is_skipped_and_named_and_status_metrics_and_doctor_still_work(
        tmp_path):
    """One line `[2026-02-30 12:00:00] Load weight end` raised in the timeline and took down `podkit status`,
    `--health`, doctor and the whole /metrics scrape. Now the line is skipped (the next good one is the
    phase) and the timeline says what it could not read; so is a stamp years ahead and one before year 1."""
    from prometheus_client import generate_latest

    from podkit import metrics, startup, status

    boot = planted_log(tmp_path, "[2026-02-30 12:00:00] Load weight end", "[9999-12-31 23:59:59] Load weight end",
                       "[0000-01-01 00:00:00] Capture cuda graph end \x1b[2J")
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {})
    took = {p["phase"]: p["at"] for p in t["phases"]}
    assert abs(took["weights_loaded"] - (boot + 30)) <= 1 and "graphs_captured" not in took, t
    assert len(t["unread"]) == 3 and "2026-02-30" in t["unread"][0] and "day is out of range" in t["unread"][0], t
    human = status.human(status.collect(tmp_path))
    assert "could not read sglang.log: '[2026-02-30 12:00:00] Load weight end'" in human, human
    assert "\x1b" not in human, "a planted escape sequence reached the terminal"
    assert 'podkit_startup_phase_seconds{phase="weights_loaded"}' in generate_latest(
        metrics.registry(tmp_path, 600)).decode()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    for verb in (["status", "--health"], ["status", "--json"], ["doctor"]):
        r = subprocess.run([*PODKIT, *verb, "--workspace", str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (verb, r.stderr[-2000:])


def test_a_boot_record_with_absurd_stage_times_and_a_pipe_or_dev_zero_as_the_log_do_not_hang_or_break_status(
        tmp_path):
    """boots.json's stage durations are data too (NaN, infinity, negative, a list); a pipe in the log's place
    blocked every reader, and /dev/zero would have filled memory."""
    from podkit import records, startup, status

    planted_log(tmp_path)
    boots = records.BOOTS.read(tmp_path / ".podkit")
    boots[-1]["took_s"] = {"preflight": float("nan"), "reap": float("inf"), "sync": -5, "setup": [1], "render": 2}
    records.BOOTS.write(tmp_path / ".podkit", boots)
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {})
    assert [p["phase"] for p in t["phases"]] == ["render", "weights_loaded"], t
    assert json.loads(json.dumps(t, allow_nan=False))
    log = tmp_path / "logs" / "sglang.log"
    for planted in ("pipe", "/dev/zero"):
        log.unlink()
        os.mkfifo(log) if planted == "pipe" else log.symlink_to(planted)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        r = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(tmp_path)], capture_output=True,
                           text=True, timeout=30, env=env)
        assert "Traceback" not in r.stderr and json.loads(r.stdout)["startup"]["phases"], (planted, r.stderr[-2000:])
        r = subprocess.run([*PODKIT, "doctor", "--workspace", str(tmp_path)], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (planted, r.stderr[-2000:])
    assert status.collect(tmp_path)["inference"]["phase"] in ("unknown", "down", "ready")


def test_an_inference_line_from_the_boots_first_second_comes_after_the_stages_that_ran_before_it(tmp_path):
    """SGLang's stamps are whole seconds: on a fast boot (the smoke stack: reap to render in under a second),
    `Load weight end` stamped with the boot's own second sorted before reap. CI run of 75d6e25 saw it."""
    from podkit import health, records, startup

    boot = int(time.time()) - 60 + 0.9  # late in its second, so its truncated second is before it
    records.BOOTS.write(tmp_path / ".podkit", [{"time": boot, "took_s": {"preflight": 0.02, "reap": 0.01,
                                                                         "sync": 0.01, "setup": 0.01,
                                                                         "render": 0.01}}])
    records.CURRENT.write(tmp_path / ".podkit", {"started": boot + 0.06})
    (tmp_path / "logs").mkdir()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot))
    (tmp_path / "logs" / "sglang.log").write_text(f"{health.START_MARK}sglang\n[{stamp}] Load weight end.\n")
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {"sglang": boot + 0.08})
    names = [p["phase"] for p in t["phases"]]
    assert names == ["preflight", "reap", "sync", "setup", "render", "supervisord", "inference_started",
                     "weights_loaded"], t
    assert all(p["took_s"] >= 0 for p in t["phases"]) and t["phases"][-1]["at"] >= boot + 0.08, t
