"""The small HTTP server the page and /metrics share: bounded connections that a slow or silent client cannot
pin, one deadline per request, and IPv6 hosts served as IPv6.

A connection takes a slot (max_connections of them). Until its handler calls `heard` (its request line,
headers and body are all in), it is "reading": it is closed at its deadline (request_s after it was accepted,
however slowly it trickles bytes), and a new connection that finds every slot taken closes the oldest reading
one (unless it is younger than grace_s: a request sent at once is read before it can be evicted) and waits
for its slot. A handler that answers at once is never evicted; nothing a stranger sends may make it wait.
"""

from __future__ import annotations

import ipaddress
import socket
import socketserver
import threading
import time
from http.server import ThreadingHTTPServer

from podkit import log

_log = log.get("web")


def family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal ("::", "::1", "fd00::1"), else AF_INET (a name resolves as IPv4)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


class Budget:
    """A global budget of events per second (a token bucket): `take` is False once it is spent."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst, self.lock = per_s, burst, threading.Lock()
        self.left, self.when = float(burst), time.monotonic()

    def take(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.left = min(self.burst, self.left + (now - self.when) * self.per_s)
            self.when = now
            if self.left < 1:
                return False
            self.left -= 1
            return True

    def refund(self) -> None:
        with self.lock:
            self.left = min(self.burst, self.left + 1)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    max_connections = 32
    request_s = 5.0  # the whole request (line, headers, body), not each read: a trickle cannot extend it
    wait_s = 1.0     # how long a new connection waits for a slot (an evicted reader's, a handler's that ends)
    grace_s = 0.05   # a reader this young is never evicted: time enough to read a request sent at once

    def __init__(self, address, handler, bind_and_activate: bool = True) -> None:
        self.address_family = family(address[0])
        self.slots = threading.BoundedSemaphore(self.max_connections)
        self.lock = threading.Lock()
        self.reading: dict = {}  # connection -> its deadline, until its handler has heard the request
        super().__init__((address[0].strip("[]"), *address[1:]), handler, bind_and_activate)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # "::" serves IPv4 too: RunPod's proxy comes over IPv4
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: its getfqdn() may wait on DNS
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def serve_forever(self, poll_interval: float = 0.25) -> None:
        super().serve_forever(poll_interval)  # service_actions (the deadlines) run at least this often

    def process_request(self, request, client_address) -> None:
        with self.lock:
            self.reading[request] = time.monotonic() + self.request_s
        if not self.slots.acquire(blocking=False):
            give_up = time.monotonic() + self.wait_s
            while True:  # a reader evicted frees its slot within ms; a young one is old enough after grace_s
                self._close_oldest_reader(but=request)
                if self.slots.acquire(timeout=self.grace_s):
                    break
                if time.monotonic() >= give_up:
                    self.shutdown_request(request)
                    return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.heard(request)
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.heard(request)
            self.slots.release()

    def heard(self, request) -> None:
        """The request is all in: from here its connection is the handler's, never evicted nor timed out."""
        with self.lock:
            self.reading.pop(request, None)

    def shutdown_request(self, request) -> None:
        with self.lock:  # never closed while an eviction holds it (its fd could be reused)
            self.reading.pop(request, None)
            super().shutdown_request(request)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = [c for c, deadline in self.reading.items() if deadline <= now]
            for c in late:
                self._cut(c)

    def _close_oldest_reader(self, but) -> None:
        with self.lock:
            oldest = min((c for c in self.reading if c is not but), key=self.reading.get, default=None)
            if oldest is not None and self.reading[oldest] - self.request_s <= time.monotonic() - self.grace_s:
                self._cut(oldest)

    def _cut(self, conn) -> None:
        """Its handler reads EOF and ends, freeing its slot (called with the lock held)."""
        self.reading.pop(conn, None)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
