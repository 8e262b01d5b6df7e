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

pytestmark = pytest.mark.timeout(240)
QUICK = {"boot.py": ["--runs", "2"], "reap.py": ["--idle", "20", "--runs", "1"],
         "sync.py": ["--commits", "20", "--runs", "1"], "stop.py": ["--runs", "1"],
         "rehearse.py": ["--steps", "2", "--runs", "1"]}
# rehearse.py runs the real trainer in the AReaL environment, as tests/test_rehearsal.py does (~2.5 min).
AREAL = [pytest.mark.rehearsal,
         pytest.mark.skipif(not os.environ.get("AREAL_PYTHON") and not os.environ.get("CI"),
                            reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                   "$(sh rehearse/env.sh))")]


def test_make_bench_runs_every_benchmark_in_bench():
    """A benchmark added to bench/ without a line in `make bench` (or here) fails this."""
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    makefile = (ROOT / "Makefile").read_text()
    bench_recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert scripts == sorted(QUICK)
    assert sorted(re.findall(r"bench/(\w+\.py)", bench_recipe)) == scripts


@pytest.mark.parametrize("script", [pytest.param(s, marks=AREAL if s == "rehearse.py" else ())
                                    for s in sorted(QUICK)])
def test_benchmark_runs_and_prints_its_ratio(script, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *QUICK[script]], capture_output=True,
                       text=True, timeout=220, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"(ratio|target)", r.stdout), r.stdout
