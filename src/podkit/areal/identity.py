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
import shlex
from pathlib import Path

from podkit import config

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
                config._check_name(getattr(self, ours), where, theirs)
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
