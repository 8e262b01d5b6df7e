"""Notifications to a webhook (a loopback receiver in the test): safe mode under a config error, the
crash-loop guard, a program gone FATAL, a watchdog restart, a stop beginning, training finished; and a
webhook that is dead or never answers blocks nothing and is logged once. Real supervisord, the smoke stack."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import PODKIT, raw_server, wait_for
from webhook import Receiver, dead_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_config_error_notifies_from_the_env_var_alone(procs, tmp_path, receiver):
    """The config does not load, so nothing in it can be read: the webhook comes from its env var, and
    the notification names the file, the key and the fix."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url, "RUNPOD_POD_ID": "pod-abc123"}
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    post = receiver.one("safe-mode")
    assert post["text"] == post["content"] and post["text"].startswith("[podkit pod-abc123] SAFE MODE (")
    assert f"{bad}: trainer.checkpoint_evry: unknown key" in post["text"] and "fix:" in post["text"]
    assert p.poll() is None, "safe mode waits"
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=20)[0].decode()
    assert receiver.url not in out and p.returncode == 0


def test_a_tripped_crash_loop_guard_notifies_as_such(stack_factory, receiver):
    """max_boots 1: the second boot inside the window waits in safe mode; the post says 'guard'."""
    first = stack_factory(PODKIT_GUARD_MAX_BOOTS="1").start()
    assert first.stop() == 0
    second = stack_factory(PODKIT_GUARD_MAX_BOOTS="1", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url)
    second.proc = second.procs.spawn([*PODKIT, "boot"], env=second.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
    assert "crash-loop guard: 2 boots" in receiver.one("guard")["text"]
    assert receiver.events() == ["guard"] and second.stop() == 0


def test_the_webhook_in_a_config_file_is_refused_as_a_secret(tmp_path):
    cfg = tmp_path / "pod.yaml"
    cfg.write_text("notify:\n  webhook_url: https://hooks.slack.com/services/T/B/x\n")
    r = subprocess.run([*PODKIT, "--config", str(cfg), "config"], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{cfg}: notify.webhook_url: is a secret" in r.stderr and "PODKIT_NOTIFY_WEBHOOK_URL" in r.stderr


def test_a_run_to_its_end_notifies_finished_then_the_stop(stack_factory, receiver):
    """max_steps reached: 'finished' with the step and the last checkpoint; then supervisord's SIGTERM:
    'stopping' with the trainer's grace. Nothing else on a healthy run."""
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url).start()
    post = receiver.one("finished")
    assert "training finished at step 12 (last checkpoint at step 12)" in post["text"]
    assert s.stop() == 0
    assert "the trainer has 7 s to checkpoint" in receiver.one("stopping")["text"]  # what the stop budget leaves
    assert sorted(receiver.events()) == ["finished", "stopping"]
    assert receiver.url not in s.stdout()


def test_a_program_gone_fatal_and_a_watchdog_restart_notify(stack_factory, receiver):
    """A leftover server squats on the inference port: sglang goes FATAL, and that is posted. Then, on a
    second stack, a hung trainer restarted by the watchdog is posted with the watchdog's reason."""
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="0", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", s.port))
    squatter.listen(1)
    try:
        s.start()
        assert "sglang gave up after" in receiver.one("fatal")["text"]
    finally:
        squatter.close()
    assert s.stop() == 0
    h = stack_factory("ws2", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url, PODKIT_WATCHDOG_INTERVAL_S="0.5",
                      PODKIT_WATCHDOG_TRAINER_STALL_S="10", PODKIT_TRAINER_STOP_GRACE_S="2").start()
    h.wait_step(3)
    os.kill(h.pid("trainer"), signal.SIGUSR1)  # the fake trainer hangs, as on a dead collective
    text = receiver.one("watchdog")["text"]
    assert "trainer" in text and "no training step" in text, text
    assert h.stop() == 0


def test_a_malformed_redirecting_or_non_http_webhook_is_recorded_as_failing_without_its_url(tmp_path, capfd):
    """A malformed URL ended in a thread's traceback that printed the URL; a 302 turned the POST into a
    bodiless GET counted as delivered; a service that does not speak HTTP gave raw tracebacks. Each is
    now a recorded failure (what doctor reads), named without the URL, and no redirect is followed."""
    from podkit import notify, records

    gets = []

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            gets.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    redirect = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=redirect.serve_forever, daemon=True).start()
    garbage = raw_server(lambda c: c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))
    urls = {"malformed": "hooks.example/T0/B0/secret-path-0123",  # no scheme
            "redirect": f"http://127.0.0.1:{redirect.server_port}/T0/B0/secret-path-0123",
            "not-http": f"http://127.0.0.1:{garbage.getsockname()[1]}/T0/B0/secret-path-0123",
            "query": f"http://127.0.0.1:{garbage.getsockname()[1]}/hook?key=secret-path-0123 x"}
    try:
        for name, url in urls.items():
            state = tmp_path / name
            state.mkdir()
            notify._failing_logged.clear()
            notify._post(url, {"event": "safe-mode", "text": "t"}, state)
            rec = records.NOTIFY.read(state)
            assert rec.get("failing_since") and rec.get("error"), (name, rec)
            assert "secret-path" not in rec["error"], (name, rec)
        assert "302" in records.NOTIFY.read(tmp_path / "redirect")["error"] and gets == []
    finally:
        redirect.shutdown()
        redirect.server_close()
        garbage.close()
    out = capfd.readouterr()
    assert "secret-path" not in out.out + out.err and "Traceback" not in out.err, out.err


@pytest.mark.parametrize("kind", ["dead", "hanging"])
def test_a_dead_or_hanging_webhook_blocks_nothing_and_is_logged_once(stack_factory, kind):
    """Nothing listens on the webhook's port, or it accepts and never answers: the run trains to its end
    and stops as fast as without one, and the failure is logged once, without the URL."""
    hang = Receiver(hang=True) if kind == "hanging" else None
    url = hang.url if hang else dead_url()
    try:
        s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=url).start()
        wait_for(lambda: s.progress().get("stopped"), 60, what="the run's end")
        if kind == "dead":  # the "finished" notification's failure, while the finished pod stays up
            wait_for(lambda: "did not take the" in s.stdout(), 20, what="the failure logged")
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 15
        out = s.stdout()
        if kind == "dead":  # a hanging one times out after the stop: nothing to log by then
            assert out.count("did not take the") == 1, out[-3000:]
            d = subprocess.run([*PODKIT, "doctor", "--workspace", str(s.workspace)], capture_output=True,
                               text=True, env=s.env, timeout=60)
            assert d.returncode == 1 and "notifications are not delivered" in d.stdout, d.stdout
        assert url not in out and "hook-token" not in out and "not-a-real-secret" not in out
    finally:
        if hang:
            hang.close()


def test_a_webhook_that_never_answers_does_not_stretch_a_stop_mid_training(stack_factory):
    """docker stop gives the whole pod 10 s. A stop in the middle of training, with a webhook that accepts
    the "stopping" notification and never answers: the trainer still checkpoints, the workspace lease is
    released, and the log listener (the last to stop) waits at most about a second for the webhook."""
    from datetime import datetime

    from podkit.programs import logs

    hang = Receiver(hang=True)
    try:
        s = stack_factory(PODKIT_NOTIFY_WEBHOOK_URL=hang.url).start()
        s.wait_step(2)
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 10
        prog = s.progress()
        assert prog["stopped"]["by"] == "SIGTERM" and prog["checkpoint_step"] == prog["step"]
        assert not (s.workspace / ".podkit" / "lease.json").exists(), "the next pod need not wait out the lease"
        # supervisord stops the listener after every other program: its own stop is the gap after the last one
        # (supervisord may see its exit up to a second late: its loop wakes once a second). It waited 3 s before.
        stops = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in s.stdout().splitlines()
                 if " INFO stopped: " in line]
        listener_s = (stops[-1] - stops[-2]).total_seconds()
        assert logs.DRAIN_S <= 1 and logs.DRAIN_S <= listener_s < 2.6, listener_s
    finally:
        hang.close()


def test_a_webhook_that_drips_its_answer_is_cut_off_and_recorded(tmp_path, monkeypatch):
    """A webhook that sends a byte every second never trips the per-read timeout: the attempt is cut at
    notify.ANSWER_S in all and recorded as failing (what doctor reads), not left hanging for hours."""
    from podkit import notify, records

    monkeypatch.setattr(notify, "ANSWER_S", 2.0)
    monkeypatch.setattr(notify, "ATTEMPTS", 1)
    def drip(c):
        c.recv(65536)
        for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 100:
            c.sendall(bytes([b]))
            time.sleep(0.5)

    srv = raw_server(drip)
    try:
        t0 = time.monotonic()
        notify._failing_logged.clear()
        notify._post(f"http://127.0.0.1:{srv.getsockname()[1]}/hook", {"event": "safe-mode", "text": "t"}, tmp_path)
        assert time.monotonic() - t0 < 6
        assert "no complete answer in 2 s" in records.NOTIFY.read(tmp_path)["error"]
    finally:
        srv.close()


@pytest.mark.parametrize("url", ["http://ntfy:S3cretPassw0rdXYZ@127.0.0.1:9/topic",
                                 "https://hooks.slack.com:S3cretPassw0rdXYZ/services/T0/B0",
                                 "https://hooks.slack.com/services/T0/B0/S3cret\nPassw0rdXYZ"])
def test_no_part_of_a_malformed_webhook_url_reaches_the_log_or_the_record(tmp_path, capfd, monkeypatch, url):
    """http.client quotes pieces of the URL in its errors (a password read as a port, a path with a
    control character): only podkit's own words are logged and recorded."""
    from podkit import notify, records

    notify._failing_logged.clear()
    monkeypatch.setattr(notify, "ATTEMPTS", 1)
    notify._post(url, {"event": "safe-mode", "text": "t"}, tmp_path)
    out = capfd.readouterr()
    rec = json.dumps(records.NOTIFY.read(tmp_path))
    assert records.NOTIFY.read(tmp_path).get("error")
    for piece in ("S3cret", "Passw0rdXYZ"):
        assert piece not in out.out + out.err + rec, out.out + out.err + rec


def test_a_dead_webhook_is_logged_again_by_the_next_pod_on_a_reused_volume(stack_factory):
    """An earlier pod on the volume found the webhook dead and recorded so (notify.json). The next pod on the
    volume (a new run started from the console, the webhook still dead) logged nothing: the earlier record
    read as "said already". Each boot's log says it once, and the record is this boot's."""
    from podkit import records

    url = dead_url()
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="3", PODKIT_NOTIFY_WEBHOOK_URL=url, RUNPOD_POD_ID="pod-old111").start()
    wait_for(lambda: "did not take the 'finished'" in s.stdout(), 60, what="the earlier pod's failure logged")
    assert s.stop() == 0
    earlier = records.NOTIFY.read(s.workspace / ".podkit")["failing_since"]
    seen = len(s.stdout())
    s.env.update(PODKIT_TRAINER_MAX_STEPS="6", RUNPOD_POD_ID="pod-new222")
    s.start()
    wait_for(lambda: "did not take the 'finished'" in s.stdout()[seen:], 60, what="the new pod's failure logged")
    assert s.progress()["step"] == 6 and s.stdout()[seen:].count("did not take the") == 1
    assert records.NOTIFY.read(s.workspace / ".podkit")["failing_since"] > earlier
    assert s.stop() == 0 and url not in s.stdout()
