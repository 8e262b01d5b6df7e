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

from podkit import config, log
from podkit.host import proc
from podkit.redact import Redactor, secret_name

_log = log.get("doctor")
LOG_TAIL = 256 << 10  # bytes of each log's end: a few thousand lines, enough for the last crash
RECORD_MAX = 1 << 20  # a record bigger than this is not podkit's; its head and tail say what it is
STACKS_MAX = 1 << 20
PACKAGES = ("podkit", "torch", "sglang", "areal", "transformers", "supervisor", "flashinfer-python",
            "sglang-kernel", "ray", "runpod")
# Environment variables a report needs to make sense of a run (values redacted like everything else).
ENV_NAMES = re.compile(r"^(PODKIT_|RUNPOD_|CUDA_|NCCL_|NVIDIA_|SGLANG_|AREAL_|TORCH|PYTORCH_|HF_|TRANSFORMERS_)")
TOTAL_MAX = 64 << 20  # the whole bundle, before compression: a workspace with thousands of logs stops here
SMI_TIMEOUT_S = 10.0


class Dir:
    """A directory under the workspace (logs/, .podkit/), opened without following a link to it: a
    planted `logs -> /root/.ssh` must not pull keys into the bundle. Files are read relative to it."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd, self.why = path, None, ""
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            self.why = "a symlink, not followed" if os.path.islink(path) else f"cannot be opened ({e.strerror})"

    def names(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.fd)) if self.fd is not None else []

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def read_regular(path: Path, limit: int, tail: bool = True, dir_fd: int | None = None,
                 margin: int = 0) -> tuple[bytes | None, str, bool]:
    """A regular file's bytes: its last `limit` (+ `margin`) when `tail`, else its first; (None, why not,
    False) for anything else. The type is checked before the open (a device node is never opened), the
    open follows no link and does not block on a FIFO. The bool: the file was cut."""
    name = path.name if dir_fd is not None else path
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return None, "a symlink, not followed" if os.path.islink(path) else "not a regular file", False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as e:
        return None, f"cannot be opened ({e.strerror})", False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file", False
        want = limit + margin
        if tail and st.st_size > want:
            os.lseek(fd, st.st_size - want, os.SEEK_SET)
        chunks, left = [], want
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if not data:
            return None, "empty", False
        return data, f"{st.st_size} bytes", st.st_size > len(data)
    except OSError as e:
        return None, f"cannot be read ({e.strerror})", False
    finally:
        os.close(fd)


def _cut(text: str, limit: int, tail: bool) -> str:
    """`limit` characters of an already redacted text, from a whole line: a secret cut in half at the
    edge was read whole (the margin) and redacted before this cut."""
    if tail:
        text = text[-limit:]
        breaks = [i for i in (text.find("\n"), text.find("\r")) if i >= 0]
        return text[min(breaks) + 1:] if breaks else ""
    text = text[:limit]
    return text[:max(text.rfind("\n"), text.rfind("\r")) + 1]


class Bundle:
    def __init__(self, redact: Redactor) -> None:
        self.redact, self.files, self.manifest, self.total = redact, {}, [], 0

    def add(self, name: str, text: str, source: str = "", note: str = "", redacted: bool = False) -> None:
        name = self.redact(name).replace("/<", "/_").replace("<", "_").replace(">", "_").replace(" ", "_")
        while name in self.files:  # two names that redact alike
            name += "_"
        data = (text if redacted else self.redact(text)).encode("utf-8", "backslashreplace")
        if self.total + len(data) > TOTAL_MAX and name != "MANIFEST.json":
            self.skip(self.redact(source) or name, f"left out: the bundle holds {TOTAL_MAX >> 20} MiB at most")
            return
        self.total += len(data)
        self.files[name] = data
        self.manifest.append({"file": name, "source": self.redact(source), "note": note})

    def skip(self, source: str, why: str) -> None:
        self.manifest.append({"file": None, "source": self.redact(source), "note": why})

    def part(self, name: str, fn) -> None:
        """One part of the bundle; its failure is named in the manifest, never the end of the bundle."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a bug report must still be written from a broken pod
            self.skip(name, f"failed: {type(e).__name__}: {e}")

    def copy(self, name: str, path: Path, limit: int, tail: bool = True, directory: Dir | None = None) -> None:
        margin = 4 * self.redact.longest + 1024
        data, note, cut = read_regular(path, limit, tail, directory.fd if directory else None, margin)
        if data is None:
            self.skip(str(path), note)
            return
        text = self.redact(data.decode("utf-8", errors="replace"))
        if cut or len(text) > limit:
            text = _cut(text, limit, tail)
            note = f"{'last' if tail else 'first'} {len(text)} characters (whole lines) of {note}"
        self.add(name, text, str(path), note, redacted=True)

    def write(self, out: Path) -> None:
        """Atomically, mode 0600: logs and records are the pod's own, redacted or not."""
        import tempfile

        self.add("MANIFEST.json", json.dumps(self.manifest, indent=2))
        out = out.absolute()
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)  # O_EXCL, 0600
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
                now = time.time()
                for name, data in self.files.items():
                    info = tarfile.TarInfo(f"podkit-doctor/{name}")
                    info.size, info.mtime, info.mode = len(data), now, 0o600
                    tar.addfile(info, io.BytesIO(data))
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def versions() -> dict:
    import importlib.metadata as md

    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


_smi_hung = []


def _smi(*args: str) -> str | None:
    """nvidia-smi's answer; after one call that hangs (a GPU fallen off the bus), no more calls."""
    exe = proc.which("nvidia-smi")
    if not exe:
        return None
    if _smi_hung:
        raise TimeoutError("skipped: an earlier nvidia-smi call did not answer")
    import subprocess

    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _smi_hung.append(1)
        raise TimeoutError(f"nvidia-smi did not answer in {SMI_TIMEOUT_S:.0f} s") from None
    return r.stdout + (f"\n[nvidia-smi exited {r.returncode}]\n{r.stderr}" if r.returncode else "")


def gather(cfg, environ=None) -> Bundle:
    environ = os.environ if environ is None else environ
    b = Bundle(Redactor.for_pod(cfg, environ))
    ws = cfg.workspace_path
    # The records as found, before status and doctor read them (a record that does not fit its shape is
    # moved aside by its reader).
    _copy_dir(b, cfg.state_dir, "records", RECORD_MAX)
    b.part("versions.json", lambda: b.add("versions.json", json.dumps(versions(), indent=2)))
    b.part("nvidia_driver", lambda: b.add("driver.txt", (_smi("--query-gpu=driver_version", "--format=csv,noheader")
                                                         or "no nvidia-smi\n"), "nvidia-smi"))
    b.part("config.yaml", lambda: _config(b, cfg))
    # A variable whose name says secret shows that it is set, never its value, however short.
    b.part("environment.txt", lambda: b.add("environment.txt", "".join(
        f"{k}={'<redacted>' if secret_name(k, environ) and v else v}\n" for k, v in sorted(environ.items())
        if ENV_NAMES.match(k) or secret_name(k, environ))))
    b.part("status.json", lambda: _status(b, ws, cfg.state_dir))
    b.part("doctor.json", lambda: _doctor(b, cfg, ws))
    _copy_dir(b, cfg.log_dir, "logs", LOG_TAIL, dumps=STACKS_MAX)
    b.part("run/podkit.env", lambda: _run_dir(b, cfg))
    b.part("supervisord.conf", lambda: b.copy("supervisord.conf", config.packaged("supervisord.conf"), RECORD_MAX))
    b.part("gpu", lambda: _gpu(b))
    b.part("system.txt", lambda: _system(b, ws))
    return b


def _copy_dir(b: Bundle, path: Path, prefix: str, limit: int, dumps: int = 0) -> None:
    """Each regular file of a workspace directory that is not itself a link (logs/, .podkit/)."""
    if not path.exists() and not path.is_symlink():
        return
    d = Dir(path)
    try:
        if d.fd is None:
            b.skip(str(path), d.why)
        for name in d.names():
            dump = dumps and name.startswith(("stacks-", "hang-"))
            if name.startswith("."):
                continue
            b.part(f"{prefix}/{name}", lambda n=name, lim=(dumps if dump else limit):
                   b.copy(f"{prefix}/{n}", path / n, lim, directory=d))
    finally:
        d.close()


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


def _status(b: Bundle, ws: Path, state_dir: Path) -> None:
    from podkit.views import status

    b.add("status.json", json.dumps(status.collect(ws, state_dir), indent=2, default=str), "podkit status --json")


def _doctor(b: Bundle, cfg, ws: Path) -> None:
    from podkit.views import doctor

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
    data, _, _ = read_regular(Path("/proc/meminfo"), 4096, tail=False)
    lines += (data or b"").decode(errors="replace").splitlines()[:3]
    b.add("system.txt", "\n".join(lines) + "\n")


def main(cfg, out: Path) -> int:
    from podkit.errors import PodkitError

    if not out.absolute().parent.is_dir():
        raise PodkitError(f"cannot write {out}: {out.absolute().parent} is not a directory",
                          "name a file in an existing directory, e.g. /workspace/report.tar.gz")
    if out.is_dir():
        raise PodkitError(f"cannot write {out}: it is a directory", "name a file, e.g. report.tar.gz")
    b = gather(cfg)
    try:
        b.write(out)
    except OSError as e:
        raise PodkitError(f"cannot write {out}: {e.strerror}", "name a file in a writable directory") from None
    skipped = [m for m in b.manifest if m["file"] is None]
    _log.info(f"wrote {out} ({len(b.files)} files, secrets redacted; {len(skipped)} skipped, see MANIFEST.json)")
    return 0
