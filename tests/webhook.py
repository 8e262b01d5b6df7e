"""A loopback webhook receiver for the notification tests (tests/views/test_notify.py), the cost guards' and the
deploy watch's, and an URL where nothing listens: shared here, not imported from one test module by another."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness import wait_for


class Receiver:
    """A loopback webhook: records each POST's JSON; `hang` makes it never answer."""

    def __init__(self, hang: bool = False) -> None:
        self.posts: list[dict] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if hang:
                    outer.release.wait(60)
                    return
                outer.posts.append(body)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/T0/B0/not-a-real-secret-abcdef"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[str]:
        return [p["event"] for p in self.posts]

    def one(self, event: str) -> dict:
        return wait_for(lambda: next((p for p in self.posts if p["event"] == event), None), 30,
                        what=f"a {event!r} notification")

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}/hook-token-0123456789"
