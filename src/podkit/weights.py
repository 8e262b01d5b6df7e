"""The model's weights on the volume before the pod needs them: `podkit weights` fills the Hugging Face cache
on the volume (HF_HOME, <workspace>/hf) with inference.model from the hub, or copies a local model
directory onto the volume (`--from DIR`) and says which inference.model then names it. Run it on a pod
of the run's network volume (a cheap CPU pod will do) before the GPU pod starts: the GPU pod then loads
the weights from the volume instead of paying for a download at start.

`where(cfg)` is what preflight asks: where the weights will come from at start (a local directory, the
volume's cache, or a download), so a boot that will download them says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from podkit import log
from podkit.errors import ConfigError, PodkitError

_log = log.get("weights")
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".gguf")


def hf_home(cfg, environ=None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get("HF_HOME") or cfg.workspace_path / "hf")


def is_local(model: str) -> bool:
    return model.startswith(("/", "./", "../")) or os.path.isdir(model)


def cached(cfg, environ=None) -> Path | None:
    """The cache snapshot of inference.model on the volume that holds weights, or None."""
    model = cfg.inference.model
    repo = hf_home(cfg, environ) / "hub" / f"models--{model.replace('/', '--')}" / "snapshots"
    try:
        snapshots = sorted(repo.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    return next((s for s in snapshots if has_weights(s)), None)


def has_weights(d: Path) -> bool:
    try:
        return (d / "config.json").exists() and any(p.name.endswith(WEIGHT_FILES) for p in d.iterdir())
    except OSError:
        return False


def where(cfg, environ=None) -> str:
    """local | cached | download: where inference.model's weights come from at this start."""
    model = cfg.inference.model
    if is_local(model):
        return "local"
    return "cached" if cached(cfg, environ) else "download"


def fill(cfg, source: str | None = None, environ=None) -> str:
    """Put inference.model's weights on the volume; returns what inference.model should name."""
    import shutil  # here: preflight imports this module on the boot path, and shutil pulls in compressors

    model = cfg.inference.model
    if source:
        src = Path(source)
        if not src.is_dir() or not has_weights(src):
            raise ConfigError("command line", "--from", f"{source}: not a model directory (config.json and weights)",
                              hint="a directory as save_pretrained writes it")
        dest = cfg.workspace_path / "models" / src.resolve().name
        if dest.exists():
            raise PodkitError(f"{dest} exists: it is kept (nothing on the volume is overwritten)",
                              f"set inference.model: {dest}, or remove it yourself first")
        tmp = dest.with_name(f".{dest.name}.copying")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, symlinks=False)
        os.rename(tmp, dest)  # a copy cut short leaves a hidden .copying directory, never a half model
        _log.info(f"copied {src} to {dest}: set inference.model: {dest} (PODKIT_INFERENCE_MODEL)")
        return str(dest)
    if is_local(model):
        _log.info(f"inference.model {model} is a directory: nothing to fetch")
        return model
    if (snap := cached(cfg, environ)) is not None:
        _log.info(f"{model} is already on the volume ({snap})")
        return model
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise PodkitError("huggingface_hub is not installed here", "run `podkit weights` in the image (on a pod), "
                          "or pip install huggingface_hub") from None
    home = hf_home(cfg, environ)
    _log.info(f"downloading {model} into {home} (HF_TOKEN from the environment for a gated model)")
    path = snapshot_download(model, cache_dir=str(home / "hub"))
    _log.info(f"{model} is on the volume: {path}")
    return model


def main(cfg, source: str | None) -> int:
    fill(cfg, source)
    return 0
