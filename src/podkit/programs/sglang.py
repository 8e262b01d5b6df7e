"""`podkit run sglang` with inference.kind sglang: SGLang's command line from the pod config, then exec.

SGLang spawns scheduler subprocesses that hold the GPUs; supervisord stops them as one process group.
A restart can still begin while the old group lets go of the devices, and a second server on a busy GPU
fails with "CUDA-capable device(s) is/are busy or unavailable", so the start waits (bounded) until nothing
else holds the inference GPUs' device files.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

from podkit import log
from podkit.areal import checks
from podkit.areal.checks import API_KEY_ENV
from podkit.host import gpu, supervisord
from podkit.programs import compile_caches, refused

_log = log.get("sglang")


def command(cfg, environ: dict[str, str] | None = None, python: str | None = None,
            secrets_file: str | None = None) -> list[str]:
    """argv for SGLang's server: the flags podkit owns (checks.SGLANG_FLAGS, the table extra_args is
    checked against), then extra_args. Every flag here is checked by SGLang's own parser in the test suite.
    The API key never goes on the command line (every user can read /proc/<pid>/cmdline): with a key,
    argv names `secrets_file` with `--config`, which SGLang's launcher merges in-process
    (sglang.srt.server_args.prepare_server_args); `secrets_yaml` is what that file must hold."""
    environ = os.environ if environ is None else environ
    argv = [python or sys.executable, "-m", "sglang.launch_server", *checks.sglang_flags(cfg)]
    if environ.get(API_KEY_ENV):
        argv += ["--config", secrets_file or SECRETS_FILE]
    return argv + shlex.split(cfg.inference.extra_args)


SECRETS_FILE = "sglang-secrets.yaml"  # in the run dir (local disk, 0700), mode 0600; SGLang wants .yaml


def secrets_yaml(environ: dict[str, str]) -> str:
    return f"api-key: {json.dumps(environ[API_KEY_ENV])}\n"  # a JSON string is a YAML string


def write_secrets(cfg, environ: dict[str, str]) -> str | None:
    """The file `--config` names, written where only this user can read it; None without a key."""
    if not environ.get(API_KEY_ENV):
        return None
    path = cfg.run_path / SECRETS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets_yaml(environ))
    os.chmod(path, 0o600)
    return str(path)


def environment(cfg, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env["CUDA_VISIBLE_DEVICES"] = cfg.inference.gpus
    # Model downloads go to the volume: a restarted pod does not fetch the weights again.
    env.setdefault("HF_HOME", str(cfg.workspace_path / "hf"))
    # SGLang's /health runs a real one-token generation by default, and one that times out stays queued in
    # its scheduler: probes at or under its 20 s timeout pile up (sglang#35884). Liveness only; the
    # watchdog's own rare /health_generate is the generation check.
    env[HEALTH_GENERATION_ENV] = "0"
    return compile_caches(cfg, env, "sglang")


HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def device_files(cfg) -> list[str]:
    """The inference GPUs' device files."""
    return gpu.device_files(cfg.devices, cfg.gpus["inference"])


def _trainer_group(cfg) -> int | None:
    """The process group supervisord started the trainer in (each program has its own)."""
    info = supervisord.process_info(cfg.socket_path, "trainer")
    try:
        return os.getpgid(info["pid"]) if info and info["pid"] else None
    except ProcessLookupError:
        return None


def wait_devices_free(cfg, timeout_s: float, interval: float = 0.5) -> list:
    """Holders still on the inference GPUs after `timeout_s` (empty: free)."""
    devices = device_files(cfg)
    if not devices:
        return []
    sharing = _trainer_group(cfg)  # on a shared GPU (configs/a40-1gpu.yaml) the running trainer holds it too
    until = time.monotonic() + timeout_s
    told = False
    while True:
        holders = [h for h in gpu.holders(devices, deadline_s=10.0)[0] if h.pgid != sharing]
        if not holders or time.monotonic() >= until:
            return holders
        if not told:
            _log.info(f"waiting up to {timeout_s:.0f}s for {len(holders)} process(es) to let go of "
                      f"{', '.join(devices)}: " + "; ".join(h.describe() for h in holders[:3]))
            told = True
        time.sleep(interval)


def main(cfg) -> int:
    if refused(cfg, checks.sglang(cfg), _log):
        return 2
    held = wait_devices_free(cfg, cfg.inference.gpu_free_timeout_s)
    if held:
        _log.error("the inference GPUs are still held, SGLang would fail with 'CUDA-capable device(s) is/are "
                   "busy or unavailable': " + "; ".join(h.describe() for h in held)
                   + " — `podkit reap --dry-run` lists them; `podkit reap` frees them")
        return 1
    env = environment(cfg)
    argv = command(cfg, secrets_file=write_secrets(cfg, env))
    key = env.pop(API_KEY_ENV, None)  # in the 0600 file now; /proc/<pid>/environ is the owner's, but no need
    _log.info(f"{'start' if key else 'exec'} {shlex.join(argv)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, "
              f"HF_HOME={env['HF_HOME']})")
    if key:
        return run_masked(argv, env, key)
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


def run_masked(argv: list[str], env: dict[str, str], secret: str) -> int:
    """SGLang logs `server_args=ServerArgs(..., api_key='<the key>', ...)` at start-up
    (entrypoints/engine.py:648), and its log goes to the container's stdout and the volume. With a
    key, this stays SGLang's parent (same process group: supervisord's stop reaches both) and
    passes its output on, line by line, with the key replaced; signals are handed on."""
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def forward(sig, _frame):
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    masked, out = secret.encode(), sys.stdout.buffer
    for line in iter(child.stdout.readline, b""):
        out.write(line.replace(masked, b"***"))
        out.flush()
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc
