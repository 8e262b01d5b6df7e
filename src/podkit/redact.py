"""Secrets, told apart and taken out: what `podkit deploy` refuses to find written literally in a
template, and what `podkit doctor --bundle` removes from everything it gathers."""

from __future__ import annotations

import re

SECRET_PREFIXES = ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "hf_", "rpa_", "sk-", "sk_live_",
                   "xoxb-", "xoxp-", "glpat-", "AKIA", "ASIA")
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|WEBHOOK)",
                         re.I)
_URL_CREDENTIALS = re.compile(r"(://)[^/\s:@'\"]+:(?:<redacted[^>]*>|[^/\s@'\"]+)@")
_PREFIXED = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(map(re.escape, SECRET_PREFIXES)) + r")[A-Za-z0-9_\-]{8,}")
_KEY_VALUE = re.compile(r"""(?i)([A-Za-z0-9_.-]*(?:token|secret|password|passwd|api[_-]?key|access[_-]?key|"""
                        r"""private[_-]?key|credential|webhook[_-]?url)['"]?\s*[:=]\s*['"]?)(?!<redacted)([^\s'",}]{4,})""")


def literal_secret(value: str, name: str = "") -> str:
    """Why `value` looks like a secret written literally ('' when it does not): credentials inside a
    URL, a known key prefix (also with spaces or quotes around it), or a long opaque value under a
    name that says it is secret. A RunPod secret reference is never one."""
    v = value.strip().strip("'\"").strip()
    if not v or "RUNPOD_SECRET_" in v:
        return ""
    if re.search(r"://[^/\s:@]+:[^/\s@]+@", v):
        return "credentials inside a URL"
    for prefix in SECRET_PREFIXES:
        if v.startswith(prefix) and len(v) >= len(prefix) + 8:
            return f"starts with {prefix}"
    if name and SECRET_NAME.search(name) and len(v) >= 16 and " " not in v:
        return f"a long value under {name}"
    return ""


class Redactor:
    """Takes every known secret value out of a text, then whatever has a secret's shape: credentials
    inside URLs, known key prefixes, and the value of `key=value` or `"key": "value"` under a secret name."""

    def __init__(self, values: dict[str, str]) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self.values = sorted(((v, k) for k, v in values.items() if v and len(v) >= 4), key=lambda x: -len(x[0]))

    @classmethod
    def for_pod(cls, cfg, environ) -> Redactor:
        """The config's credentials (a token split out of repo.url) and every variable of `environ` whose
        name says secret."""
        values = {f"config {k}": str(v) for k, v in getattr(cfg, "secrets", {}).items() if k != "repo.user"}
        values.update({f"env {k}": v for k, v in environ.items() if SECRET_NAME.search(k)})
        return cls(values)

    def __call__(self, text: str) -> str:
        for value, name in self.values:
            text = text.replace(value, f"<redacted: {name}>")
        text = _URL_CREDENTIALS.sub(r"\1<redacted>@", text)
        text = _PREFIXED.sub("<redacted>", text)
        return _KEY_VALUE.sub(lambda m: m.group(1) + "<redacted>", text)
