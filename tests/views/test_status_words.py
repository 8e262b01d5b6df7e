"""`podkit status` on a pod that has stopped reads as a person would say it: no "None", no "vNone", and no
server called ready because something else answers on its port."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading

import pytest

from conftest import PODKIT, free_port

pytestmark = pytest.mark.timeout(60)


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_):
        pass


def test_a_stopped_pod_that_never_trained_says_so_and_its_port_answering_is_not_its_server(procs, tmp_path):
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Healthy)  # someone else's server, same port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ws = tmp_path / "ws"
        state = ws / ".podkit"
        state.mkdir(parents=True)
        gone = procs.spawn(["true"])
        gone.wait(10)
        (state / "current.json").write_text(json.dumps({
            "socket": str(tmp_path / "no-such.sock"), "supervisord_pid": gone.pid, "started": 1.0,
            "inference": {"host": "127.0.0.1", "port": port}}))
        # A script refused before its first step: no step, no checkpoint, no weights pushed.
        (state / "progress.json").write_text(json.dumps({"kind": "areal", "pid": gone.pid, "stopped": {
            "by": "config-error", "time": 2.0, "message": "ModuleNotFoundError: No module named 'my_rewards'"}}))
        out = subprocess.run([*PODKIT, "status", "--workspace", str(ws)], capture_output=True, text=True, timeout=30)
        assert "None" not in out.stdout, out.stdout
        assert "before its first step" in out.stdout and "no checkpoint" in out.stdout, out.stdout
        assert "no weights pushed" in out.stdout and "inference: stopped" in out.stdout, out.stdout
        st = json.loads(subprocess.run([*PODKIT, "status", "--json", "--workspace", str(ws)], capture_output=True,
                                       text=True, timeout=30).stdout)
        assert st["inference"]["phase"] == "stopped", st["inference"]
    finally:
        server.shutdown()
        server.server_close()
