"""rclone's secrets, as rclone's backends mark them: which environment variable and which connection-string
parameter holds one, and a remote shown with them taken out.

A secret is what the remote's backend says is secret (its options marked IsPassword or Sensitive, the table
rclonesecrets_table.py, generated from the pinned rclone by `python -m podkit.remote.rclonesecrets`), never a list of
names podkit keeps. rclone reads a backend option from:

- `RCLONE_CONFIG_<REMOTE>_<OPTION>` (the remote's type in `RCLONE_CONFIG_<REMOTE>_TYPE` says whose options;
  without it, any backend's secret option counts), and `RCLONE_CONFIG_PASS` (the config file's password);
- `RCLONE_<PREFIX>_<OPTION>`, every remote of that backend (and `RCLONE_<OPTION>` for its global options);
- a connection string, `remote,opt=value,...:path` or `:backend,opt=value,...:path` (rclone's fs/fspath.Parse,
  mirrored by `split`: a value may be quoted with ' or ", a doubled quote inside it is one).

A leaf: only the standard library and the table.
"""

from __future__ import annotations

import re

from podkit.remote.rclonesecrets_table import BACKENDS, GLOBAL

REDACTED = "<redacted>"
# Every secret option of every backend: what a variable or parameter of a remote whose type is unknown is held to.
ANY = frozenset(o for _, opts in BACKENDS.values() for o in opts)
# rclone's config name (fspath's configNameRe): letters, digits, _ . + @, and - or space inside.
NAME = r"[\w.+@]+(?:[ -]+[\w.+@-]+)*"
_PARAM_CHARS = re.compile(r"^[A-Za-z0-9_.]+$")


def backend(type_name: str | None) -> tuple[str, frozenset[str]] | None:
    """(env prefix, secret options) of the backend `type =` names (its name, prefix or alias); None: unknown."""
    found = BACKENDS.get((type_name or "").strip())
    return (found[0], frozenset(found[1])) if found else None


def secrets_of(type_name: str | None) -> frozenset[str]:
    """The options the backend marks secret; an unknown or unsaid type: every backend's."""
    found = backend(type_name)
    return found[1] if found else ANY


def secret_env(name: str, environ=None) -> bool:
    """Whether rclone reads a secret from the environment variable `name` (`environ` tells a remote's type)."""
    up = name.upper()
    if up == "RCLONE_CONFIG_PASS":
        return True
    if up.startswith("RCLONE_CONFIG_"):
        # Every reading counts: remote A_B's option KEY, and remote A's option B_KEY, each held to its own
        # remote's backend (one whose type is not in `environ`, rclone.conf's say: any backend's).
        rest = up[len("RCLONE_CONFIG_"):]
        return any(rest[i + 1:].lower() in secrets_of(_type_of(rest[:i], environ))
                   for i, c in enumerate(rest) if c == "_")
    if up.startswith("RCLONE_"):
        rest = up[len("RCLONE_"):].lower()
        if rest in GLOBAL:
            return True
        return any(rest.startswith(prefix + "_") and rest[len(prefix) + 1:] in opts
                   for prefix, opts in BACKENDS.values())
    return False


def _type_of(remote: str, environ) -> str | None:
    """The type rclone reads for `remote`: RCLONE_CONFIG_<REMOTE>_TYPE, that name exactly (the environment is
    case-sensitive: `rclone_config_x_type` is no variable rclone reads)."""
    return environ.get(f"RCLONE_CONFIG_{remote.upper()}_TYPE") if environ else None


class Invalid(ValueError):
    """A remote rclone would not take; the message never holds a parameter's value."""


def split(remote: str) -> tuple[str, dict[str, str], str] | None:
    """rclone's reading of a remote with parameters: (name, {param: value}, path), the name ":backend" for an
    on-the-fly one; None when `remote` has no parameters (a plain name:path, or no remote). Invalid for what
    rclone refuses, in its words, with no value in them."""
    if ":" not in remote:
        return None  # rclone: a local path
    head = re.match(rf"^(:?{NAME}),", remote)
    if not head:
        if remote.startswith(":") and re.match(r"^:[^:/\\]*,", remote):
            raise Invalid(f"{remote.split(',')[0]!r} is not a backend's name (letters, digits, _ . + @ -)")
        return None
    name, i, params = head.group(1), head.end(), {}
    while True:
        m = re.compile(r"[^,:=]*").match(remote, i)
        param, i = m.group(0), m.end()
        if not param:
            raise Invalid(f"{name}: a parameter without a name (rclone: config parameters can't be empty)")
        if not _PARAM_CHARS.match(param):
            raise Invalid(f"{name}: a parameter name may only hold A-Z a-z 0-9 _ and . (rclone's rule)")
        if i >= len(remote):
            raise Invalid(f"{name}: parameter {param} must end with , or : (rclone's rule)")
        if remote[i] != "=":
            params[param], i = "true", i + 1
        else:
            value, i = _value(remote, i + 1, name, param)
            params[param] = value
        if remote[i - 1] == ":":
            return name, params, remote[i:]


def _value(remote: str, i: int, name: str, param: str) -> tuple[str, int]:
    """A parameter's value from `i`, and the index after the , or : that ends it."""
    if i < len(remote) and remote[i] in "'\"":
        quote, j, out = remote[i], i + 1, []
        while True:
            k = remote.find(quote, j)
            if k < 0:
                raise Invalid(f"{name}: the quoted value of {param} is not closed (rclone's rule)")
            out.append(remote[j:k])
            if remote[k + 1:k + 2] == quote:  # a doubled quote: one, and the value goes on
                out.append(quote)
                j = k + 2
                continue
            if remote[k + 1:k + 2] not in (",", ":"):
                raise Invalid(f"{name}: after the quoted value of {param}, rclone expects , or :")
            return "".join(out), k + 2
    m = re.compile(r"[^,:]*").match(remote, i)
    if m.end() >= len(remote):
        raise Invalid(f"{name}: the value of {param} must end with , or : (rclone's rule)")
    return m.group(0), m.end() + 1


def secret_params(name: str, params: dict[str, str], environ=None) -> list[str]:
    """The parameters of a connection string that the backend marks secret. Its backend: an on-the-fly remote's
    name; a named remote's own `type=` parameter (rclone reads the string's parameters over the remote's
    variables), else its RCLONE_CONFIG_<NAME>_TYPE."""
    own = next((v for p, v in params.items() if p.lower() == "type"), None)
    kind = name[1:] if name.startswith(":") else own if own is not None else _type_of(name.upper(), environ)
    secret = secrets_of(kind)
    return [p for p in params if p.lower() in secret]


# A wrapping backend's parameters that hold other remotes (crypt, alias, chunker, compress, hasher, cache: `remote`;
# union, combine: `upstreams`, space-separated, combine's as dir=remote:path, union's with an optional :ro/:nc).
WRAPS = ("remote", "upstreams")


def _upstreams(value: str) -> list[tuple[str, str]]:
    """A union's or combine's `upstreams` as rclone reads it (fs.SpaceSepList: fields apart by spaces, a field
    may be double-quoted, a doubled quote inside it one): (combine's `dir=`, or '', the remote) each. A field whose
    '=' comes before any ',' or ':' is combine's dir=remote:path (a dir may be any name); a union's remote
    (`:b2,key=...:bucket`, `name:path:ro`) has its ',' or ':' first."""
    import csv

    try:
        fields = next(csv.reader([value], delimiter=" ", quotechar='"', skipinitialspace=True), [])
    except csv.Error:
        fields = value.split()
    out = []
    for f in (f for f in fields if f):
        eq, stop = f.find("="), min((i for i in (f.find(","), f.find(":")) if i >= 0), default=len(f))
        out.append((f[:eq + 1], f[eq + 1:]) if 0 <= eq < stop else ("", f))
    return out


def _inner(param: str, value: str) -> list[str]:
    """The remotes a wrapping parameter's value names."""
    return [value] if param.lower() == "remote" else [r for _, r in _upstreams(value)]


def _upstreams_shown(value: str, environ, depth: int) -> str:
    def field(text: str) -> str:
        return f'"{text.replace(chr(34), chr(34) * 2)}"' if any(c in text for c in ' "') else text
    return " ".join(field(d + _shown(r, environ, depth + 1)) for d, r in _upstreams(value))


def secret_values(remote: str, environ=None, depth: int = 0) -> list[tuple[str, str]]:
    """(parameter, value) of every secret a remote's connection string holds, in the remotes it wraps too (a
    crypt over `:b2,key=...:bucket`), and the credentials of a URL in it; [] for a plain name:path."""
    remote = remote.strip()
    out = [(f"{p} credentials", v) for p, v in url_credentials(remote)]
    try:
        parts = split(remote)
    except Invalid:
        return out
    if parts is None or depth > 8:
        return out
    name, params, _ = parts
    hide = set(secret_params(name, params, environ))
    for p, v in params.items():
        if p in hide:
            out.append((p, v))
        elif p.lower() in WRAPS:
            out += [(f"{p}: {q}", w) for inner in _inner(p, v) for q, w in secret_values(inner, environ, depth + 1)]
        else:
            out += [(f"{p} credentials", w) for _, w in url_credentials(v)]
    return out


_SCHEME = re.compile(r"(?i)^([a-z][a-z0-9+.-]*://)(.*)$", re.S)


def _userinfo_end(rest: str) -> int:
    """Where the user part of a URL (its text after scheme://) ends, at its '@'; -1 without one. It is in the
    host part (before the first '/', as Go's URL parser reads it), or user:password runs to the last '@' when what
    follows the ':' is no port (an AWS secret holds '/'); host:8443/path/alice@example.com has no user."""
    host = rest.split("/", 1)[0]
    if "@" in host:
        return host.rindex("@")
    head, at, _ = rest.rpartition("@")
    user, colon, after = head.partition(":")
    if at and colon and "/" not in user and not re.match(r"^\d{1,5}(?:/|$)", after):
        return len(head)
    return -1


def url_credentials(value: str) -> list[tuple[str, str]]:
    """A URL's user and password (scheme://user:pass@host/..., any scheme, the password holding '/' or not)."""
    m = _SCHEME.match(value.strip())
    end = _userinfo_end(m.group(2)) if m else -1
    if end < 0:
        return []
    user, _, password = m.group(2)[:end].partition(":")
    return [(k, v) for k, v in (("user", user), ("password", password)) if v]


def _without_userinfo(value: str) -> str:
    m = _SCHEME.match(value)
    end = _userinfo_end(m.group(2)) if m else -1
    return value if end < 0 else f"{m.group(1)}{REDACTED}@{m.group(2)[end + 1:]}"


def shown(remote: str, environ=None) -> str:
    """`remote` in a message or a record: each secret parameter's value (and credentials in an s3:// URL) taken
    out; a connection string rclone would refuse shows its name only."""
    return _shown(remote.strip(), environ, 0)


def _shown(remote: str, environ, depth: int) -> str:
    if _SCHEME.match(remote):  # s3://KEY:SECRET@bucket, b2://, https://user:pass@host: any scheme, any case
        return _without_userinfo(remote)
    try:
        parts = split(remote)
    except Invalid:
        return remote.split(",")[0] + f",{REDACTED}"
    if parts is None:  # not a connection string rclone reads; with parameters, none is shown
        return remote.split(",")[0] + f",{REDACTED}" if "," in remote else remote
    name, params, path = parts
    hide = set(secret_params(name, params, environ))

    def one(p: str, v: str) -> str:
        if p in hide:
            return f"{p}={REDACTED}"
        if v == "true":
            return p
        if p.lower() in WRAPS and depth < 8:
            inner = _shown(v, environ, depth + 1) if p.lower() == "remote" else _upstreams_shown(v, environ, depth)
            return f"{p}={_quoted(inner)}"
        return f"{p}={_quoted(_without_userinfo(v))}"
    said = ",".join(one(p, v) for p, v in params.items())
    # the rest of a value cut at its unquoted ':' (JSON, a URL) is no path: it may be the secret itself
    last = list(params.values())[-1] if params else ""
    return f"{name},{said}:{REDACTED if cut_value(path, last) else redact_text(path)}"


def s3_credentials(remote: str) -> bool:
    """s3://KEY:SECRET@bucket/prefix (a bucket never holds ':' nor '@'; the secret may hold '/'), S3:// too."""
    rest = remote.strip()[len("s3://"):]
    return remote.strip()[:5].lower() == "s3://" and "@" in rest and ":" in rest.rpartition("@")[0]


def cut_value(path: str, value: str = "") -> bool:
    """Whether `path` is the rest of `value` (the last parameter's), cut at its unquoted ':': a URL's `//`, more
    parameters before the path's first '/', or a value that opens JSON (a service account's key). A path is
    otherwise the user's, whatever it holds (`lr=0.001,bs=64`, `?`, braces): rclone takes it."""
    return (path.startswith("//") or re.match(r"^[^/]*,[A-Za-z0-9_.]+=", path) is not None
            or value.lstrip()[:1] in ("{", "["))


def cut_anywhere(remote: str, depth: int = 0) -> bool:
    """cut_value in a connection string or in any remote it wraps (a crypt over `:azureblob,sas_url=https://...`)."""
    try:
        parts = split(remote.strip())
    except Invalid:
        return False
    if parts is None or depth > 8:
        return False
    name, params, path = parts
    last = list(params.values())[-1] if params else ""
    return cut_value(path, last) or any(cut_anywhere(inner, depth + 1) for p, v in params.items()
                                        if p.lower() in WRAPS for inner in _inner(p, v))


# A RunPod secret reference as a connection string's value, unquoted: the secret is filled in as is, and its first
# ':' or ',' (a JSON key, a SAS URL) would end the value there.
_UNQUOTED_REF = re.compile(r"(?:^|,)([A-Za-z0-9_.]+)=\s*\{\{\s*RUNPOD_SECRET_")


def unquoted_reference(value: str) -> str:
    """The parameter of a connection string in `value` whose RunPod secret reference is not quoted ('' if none)."""
    m = _UNQUOTED_REF.search(value) if "," in value else None
    return m.group(1) if m else ""


def _quoted(v: str) -> str:
    return v if not any(c in v for c in ",:'\"") else "'" + v.replace("'", "''") + "'"


# A connection string inside any text (a log line, a record): the name, then each parameter (rclone's own message
# may quote one it refused, cut short or ending in ",:"). An unquoted value in text ends at a space, a quote or a
# backslash too (the JSON around it stays whole); a name with a space is not looked for (the scan stays linear).
_GO_QUOTED = r'\\"(?:[^"\\\n]|\\[^"\n])*(?:\\")?'  # a value inside a Go-quoted error: \"...\"
_VALUE = rf"""(?:{_GO_QUOTED}|"(?:[^"\n]|"")*"?|'(?:[^'\n]|'')*'?|[^,:\s"'\\]*)"""
_IN_TEXT = re.compile(rf"(?<![\w.+@-])(:?[\w.+@-]+)((?:,[A-Za-z0-9_.]+(?:={_VALUE})?)+)")
_PARAM = re.compile(rf",([A-Za-z0-9_.]+)(={_VALUE})?")


# `RCLONE_..._KEY=value` (an env dump, `export`, a JSON of the environment): the variable's value.
_ENV_IN_TEXT = re.compile(r"""(?<![A-Za-z0-9_])(RCLONE_[A-Za-z0-9_]{1,128})(['"]?\s*[:=]\s*['"]?)"""
                          r"""(?!<redacted)([^\s'",}]{1,4096})""")


_S3_IN_TEXT = re.compile(r"(?i)(s3://)[A-Za-z0-9_.-]+:[^\s@'\"]+@")
# any scheme's user:password (not host:port/path@...)
_URL_IN_TEXT = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s@'\"/:]*:(?!\d{1,5}(?:/|@))[^\s@'\"]+@")


def redact_text(text: str) -> str:
    """Every secret parameter's value of each connection string in `text`, and the value of every rclone variable
    that holds a secret, taken out (a remote's type unknown here: any backend's secret option counts, but an
    on-the-fly remote's own backend decides)."""
    if "RCLONE_" in text:
        text = _ENV_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + REDACTED if secret_env(m.group(1))
                                else m.group(0), text)
    if "://" in text:  # s3://KEY:SECRET@bucket (the secret holding '/' or not), https://user:pass@host
        text = _URL_IN_TEXT.sub(lambda m: m.group(1) + REDACTED + "@", _S3_IN_TEXT.sub(
            lambda m: m.group(1) + REDACTED + "@", text))
    if "," not in text:
        return text
    return _IN_TEXT.sub(_one, text)


def _one(m: re.Match) -> str:
    name = m.group(1)
    secret = secrets_of(name[1:] if name.startswith(":") else None)

    def param(p: re.Match) -> str:
        if not p.group(2) or p.group(2) == f"={REDACTED}":
            return p.group(0)
        if p.group(1).lower() in secret:
            return f",{p.group(1)}={REDACTED}"
        if p.group(1).lower() in WRAPS:  # the remote it wraps, its own secrets taken out
            return f",{p.group(1)}={redact_text(p.group(2)[1:])}"
        return p.group(0)
    return name + _PARAM.sub(param, m.group(2))


# -- the table, from the installed rclone ------------------------------------------------------------------------
def table_from(providers: list[dict], options: dict[str, list[dict]], version: str) -> str:
    """rclonesecrets_table.py's text from `rclone config providers` and `rclone rc --loopback options/info`."""
    def secret(o: dict) -> bool:
        return bool(o.get("IsPassword") or o.get("Sensitive"))

    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for b in providers:
        opts = tuple(sorted({o["Name"] for o in b.get("Options") or [] if secret(o)}))
        for key in (b["Name"], b.get("Prefix") or b["Name"], *(b.get("Aliases") or [])):
            rows.setdefault(key, (b.get("Prefix") or b["Name"], opts))
    main = tuple(sorted({o["Name"] for o in options.get("main") or [] if secret(o)}))
    lines = ['"""The options rclone\'s backends mark secret (IsPassword or Sensitive), from rclone '
             f'{version}.', "", "Generated by `python -m podkit.remote.rclonesecrets` from `rclone config providers` and "
             "`rclone rc --loopback", "options/info`: do not edit. tests/secrets/test_secrets_rclone.py checks it against "
             'the installed rclone."""', "",
             "# a backend's name, prefix or alias (what `type =` takes) -> (its env prefix, its secret options)",
             "BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {"]
    lines += [f"    {k!r}: ({v[0]!r}, {v[1]!r})," for k, v in sorted(rows.items())]
    lines += ["}", "# rclone's global options marked secret (RCLONE_<OPTION>)", f"GLOBAL = {main!r}",
              f"VERSION = {version!r}", ""]
    return "\n".join(lines)


def from_rclone(binary: str) -> str:
    """The table's text as the rclone at `binary` says it."""
    import json
    import subprocess

    def run(*args: str) -> str:
        return subprocess.run([binary, *args], capture_output=True, text=True, check=True, timeout=60,
                              stdin=subprocess.DEVNULL).stdout

    version = run("version").split()[1]
    return table_from(json.loads(run("config", "providers")),
                      json.loads(run("rc", "--loopback", "options/info")), version)


if __name__ == "__main__":  # regenerate the table from the pinned rclone (mover.binary())
    from pathlib import Path

    from podkit.remote import mover

    out = Path(__file__).with_name("rclonesecrets_table.py")
    out.write_text(from_rclone(mover.binary()))
    print(f"wrote {out}")
