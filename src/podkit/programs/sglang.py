"""`podkit run sglang` with inference.kind sglang: SGLang's command line from the pod config, then exec.

SGLang spawns scheduler subprocesses that hold the GPUs; supervisord stops them as one process group.
A restart can still begin while the old group lets go of the devices, and a second server on a busy GPU
fails with "CUDA-capable device(s) is/are busy or unavailable", so the start waits (bounded) until nothing
else holds the inference GPUs' device files.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time

from podkit import log

_log = log.get("sglang")
API_KEY_ENV = "SGLANG_API_KEY"  # a secret: from the env file / RunPod secret, never the YAML


def command(cfg, environ: dict[str, str] | None = None, python: str | None = None) -> list[str]:
    """argv for SGLang's server. Every flag here is checked by SGLang's own parser in the test suite."""
    environ = os.environ if environ is None else environ
    inf = cfg.inference
    argv = [python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", inf.model,
            "--host", inf.host,
            "--port", str(inf.port),
            "--tp-size", str(inf.tp),
            "--mem-fraction-static", f"{inf.mem_fraction_static:g}",
            "--attention-backend", inf.attention_backend,
            "--random-seed", str(cfg.trainer.seed)]  # the trainer's seed: sampling repeats across restarts
    if inf.context_length:
        argv += ["--context-length", str(inf.context_length)]
    if inf.cuda_graph_max_bs:
        argv += ["--cuda-graph-max-bs", str(inf.cuda_graph_max_bs)]
    if environ.get(API_KEY_ENV):
        argv += ["--api-key", environ[API_KEY_ENV]]
    return argv + shlex.split(inf.extra_args)


def redacted(argv: list[str]) -> str:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return shlex.join(out)


def environment(cfg, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env["CUDA_VISIBLE_DEVICES"] = cfg.inference.gpus
    # Model downloads go to the volume: a restarted pod does not fetch the weights again.
    env.setdefault("HF_HOME", str(cfg.workspace_path / "hf"))
    return env


def device_files(cfg) -> list[str]:
    """The inference GPUs' device files (/dev/nvidiaN for each N in inference.gpus). /dev/nvidiactl is
    left out: every CUDA process holds it, the trainer's too."""
    from podkit.reap import match_devices

    wanted = {g.strip() for g in cfg.inference.gpus.split(",") if g.strip()}
    return [d for d in match_devices(cfg.devices)
            if (m := re.search(r"nvidia(\d+)$", d)) and m.group(1) in wanted]


def _trainer_group(cfg) -> int | None:
    """The process group supervisord started the trainer in (each program has its own)."""
    from podkit.programs import program_info

    info = program_info(cfg, "trainer")
    try:
        return os.getpgid(info["pid"]) if info and info["pid"] else None
    except ProcessLookupError:
        return None


def wait_devices_free(cfg, timeout_s: float, interval: float = 0.5) -> list:
    """Holders still on the inference GPUs after `timeout_s` (empty: free)."""
    from podkit.reap import describe, scan

    devices = device_files(cfg)
    if not devices:
        return []
    sharing = _trainer_group(cfg)  # on a shared GPU (configs/a40-1gpu.yaml) the running trainer holds it too
    until = time.monotonic() + timeout_s
    told = False
    while True:
        holders = [h for h in scan(devices, deadline_s=10.0)[0] if h.pgid != sharing]
        if not holders or time.monotonic() >= until:
            return holders
        if not told:
            _log.info(f"waiting up to {timeout_s:.0f}s for {len(holders)} process(es) to let go of "
                      f"{', '.join(devices)}: " + "; ".join(describe(h) for h in holders[:3]))
            told = True
        time.sleep(interval)


def problems(cfg, environ: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(key, what is wrong, hint) for a setup where SGLang would fail or expose itself."""
    environ = os.environ if environ is None else environ
    from podkit.preflight import loopback

    out = []
    if not loopback(cfg.inference.host) and not environ.get(API_KEY_ENV):
        out.append(("inference.host", f"{cfg.inference.host} exposes SGLang beyond this machine without an API key",
                    f"set {API_KEY_ENV} (env file or RunPod secret), or bind 127.0.0.1"))
    n = len([g for g in cfg.inference.gpus.split(",") if g.strip()])
    if n != cfg.inference.tp:
        out.append(("inference.tp", f"is {cfg.inference.tp} but inference.gpus {cfg.inference.gpus!r} names {n} GPU(s)",
                    "SGLang runs one tensor-parallel rank per GPU; make them agree"))
    try:
        shlex.split(cfg.inference.extra_args)
    except ValueError as e:
        out.append(("inference.extra_args", f"cannot be split like a shell line: {e}", "check the quoting"))
    return out


def main(cfg) -> int:
    from podkit.programs import refused

    if refused(cfg, problems(cfg), _log):
        return 2
    held = wait_devices_free(cfg, cfg.inference.gpu_free_timeout_s)
    if held:
        from podkit.reap import describe

        _log.error("the inference GPUs are still held, SGLang would fail with 'CUDA-capable device(s) is/are "
                   "busy or unavailable': " + "; ".join(describe(h) for h in held)
                   + " — `podkit reap --dry-run` lists them; `podkit reap` frees them")
        return 1
    argv = command(cfg)
    env = environment(cfg)
    _log.info(f"exec {redacted(argv)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, "
              f"HF_HOME={env['HF_HOME']})")
    os.execvpe(argv[0], argv, env)
    return 127  # not reached
