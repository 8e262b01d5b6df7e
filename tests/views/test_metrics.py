"""The pod's /metrics, scraped and parsed with the Prometheus client library's own parser: from the smoke
stack under real supervisord, behind a key, in safe mode, and off."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import PODKIT, ROOT, free_port, wait_for
from podkit import config
from podkit.areal import checks
from scrape import scrape, try_scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_smoke_run_serves_what_status_says(stack_factory):
    """Program states, restarts, the trainer's step and its age, the checkpoint's step and age, the last
    weight update's duration, the guard's boot count, safe mode off; the step agrees with status."""
    port = free_port()
    s = stack_factory(PODKIT_METRICS_PORT=str(port)).start()
    s.wait_step(12)
    m = wait_for(lambda: try_scrape(port), 30, what="/metrics")
    assert m[("podkit_program_up", (("program", "trainer"),))] == 1.0
    assert m[("podkit_program_up", (("program", "sglang"),))] == 1.0
    assert m[("podkit_program_state", (("program", "metrics"), ("state", "RUNNING")))] == 1.0
    assert m[("podkit_program_restarts_total", (("program", "trainer"),))] == 0.0
    assert m[("podkit_supervisord_up", ())] == 1.0 and m[("podkit_safe_mode", (("stage", ""),))] == 0.0
    assert m[("podkit_trainer_step", ())] >= 12 and 0 <= m[("podkit_trainer_seconds_since_step", ())] < 30
    assert m[("podkit_checkpoint_step", ())] >= 10 and 0 <= m[("podkit_checkpoint_age_seconds", ())] < 60
    assert 0 < m[("podkit_weight_update_seconds", ())] < 10
    assert m[("podkit_boots_in_window", ())] == 1.0
    os.kill(s.pid("trainer"), signal.SIGKILL)
    wait_for(lambda: (try_scrape(port) or {}).get(("podkit_program_restarts_total", (("program", "trainer"),)))
             == 1.0, 30, what="the restart counted")
    step = scrape(port)[("podkit_trainer_step", ())]
    assert abs(s.status()["trainer"]["step"] - step) <= 10
    from podkit import (
        records,  # the boot made podkit's reserve for its own records on a full volume (issue 55)
    )

    assert (s.workspace / ".podkit" / records.RESERVE).stat().st_size == records.RESERVE_BYTES
    assert s.stop() == 0


def test_with_a_key_a_scrape_without_it_is_refused(stack_factory):
    port = free_port()
    s = stack_factory(PODKIT_METRICS_PORT=str(port), PODKIT_METRICS_KEY="metrics-key-7f3a").start()
    wait_for(lambda: try_scrape(port, "metrics-key-7f3a"), 30, what="/metrics with the key")
    for wrong in ("", "metrics-key-7f3b"):
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(port, wrong)
        assert e.value.code == 401
    assert "metrics-key-7f3a" not in s.stdout()
    assert s.stop() == 0


def test_beyond_loopback_without_a_key_or_on_inferences_port_is_a_config_error():
    cfg = config.load(environ={"PODKIT_METRICS_HOST": "0.0.0.0"})
    assert checks.metrics(cfg, environ={})[0][:2] == ("metrics.host", "0.0.0.0 exposes /metrics beyond this "
                                                                      "machine without a key")
    assert checks.metrics(cfg, environ={"PODKIT_METRICS_KEY": "k" * 16}) == []
    same = config.load(environ={"PODKIT_METRICS_PORT": "30000", "PODKIT_INFERENCE_PORT": "30000"})
    assert checks.metrics(same, environ={})[0][0] == "metrics.port"
    assert checks.metrics(config.load(environ={"PODKIT_METRICS_HOST": "0.0.0.0", "PODKIT_METRICS_PORT": "0"}),
                          environ={}) == []


def test_a_pod_in_safe_mode_serves_safe_mode(procs, tmp_path):
    """A config error: the waiting boot serves /metrics on loopback, PODKIT_METRICS_PORT read on its own."""
    port = free_port()
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_METRICS_PORT": str(port)}
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    m = wait_for(lambda: try_scrape(port), 30, what="/metrics in safe mode")
    assert m[("podkit_safe_mode", (("stage", "config"),))] == 1.0 and m[("podkit_supervisord_up", ())] == 0.0
    assert m[("podkit_boots_in_window", ())] == 1.0
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0


def _listening_on(port: int) -> set[str]:
    """The addresses a listening TCP socket on `port` is bound to, from the kernel's table."""
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def test_safe_mode_does_not_serve_what_the_check_refused(procs, tmp_path):
    """metrics.host beyond loopback without a key is the config error safe mode explains: it serves
    /metrics on loopback only, not where the check refused."""
    port = free_port()
    ws = tmp_path / "ws"
    ws.mkdir()
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"),
           "PODKIT_WORKSPACE": str(ws), "PODKIT_METRICS_PORT": str(port), "PODKIT_METRICS_HOST": "0.0.0.0"}
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    m = wait_for(lambda: try_scrape(port), 30, what="/metrics in safe mode")
    assert any(name == "podkit_safe_mode" and v == 1.0 for (name, _), v in m.items()), m
    assert _listening_on(port) == {"127.0.0.1"}
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=20)[0].decode()
    assert "metrics.host" in out and "127.0.0.1 only" in out, out


def _serving(tmp_path, key: str = ""):
    from podkit.views import metrics

    (tmp_path / "ws" / ".podkit").mkdir(parents=True)
    port = free_port()
    httpd = metrics.server("127.0.0.1", port, metrics.registry(tmp_path / "ws", 600), key)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, port


def test_a_key_a_header_cannot_carry_is_refused_and_no_header_breaks_a_scrape(tmp_path):
    from podkit.views import metrics

    cfg = config.load(environ={})
    problem = checks.metrics(cfg, environ={"PODKIT_METRICS_KEY": "clé-secrète-0123456789"})[0]
    assert problem[0] == "PODKIT_METRICS_KEY" and "visible ASCII" in problem[1], problem
    with pytest.raises(ValueError):
        metrics.server("127.0.0.1", free_port(), None, "clé-secrète-0123456789")
    httpd, port = _serving(tmp_path, "metrics-key-7f3a")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer cl\xc3\xa9\xff\r\n\r\n")
            assert c.recv(64).startswith(b"HTTP/1.0 401"), "a non-ASCII header is refused, not a dropped connection"
        assert scrape(port, "metrics-key-7f3a")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_idle_connections_are_closed_and_bounded_and_a_scrape_is_answered_at_once(tmp_path):
    """Hundreds of connections that send nothing pin neither threads nor file descriptors, and a real
    scrape among them is answered at once; a silent one is closed after IDLE_S."""
    from podkit.views import metrics

    before = threading.active_count()
    httpd, port = _serving(tmp_path)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        assert threading.active_count() <= before + 1 + metrics.MAX_CONNECTIONS
        start = time.monotonic()
        assert scrape(port)[("podkit_supervisord_up", ())] == 0.0
        assert time.monotonic() - start < 3
        last = idle[-1]
        last.settimeout(metrics.IDLE_S + 10)
        start = time.monotonic()
        assert last.recv(1) == b"" and time.monotonic() - start < metrics.IDLE_S + 5
    finally:
        for c in idle:
            c.close()
        httpd.shutdown()
        httpd.server_close()


def test_metrics_off_is_an_idle_running_program_and_a_healthy_pod(stack_factory):
    s = stack_factory(PODKIT_METRICS_PORT="0").start()
    s.wait_step(3)
    wait_for(lambda: s.status()["programs"]["metrics"]["state"] == "RUNNING", 30, what="metrics RUNNING")
    r = subprocess.run([*PODKIT, "status", "--health", "--workspace", str(s.workspace)], capture_output=True,
                       text=True, env=s.env, timeout=30)
    assert r.returncode == 0 and "healthy" in r.stdout, r.stdout
    assert "metrics.port is 0" in s.log("metrics")
    assert s.stop() == 0


def test_the_code_that_trains_is_an_info_metric_and_a_status_line(tmp_path):
    """A run is traceable to its code: trainer.entry, the synced commit and a dirty tree, as the AReaL
    trainer's hooks record them in progress.json; a planted record of the wrong shape shows nothing."""
    from prometheus_client import generate_latest

    from podkit import records
    from podkit.views import metrics, status

    state = tmp_path / ".podkit"
    state.mkdir()
    commit = "3f" * 20
    records.PROGRESS.write(state, {"kind": "areal", "step": 4, "code": {"entry": "train.py", "commit": commit,
                                                                       "dirty": True}})
    text = generate_latest(metrics.registry(tmp_path, 600)).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("podkit_trainer_code_info", (("commit", commit), ("dirty", "true"), ("entry", "train.py")))] == 1.0
    assert f"code: train.py at {commit[:12]} (with uncommitted changes)" in status.human(status.collect(tmp_path))
    records.PROGRESS.write(state, {"kind": "areal", "step": 4, "code": {"entry": ["x"], "commit": 5}})
    assert "podkit_trainer_code_info" not in generate_latest(metrics.registry(tmp_path, 600)).decode()


def test_scrapes_are_answered_while_forty_clients_trickle_their_headers_and_a_label_utf8_cannot_carry_is_escaped(
        tmp_path):
    """Forty clients send their headers a byte a second: /metrics answered 0 of 8 scrapes (a connection was its
    handler's from its request line on, never cut). One label value with a lone surrogate (a non-UTF-8 byte in the
    entry's path) made every scrape a 500."""

    httpd, port = _serving(tmp_path)
    (tmp_path / "ws" / ".podkit" / "progress.json").write_text(
        '{"step": 3, "time": 1700000000.0, "code": {"entry": "train_\\udcff.py", "commit": "abc", "dirty": false}}')
    stop, threads = threading.Event(), []

    def trickle():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\n")
                    for b in b"Host: 127.0.0.1\r\nX-Slow: " + b"1" * 100:
                        if stop.is_set():
                            return
                        s.sendall(bytes([b]))
                        time.sleep(1.0)
            except OSError:
                pass  # cut at its deadline: comes again
    try:
        threads = [threading.Thread(target=trickle, daemon=True) for _ in range(40)]
        for t in threads:
            t.start()
        time.sleep(2)  # every slot taken by a trickler first
        answered = 0
        for _ in range(8):
            try:
                m = scrape(port)
                answered += 1
            except OSError:
                pass
            time.sleep(0.5)
        assert answered == 8, answered
        info = [k for k in m if k[0] == "podkit_trainer_code_info"]
        assert info and any("\\udcff" in v for _, v in info[0][1]), info
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        httpd.shutdown()
        httpd.server_close()
