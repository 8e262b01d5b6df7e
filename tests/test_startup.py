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
