"""Secrets, told apart and taken out: what `podkit deploy` refuses to find written literally in a
template, and what `podkit doctor --bundle` removes from everything it gathers."""

from __future__ import annotations

import base64
import json
import re

from podkit.remote import rclonesecrets

SECRET_PREFIXES = ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "hf_", "rpa_", "sk-", "sk_live_",
                   "xoxb-", "xoxp-", "glpat-", "AKIA", "ASIA")
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|WEBHOOK)",
                         re.I)
# The secrets podkit itself reads from the environment, whatever their names say (tests/views/test_bundle.py
# holds every such constant of podkit's to this list).
PODKIT_SECRET_ENV = ("SGLANG_API_KEY", "PODKIT_METRICS_KEY", "PODKIT_NOTIFY_WEBHOOK_URL", "RUNPOD_API_KEY")


def secret_name(name: str, environ=None) -> bool:
    """The one rule for which variable holds a secret: podkit's own, a name that says so, or one rclone reads a
    secret option from (its backend marks it IsPassword or Sensitive: RCLONE_CONFIG_<REMOTE>_KEY of B2 and Azure,
    _PASS, _SAS_URL, RCLONE_CONFIG_PASS; `environ` tells the remote's type, rclonesecrets.py)."""
    return name in PODKIT_SECRET_ENV or bool(SECRET_NAME.search(name)) or rclonesecrets.secret_env(name, environ)


_URL_CREDENTIALS = re.compile(r"(://)[^/\s:@'\"]+:(?:<redacted[^>]*>|[^/\s@'\"]+)@")
# s3://KEY:SECRET@bucket: an AWS secret may hold '/' (a bucket never holds ':' nor '@')
_S3_CREDENTIALS = re.compile(r"(?i)(s3://)[A-Za-z0-9_.-]+:[^\s@'\"]+@")
# A long user part alone is a token used as the user (https://TOKEN@github.com/...), as git allows.
_URL_TOKEN_USER = re.compile(r"(://)[^/\s:@'\"<>]{16,}@")
_PREFIXED = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(map(re.escape, SECRET_PREFIXES)) + r")[A-Za-z0-9_\-]{8,}")
# The name part is bounded and anchored, so a long run of name characters costs linear time, not quadratic.
_KEY_VALUE = re.compile(r"""(?i)((?<![A-Za-z0-9_.-])[A-Za-z0-9_.-]{0,64}?(?:token|secret|password|passwd|"""
                        r"""api[_-]?key|access[_-]?key|private[_-]?key|credential|webhook[_-]?url|cookie)"""
                        r"""['"]?\s*[:=]\s*)(?!['"]?<redacted)("[^"\n]{1,512}"|'[^'\n]{1,512}'|[^\s'",}]{4,512})""")
_AUTHORIZATION = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?\w+ )[^\s'\",}]+")
# A value this short or plain (true, 4096) under a secret-sounding name (TOKENIZERS_PARALLELISM, MAX_TOKENS)
# is a setting, not a secret: replacing it everywhere would break the bundle's JSON and hide nothing.
_PLAIN = re.compile(r"^(?:true|false|yes|no|on|off|none|null|-?\d+(?:\.\d+)?)$", re.I)


# A RunPod secret reference, which RunPod fills in when the pod starts.
_REFERENCE = re.compile(r"\{\{\s*RUNPOD_SECRET_[\w.-]+\s*\}\}")
_REF = "\x00"  # what a reference becomes while the rest of the value is read
_URL_USERINFO = re.compile(r"://([^/\s@'\"]*)@")
_PATH = re.compile(r"^(?:/|~/|\./)[^\s]*$")  # HF_TOKEN_PATH: /workspace/hf/token names a file, not a secret
_OPAQUE = re.compile(r"(?=[^\d]*\d)(?=.*[A-Za-z])[A-Za-z0-9_\-]{6,}")  # letters and digits: a key, not a word


def literal_secret(value: str, name: str = "", environ=None) -> str:
    """Why `value` looks like a secret written literally ('' when it does not): credentials inside a
    URL, a known key prefix (also with spaces or quotes around it), or any value under a name that says
    it is secret (a setting such as true or 4096, or a file's path, aside). RunPod secret references are never one, but what is written beside
    them is read as a value of its own (a literal token as a URL's user beside a referenced password).
    `environ` (the template's env) tells an rclone remote's type: an option is secret where its backend says so."""
    v = _REFERENCE.sub(_REF, value).strip().strip("'\"").strip()
    if not v.replace(_REF, "").strip():
        return ""
    if why := _literal_parameter(v, environ):
        return why
    if _REF not in v:
        return _literal(v, name, environ)
    for userinfo in _URL_USERINFO.findall(v):
        user, colon, password = userinfo.partition(":")
        if colon and password and password != _REF:
            return "credentials inside a URL"
        if user != _REF and any(user.startswith(p) for p in SECRET_PREFIXES):
            return "a token as a URL's user"
    for piece in (p.strip(" \t'\":;,=@/") for p in v.split(_REF)):
        for prefix in SECRET_PREFIXES:
            if piece.startswith(prefix) and len(piece) >= len(prefix) + 8:
                return f"starts with {prefix}" if piece == v else f"{prefix}... beside a RunPod secret reference"
        if name and secret_name(name, environ) and _OPAQUE.fullmatch(piece):
            return f"a literal value under {name}"
    return ""


def _literal_parameter(v: str, environ=None) -> str:
    """A secret parameter of an rclone connection string (`:b2,key=...:bucket`) written literally."""
    try:
        parts = rclonesecrets.split(v)
    except rclonesecrets.Invalid:
        return ""
    if parts is None:
        return ""
    for p, value in rclonesecrets.secret_values(v, environ):  # the remotes it wraps too (a crypt over :b2,...)
        if not p.endswith("user credentials") and value.replace(_REF, "").strip(" '\""):
            return f"a literal {p} in an rclone connection string"
    return ""


def _literal(v: str, name: str, environ=None) -> str:
    """The rule for a value without references, read whole."""
    if _URL_CREDENTIALS.search(v) or _S3_CREDENTIALS.search(v) or any(
            k == "password" for k, _ in rclonesecrets.url_credentials(v)):  # any scheme, a password holding '/'
        return "credentials inside a URL"
    for prefix in SECRET_PREFIXES:
        if v.startswith(prefix) and len(v) >= len(prefix) + 8:
            return f"starts with {prefix}"
    if name and rclonesecrets.secret_env(name, environ):  # rclone's own (RCLONE_CONFIG_PASS=40817263): any value
        return f"a literal value under {name}"
    if name and secret_name(name, environ) and not _PLAIN.match(v) and not _PATH.match(v):
        return f"a literal value under {name}"  # whatever its length: a short password is still one
    return ""


def _url_pieces(value: str) -> list[str]:
    """The secret-bearing pieces of a URL value: its user and password, and path segments and query
    values long enough to be tokens (12 characters or more)."""
    from urllib.parse import parse_qsl, urlsplit

    if "://" not in value:
        return []
    try:
        u = urlsplit(value.strip())
        user, password = u.username, u.password
    except ValueError:
        return []
    pieces = [p for p in (user, password) if p and len(p) >= 6]
    pieces += [seg for seg in u.path.split("/") if len(seg) >= 12]
    pieces += [v for _, v in parse_qsl(u.query) if len(v) >= 12]
    return pieces


def go_quoted(v: str) -> str:
    """`v` as Go's strconv.Quote writes it, without the quotes (rclone's errors quote a value with %q: a SAS
    URL ending in a carriage return is `...sig=abc\\r` there, not the raw value)."""
    named = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
             "\v": "\\v", "\\": "\\\\", '"': '\\"'}
    out = []
    for c in v:
        if c in named:
            out.append(named[c])
        elif c.isprintable() or c == " ":
            out.append(c)
        elif ord(c) < 0x80:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return "".join(out)


def forms(v: str) -> list[str]:
    """The ways a text may carry the secret `v`: as is, in a JSON string, Go-quoted (rclone's %q), and
    URL-encoded; longest first, so a form that holds another is replaced whole."""
    from urllib.parse import quote, quote_plus

    # surrogateescape: a value read from the environment with a byte that is not UTF-8 (os.fsdecode's \udcff)
    found = {v, json.dumps(v)[1:-1], json.dumps(v, ensure_ascii=False)[1:-1], go_quoted(v),
             quote(v, safe="", errors="surrogateescape"), quote_plus(v, errors="surrogateescape")}
    return sorted(found, key=lambda f: (-len(f), f))


class Redactor:
    """Takes every known secret value out of a text, then whatever has a secret's shape: credentials
    inside URLs, known key prefixes, and the value of `key=value` or `"key": "value"` under a secret name."""

    def __init__(self, values: dict[str, str], always: frozenset[str] = frozenset()) -> None:
        """`values`: {what it is: the secret}; those named in `always` are secrets whatever they look like (rclone's
        config password may be 40817263), the others only when they are no setting word (true, 4096)."""
        found: dict[str, str] = {}
        for name, v in values.items():
            if not v or len(v) < 6 or name not in always and _PLAIN.match(v.strip()):
                continue
            # The value as a log, a JSON string, a Go-quoted error, a URL or base64 may carry it; a secret URL's
            # pieces travel alone too (an error quoting its password as a "port", its token path).
            b64 = base64.b64encode(v.encode(errors="surrogateescape")).decode().rstrip("=")
            for part in (v, *_url_pieces(v)):
                for form in forms(part):
                    found.setdefault(form, name)
            found.setdefault(b64, name)
            found.setdefault(b64.replace("+", "-").replace("/", "_"), name)
        # Longest first, so a secret that contains another is replaced whole.
        self.values = sorted(found.items(), key=lambda x: -len(x[0]))  # (form, name)
        self.longest = max((len(v) for v, _ in self.values), default=0)

    @classmethod
    def for_pod(cls, cfg, environ) -> Redactor:
        """The config's credentials (a token split out of repo.url) and every variable of `environ` whose
        name says secret."""
        secrets = getattr(cfg, "secrets", {})
        # A user with no password is the token itself (https://TOKEN@host/...).
        values = {f"config {k}": str(v) for k, v in secrets.items() if k != "repo.user" or "repo.token" not in secrets}
        values.update({f"env {k}": v for k, v in environ.items() if secret_name(k, environ)})
        always = {f"env {k}" for k in environ if rclonesecrets.secret_env(k, environ)}
        for k, v in environ.items():  # a remote's secrets inside another value (RCLONE_CONFIG_X_REMOTE=:b2,key=...)
            if "," in v or "://" in v:
                for p, secret in rclonesecrets.secret_values(v, environ):
                    values.setdefault(f"env {k} {p}", secret)
                    always.add(f"env {k} {p}")
        return cls(values, frozenset(always))

    def __call__(self, text: str) -> str:
        for value, name in self.values:
            text = text.replace(value, f"<redacted: {name}>")
        text = _S3_CREDENTIALS.sub(r"\1<redacted>@", text)
        text = _URL_CREDENTIALS.sub(r"\1<redacted>@", text)
        text = _URL_TOKEN_USER.sub(r"\1<redacted>@", text)
        text = _PREFIXED.sub("<redacted>", text)
        text = _AUTHORIZATION.sub(lambda m: m.group(1) + "<redacted>", text)
        text = rclonesecrets.redact_text(text)  # an rclone connection string's secret parameters
        return _KEY_VALUE.sub(lambda m: m.group(1) + "<redacted>", text)
