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
    """trainer.overrides as {key: value} (Hydra's key=, +key=, ++key=; the last wins); a dict value's own keys
    as section.key too (a flat `{k:v}` only: the fast path, the trainer checks what AReaL ends up with)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return {}
    out = {}
    for word in words:
        key, eq, value = word.partition("=")
        if eq and not key.startswith("~"):
            key = key.lstrip("+")
            inner = value.strip()
            if inner.startswith("{") and inner.endswith("}"):  # Hydra's dict: recover={mode:disabled,freq_steps:1}
                for part in inner[1:-1].split(","):
                    k, colon, v = part.partition(":")
                    if colon and k.strip():
                        out[f"{key}.{k.strip()}"] = v.strip().strip("'\"")
            out[key] = value
    return out


def deleted(text: str) -> list[str]:
    """Keys trainer.overrides deletes (Hydra's ~key, ~key=value): AReaL's default takes their place."""
    try:
        words = shlex.split(text)
    except ValueError:
        return []
    return [w[1:].partition("=")[0] for w in words if w.startswith("~") and len(w) > 1]
