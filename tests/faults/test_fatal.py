"""A program supervisord gives up on (FATAL) is recorded and shown; the container stays up."""

from __future__ import annotations

import socket

import pytest

from conftest import wait_for
from podkit import config, doctor

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
