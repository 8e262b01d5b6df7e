"""The pod config: one YAML file, every key with a `PODKIT_` env-var twin, validated on load.

Precedence, lowest first: the schema's defaults, the YAML file, `PODKIT_*` env vars, CLI flags.
Never imports torch, sglang or areal: `podkit boot` reads this before anything heavy exists.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from podkit import records
from podkit.areal import discovery
from podkit.errors import ConfigError
from podkit.settings import DURATION_MAX_S, SCHEMA, Field

# Boot-path module: stdlib only at import time (yaml, difflib, hashlib load when needed), and no
# dataclasses, whose import and code generation cost more than supervisord's own start-up budget.

ENV_PREFIX = "PODKIT_"
# Env vars with the prefix that are not settings (they select or locate a config).
NON_SETTING_ENV = {"PODKIT_CONFIG", "PODKIT_DEBUG", "PODKIT_PYTHON", "PODKIT_UID", "PODKIT_NOTIFY_WEBHOOK_URL",
                   "PODKIT_METRICS_KEY", "PODKIT_PAGE_TOKEN",  # secrets (checks.py)
                   "PODKIT_RUN_ID",  # `podkit deploy` names each run (ledger.RUN_ENV)
                   # rendered beside the settings (render.environment) and set for a cluster's driver and ranks
                   "PODKIT_LOG_DIR", "PODKIT_RAY_STOP_WAIT_S", "PODKIT_CLUSTER_RUN", "PODKIT_RAY_ADDRESS",
                   "PODKIT_RAY_STANDIN_LM"}


NAME = discovery.NAME  # one path component of safe characters


def check_name(value: str, source: str, key: str) -> None:
    """AReaL's run names become directories (checkpoints, name_resolve records that boot clears): one safe
    path component each, or a clear of `<experiment>/<trial>` could reach outside podkit's own directories."""
    if not NAME.match(value) or value in (".", ".."):
        raise ConfigError(source, key, f"{value!r} is not a name: one path component of letters, digits, '_', "
                          "'.' and '-', not starting with '.' or '-'",
                          hint=f"{key} names the run's directories (e.g. myrepo-v2), never a path")


def is_stop_time(at: float) -> bool:
    """A guard.stop_pod_at that is a time: from 2001 on (smaller is a duration by mistake), finite."""
    return 1e9 <= at < float("inf")


def _check_stop_time(at: float, source: str) -> None:
    if at and not is_stop_time(at):
        raise ConfigError(source, "guard.stop_pod_at", f"{at:g} is a Unix time in 1970-2001, so the pod would stop at "
                          "once", hint="a Unix time (`date -d +12hours +%s`); `podkit deploy --max-runtime 12h` sets "
                          "it for you, `podkit guard set stop_pod_at=+12h` on a running pod")


def check(section: str, key: str, raw: object, source: str, from_env: bool = True) -> object:
    """One setting's value from `raw` by the rules load() applies (type, choices, range; a stop time that is
    a time), or a ConfigError naming `source` and the key: for values that come from elsewhere (guardfile.py)."""
    value = _coerce(SCHEMA[section][key], raw, source, dotted(section, key), from_env)
    if (section, key) == ("guard", "stop_pod_at"):
        _check_stop_time(value, source)
    return value


def env_name(section: str, key: str) -> str:
    return ENV_PREFIX + (f"{section}_{key}" if section else key).upper()


ENV_KEYS: dict[str, tuple[str, str]] = {env_name(s, k): (s, k) for s, keys in SCHEMA.items() for k in keys}


def dotted(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


class Section:
    """Attribute access to one section's validated values."""

    def __init__(self, values: dict[str, object]) -> None:
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"Section({self.__dict__!r})"


class Config:
    def __init__(self, values: dict[str, dict[str, object]], source: str = "defaults",
                 warnings: list[str] | None = None, origins: dict[str, str] | None = None,
                 secrets: dict[str, str] | None = None) -> None:
        self.values, self.source, self.warnings = values, source, warnings or []
        self.origins = origins or {}
        # Credentials found inside settings (a token in repo.url): used by the stage that needs them,
        # never rendered, printed or passed to a program.
        self.secrets = secrets or {}
        # The GPU lists, parsed once (load() has validated them).
        self.gpus = {s: parse_gpus(values[s]["gpus"]) for s in ("inference", "trainer") if s in values}

    def origin(self, key: str) -> str:
        """Where `section.key`'s value came from: the YAML file, `env PODKIT_X`, `command line`, or defaults."""
        return self.origins.get(key, "defaults")

    def __getattr__(self, name: str) -> object:
        values = self.__dict__.get("values", {})
        if name in values:
            return Section(values[name])
        if name in values.get("", {}):
            return values[""][name]
        raise AttributeError(name)

    @property
    def workspace_path(self) -> Path:
        return Path(self.values[""]["workspace"])

    @property
    def run_path(self) -> Path:
        return Path(self.values[""]["run_dir"])

    @property
    def node(self) -> str:
        """"" on a single pod and a cluster's rank 0; "node-<rank>" on the others, whose records and logs
        live beside rank 0's on the shared volume."""
        rank = self.values.get("cluster", {}).get("rank", 0)
        return f"node-{rank}" if rank > 0 else ""

    @property
    def state_dir(self) -> Path:
        """Podkit's records on the volume: boots, progress, program states."""
        return self.workspace_path / ".podkit" / self.node

    @property
    def log_dir(self) -> Path:
        return self.workspace_path / "logs" / self.node

    @property
    def multi_node(self) -> bool:
        return self.values.get("cluster", {}).get("nodes", 1) > 1

    @property
    def checkpoint_dir(self) -> Path:
        return self.workspace_path / "checkpoints"

    @property
    def socket_path(self) -> Path:
        return self.run_path / "supervisor.sock"

    def as_env(self, shown: bool = False) -> dict[str, str]:
        """Every resolved setting as its env twin: the rendered config that supervisord passes on. `shown`: as a
        file or a person reads it (podkit.env, `podkit render`), checkpoint.remote without its secrets."""
        out = {}
        for section, keys in self.values.items():
            for key, value in keys.items():
                out[env_name(section, key)] = _format(value)
        if shown:
            out[env_name("checkpoint", "remote")] = self.as_dict()["checkpoint"]["remote"]
        return out

    def as_dict(self) -> dict[str, object]:
        """The resolved config as shown (`podkit config`, the bug report): checkpoint.remote without its secrets."""
        top = dict(self.values[""])
        top.update({s: dict(v) for s, v in self.values.items() if s})
        if top["checkpoint"]["remote"]:
            from podkit.remote import rclonesecrets  # only with a remote: the boot path's imports are pinned

            top["checkpoint"]["remote"] = rclonesecrets.shown(top["checkpoint"]["remote"])
        return top


def remote_secrets(url: str, environ) -> dict[str, str]:
    """The secrets written into checkpoint.remote itself: the parameters of an rclone connection string that its
    backend marks secret (in the remotes it wraps too), credentials in a URL (refused, remote.parse; still never
    shown)."""
    if "," not in url and "@" not in url:
        return {}
    from podkit.remote import rclonesecrets  # only for such a remote: the boot path's imports are pinned

    return {f"checkpoint.remote {p}": v for p, v in rclonesecrets.secret_values(url, environ)}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """`https://user:tok@host/x` -> (`https://host/x`, user, tok). Only the clean URL is ever stored."""
    from urllib.parse import urlsplit, urlunsplit  # only for a URL with an '@' in it

    if "@" not in url:
        return url, None, None
    try:
        parts = urlsplit(url)
        if parts.scheme in ("http", "https") and (parts.username or parts.password):
            host = parts.hostname or ""
            if parts.port:
                host += f":{parts.port}"
            return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), parts.username, \
                parts.password
        if parts.password:  # ssh://user:pass@host/x: the user stays (ssh needs it), the password is split out
            host = f"{parts.username}@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
            return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), parts.username, \
                parts.password
    except ValueError:
        pass
    return url, None, None


def parse_gpus(text: str) -> tuple[int, ...]:
    """`"0,1, 3"` -> (0, 1, 3); "" -> (). Raises ValueError naming what is wrong."""
    ids = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a GPU index")
        if int(part) in ids:
            raise ValueError(f"GPU {part} is listed twice")
        ids.append(int(part))
    return tuple(ids)


def _did_you_mean(word: str, candidates) -> str:
    import difflib  # an error's hint only

    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else ""


def _coerce(spec: Field, raw: object, source: str, key: str, from_env: bool) -> object:
    want = spec.type
    value: object = raw
    if from_env and isinstance(raw, str):
        value = raw.strip()
        if want in (int, float):
            try:
                value = want(value)
            except ValueError:
                pass  # reported below with the raw value
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith(("gpus", "ref")):
        value = str(value)  # `gpus: 0` or `ref: 1234` in YAML mean the string
    if value is None and want is str:
        value = ""
    if not isinstance(value, want) or isinstance(value, bool):
        expected = {int: "a whole number", float: "a number", str: "a string"}[want]
        unit = f" ({spec.unit})" if spec.unit and spec.unit not in ("path", "url", "glob") else ""
        raise ConfigError(source, key, f"expected {expected}{unit}, got {raw!r}",
                          hint=f"{key}: {spec.doc}; default {_format(spec.default)!s}")
    if spec.choices and value not in spec.choices:
        raise ConfigError(source, key, f"{value!r} is not one of {', '.join(spec.choices)}",
                          hint=_did_you_mean(str(value), spec.choices) or spec.doc)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(source, key, f"{raw!r} is not a finite number", hint=f"{key}: {spec.doc}")
    if isinstance(value, str) and (bad := _bad_character(value)):
        raise ConfigError(source, key, f"{bad}: {value!r}",
                          hint="one line of UTF-8 text; an env var set from a binary file carries its bytes")
    if spec.minimum is not None and value < spec.minimum:
        raise ConfigError(source, key, f"{value!r} is below the minimum {_number(spec.minimum)}", hint=spec.doc)
    if spec.maximum is not None and value > spec.maximum:
        raise ConfigError(source, key, f"{value!r} is above the maximum {_number(spec.maximum)}"
                          + (" (30 days)" if spec.maximum == DURATION_MAX_S and spec.unit == "s" else ""),
                          hint=spec.doc)
    return value


def _bad_character(text: str) -> str:
    """Why `text` cannot be a setting: bytes that were not UTF-8 (os.environ keeps them as surrogates),
    or control characters (a newline would split podkit.env and supervisord.conf lines)."""
    for c in text:
        if "\udc80" <= c <= "\udcff":
            return "not UTF-8"
        if (c < " " and c != "\t") or c == "\x7f":
            return f"contains the control character {c!r}"
    return ""


def _cache_dir(environ) -> Path | None:
    """The parse cache lives with podkit's records on the volume (it outlives the container, as the
    config file usually does), and only where PODKIT_WORKSPACE says where that is."""
    ws = environ.get("PODKIT_WORKSPACE")
    return Path(ws) / ".podkit" if ws else None


def _read_yaml(path: Path, environ) -> tuple[dict[str, object], object]:
    """The file's mapping, and what writes its parse to the cache (None: it came from there), for load()
    to call once the config passed every check. A parse is cached, keyed by the file's path and content: PyYAML's import
    alone costs a sixth of supervisord's start-up, and restarts re-read an unchanged file. The cache
    is used only when this user owns it and nobody else can write it (it could steer root's
    config); its data is validated like fresh data, only the YAML parse is skipped."""
    import zlib  # a builtin module: cheap

    raw = _read_bytes(path)
    key = [os.path.abspath(path), zlib.crc32(raw), len(raw)]
    cache = _cache_dir(environ)
    if cache is not None:
        cached = records.CONFIG_CACHE.read_owned(cache)
        if cached.get("key") == key and isinstance(cached.get("data"), dict):
            return cached["data"], None
    data = _parse_yaml(path, raw)
    repo = data.get("repo")
    secret = isinstance(repo, dict) and split_credentials(str(repo.get("url") or ""))[2]

    def store() -> None:
        if cache is not None and cache.is_dir() and not secret:  # a file with a token is not copied to the volume
            try:
                records.CONFIG_CACHE.write(cache, {"key": key, "data": data}, mode=0o600)
            except (OSError, TypeError, ValueError):
                pass  # not JSON-representable (dates...) or no room: parse again next time
    return data, store


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found", hint="set PODKIT_CONFIG or --config to an existing "
                          "file; configs/default.yaml documents every key") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "", "is a directory, not a YAML file",
                          hint="PODKIT_CONFIG names the pod config file itself") from None
    except OSError as e:
        raise ConfigError(str(path), "", f"cannot read: {e.strerror}") from None


MAX_CONFIG_BYTES = 1 << 20  # a pod config is a few KiB
# A pod config holds about a hundred values. Aliases of aliases (a "billion laughs" file) expand far past
# any such count while the file stays tiny: counted on the parse before anything is built or written.
MAX_CONFIG_VALUES = 10_000


def _expanded(node, memo: dict) -> int:
    """How many values `node` stands for once every alias in it is expanded (shared nodes counted each
    time they are used, each counted once per node: linear in the file)."""
    import yaml

    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias ends here
    if isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded(v, memo) for v in node.value)
    else:
        n = 1
    memo[id(node)] = n
    return n


def _parse_yaml(path: Path, raw: bytes) -> dict[str, object]:
    import yaml  # only when there is a file to parse (and no cached parse of it)

    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), "", f"is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a pod config",
                          hint="PODKIT_CONFIG names the pod config file itself")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(str(path), f"line {line}", f"not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})",
                          hint="save the file as UTF-8; a binary or corrupt file is not a pod config") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and (n := _expanded(node, {})) > MAX_CONFIG_VALUES:
            raise ConfigError(str(path), "", f"expands to {n:,} values through YAML aliases (a pod config holds "
                              f"about a hundred; the limit is {MAX_CONFIG_VALUES:,})",
                              hint="write the settings out; aliases of aliases multiply")
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(path), where, f"invalid YAML: {problem}",
                          hint="check the indentation and quoting around that line") from None
    except RecursionError:
        raise ConfigError(str(path), "", "invalid YAML: nested too deeply", hint="a pod config is two levels deep") from None
    finally:
        loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", f"expected a mapping of settings, got {type(data).__name__}",
                          hint="configs/default.yaml shows the shape: sections of key: value")
    return data


def _apply_file(values: dict, data: dict, source: str, origins: dict) -> None:
    top_keys = list(SCHEMA[""]) + [s for s in SCHEMA if s]
    for name, raw in data.items():
        name = str(name)
        if name in SCHEMA[""]:
            values[""][name] = _coerce(SCHEMA[""][name], raw, source, name, from_env=False)
            origins[name] = source
        elif name in SCHEMA and name:
            if raw is None:
                continue
            if not isinstance(raw, dict):
                raise ConfigError(source, name, f"expected a section (a mapping), got {raw!r}")
            for key, sub in raw.items():
                key = str(key)
                if key not in SCHEMA[name]:
                    raise ConfigError(source, f"{name}.{key}", "unknown key",
                                      hint=_did_you_mean(key, SCHEMA[name]) or
                                      f"known keys of {name}: {', '.join(SCHEMA[name])}")
                values[name][key] = _coerce(SCHEMA[name][key], sub, source, f"{name}.{key}", from_env=False)
                origins[f"{name}.{key}"] = source
        elif name == "notify":
            raise ConfigError(source, "notify.webhook_url", "is a secret (anyone with it posts to the channel), "
                              "never in a file", hint="set PODKIT_NOTIFY_WEBHOOK_URL in the environment "
                              "(a RunPod secret: {{ RUNPOD_SECRET_... }}) and remove the notify section")
        else:
            raise ConfigError(source, name, "unknown key",
                              hint=_did_you_mean(name, top_keys) or f"known keys: {', '.join(top_keys)}")


def _apply_env(values: dict, environ: dict[str, str], warnings: list[str], origins: dict) -> None:
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var in NON_SETTING_ENV:
            continue
        if var not in ENV_KEYS:
            guess = _did_you_mean(var, ENV_KEYS)
            warnings.append(f"env {var}: not a podkit setting, ignored" + (f"; {guess}" if guess else ""))
            continue
        section, key = ENV_KEYS[var]
        values[section][key] = _coerce(SCHEMA[section][key], raw, f"env {var}", dotted(section, key), True)
        origins[dotted(section, key)] = f"env {var}"


SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with its terminating NUL


def _check_paths(top: dict, origins: dict) -> None:
    """Paths that supervisord takes into its config: a `%` there is read as an expansion, and a unix
    socket path longer than sun_path fails to bind only once supervisord starts."""
    for key in ("workspace", "run_dir"):
        if "%" in top[key]:
            raise ConfigError(origins.get(key, "defaults"), key, f"{top[key]!r} contains '%', which supervisord "
                              "reads as an expansion", hint="pick a path without '%'")
    sock = os.path.join(top["run_dir"], "supervisor.sock")
    if len(os.fsencode(sock)) > SOCKET_PATH_MAX:
        raise ConfigError(origins.get("run_dir", "defaults"), "run_dir", f"the control socket {sock} would be "
                          f"{len(os.fsencode(sock))} bytes long; a unix socket path holds at most {SOCKET_PATH_MAX}",
                          hint="set PODKIT_RUN_DIR to a short local directory, e.g. /tmp/podkit")


def default_run_dir(workspace: str, rank: int = 0) -> str:
    # Short and per workspace (and node: a test cluster's nodes share one machine): a unix socket path
    # must stay under 108 bytes.
    import hashlib  # only when run_dir is not set

    digest = hashlib.sha1(os.path.abspath(workspace).encode()).hexdigest()[:8]
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"podkit-{os.getuid()}-{digest}" + (f"-n{rank}" if rank else ""))


def _resolve_cluster(c: dict, environ, origins: dict) -> None:
    """RunPod Instant Clusters say who is who in NODE_RANK, PRIMARY_ADDR (MASTER_ADDR) and NODE_ADDR."""
    def origin(key):
        return origins.get(f"cluster.{key}", "defaults")

    if c["rank"] < 0 and c["nodes"] == 1:
        c["rank"] = 0  # a single pod: a NODE_RANK set for other reasons says nothing about it
    if c["rank"] < 0:
        raw = environ.get("NODE_RANK", "")
        if not raw.isdigit():
            raise ConfigError(origin("rank"), "cluster.rank", f"-1 takes the rank from $NODE_RANK, which is {raw!r}",
                              hint="set PODKIT_CLUSTER_RANK (0 on the head node) or run on a RunPod Instant Cluster")
        c["rank"] = int(raw)
    if c["rank"] >= c["nodes"]:
        raise ConfigError(origin("rank"), "cluster.rank", f"rank {c['rank']} of a {c['nodes']}-node cluster",
                          hint="ranks run from 0 to cluster.nodes - 1; on an Instant Cluster that was scaled up, "
                          "this node joined beyond the run's cluster.nodes and takes no part in it (it waits here): "
                          "remove it, or run on more nodes as a new cluster made for them")
    c["head"] = c["head"] or environ.get("PRIMARY_ADDR") or environ.get("MASTER_ADDR") or ""
    c["node_addr"] = c["node_addr"] or environ.get("NODE_ADDR") or (c["head"] if c["rank"] == 0 else "")
    if c["nodes"] > 1:
        for key in ("head", "node_addr"):
            if not c[key]:
                raise ConfigError(origin(key), f"cluster.{key}", "empty on a multi-node run",
                                  hint="set PODKIT_CLUSTER_HEAD and PODKIT_CLUSTER_NODE_ADDR, or run on a RunPod "
                                  "Instant Cluster (PRIMARY_ADDR, NODE_ADDR)")


def load(path: str | os.PathLike | None = None, environ: dict[str, str] | None = None,
         overrides: dict[str, object] | None = None) -> Config:
    """Defaults < YAML file (path or $PODKIT_CONFIG) < PODKIT_* env < overrides ({"section.key": value})."""
    environ = os.environ if environ is None else environ
    values = {s: {k: f.default for k, f in keys.items()} for s, keys in SCHEMA.items()}
    warnings: list[str] = []
    origins: dict[str, str] = {}
    path = path or environ.get("PODKIT_CONFIG") or None
    source, store = "defaults", None
    if path:
        source = str(path)
        data, store = _read_yaml(Path(path), environ)
        _apply_file(values, data, source, origins)
    _apply_env(values, environ, warnings, origins)
    for name, raw in (overrides or {}).items():
        section, _, key = name.rpartition(".")
        values[section][key] = _coerce(SCHEMA[section][key], raw, "command line", name, from_env=True)
        origins[name] = "command line"
    for section in ("inference", "trainer"):
        try:
            parse_gpus(values[section]["gpus"])
        except ValueError as e:
            key = f"{section}.gpus"
            raise ConfigError(origins.get(key, "defaults"), key, str(e),
                              hint="comma-separated GPU indexes, e.g. \"1,2,3\"") from None
    _check_stop_time(values["guard"]["stop_pod_at"], origins.get("guard.stop_pod_at", "defaults"))
    deadline, update = values["watchdog"]["weight_update_deadline_s"], values["trainer"]["weight_update_timeout_s"]
    if 0 < deadline < update:  # the watchdog would restart inference in the middle of a normal update
        raise ConfigError(origins.get("watchdog.weight_update_deadline_s", "defaults"), "watchdog.weight_update_deadline_s",
                          f"{deadline:g} s is shorter than one weight update may take (trainer.weight_update_timeout_s "
                          f"{update:g} s): inference would be restarted as hung during updates",
                          hint=f"0 (5 x trainer.weight_update_timeout_s), or at least {update:g}")
    for key in ("experiment", "trial"):
        if values["trainer"][key]:  # empty: the AReaL YAML's own name
            check_name(values["trainer"][key], origins.get(f"trainer.{key}", "defaults"), f"trainer.{key}")
    top = values[""]
    top["workspace"] = os.path.abspath(top["workspace"])
    _resolve_cluster(values["cluster"], environ, origins)
    if not top["run_dir"]:
        top["run_dir"] = default_run_dir(top["workspace"], values["cluster"]["rank"])
    if not values["repo"]["dest"]:
        values["repo"]["dest"] = os.path.join(top["workspace"], "repo")
    if not values["trainer"]["name_resolve_root"]:
        values["trainer"]["name_resolve_root"] = os.path.join(top["run_dir"], "name_resolve")
    inf = values["inference"]
    if inf["kind"] == "standin-lm" and inf["model"].startswith("./"):  # a model the rehearsal built there
        inf["model"] = os.path.join(top["workspace"], inf["model"][2:])
    _check_paths(top, origins)
    url, user, token = split_credentials(values["repo"]["url"])
    values["repo"]["url"] = url
    if token and not url.startswith(("http://", "https://")):
        raise ConfigError(origins.get("repo.url", "defaults"), "repo.url", f"{url.split('://')[0]} URL with a "
                          "password in it: git gives it to nobody (ssh takes keys, not a password from the URL)",
                          hint=f"remove the password ({url}) and give the pod a deploy key, or use an https URL "
                          "with GIT_TOKEN")
    secrets = {k: v for k, v in (("repo.user", user), ("repo.token", token)) if v}
    secrets.update(remote_secrets(values["checkpoint"]["remote"], environ))
    areal = values["trainer"]["areal_config"]
    if areal and not os.path.isabs(areal):
        # The user's YAML is in their repo; podkit's beside the pod config that names it, so
        # configs/a40-4gpu.yaml can say areal/grpo-a40-4gpu.yaml.
        base = values["repo"]["dest"] if values["trainer"]["entry"] else (os.path.dirname(path) if path else "")
        values["trainer"]["areal_config"] = os.path.abspath(os.path.join(base, areal))
    if path and store:
        store()  # only a config that passed every check is written to the volume
    return Config(values, source, warnings, origins, secrets)


def packaged(name: str) -> Path:
    """A file shipped at the top of the repo (supervisord.conf, configs/*): the wheel's copy, else the tree's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "data" / name, here.parent.parent / name):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"podkit is installed without {name}; reinstall podkit")


def render_default_yaml() -> str:
    """The documented default config, generated from the schema (configs/default.yaml must equal it)."""
    lines = [
        "# podkit's default pod config, every key with its default. Generated by `podkit config --defaults`;",
        "# a test checks it matches the code. Read by `podkit boot` (the container's entrypoint), which owns",
        "# the lifecycle: it runs the stages, then execs supervisord. Each key has an env twin, shown after it.",
    ]
    for section, keys in SCHEMA.items():
        indent = ""
        if section:
            lines += ["", f"{section}:"]
            indent = "  "
        for key, spec in keys.items():
            value = json.dumps(spec.default) if isinstance(spec.default, str) else _format(spec.default)
            unit = f" [{spec.unit}]" if spec.unit else ""
            lines.append(f"{indent}{key}: {value}  # {spec.doc}{unit} ({env_name(section, key)})")
    return "\n".join(lines) + "\n"


def settings_table() -> str:
    """The settings reference in docs/configuration.md, generated from the schema (a test checks the page
    holds exactly this): one markdown row per setting, in SCHEMA order. A setting with choices its meaning
    does not already name gets them appended."""
    rows = ["| setting | env var | default | unit | range | meaning |", "|---|---|---|---|---|---|"]
    for section, keys in SCHEMA.items():
        for key, spec in keys.items():
            meaning, default = spec.doc, _format(spec.default) or '""'
            if spec.choices and not all(c in spec.doc for c in spec.choices):
                meaning += f" (one of {', '.join(spec.choices)})"
            span = "" if spec.maximum is None else \
                f"{_number(spec.minimum) if spec.minimum is not None else ''}..{_number(spec.maximum)}"
            cells = (f"`{dotted(section, key)}`", f"`{env_name(section, key)}`",
                     f"`{default}`", spec.unit, span, meaning.replace("|", "\\|"))
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
