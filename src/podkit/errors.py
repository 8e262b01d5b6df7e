"""Errors a person can act on: what is wrong, where, and how to fix it."""

from __future__ import annotations


class PodkitError(Exception):
    """A failure with a message for people. `exit_code` follows click: 2 usage/config, 1 runtime."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message + (f"\n  hint: {self.hint}" if self.hint else "")


class ConfigError(PodkitError):
    """A bad setting: names the source (file or env var), the key and what is wrong."""

    exit_code = 2

    def __init__(self, source: str, key: str, problem: str, hint: str = "") -> None:
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}", hint)
        self.source, self.key, self.problem = source, key, problem


class StageError(PodkitError):
    """A boot stage could not do its job; the boot turns it into safe mode, never a fast exit."""

    def __init__(self, stage: str, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.stage = stage
