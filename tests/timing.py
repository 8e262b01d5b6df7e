"""Where the suite's time went, printed after every run: seconds and CPU-seconds by lane (an xdist group runs on
one worker, so its total is a floor under the wall time) and by file. A test's CPU is its worker's own and that of
every process it started and reaped (supervisord reaps its programs, a test its `podkit boot`): what the test cost
the machine. PODKIT_TEST_TIMES=<path> also writes every test's seconds and CPU-seconds as JSON, for comparing runs."""

from __future__ import annotations

import json
import os
import re
import resource
from collections import defaultdict

import pytest

_seconds: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)


def _used() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_START] = _used()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _START in item.stash:  # the worker's side: the test's whole CPU, with it
        outcome.get_result().user_properties.append(("cpu_s", round(_used() - item.stash[_START], 3)))


_START = pytest.StashKey[float]()


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid] += report.duration  # setup, call and teardown
    _cpu[report.nodeid] += sum(v for k, v in report.user_properties if k == "cpu_s")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    lanes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for nodeid, s in _seconds.items():
        group = re.search(r"@([\w-]+)$", nodeid)  # xdist's loadgroup suffix
        for row in (lanes[group.group(1) if group else "(any worker)"], files[nodeid.split("::")[0]]):
            row[0] += s
            row[1] += _cpu[nodeid]
    w = terminalreporter
    w.section("where the time went")
    w.line(f"{sum(_seconds.values()):8.0f} s {sum(_cpu.values()):8.0f} CPU-s  in {len(_seconds)} tests")
    for lane, (s, c) in sorted(lanes.items(), key=lambda x: -x[1][0]):
        w.line(f"{s:8.0f} s {c:8.0f} CPU-s  lane {lane}")
    for f, (s, c) in sorted(files.items(), key=lambda x: -x[1][1])[:20]:
        w.line(f"{s:8.0f} s {c:8.0f} CPU-s  {f}")
    if path := os.environ.get("PODKIT_TEST_TIMES"):
        with open(path, "w") as out:
            json.dump({k: {"s": round(s, 3), "cpu_s": round(_cpu[k], 3)}
                       for k, s in sorted(_seconds.items(), key=lambda x: -x[1])}, out, indent=0)
