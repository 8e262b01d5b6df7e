"""The stop budget after supervisord reloaded (supervisorctl reload, SIGHUP to PID 1): the deadline is
counted from this stop's SIGTERM, not from the reload's stop, and it still kills what outlives it."""

from __future__ import annotations

import signal

import pytest
from test_stop_budget import STUBBORN, pid1_supervisord, sigterm_took

from conftest import wait_for
from podkit.host import pid1

pytestmark = pytest.mark.timeout(120)


def test_a_stop_after_a_reload_still_ends_by_its_deadline(procs, tmp_path):
    """A program that ignores SIGTERM (stopwaitsecs 60), a reload, then docker's SIGTERM: the reload's stop
    had used up the deadline's one kill, so the real stop waited out the 60 s (PID 1 killed at 10 s)."""
    p, log = pid1_supervisord(procs, tmp_path, STUBBORN, **{pid1.STOP_DEADLINE_ENV: "1.5"})
    wait_for(lambda: "stubborn entered RUNNING" in log(), 30, what="the program to start")
    p.send_signal(signal.SIGHUP)
    wait_for(lambda: log().count("stubborn entered RUNNING") == 2, 30, what="the program after the reload")
    took = sigterm_took(p)
    assert took < 2.5, took
    assert log().count("has passed") == 2, log()
