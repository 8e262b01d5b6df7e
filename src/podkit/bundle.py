"""`podkit doctor --bundle FILE.tar.gz`: what a maintainer asks for first in a bug report, in one file
with the secrets taken out. Versions (podkit, Python, torch, SGLang, AReaL, supervisor, the driver), the
resolved config and the config file, doctor's findings, status, every record under .podkit/ as found,
the settings the last boot rendered and the supervisord.conf it ran, the last lines of each log, the
stack dumps, and the GPU facts (nvidia-smi -q, compute mode, topology)
where there is an nvidia-smi.

What it reads belongs to a pod that may be broken or tampered with: a symlink, a FIFO or a device is
never opened (a planted link must not pull a key into the bundle), a big file gives its tail, and a part
that fails is named in MANIFEST.json while the rest is still written. Secrets are removed by value (the
config's credentials, every variable of the environment whose name says secret) and by shape
(credentials inside URLs, known key prefixes, `key=value` and `"key": "value"` under a secret name).
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import stat
import sys
import tarfile
import time
from pathlib import Path

from podkit import log, proc
from podkit.redact import SECRET_NAME, Redactor

_log = log.get("doctor")
LOG_TAIL = 256 << 10  # bytes of each log's end: a few thousand lines, enough for the last crash
RECORD_MAX = 1 << 20  # a record bigger than this is not podkit's; its head and tail say what it is
STACKS_MAX = 1 << 20
PACKAGES = ("podkit", "torch", "sglang", "areal", "transformers", "supervisor", "flashinfer-python",
            "sglang-kernel", "ray", "runpod")
# Environment variables a report needs to make sense of a run (values redacted like everything else).
ENV_NAMES = re.compile(r"^(PODKIT_|RUNPOD_|CUDA_|NCCL_|NVIDIA_|SGLANG_|AREAL_|TORCH|PYTORCH_|HF_|TRANSFORMERS_)")
def read_regular(path: Path, limit: int, tail: bool = True) -> tuple[bytes | None, str]:
    """A regular file's bytes (its last `limit` when `tail`, else its first), opened without following a
    link and without blocking on a FIFO; (None, why not) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return None, "a symlink, not followed" if os.path.islink(path) else f"cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if tail and st.st_size > limit:
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if not data:
            return None, "empty"
        if st.st_size > len(data):
            if tail and b"\n" in data:
                data = data.split(b"\n", 1)[1]  # from the first whole line
            return data, f"last {len(data)} of {st.st_size} bytes" if tail else f"first {len(data)} of {st.st_size} bytes"
        return data, f"{len(data)} bytes"
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    finally:
        os.close(fd)


class Bundle:
    def __init__(self, redact: Redactor) -> None:
        self.redact, self.files, self.manifest = redact, {}, []

    def add(self, name: str, text: str, source: str = "", note: str = "") -> None:
        self.files[name] = self.redact(text).encode()
        self.manifest.append({"file": name, "source": source, "note": note})

    def skip(self, source: str, why: str) -> None:
        self.manifest.append({"file": None, "source": source, "note": why})

    def part(self, name: str, fn) -> None:
        """One part of the bundle; its failure is named in the manifest, never the end of the bundle."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a bug report must still be written from a broken pod
            self.skip(name, f"failed: {type(e).__name__}: {e}")

    def copy(self, name: str, path: Path, limit: int, tail: bool = True) -> None:
        data, note = read_regular(path, limit, tail)
        if data is None:
            self.skip(str(path), note)
        else:
            self.add(name, data.decode("utf-8", errors="replace"), str(path), note)

    def write(self, out: Path) -> None:
        """Atomically, mode 0600: logs and records are the pod's own, redacted or not."""
        self.add("MANIFEST.json", json.dumps(self.manifest, indent=2))
        out = out.absolute()
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
                now = time.time()
                for name, data in self.files.items():
                    info = tarfile.TarInfo(f"podkit-doctor/{name}")
                    info.size, info.mtime, info.mode = len(data), now, 0o600
                    tar.addfile(info, io.BytesIO(data))
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def versions() -> dict:
    import importlib.metadata as md

    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    found["nvidia_driver"] = (_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").strip() or None
    return found


def _smi(*args: str) -> str | None:
    exe = proc.which("nvidia-smi")
    if not exe:
        return None
    import subprocess

    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    return r.stdout + (f"\n[nvidia-smi exited {r.returncode}]\n{r.stderr}" if r.returncode else "")


def gather(cfg, environ=None) -> Bundle:
    environ = os.environ if environ is None else environ
    b = Bundle(Redactor.for_pod(cfg, environ))
    ws = cfg.workspace_path
    # The records as found, before status and doctor read them (a record that does not fit its shape is
    # moved aside by its reader).
    for path in sorted(cfg.state_dir.glob("*")) if cfg.state_dir.is_dir() else []:
        if path.name.startswith(".") or (path.is_dir() and not path.is_symlink()):
            continue
        b.part(f"records/{path.name}", lambda p=path: b.copy(f"records/{p.name}", p, RECORD_MAX))
    b.part("versions.json", lambda: b.add("versions.json", json.dumps(versions(), indent=2)))
    b.part("config.yaml", lambda: _config(b, cfg))
    b.part("environment.txt", lambda: b.add("environment.txt", "".join(
        f"{k}={v}\n" for k, v in sorted(environ.items()) if ENV_NAMES.match(k) or SECRET_NAME.search(k))))
    b.part("status.json", lambda: _status(b, ws))
    b.part("doctor.json", lambda: _doctor(b, cfg, ws))
    for path in sorted(cfg.log_dir.glob("*")) if cfg.log_dir.is_dir() else []:
        dump = path.name.startswith(("stacks-", "hang-"))
        b.part(f"logs/{path.name}", lambda p=path, d=dump: b.copy(f"logs/{p.name}", p, STACKS_MAX if d else LOG_TAIL))
    b.part("run/podkit.env", lambda: _run_dir(b, cfg))
    b.part("supervisord.conf", lambda: b.copy("supervisord.conf", _packaged("supervisord.conf"), RECORD_MAX))
    b.part("gpu", lambda: _gpu(b))
    b.part("system.txt", lambda: _system(b, ws))
    return b


def _run_dir(b: Bundle, cfg) -> None:
    """The settings the last boot rendered for supervisord (podkit.env), from the run dir current.json
    names if that is a directory of this user's that only it may enter (as podkit makes its run dirs),
    else the config's."""
    from podkit import records

    named = records.CURRENT.read(cfg.state_dir).get("run_dir")
    run_dir = cfg.run_path
    if named:
        try:
            st = os.lstat(named)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
                run_dir = Path(named)
            else:
                b.skip(named, "current.json names it as the run dir, but it is not a private directory of this user")
        except OSError:
            pass
    if run_dir.is_dir():
        b.copy("run/podkit.env", run_dir / "podkit.env", RECORD_MAX)
    else:
        b.skip(str(run_dir), "no run dir (gone with the last stop, or another machine's)")


def _packaged(name: str) -> Path:
    from podkit import config

    return config.packaged(name)


def _config(b: Bundle, cfg) -> None:
    """The resolved config, and the file it came from as it is on disk. Under a config error (doctor is
    tolerant of one), the error and the file that has it, and the defaults status and doctor used."""
    import yaml

    error, source = getattr(cfg, "load_error", None) or (None, None if cfg.source == "defaults" else cfg.source)
    head = "".join(f"# {ln}\n" for ln in f"config error; the defaults below stood in:\n{error}".splitlines()) \
        if error else ""
    b.add("config.yaml", head + yaml.safe_dump(cfg.as_dict(), sort_keys=False), "podkit config")
    if source:
        b.copy("config-file.yaml", Path(source), RECORD_MAX, tail=False)


def _status(b: Bundle, ws: Path) -> None:
    from podkit import status

    b.add("status.json", json.dumps(status.collect(ws), indent=2, default=str), "podkit status --json")


def _doctor(b: Bundle, cfg, ws: Path) -> None:
    from podkit import doctor

    findings = [f.to_dict() for f in doctor.examine(cfg, ws)]
    b.add("doctor.json", json.dumps({"findings": findings}, indent=2), "podkit doctor --json")


def _gpu(b: Bundle) -> None:
    if not proc.which("nvidia-smi"):
        b.skip("nvidia-smi", "not on PATH: no GPU facts")
        return
    for name, args in (("nvidia-smi-q.txt", ["-q"]), ("topology.txt", ["topo", "-m"]),
                       ("compute-mode.txt", ["--query-gpu=index,name,compute_mode,memory.used,memory.total",
                                             "--format=csv"])):
        b.part(f"gpu/{name}", lambda n=name, a=args: b.add(f"gpu/{n}", _smi(*a) or "", "nvidia-smi " + " ".join(a)))


def _system(b: Bundle, ws: Path) -> None:
    lines = [f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}", f"uname: {' '.join(os.uname())}",
             f"cpus: {os.cpu_count()}", f"load average: {os.getloadavg()}"]
    try:
        st = os.statvfs(ws)
        lines.append(f"workspace {ws}: {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free of "
                     f"{st.f_blocks * st.f_frsize / 2**30:.1f} GiB")
    except OSError as e:
        lines.append(f"workspace {ws}: {e.strerror}")
    data, _ = read_regular(Path("/proc/meminfo"), 4096, tail=False)
    lines += (data or b"").decode(errors="replace").splitlines()[:3]
    b.add("system.txt", "\n".join(lines) + "\n")


def main(cfg, out: Path) -> int:
    b = gather(cfg)
    b.write(out)
    skipped = [m for m in b.manifest if m["file"] is None]
    _log.info(f"wrote {out} ({len(b.files)} files, secrets redacted; {len(skipped)} skipped, see MANIFEST.json)")
    return 0
