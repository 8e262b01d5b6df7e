"""The log listener: prefixes each program line, joins lines split across events, survives
non-ASCII output (the protocol is read in bytes), and counts starts for `podkit status`."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from podkit.programs.logs import Pump

pytestmark = pytest.mark.timeout(60)


def event(name: str, payload: bytes) -> bytes:
    return f"ver:3.0 server:supervisor serial:1 pool:logs poolserial:1 eventname:{name} len:{len(payload)}\n".encode() + payload


def log_event(proc: str, data: str) -> bytes:
    return event("PROCESS_LOG_STDOUT", f"processname:{proc} groupname:{proc} pid:7 channel:stdout\n".encode() + data.encode())


def test_lines_split_across_events_are_joined_and_prefixed(tmp_path):
    """A line that arrives in two chunks is printed once, whole, with the program's name."""
    out = io.StringIO()
    pump = Pump(out, tmp_path)
    pump.handle({"eventname": "PROCESS_LOG_STDOUT"}, b"processname:trainer groupname:trainer pid:7 channel:stdout\nstep 1 lo")
    pump.handle({"eventname": "PROCESS_LOG_STDOUT"}, b"processname:trainer groupname:trainer pid:7 channel:stdout\nss 0.5\nstep 2\n")
    assert out.getvalue() == "trainer  | step 1 loss 0.5\ntrainer  | step 2\n"


def test_listener_speaks_the_protocol_in_bytes_with_non_ascii_output(tmp_path):
    """`podkit run logs` as supervisord drives it: READY, event, RESULT; a multi-byte character in one
    event must not desynchronise the next."""
    feed = log_event("sglang", "température ✓ 温度\n") + log_event("trainer", "next line\n")
    env = {"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin"}
    (tmp_path / "run").mkdir()
    r = subprocess.run([sys.executable, "-m", "podkit", "run", "logs"], input=feed, capture_output=True,
                       env=env, timeout=30)
    assert r.returncode == 0
    assert r.stdout == b"READY\nRESULT 2\nOKREADY\nRESULT 2\nOKREADY\n"
    assert r.stderr.decode() == "sglang   | température ✓ 温度\ntrainer  | next line\n"


def test_state_events_count_starts_and_record_fatal(tmp_path):
    """STARTING events count starts (restarts = starts - 1); FATAL is recorded."""
    pump = Pump(io.StringIO(), tmp_path)
    for to in ("STARTING", "RUNNING", "BACKOFF", "STARTING", "FATAL"):
        pump.state(f"PROCESS_STATE_{to}", {"processname": "sglang", "pid": "9"})
    rec = json.loads((tmp_path / "programs.json").read_text())["sglang"]
    assert rec["starts"] == 2 and rec["state"] == "FATAL" and "fatal_at" in rec
