"""Git remotes for the sync tests: local bare repos, and a loopback smart-HTTP server running the
real `git http-backend` (CGI) behind Basic auth. It also records every process's argv while it
serves, so a test can prove a token never appeared on a command line."""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1"}


def git(*args, cwd=None, check=True) -> str:
    env = dict(os.environ, **GIT_ENV)
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise AssertionError(f"git {' '.join(args)}: {r.stderr}")
    return r.stdout.strip()


class Remote:
    """A bare repository with a work clone used to push commits to it."""

    def __init__(self, root: Path, name: str = "train.git") -> None:
        self.bare = root / name
        self.work = root / f"{name}-work"
        git("init", "-q", "--bare", "-b", "main", str(self.bare))
        git("init", "-q", "-b", "main", str(self.work))
        git("remote", "add", "origin", str(self.bare), cwd=self.work)

    @property
    def url(self) -> str:
        return str(self.bare)

    def commit(self, path: str = "train.py", text: str | None = None, n: int = 1) -> str:
        for _ in range(n):
            f = self.work / path
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text if text is not None else f"{f.read_text() if f.exists() else ''}# more\n")
            git("add", path, cwd=self.work)
            git("commit", "-q", "-m", f"change {path}", cwd=self.work)
        git("push", "-q", "origin", "HEAD:main", "--tags", cwd=self.work)
        return self.head()

    def head(self, ref: str = "main") -> str:
        return git("rev-parse", ref, cwd=self.bare)


def all_cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


class HTTPRemote:
    """Smart HTTP for the repos under `root`. mode: ok | deny (401 always)."""

    def __init__(self, root: Path, token: str | None = None, mode: str = "ok") -> None:
        self.root, self.token, self.mode = root, token, mode
        self.seen_cmdlines: list[str] = []
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _authorized(self) -> bool:
                if server.mode == "deny":
                    return False
                if server.token is None:
                    return True
                want = base64.b64encode(f"x-access-token:{server.token}".encode()).decode()
                return self.headers.get("Authorization") == f"Basic {want}"

            def _handle(self):
                server.requests += 1
                server.seen_cmdlines += all_cmdlines()
                # Read the body first: closing with unread request data resets the connection.
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._authorized():
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="git"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path, _, query = self.path.partition("?")
                env = dict(os.environ, GIT_PROJECT_ROOT=str(server.root), GIT_HTTP_EXPORT_ALL="1",
                           PATH_INFO=path, QUERY_STRING=query, REQUEST_METHOD=self.command,
                           CONTENT_TYPE=self.headers.get("Content-Type", ""), CONTENT_LENGTH=str(len(body)),
                           REMOTE_USER="x-access-token", REMOTE_ADDR="127.0.0.1",
                           GIT_PROTOCOL=self.headers.get("Git-Protocol", ""),
                           HTTP_CONTENT_ENCODING=self.headers.get("Content-Encoding", ""))
                r = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
                head, _, payload = r.stdout.partition(b"\r\n\r\n")
                status = 200
                headers = []
                for line in head.decode().split("\r\n"):
                    k, _, v = line.partition(":")
                    if k.lower() == "status":
                        status = int(v.strip().split()[0])
                    elif k:
                        headers.append((k, v.strip()))
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
