"""A Docker engine of the test run's own, and the project's image built on a local CPU base.

The engine: Debian's dockerd with its own exec root and socket in a temp dir, no bridge and no
iptables (`--bridge=none --iptables=false`): containers and builds use the host's network, so all
traffic stays on loopback or goes to the package indexes. Storage: overlay2 where the kernel mounts an
overlay on the data root's file system (a layer is a diff), else vfs (every layer a full copy of the
image: minutes per build step). Each driver's data root is kept under ~/.cache/podkit/docker-<driver>
so the debootstrap base and the unchanged layers are reused by the next run.
The daemon is stopped by its pid and its temp dirs removed at the end. Where no engine can be
installed or started, the image tests skip and say why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LABEL = f"podkit-test-run={os.getpid()}"


def cache_dir() -> Path:
    return Path(os.environ.get("PODKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                           Path.home() / ".cache") / "podkit")


def overlay_mounts(where: Path) -> bool:
    """Can this kernel mount an overlay whose layers live on `where`'s file system (overlay2's need)?"""
    where.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=where))
    try:
        for sub in ("lower", "upper", "work", "merged"):
            (d / sub).mkdir()
        opts = f"lowerdir={d / 'lower'},upperdir={d / 'upper'},workdir={d / 'work'}"
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(d / "merged")],
                           capture_output=True, timeout=30)
        if r.returncode:
            return False
        subprocess.run(["umount", str(d / "merged")], capture_output=True, timeout=30)
        return True
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Engine:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="podkit-docker-"))
        self.sock = self.tmp / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_CONFIG": str(self.tmp / "cli")}
        self.proc: subprocess.Popen | None = None
        self.timings: dict[str, float] = {}
        self.compose_bin = str(Path(sys.executable).parent / "docker-compose")
        self.driver = ""

    # -- lifecycle --------------------------------------------------------------------------------------
    def install(self) -> str | None:
        """dockerd and debootstrap from Debian's packages when missing; why not, or None."""
        missing = [p for p, b in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(b)]
        if not missing:
            return None
        if os.getuid() != 0:
            return f"no Docker engine: {' '.join(missing)} not installed and not root to install them"
        t0 = time.monotonic()
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            if r.returncode:
                return f"no Docker engine: {' '.join(argv)} failed: {r.stderr.strip()[-500:]}"
        self.timings["install engine"] = time.monotonic() - t0
        return None

    def start(self) -> str | None:
        if os.getuid() != 0:
            return "no Docker engine: dockerd needs root here"
        why = None
        for driver in ("overlay2", "vfs") if overlay_mounts(cache_dir()) else ("vfs",):
            why = self._start(driver)
            if why is None:
                self.driver = driver
                return None
            self._kill()
        return why

    def _start(self, driver: str) -> str | None:
        data_root = cache_dir() / f"docker-{driver}"
        data_root.mkdir(parents=True, exist_ok=True)
        log = open(self.tmp / "dockerd.log", "ab")  # noqa: SIM115 - the daemon's for its lifetime
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(data_root), "--exec-root", str(self.tmp / "exec"),
             "-H", f"unix://{self.sock}", "--pidfile", str(self.tmp / "docker.pid"),
             "--storage-driver", driver, "--bridge=none", "--iptables=false", "--ip6tables=false",
             "--ip-masq=false", "--userland-proxy=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until = time.monotonic() + 60
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                break
            if self.sock.exists() and self.docker("version", timeout=10, check=False).returncode == 0:
                # A run killed halfway left its containers and volumes in the kept data root.
                self.docker("container", "prune", "-f", check=False, timeout=300)
                self.docker("volume", "prune", "-f", check=False, timeout=300)
                return None
            time.sleep(0.5)
        tail = (self.tmp / "dockerd.log").read_text(errors="replace")[-800:]
        return f"no Docker engine: dockerd ({driver}) did not start: {tail}"

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            ids = self.docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=120)
            # Drop the layers a rebuild left behind (under vfs each is a full copy), keep the rest.
            self.docker("image", "prune", "-f", check=False, timeout=300)
        self._kill()
        # containerd-shims outlive a killed daemon only in its own session; ours is gone with it.
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- commands ---------------------------------------------------------------------------------------
    def docker(self, *args, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode:
            raise AssertionError(f"docker {' '.join(args[:3])} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r

    def compose(self, project: str, *args, env: dict | None = None, timeout: float = 300, check: bool = True):
        argv = [self.compose_bin, "-p", project, "-f", str(ROOT / "docker-compose.yml"),
                "-f", str(HERE / "compose.test.yml"), *args]
        r = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                           cwd=ROOT)
        if check and r.returncode:
            raise AssertionError(f"compose {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r

    def build(self, context: Path, tag: str, base: str) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        r = self.docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", tag, str(context),
                        timeout=1800)
        return r, time.monotonic() - t0

    def layers(self, tag: str) -> list[tuple[str, int, str]]:
        """(layer id, size in bytes, instruction), newest first."""
        out = self.docker("history", "--no-trunc", "--human=false", "--format", "{{.ID}}\t{{.Size}}\t{{.CreatedBy}}",
                          tag).stdout
        rows = []
        for line in out.splitlines():
            lid, size, by = line.split("\t", 2)
            rows.append((lid, int(size), by))
        return rows


@pytest.fixture(scope="session")
def engine():
    e = Engine()
    why = e.install() or e.start()
    if why:
        e.stop()
        pytest.skip(why)
    yield e
    e.stop()
    if e.timings:
        print(f"\n[image timings] storage {e.driver}: " + ", ".join(f"{k} {v:.0f}s" for k, v in e.timings.items()))


def base_tag() -> str:
    key = hashlib.sha256((HERE / "base.sh").read_bytes()).hexdigest()[:12]
    return f"podkit-test-base:{key}"


@pytest.fixture(scope="session")
def image(engine):
    """The project's Dockerfile, unchanged, built FROM the CPU base; tagged as compose names it."""
    tag = base_tag()
    t0 = time.monotonic()
    r = subprocess.run(["sh", str(HERE / "base.sh"), tag], env=engine.env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    engine.timings["base"] = time.monotonic() - t0
    build, seconds = engine.build(ROOT, "podkit:latest", tag)
    engine.timings["build"] = seconds
    return {"tag": "podkit:latest", "base": tag, "build_log": build.stdout}
