"""bench/ must not rot: every benchmark `make bench` runs also runs here, briefly, and must print its
figures and its ratio against the baseline it names. The figures themselves are not asserted: speed
targets are benchmarks, recorded in bench/RESULTS.md, not timed tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(660)
QUICK = {"boot.py": ["--runs", "2"], "reap.py": ["--idle", "20", "--runs", "1"],
         "sync.py": ["--commits", "20", "--runs", "1"], "stop.py": ["--runs", "1"],
         "rehearse.py": ["--smoke", "--steps", "2", "--runs", "1"], "entry.py": ["--smoke", "--steps", "1", "--runs", "1"],
         "startup.py": ["--kind", "smoke", "--runs", "1"],
         "page.py": ["--steps", "3000", "--runs", "3", "--flood-seconds", "1"],
         "remote.py": ["--size-mib", "16", "--runs", "1", "--seconds", "3"]}
# rehearse.py and entry.py time the real trainer under `make bench` (minutes each); here they run every
# measurement on the smoke stack (--smoke: seconds), so the scripts cannot rot without taking a place on the
# real-trainer lane. What they measure is tested on the real trainer by tests/trainer/test_rehearsal.py and
# tests/trainer/test_your_code.py: a cold launch, steps, kill -9 of the trainer, inference restarted alone.
LIMIT = {"rehearse.py": 240, "entry.py": 240, "remote.py": 420}  # remote.py: 7 pod boots on a busy machine


def test_make_bench_runs_every_benchmark_in_bench():
    """A benchmark added to bench/ without a line in `make bench` (or here) fails this."""
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    makefile = (ROOT / "Makefile").read_text()
    bench_recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert scripts == sorted(QUICK)
    assert sorted(re.findall(r"bench/(\w+\.py)", bench_recipe)) == scripts


def test_bench_and_the_tests_drive_pods_with_one_harness():
    """bench/ and tests/ share tests/harness.py: one free_port (never the same port twice in a process, so a
    pod's inference and metrics ports cannot collide), one alive, and one Pod under the tests' Stack and
    bench's Pod."""
    import conftest
    import harness

    assert (conftest.free_port, conftest.alive, conftest.wait_for) == (harness.free_port, harness.alive,
                                                                      harness.wait_for)
    assert issubclass(conftest.Stack, harness.Pod)
    check = ("import sys; sys.path.insert(0, sys.argv[1]); import boot, harness, rehearse, startup; "
             "assert boot.free_port is rehearse.free_port is startup.free_port is harness.free_port; "
             "assert rehearse.alive is harness.alive and issubclass(startup.Pod, harness.Pod); "
             "ports = [harness.free_port() for _ in range(200)]; assert len(set(ports)) == 200")
    r = subprocess.run([sys.executable, "-c", check, str(ROOT / "bench")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT / "bench")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("script", sorted(QUICK))
def test_benchmark_runs_and_prints_its_ratio(script, tmp_path):
    args = [*QUICK[script], *(["--workspace", str(tmp_path / "ws")] if script == "rehearse.py" else [])]
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / script), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    limit = LIMIT.get(script, 220)
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.terminate()  # its `finally` stops what it started
        out, err = p.communicate(timeout=150)
        pytest.fail(f"{script} ran past {limit} s:\n{out[-3000:]}\n{err[-2000:]}\n{logs_of(tmp_path)}")
    assert p.returncode == 0, out[-2000:] + err[-2000:] + logs_of(tmp_path)
    assert re.search(r"(ratio|target)", out), out


def logs_of(tmp_path) -> str:
    """The tail of each log a rehearse.py pod left: where a slow recovery shows what it waited on."""
    paths = [tmp_path / "ws-boot.log", *sorted((tmp_path / "ws" / "logs").glob("*.log"))]
    return "".join(f"\n--- {p.name} (tail)\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists())
