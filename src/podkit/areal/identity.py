"""Run identity: which run this is, by the user's names, and whether a checkpoint on the volume is its own.

A network volume outlives pods and holds many runs. AReaL names every directory of a run (checkpoints,
recover info, logs, W&B's id) by `experiment_name` and `trial_name`, so those names, the user's, are the
run's identity. They come from, last wins: podkit's defaults (trainer.experiment/trial), the AReaL YAML's
own names, podkit's trainer.experiment/trial when the user set them (config file or env), and
trainer.overrides. The launcher passes the result to AReaL, so both read the same names.

Names of one run can still meet another run's checkpoint (AReaL's example YAML and the user's own script
both called gsm8k-grpo/trial0): each run's checkpoint directory carries a record of what trained it
(RECORD), and a trainer whose run differs in anything but the commit does not resume it (check).
Stdlib only at import: the launcher, reap and status import it.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import time
from pathlib import Path

from podkit import config

_LAYER = re.compile(r"\.layers\.(\d+)\.")
RECORD = "podkit-run.json"  # in AReaL's save root of the run: <fileroot>/checkpoints/<user>/<exp>/<trial>
NAME_KEYS = {"experiment": "experiment_name", "trial": "trial_name"}


class Names:
    """The run's names and where each came from: {name: (where, key)} for the log line and a config error."""

    def __init__(self, experiment: str, trial: str, origins: dict[str, tuple[str, str]]) -> None:
        self.experiment, self.trial, self.origins = experiment, trial, origins

    def __str__(self) -> str:
        return f"{self.experiment}/{self.trial}"

    def problems(self) -> list[tuple[str, str, str]]:
        """(key, what, hint) for each name that is not one safe path component."""
        out = []
        for ours, theirs in NAME_KEYS.items():
            where, key = self.origins[ours]
            try:
                config.check_name(getattr(self, ours), where, theirs)
            except config.ConfigError as e:
                out.append((key, f"{theirs} {e.problem} (from {where})",
                            f"AReaL names the run's directories by {theirs}: a plain name such as myrepo-v2"))
        return out


def _yaml_names(cfg) -> dict:
    """The AReaL YAML's top-level names, when it can be read ({} otherwise: the checks say why)."""
    if cfg.trainer.kind != "areal" or not cfg.trainer.areal_config:
        return {}
    try:
        import yaml

        with open(cfg.trainer.areal_config, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - unreadable YAML: checks.areal names it; the names fall back
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in NAME_KEYS.values() if isinstance(data.get(k), (str, int)) and not
            isinstance(data.get(k), bool)}


def _override_names(overrides: str) -> dict:
    """experiment_name / trial_name set in trainer.overrides (Hydra: key=, +key=, ++key=; the last wins)."""
    try:
        words = shlex.split(overrides)
    except ValueError:
        return {}
    out = {}
    for w in words:
        key, eq, value = w.lstrip("+").partition("=")
        if eq and key in NAME_KEYS.values():
            out[key] = value
    return out


def names(cfg) -> Names:
    """The run's names: see the module's docstring for the order."""
    t = cfg.trainer
    found = {ours: (getattr(t, ours), ("podkit's default", f"trainer.{ours}")) for ours in NAME_KEYS}
    from_yaml, from_overrides = _yaml_names(cfg), _override_names(t.overrides)
    for ours, theirs in NAME_KEYS.items():
        if theirs in from_yaml:
            found[ours] = (str(from_yaml[theirs]), (f"{t.areal_config}", "trainer.areal_config"))
        if cfg.origin(f"trainer.{ours}") != "defaults":
            found[ours] = (getattr(t, ours), (cfg.origin(f"trainer.{ours}"), f"trainer.{ours}"))
        if theirs in from_overrides:
            found[ours] = (from_overrides[theirs], ("trainer.overrides", "trainer.overrides"))
    return Names(found["experiment"][0], found["trial"][0], {k: v[1] for k, v in found.items()})


# --- the checkpoint's owner -----------------------------------------------------------------------------


def save_root(fileroot: str, experiment: str, trial: str, user: str | None = None) -> Path:
    """AReaL's Saver.get_save_root, without creating it."""
    return Path(fileroot) / "checkpoints" / (user or getpass.getuser()) / experiment / trial


def repo_of(url: str) -> str:
    """A repo URL as an identity: no credentials, no trailing '.git' or '/', host in lower case."""
    url = url.strip()
    if "://" in url:
        scheme, _, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        url = f"{scheme}://{host.rpartition('@')[2].lower()}{slash}{path}"
    return url.rstrip("/").removesuffix(".git")


def model_shape(path: str) -> dict:
    """hidden size, layers and vocabulary from a local model's config.json ({} when not local or unreadable)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    data = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data
    out = {"hidden_size": data.get("hidden_size"), "layers": data.get("num_hidden_layers"),
           "vocab": data.get("vocab_size")}
    return {k: v for k, v in out.items() if isinstance(v, int) and not isinstance(v, bool)}


def checkpoint_shape(recover_dir: Path) -> dict:
    """What a recover checkpoint (torch DCP) says of its model: the embedding's [vocab, hidden] and the
    number of layers ({} when it cannot be read: a checkpoint in another format, or torch missing)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(recover_dir)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: nothing can be said of it
        return {}
    out, layers = {}, set()
    for key, m in meta.items():
        size = getattr(m, "size", None)
        if key.endswith("embed_tokens.weight") and size is not None and len(size) == 2:
            out.update(vocab=int(size[0]), hidden_size=int(size[1]))
        if (m_ := _LAYER.search(key)) is not None:
            layers.add(int(m_.group(1)))
    if layers:
        out["layers"] = max(layers) + 1
    return out


def record_for(names: tuple[str, str], entry: str, model: str, repo: str, commit: str = "") -> dict:
    """What trained a run's checkpoints: written beside them when training starts."""
    return {"names": list(names), "entry": entry, "model": {"path": model, "shape": model_shape(model)},
            "repo": repo_of(repo) if repo else "", "commit": commit, "time": time.time()}


def read_record(root: Path) -> dict | None:
    """The record of the run that owns `root`, or None (absent, or not one: corrupt, planted, too big)."""
    p = root / RECORD
    try:
        if p.is_symlink() or p.stat().st_size > 65536:
            return None
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (isinstance(data, dict) and isinstance(data.get("names"), list) and len(data["names"]) == 2
          and all(isinstance(n, str) for n in data["names"]) and isinstance(data.get("entry"), str)
          and isinstance(data.get("model"), dict) and isinstance(data["model"].get("path"), str)
          and isinstance(data["model"].get("shape", {}), dict) and isinstance(data.get("repo"), str))
    return data if ok else None


def write_record(root: Path, record: dict) -> None:
    from podkit.records import write_json

    root.mkdir(parents=True, exist_ok=True)
    write_json(root / RECORD, record)


def has_checkpoint(root: Path) -> bool:
    """AReaL resumes when the save root holds recover info (RecoverInfo.load reads step_info.json first)."""
    return (root / "recover_info" / "step_info.json").is_file()


def differences(mine: dict, theirs: dict | None, root: Path) -> list[str]:
    """How the run that owns `root` differs from this one, the commit aside (a new commit of the same repo is
    the normal fix-and-push, and resumes). Without a record (a checkpoint from before podkit kept one), only
    what the checkpoint itself says: its model's shape."""
    out = []
    if theirs is not None:
        if theirs["names"] != mine["names"]:
            out.append(f"its names are {'/'.join(theirs['names'])}, this run's {'/'.join(mine['names'])}")
        if theirs["entry"] != mine["entry"]:
            out.append(f"it was trained by {theirs['entry']}, this run runs {mine['entry']}")
        if Path(theirs["model"]["path"]).name != Path(mine["model"]["path"]).name:
            out.append(f"its model is {theirs['model']['path']}, this run's {mine['model']['path']}")
        if theirs["repo"] != mine["repo"]:
            out.append(f"it came from the repo {theirs['repo'] or '(none: podkit example)'}, this run from "
                       f"{mine['repo'] or '(none: podkit example)'}")
        shape = theirs["model"].get("shape") or {}
    else:
        shape = checkpoint_shape(root / "default" / "recover_checkpoint")
    ours = mine["model"].get("shape") or {}
    wrong = [f"{k} {shape[k]} (this model: {ours[k]})" for k in ("hidden_size", "layers", "vocab")
             if k in shape and k in ours and shape[k] != ours[k]]
    if wrong:
        out.append("its model has " + ", ".join(wrong))
    return out


def start_over(cfg, dry_run: bool = False, say=print) -> int:
    """`podkit start-over`: this run's checkpoints (AReaL's save root under its names) moved aside beside
    them, kept, never deleted; then the trainer started again if the pod runs. For a run that found
    another run's checkpoint under its names (check_run in hooks.py), or a user who wants step 0."""
    from podkit import supervisord
    from podkit.areal.command import fileroot
    from podkit.errors import ConfigError, PodkitError

    run = names(cfg)
    for key, what, hint in run.problems():
        raise ConfigError(cfg.origin(key), key, what, hint=hint)
    root = save_root(fileroot(cfg), run.experiment, run.trial)
    info = supervisord.process_info(cfg.socket_path, "trainer")
    if info and info.get("statename") not in supervisord.STOPPED_STATES:
        raise PodkitError(f"the trainer of run {run} is {info.get('statename')}: its checkpoints are in use",
                          "stop it first (`podkit ctl stop trainer`), then run `podkit start-over` again")
    if not root.is_dir() or root.is_symlink():
        say(f"run {run} has no checkpoints at {root}: it starts from step 0 as it is")
        return 0
    aside = root.with_name(f"{root.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    if dry_run:
        say(f"would move {root} to {aside}")
        return 0
    os.rename(root, aside)  # one directory, same filesystem: all of it or nothing
    say(f"moved the checkpoints of run {run} aside: {aside} (nothing deleted; move it back to resume it)")
    if info is not None:
        try:
            supervisord.rpc(cfg.socket_path).supervisor.startProcess("trainer", False)
            say(f"started the trainer: it trains run {run} from step 0")
        except Exception as e:  # noqa: BLE001 - xmlrpc faults and socket errors alike: the move stands
            say(f"could not start the trainer ({e}): `podkit ctl start trainer`")
    return 0
