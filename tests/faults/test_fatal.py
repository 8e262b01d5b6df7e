"""A program supervisord gives up on (FATAL) is recorded and shown; the container stays up."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import wait_for
from podkit import config
from podkit.views import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_inference_that_cannot_start_goes_fatal_and_is_explained(stack_factory):
    """Something already listens on the inference port (a leftover server): every start fails,
    supervisord gives up (FATAL) and stays up; status shows FATAL and doctor quotes the error."""
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="0")
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", s.port))
    squatter.listen(1)
    try:
        s.start()
        st = wait_for(lambda: (st := s.status())["programs"]["sglang"]["state"] == "FATAL" and st, 90,
                      what="sglang FATAL")
        assert st["programs"]["sglang"]["fatal"] and s.proc.poll() is None, "supervisord must stay up"
        found = {f.id: f for f in doctor.examine(config.load(environ={"PODKIT_WORKSPACE": str(s.workspace)}),
                                                 s.workspace, min_free_bytes=0, min_mb_s=0)}
        f = found["inference_restarts"]
        assert "gave up (FATAL)" in f.title and any("Address already in use" in e for e in f.evidence)
        assert "FATAL" in s.stdout()
    finally:
        squatter.close()
    assert s.stop() == 0


def test_a_supervisord_alive_but_not_answering_is_said_by_status_and_metrics_within_seconds(stack_factory):
    """supervisord stopped with SIGSTOP (alive, its socket accepting, never answering): `podkit status` and /metrics
    hung for ever (no timeout on the XML-RPC call). Now each answers within status.RPC_TIMEOUT_S and a margin, with
    supervisord said not to answer (the standing unknown, never a guess)."""
    import os
    import signal
    import subprocess
    import time

    from conftest import PODKIT, free_port
    from podkit.views import status
    from scrape import scrape

    port = free_port()
    s = stack_factory(PODKIT_METRICS_PORT=str(port)).start()
    s.wait_step(1)
    pid = s.rpc().supervisor.getPID()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(s.workspace)], capture_output=True,
                             text=True, env=s.env, timeout=60)
        took = time.monotonic() - t0
        st = json.loads(out.stdout)
        assert st["supervisord"]["reachable"] is False and st["standing"]["run"] == "unknown", st["supervisord"]
        assert took < status.RPC_TIMEOUT_S + 20, took
        t0 = time.monotonic()
        m = scrape(port)  # the metrics server runs in the listener, which supervisord's stop does not stop
        assert time.monotonic() - t0 < status.RPC_TIMEOUT_S + 5
        assert ("podkit_can_train", ()) not in m, "unknown, not a guess"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert s.stop() == 0


def test_a_supervisord_that_answers_a_byte_every_few_seconds_is_cut_within_the_status_timeout(tmp_path):
    """The socket answers a byte every 2 s: each read came within its 5 s, so `podkit status` waited for ever. The
    whole call is bounded now."""
    import os
    import socket
    import threading
    import time

    from podkit import records
    from podkit.views import status

    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                srv.settimeout(0.5)
                c, _ = srv.accept()
            except OSError:
                continue
            with c:
                for b in b"HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\nContent-Length: 999\r\n\r\n<?xml":
                    if stop.is_set():
                        return
                    try:
                        c.sendall(bytes([b]))
                    except OSError:
                        break
                    time.sleep(2)
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    state = tmp_path / ".podkit"
    state.mkdir()
    records.CURRENT.write(state, {"socket": path, "supervisord_pid": os.getpid(), "started": time.time()})
    try:
        t0 = time.monotonic()
        st = status.collect(tmp_path)
        assert time.monotonic() - t0 < status.RPC_TIMEOUT_S + 3
        assert st["supervisord"]["reachable"] is False and st["standing"]["run"] == "unknown", st["supervisord"]
    finally:
        stop.set()
        srv.close()
        t.join(10)
