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
    model = cfg.inference.model
    if source:
        return str(copy_in(cfg, Path(source)))
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


def _kept(dest: Path) -> None:
    if dest.exists():
        raise PodkitError(f"{dest} exists: it is kept (nothing on the volume is overwritten)",
                          f"set inference.model: {dest}, or remove it yourself first")


def copy_in(cfg, src: Path) -> Path:
    """Copy a local model directory to <workspace>/models/<name>, each file once: a link to a directory (a
    loop back up, or a second path to what is copied anyway) and a link out of the directory are skipped and
    named; a failed copy removes its own temporary directory and nothing else."""
    import shutil  # here: preflight imports this module on the boot path, and shutil pulls in compressors
    import tempfile

    if not src.is_dir() or not has_weights(src):
        raise ConfigError("command line", "--from", f"{src}: not a model directory (config.json and weights)",
                          hint="a directory as save_pretrained writes it")
    dest = cfg.workspace_path / "models" / src.resolve().name
    _kept(dest)
    if _under(os.path.realpath(dest.parent), [os.path.realpath(src)]):  # the copy would copy itself
        raise ConfigError("command line", "--from", f"{src} holds the destination {dest.parent}",
                          hint="a model directory outside the workspace's models/")
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Its own name: another copy of the same model in progress keeps its directory.
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".copying", dir=dest.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep the model from a server running as another user
        skipped = _copy_tree(src, tmp, shutil.copyfile)
        for what in skipped:
            _log.warn(f"not copied: {what}")
        if not has_weights(tmp):
            raise PodkitError(f"{src}: without the {len(skipped)} link(s) skipped it is not a model (config.json "
                              f"and weights): {'; '.join(skipped[:3])}", "copy the files themselves into the "
                              "directory, not links to elsewhere")
        _kept(dest)  # made meanwhile: a rename would replace an empty directory
        os.rename(tmp, dest)
    except BaseException as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full volume, an unreadable file
            raise PodkitError(f"copying {src} to {dest} failed: {e}", "free space on the volume (df -h "
                              f"{dest.parent}) or fix what is named, then run it again") from None
        raise
    _log.info(f"copied {src} to {dest}: set inference.model: {dest} (PODKIT_INFERENCE_MODEL)")
    return dest


def _copy_tree(src: Path, dst: Path, copyfile) -> list[str]:
    """src's regular files and directories into dst (made); a link to a file is copied as that file when
    the file is inside src, or in the blobs of the Hugging Face cache repo src is a snapshot of (the cache's
    own layout). A file reached by several paths (links, hard links) is copied once. Returns what was
    skipped, each with why."""
    root = os.path.realpath(src)
    inside = [root]
    if Path(root).parent.name == "snapshots" and Path(root).parent.parent.name.startswith("models--"):
        inside.append(str(Path(root).parent.parent / "blobs"))
    skipped: list[str] = []
    seen: set[tuple[int, int]] = set()  # a directory mounted inside itself is walked once
    copied: dict[tuple[int, int], Path] = {}  # each file's first copy: its other paths are hard links to it

    def copy(path, to: Path) -> None:
        st = os.stat(path)
        first = copied.setdefault((st.st_dev, st.st_ino), to)
        if first is not to:
            try:
                return os.link(first, to)
            except OSError:
                pass  # a file system without hard links: a copy of its own
        copyfile(path, to)
    todo = [(src, dst)]
    while todo:
        here, there = todo.pop()
        st = os.stat(here, follow_symlinks=False)
        if (st.st_dev, st.st_ino) in seen:
            skipped.append(f"{here} (the same directory as one already copied)")
            continue
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(here) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            path, to = Path(e.path), there / e.name
            if e.is_symlink():
                target = os.path.realpath(path)
                if os.path.isdir(target):
                    why = "a loop: a link back to a directory above it" if \
                        os.path.commonpath([target, os.path.realpath(here)]) == target else \
                        ("a second path to a directory copied at its own place" if _under(target, [root])
                         else f"a link to a directory out of {src}")
                    skipped.append(f"{path} -> {target} ({why})")
                elif not _under(target, inside):
                    skipped.append(f"{path} -> {target} (a link out of {src})")
                elif not os.path.isfile(target):
                    skipped.append(f"{path} -> {target} (broken, or not a regular file)")
                else:
                    copy(target, to)
            elif e.is_dir(follow_symlinks=False):
                to.mkdir()
                todo.append((path, to))
            elif e.is_file(follow_symlinks=False):
                copy(path, to)
            else:
                skipped.append(f"{path} (not a regular file: a pipe, socket or device)")
    return skipped


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def main(cfg, source: str | None) -> int:
    fill(cfg, source)
    return 0
