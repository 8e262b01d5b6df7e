"""Run identity: which run this is, by the user's names, and whether a checkpoint on the volume is its own.

A network volume outlives pods and holds many runs. AReaL names every directory of a run (checkpoints,
recover info, logs, W&B's id) by `experiment_name` and `trial_name`, so those names, the user's, are the
run's identity. They come from, last wins: podkit/run (a YAML without names), the AReaL YAML's own names,
trainer.experiment/trial when set (empty by default), and trainer.overrides. The launcher passes the
result to AReaL, so both read the same names; a name only AReaL's loader can tell (Hydra `defaults:`, an
interpolation, a value YAML types) is left to it, and the trainer checks what it decided.

Names of one run can still meet another run's checkpoint (AReaL's example YAML and the user's own script
both called gsm8k-grpo/trial0): each run's checkpoint directory carries a record of what trained it
(RECORD), and a trainer whose run differs in anything but the commit does not resume it (check).
Stdlib only at import: the launcher, reap and status import it.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import time
from pathlib import Path

from podkit import config
from podkit.areal import userconf

_LAYER = re.compile(r"\.layers\.(\d+)\.")
RECORD = "podkit-run.json"  # in AReaL's save root of the run: <fileroot>/checkpoints/<user>/<exp>/<trial>
NAME_KEYS = {"experiment": "experiment_name", "trial": "trial_name"}


DEFAULTS = {"experiment": "podkit", "trial": "run"}  # a YAML without names (AReaL requires both)


class Names:
    """The run's names and where each came from: {name: (where, key)} for the log line and a config error.
    A name is None where only AReaL's loader can tell it (a Hydra `defaults:` list, an interpolation, a
    value YAML types as a date, a float or a boolean): podkit then passes none, and the trainer checks the
    name AReaL ends up with (hooks.check_run)."""

    def __init__(self, experiment: str | None, trial: str | None, origins: dict[str, tuple[str, str]]) -> None:
        self.experiment, self.trial, self.origins = experiment, trial, origins

    def __str__(self) -> str:
        return f"{self.experiment or '(AReaL decides)'}/{self.trial or '(AReaL decides)'}"

    @property
    def known(self) -> bool:
        return self.experiment is not None and self.trial is not None

    def problems(self) -> list[tuple[str, str, str]]:
        """(key, what, hint) for each name that is not one safe path component."""
        out = []
        for ours, theirs in NAME_KEYS.items():
            where, key = self.origins[ours]
            if getattr(self, ours) is None:
                continue
            try:
                config.check_name(getattr(self, ours), where, theirs)
            except config.ConfigError as e:
                out.append((key, f"{theirs} {e.problem} (from {where})",
                            f"AReaL names the run's directories by {theirs}: a plain name such as myrepo-v2"))
        return out


def _plain(value) -> bool:
    """A name AReaL's loader reads as podkit does: a string without interpolation, or an integer."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, str) and "${" not in value


def _yaml_names(cfg) -> tuple[dict, dict]:
    """The AReaL YAML's top-level names ({key: value}) and those only AReaL can tell ({key: why})."""
    if cfg.trainer.kind != "areal" or not cfg.trainer.areal_config:
        return {}, {}
    data = userconf.areal_yaml(cfg)  # an unreadable YAML is checks.areal's to name; the names fall back
    if not isinstance(data, dict):
        return {}, {}
    found, undecided = {}, {}
    for key in NAME_KEYS.values():
        if key in data and _plain(data[key]):
            found[key] = str(data[key])
        elif key in data:
            undecided[key] = f"{cfg.trainer.areal_config}: {key} {data[key]!r:.60} (as AReaL's loader reads it)"
        elif "defaults" in data:
            undecided[key] = f"{cfg.trainer.areal_config}: {key} from its Hydra defaults"
    return found, undecided


def _override_names(overrides: str) -> dict:
    """experiment_name / trial_name set in trainer.overrides (the last wins)."""
    return {k: v for k, v in userconf.overridden(overrides).items() if k in NAME_KEYS.values()}


def names(cfg) -> Names:
    """The run's names: see the module's docstring for the order."""
    t = cfg.trainer
    found = {ours: (DEFAULTS[ours], ("podkit's default", f"trainer.{ours}")) for ours in NAME_KEYS}
    (from_yaml, undecided), from_overrides = _yaml_names(cfg), _override_names(t.overrides)
    for ours, theirs in NAME_KEYS.items():
        if theirs in from_yaml:
            found[ours] = (from_yaml[theirs], (f"{t.areal_config}", "trainer.areal_config"))
        elif theirs in undecided:
            found[ours] = (None, (undecided[theirs], "trainer.areal_config"))
        if getattr(t, ours):
            found[ours] = (getattr(t, ours), (cfg.origin(f"trainer.{ours}"), f"trainer.{ours}"))
        if theirs in from_overrides:
            value = from_overrides[theirs]
            found[ours] = (value if "${" not in value else None, ("trainer.overrides", "trainer.overrides"))
    return Names(found["experiment"][0], found["trial"][0], {k: v[1] for k, v in found.items()})


# --- the checkpoint's owner -----------------------------------------------------------------------------


def fileroot(cfg) -> str:
    """AReaL's logs, HF saves and recover checkpoints: on the volume, so a new container resumes."""
    return str(cfg.workspace_path / "areal")


def save_root(root: str, experiment: str, trial: str, user: str | None = None) -> Path:
    """AReaL's Saver.get_save_root, without creating it."""
    return Path(root) / "checkpoints" / (user or getpass.getuser()) / experiment / trial


_SCP_LIKE = (re.compile(r"^[^/]+@[^/:]+:"), re.compile(r"^[A-Za-z0-9.-]+\.[A-Za-z]+:[^/]"))  # user@host:path, host.tld:path


def repo_of(url: str) -> str:
    """One repo, however git's URL forms write it (the run's record and the sync agree through this): for a
    remote, host/path in lower case without the scheme (https, http, ssh, git+ssh, scp-like user@host:path),
    credentials, port, '.git' or a trailing '/'; for a local path or file:// URL, its realpath without '.git'."""
    url = url.strip()
    if not url:
        return ""  # no origin at all: never the realpath of the cwd
    if url.startswith(("/", ".", "file://")):
        # One directory, however the path reaches it (a symlink named x.git included).
        return os.path.realpath(url.removeprefix("file://").rstrip("/") or "/").removesuffix(".git")
    if "://" in url:
        rest = url.partition("://")[2]
        host, _, path = rest.partition("/")
        host = host.rpartition("@")[2].partition(":")[0]
    elif any(p.match(url) for p in _SCP_LIKE):
        host, _, path = url.rpartition("@")[2].partition(":")
    else:
        return url.rstrip("/").removesuffix(".git")  # a relative path: as written
    return f"{host}/{path.strip('/').removesuffix('.git')}".lower()


def model_id(path: str) -> str:
    """Which model a path names, in full, as transformers resolves it: an existing local directory by its
    resolved path, parents included (.../sft-v1/hf and .../sft-v2/hf are two); else a hub id in lower case
    with its organisation (Qwen/X and me/X are two models; gpt2 is a hub id), also when written as a hub
    cache snapshot (.../models--Org--Name/snapshots/<sha>)."""
    p = path.strip().rstrip("/")
    parts = Path(p).parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return "/".join(part.split("--")[1:]).lower()
    if not p or os.path.isdir(p) or p.startswith(("/", ".", "~")) or p.count("/") > 1:
        return os.path.realpath(os.path.expanduser(p)) if p else ""
    return p.lower()  # a hub id (the hub's ids are case-insensitive)


def _config_json(path: str) -> str | None:
    """A model's config.json: a local directory's, or a hub id's from the hub cache (HF_HOME, on the
    volume; never downloaded here). None when there is none to read."""
    local = os.path.join(path, "config.json")
    if not os.path.isfile(local) and re.match(r"^[\w.-]+(/[\w.-]+)?$", path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            local = cached if isinstance(cached, str) else local
        except Exception:  # noqa: BLE001 - no hub library, or a cache it cannot read
            pass
    return local if os.path.isfile(local) else None


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def model_fingerprint(path: str) -> str:
    """The model's weights, told without reading them all: the first 16 hex of sha256 over each weight file's
    name, size and first and last MiB, for a local directory or a hub id's cached snapshot ("" when none is
    here). The same files at a new place (a hub model copied to the volume) are the same model; a directory
    written over by another training is another, whatever its config.json says."""
    found = _config_json(path)
    folder = os.path.dirname(found) if found else path
    if not os.path.isdir(folder):
        return ""
    h = hashlib.sha256()
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(WEIGHTS))[:512]
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:  # a hub snapshot's files are links to blobs
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                h.update(f.read(1 << 20))
                if size > 2 << 20:
                    f.seek(-(1 << 20), os.SEEK_END)
                    h.update(f.read(1 << 20))
    except OSError:
        return ""
    return h.hexdigest()[:16] if names else ""


def entry_id(entry: str) -> str:
    """The training entry as the checkout resolves it: a script's path normalised (./train.py and train.py are
    one script); a module:function as written."""
    e = entry.strip()
    if e.endswith(".py") or "/" in e:
        return os.path.normpath(e)
    return e


def entry_file(path: str, checkout: str | None) -> str:
    """The file that defines the entry, as the checkout resolves it: links followed, relative to the checkout when
    it is inside it (`grpo/train.py` and `grpo.train:main` are one script when main is defined there; a link the
    repo keeps to it too). "" when unknown."""
    if not path:
        return ""
    real = os.path.realpath(path)
    if checkout:
        root = os.path.realpath(checkout)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(real, root)
    return real


DATA_FILES, DATA_READ = 256, 64 << 10  # contents read from at most 256 files: at most 32 MiB, whatever the size
DATA_LISTED = 200_000  # names and sizes hashed: every file of a dataset up to this many


def data_files(path: str) -> list[str]:
    """Every file under the directory `path`, relative, sorted (at most DATA_LISTED): hidden ones left out, links
    to directories followed once (a loop of links is walked once), links to nothing kept (data_fingerprint
    names them)."""
    out, seen = [], set()
    for top, dirs, names in os.walk(path, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.relpath(os.path.join(top, n), path) for n in names if not n.startswith(".")]
        if len(out) >= DATA_LISTED:
            break
    return sorted(out)[:DATA_LISTED]


def data_fingerprint(path: str) -> str:
    """What a training data path names, told without reading it all: the first 16 hex of sha256 over every
    file's name (relative) and size, and the first and last 64 KiB of a deterministic sample of DATA_FILES of
    them spread evenly over the sorted names (every file when there are fewer), for a local file or directory;
    a link to nothing, or a file that cannot be read, is hashed as what it is, never as "no fingerprint". The
    path itself for what is not here (a hub dataset's id); "" for no path."""
    if not path:
        return ""
    if not os.path.lexists(path):
        return f"id:{path}"
    h = hashlib.sha256()
    if os.path.isdir(path):
        files = data_files(path)
        h.update(f"{len(files)} files\0".encode())
    else:
        files = [""]
    step = max(1.0, len(files) / DATA_FILES)
    sample = {int(i * step) for i in range(min(len(files), DATA_FILES))}
    for i, rel in enumerate(files):
        f_path = os.path.join(path, rel) if rel else path
        h.update(f"{rel}\0".encode())
        try:
            if i not in sample:
                h.update(f"{os.stat(f_path).st_size}\0".encode())
                continue
            with open(f_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{size}\0".encode())
                h.update(f.read(DATA_READ))
                if size > 2 * DATA_READ:
                    f.seek(-DATA_READ, os.SEEK_END)
                    h.update(f.read(DATA_READ))
        except OSError as e:  # a link to nothing, a file it may not read: what it is, not nothing
            link = os.readlink(f_path) if os.path.islink(f_path) else ""
            h.update(f"unreadable {e.errno} {link}\0".encode())
    return h.hexdigest()[:16]


def model_shape(path: str) -> dict:
    """hidden size, layers and vocabulary from a model's config.json: a local directory's, or a hub id's
    from the hub cache (HF_HOME, on the volume; never downloaded here). {} when it cannot be read."""
    local = _config_json(path)
    try:
        with open(local, encoding="utf-8") as f:  # type: ignore[arg-type]
            data = json.load(f)
    except (OSError, ValueError, TypeError):
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


def record_for(names: tuple[str, str], entry: str, model: str, repo: str, commit: str = "", file: str = "",
               data: str = "") -> dict:
    """What trained a run's checkpoints: written beside them when training starts. Each part is kept as
    written and as resolved (what differences() compares): the entry and the file that defines it, the model,
    the repo, the training data (its path and what it names); `wandb` is added by the trainer when W&B is on."""
    out = {"names": list(names), "entry": entry, "entry_id": entry_id(entry),
           "model": {"path": model, "id": model_id(model), "weights": model_fingerprint(model),
                     "shape": model_shape(model)},
           "repo": repo_of(repo) if repo else "", "commit": commit, "time": time.time()}
    if file:
        out["entry_file"] = file
    if data:
        out["data"] = {"path": data, "fingerprint": data_fingerprint(data)}
    return out


def read_record(root: Path) -> dict | None:
    """The record of the run that owns `root`, or None (absent, or not one: corrupt, planted, too big)."""
    p = root / RECORD
    try:
        if p.is_symlink() or p.stat().st_size > 65536:
            return None
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if is_record(data) else None


def is_record(data) -> bool:
    """Whether `data` has a run identity record's shape (read_record's, and a remote manifest's identity)."""
    return (isinstance(data, dict) and isinstance(data.get("names"), list) and len(data["names"]) == 2
            and all(isinstance(n, str) for n in data["names"]) and isinstance(data.get("entry"), str)
            and isinstance(data.get("model"), dict) and isinstance(data["model"].get("path"), str)
            and isinstance(data["model"].get("shape", {}), dict) and isinstance(data.get("repo"), str))


def write_record(root: Path, record: dict) -> None:
    from podkit.records import write_json

    root.mkdir(parents=True, exist_ok=True)
    write_json(root / RECORD, record)


def has_checkpoint(root: Path) -> bool:
    """AReaL resumes when the save root holds recover info (RecoverInfo.load reads step_info.json first)."""
    return (root / "recover_info" / "step_info.json").is_file()


def differences(mine: dict, theirs: dict | None, root: Path) -> list[str]:
    """How the run that owns `root` differs from this one: THE definition of "the same run". Two runs are one
    when their names, their entry (resolved in the checkout: ./train.py is train.py), their model (its full
    hub id or resolved local path, unless the weights are the same files; never other weights) and their repo (however its URL is
    written: https and ssh forms are one repo) are the same. The commit is not compared: a new commit of the
    same repo is the normal fix-and-push, and resumes. Without a record (a checkpoint from before podkit kept
    one), only what the checkpoint itself says: its model's shape."""
    out = []
    if theirs is not None:
        if theirs["names"] != mine["names"]:
            out.append(f"its names are {'/'.join(theirs['names'])}, this run's {'/'.join(mine['names'])}")
        tf, mf = (r.get("entry_file") if isinstance(r.get("entry_file"), str) else "" for r in (theirs, mine))
        if (tf != mf) if tf and mf else entry_id(theirs["entry"]) != entry_id(mine["entry"]):
            out.append(f"it was trained by {theirs['entry']}{f' ({tf})' if tf and tf != theirs['entry'] else ''}, "
                       f"this run runs {mine['entry']}{f' ({mf})' if mf and mf != mine['entry'] else ''}")
        # Another dataset: another path that names other contents. The same path edited (a bad row fixed, a
        # pull of the repo's data) is this run's data; the same files moved are too.
        td, md = (r.get("data") if isinstance(r.get("data"), dict) else {} for r in (theirs, mine))
        tp, mp = (str(d.get("fingerprint") or "") for d in (td, md))
        moved = os.path.normpath(str(td.get("path") or "")) != os.path.normpath(str(md.get("path") or ""))
        if tp and mp and tp != mp and moved:
            out.append(f"its training data is {td.get('path')}, this run's {md.get('path')} (other contents)")
        tm, mm = theirs["model"], mine["model"]
        tw, mw = (str(m.get("weights") or "") for m in (tm, mm))
        same_id = (tm.get("id") or model_id(tm["path"])) == (mm.get("id") or model_id(mm["path"]))
        if tw and mw and tw != mw:
            out.append(f"its model's weights ({tm['path']}) are not this run's ({mm['path']})"
                       + (": the directory was written over by another model" if same_id else ""))
        elif not same_id and not (tw and tw == mw):  # the same weights at a new place are the same model
            out.append(f"its model is {tm['path']}, this run's {mm['path']}")
        if repo_of(theirs["repo"]) != repo_of(mine["repo"]):
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


def set_aside(root: Path) -> list[Path]:
    """The earlier runs under root's names that `start-over` moved aside, oldest first."""
    return sorted(root.parent.glob(f"{glob_escape(root.name)}.set-aside-*")) if root.parent.is_dir() else []


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


_WANDB_RUN = re.compile(r"(?:offline-)?run-\d{8}_\d{6}-(.+)")


def wandb_logged(log_dir: str | Path) -> set[str]:
    """The W&B ids that runs under these names logged into from this volume: wandb's own run directories in
    AReaL's log directory of the names (<log_dir>/wandb/[offline-]run-<time>-<id>), which no start-over or
    checkpoint removal touches. Bounded: a huge or planted directory is read in part."""
    out = set()
    try:
        with os.scandir(Path(log_dir) / "wandb") as it:
            for i, e in enumerate(it):
                if i >= 4096:
                    break
                m = _WANDB_RUN.fullmatch(e.name)
                if m and e.is_dir(follow_symlinks=False):
                    out.add(m.group(1))
    except OSError:
        pass
    return out


def wandb_id(root: Path, base: str, resuming: bool, logged: set[str] = frozenset()) -> str:
    """The W&B run a start of the run at `root` logs into. AReaL names it <experiment>_<trial>_<id_suffix>
    (`base`) with resume="allow": a run that resumes keeps the W&B run its record names, and every other start
    (from step 0, or a resume of a run that never logged to W&B) gets the first of base, base-2, base-3, ...
    that no run under these names used: none logged into it (`logged`, wandb_logged) and no record names it
    (this run's, and those `start-over` set aside). A run from step 0 thus never writes into a run whose steps
    W&B would keep over its own."""
    own = read_record(root)
    kept = (own or {}).get("wandb")
    if resuming and isinstance(kept, str) and kept:
        return kept
    used = set(logged)
    for rec in [own, *(read_record(d) for d in set_aside(root))]:
        if rec is None:
            continue
        if "wandb" not in rec:
            used.add(base)  # a record from before podkit chose: that run logged (if at all) on AReaL's id
        elif isinstance(rec["wandb"], str) and rec["wandb"]:
            used.add(rec["wandb"])  # None: W&B was off, nothing logged
    if base not in used:
        return base
    n = 2
    while f"{base}-{n}" in used:
        n += 1
    return f"{base}-{n}"


def own_run(cfg, verb: str):
    """The run whose checkpoints `verb` changes, refused where they may be in use: (names, save root, the
    trainer's supervisord info or None)."""
    from podkit import records
    from podkit.errors import ConfigError, PodkitError
    from podkit.host import lease, supervisord

    if cfg.multi_node and cfg.cluster.rank != 0:
        raise PodkitError("this is not the cluster's rank 0, whose trainer owns the run", "run it on rank 0's pod")
    holder = lease.read(cfg.state_dir)
    if lease.live(holder, cfg.guard.lease_s) and not lease.same_container(holder):
        raise PodkitError(f"another pod holds this workspace ({lease.describe(holder, cfg.guard.lease_s)}): its "
                          "trainer may be using these checkpoints", "run it on that pod, or stop that pod first")
    run = names(cfg)
    last = records.PROGRESS.read(cfg.state_dir).get("run") or ""
    if not run.known and last.count("/") == 1:  # only AReaL's loader can tell: the names it last used
        run = Names(*last.split("/"), run.origins)
    for key, what, hint in run.problems():
        raise ConfigError(cfg.origin(key), key, what, hint=hint)
    if not run.known:
        raise PodkitError(f"the run's names are AReaL's to tell ({run}) and no trainer has said them yet",
                          "start the trainer once (it names the run in its log), or set trainer.trial")
    root = save_root(fileroot(cfg), run.experiment, run.trial)
    info = supervisord.process_info(cfg.socket_path, "trainer")
    if info and info.get("statename") not in supervisord.STOPPED_STATES:
        raise PodkitError(f"the trainer of run {run} is {info.get('statename')}: its checkpoints are in use",
                          f"stop it first (`podkit ctl stop trainer`), then run `podkit {verb}` again")
    return run, root, info


def _start_trainer(cfg, info, run, say) -> None:
    from podkit.host import supervisord

    if info is None:
        return
    try:
        supervisord.rpc(cfg.socket_path).supervisor.startProcess("trainer", False)
        say(f"started the trainer of run {run}")
    except Exception as e:  # noqa: BLE001 - xmlrpc faults and socket errors alike: the change stands
        say(f"could not start the trainer ({e}): `podkit ctl start trainer`")


def adopt(cfg, dry_run: bool = False, say=print, then=lambda: None) -> int:
    """`podkit adopt`: the checkpoint under this run's names is this run's, although its record says another
    run wrote it (the same script renamed, the repo moved, the model copied elsewhere): the trainer's next
    start resumes it and writes its own record over the old one (kept beside it). For a refusal the user
    knows to be wrong; start-over is the way when the checkpoint is really another run's. `then()` runs once the
    change is made, before the trainer starts (the run's new lineage)."""
    from podkit.errors import PodkitError

    run, root, info = own_run(cfg, "adopt")
    if cfg.trainer.kind != "areal":  # the fake trainer's checkpoints say no run: adopting is the new lineage alone
        from podkit.errors import PodkitError
        from podkit.remote.checkpoint import CheckpointDir

        latest = CheckpointDir(cfg.checkpoint_dir).latest_path()
        if latest is None:
            raise PodkitError(f"run {run} has no checkpoint at {cfg.checkpoint_dir}: there is nothing to adopt",
                              "start the trainer: it trains from step 0")
        if dry_run:
            say(f"would make {latest} the run's line: a new lineage from it")
            return 0
        then()
        _start_trainer(cfg, info, run, say)
        return 0
    record = read_record(root)
    if not has_checkpoint(root):
        raise PodkitError(f"run {run} has no recover checkpoint at {root}: there is nothing to adopt",
                          "start the trainer: it trains from step 0")
    if dry_run:
        say(f"would mark the checkpoint in {root} as run {run}'s own: its next start resumes it")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if record is not None:
        from podkit.records import write_json

        write_json(root.parent / f"{root.name}.{RECORD}.before-{stamp}", record)
    write_record(root, {**(record or record_for(("", ""), "", "", "")), "adopt": time.time()})
    say(f"the checkpoint in {root} is run {run}'s own now: its next start resumes it"
        + (f" (the old record kept as {root.parent / f'{root.name}.{RECORD}.before-{stamp}'})" if record else ""))
    then()
    _start_trainer(cfg, info, run, say)
    return 0


def start_over(cfg, dry_run: bool = False, say=print, then=lambda: None) -> int:
    """`podkit start-over`: this run's checkpoints (AReaL's save root under its names) moved aside beside
    them, kept, never deleted; then the trainer started again if the pod runs. For a run that found
    another run's checkpoint under its names (check_run in hooks.py), or a user who wants step 0. `then()` runs
    once the volume's part is done, before the trainer starts: the run's new lineage, so that no pod restores the
    checkpoints it left from the remote (also when this volume holds none of them)."""
    from podkit import records
    from podkit.errors import PodkitError

    run, root, info = own_run(cfg, "start-over")
    if cfg.trainer.kind != "areal":  # the fake trainer keeps its checkpoints in checkpoint_dir, not AReaL's root
        root = Path(cfg.checkpoint_dir)
    if root.is_symlink():
        raise PodkitError(f"{root} is a symbolic link: podkit moves only a directory of its own",
                          "move it aside by hand (AReaL follows the link and finds the checkpoint)")
    if not root.is_dir():
        if dry_run:
            say(f"run {run} has no checkpoints at {root}: would begin a new lineage of the run")
            return 0
        say(f"run {run} has no checkpoints at {root}: it starts from step 0 as it is")
        then()
        return 0
    aside = root.with_name(f"{root.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    if dry_run:
        say(f"would move {root} to {aside}")
        return 0
    os.rename(root, aside)  # one directory, same filesystem: all of it or nothing
    say(f"moved the checkpoints of run {run} aside: {aside} (nothing deleted; move it back to resume it). "
        "Its next start trains from step 0, in a new W&B run when W&B is on (status names it)")
    # The old run's steps are not the new one's: the loop bound would count every step below them as no
    # progress, and status would show them.
    records.TRAINER_LOOP.path(cfg.state_dir).unlink(missing_ok=True)
    progress = records.PROGRESS.read(cfg.state_dir)
    if progress:
        records.PROGRESS.write(cfg.state_dir, {**progress, "step": None, "checkpoint_step": None,
                                               "resumed_at": None, "resumed_from": None})
    then()
    _start_trainer(cfg, info, run, say)
    return 0


def clear_discovery(cfg, run: Names) -> list[str]:
    """AReaL's discovery records of the run (a dead server's address, a used weight-update key). Names
    only AReaL can tell: every record under the root when it is podkit's private one, else none."""
    from podkit.areal import discovery

    root = cfg.trainer.name_resolve_root
    if run.known and not run.problems():
        return discovery.clear(root, run.experiment, run.trial)
    if os.path.normpath(root) == os.path.normpath(cfg.run_path / "name_resolve"):
        return discovery.clear_user(root)
    return [f"name_resolve records under {root} not cleared: the run's names are AReaL's to tell ({run})"]
