"""The user's AReaL config as data: their YAML (trainer.areal_config) and their trainer.overrides, read the
one way that checks (what podkit sets, the run's shape) and identity (the run's names) both read them.
Stdlib only at import (the YAML parser only when a YAML is read): checks imports it on demand."""

from __future__ import annotations

import shlex


def areal_yaml(cfg):
    """The AReaL YAML as data, or the error that kept it from being read."""
    import yaml  # the AReaL YAML is read only where an AReaL trainer is configured

    try:
        with open(cfg.trainer.areal_config, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: bytes that are not UTF-8
        return e


def overridden(text: str) -> dict[str, str]:
    """trainer.overrides as {key: value} (Hydra's key=, +key=, ++key=; the last wins)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return {}
    out = {}
    for word in words:
        key, eq, value = word.partition("=")
        if eq and not key.startswith("~"):
            out[key.lstrip("+")] = value
    return out
