"""Where the suite's time went, printed after every run: the lanes (an xdist group runs on one worker, so its
total is a floor under the wall time), and the files by their total. PODKIT_TEST_TIMES=<path> also writes every
test's seconds as JSON, for comparing two runs."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    lanes: dict[str, float] = defaultdict(float)
    files: dict[str, float] = defaultdict(float)
    for nodeid, s in _seconds.items():
        group = re.search(r"@([\w-]+)$", nodeid)  # xdist's loadgroup suffix
        lanes[group.group(1) if group else "(any worker)"] += s
        files[nodeid.split("::")[0]] += s
    w = terminalreporter
    w.section("where the time went")
    w.line(f"{sum(_seconds.values()):8.0f} s in tests, {len(_seconds)} tests")
    for lane, s in sorted(lanes.items(), key=lambda x: -x[1]):
        w.line(f"{s:8.0f} s  lane {lane}")
    for f, s in sorted(files.items(), key=lambda x: -x[1])[:15]:
        w.line(f"{s:8.0f} s  {f}")
    if path := os.environ.get("PODKIT_TEST_TIMES"):
        with open(path, "w") as out:
            json.dump(dict(sorted(_seconds.items(), key=lambda x: -x[1])), out, indent=0)
