"""A real S3 endpoint on loopback for the checkpoint remote: `rclone serve s3` over a directory, driven by the rclone
podkit ships (mover.binary()). Each directory under the root is a bucket. Plain Python (no pytest), like harness.py:
tests/remote/test_remote.py and tests/trainer/test_rehearsal.py serve from it, and bench/remote.py puts tests/ on its path for it."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from harness import free_port, wait_for

KEY, SECRET = "podkittestaccess01", "podkittestsecret0123456789"  # serve s3 refuses keys much shorter


class Server:
    """`rclone serve s3` on 127.0.0.1 over `root`, with the buckets `buckets` made before it starts (its directory
    cache sees them)."""

    def __init__(self, root: Path, buckets: list[str]) -> None:
        self.root, self.buckets, self.port = root, buckets, free_port()
        self.proc: subprocess.Popen | None = None
        self.nice = 0  # bench/remote.py's step time: the server stands for another machine, its CPU not the pod's

    def start(self) -> Server:
        from podkit.remote import mover

        for name in self.buckets:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([*mover.yielding(self.nice), mover.binary(), "serve", "s3",
                                      "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}", "-q",
                                      str(self.root)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _listening(self.port), 15, what="rclone serve s3 to listen")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # ours, by its pid
            self.proc.wait(10)

    def env(self, bucket: str, prefix: str = "runs", secret: str = SECRET) -> dict[str, str]:
        """A pod's environment for checkpoint.remote in `bucket` on this server, as the README shows it."""
        return {"PODKIT_CHECKPOINT_REMOTE": f"s3://{bucket}/{prefix}", "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def fixtures(buckets: list[str]):
    """A test module's `server` (one per module, over `buckets`) and `bucket` (a bucket of the test's own) fixtures:
    `server, bucket = s3server.fixtures(BUCKETS)` at the module's top level."""
    import pytest

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        s = Server(tmp_path_factory.mktemp("s3"), buckets).start()
        yield s
        s.kill()

    handed = iter(buckets)

    @pytest.fixture
    def bucket(server) -> str:
        return next(handed)

    return server, bucket
