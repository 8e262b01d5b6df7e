"""The run's record: what must follow a run from pod to pod (its lineages, its pods and what each cost, its guards,
its restores and what they found), kept where the run lives: on the checkpoint remote, under
`<remote>/<experiment>/<trial>/run/`, when `checkpoint.remote` is set, else on the volume.

Neither RunPod's S3 API nor rclone has a conditional write, so no object is ever written by two pods: each entry is
an object of its own, named by its time and the pod that wrote it (`<kind>/<time_ns>-<pod>.json`), and the record
is read as the set of them. The one exception, a pod's own running figures (`pods/<pod>.json`: its spend), is
written by that pod alone. A mirror on the volume (`<workspace>/.podkit/run/<experiment>/<trial>/`) holds what was
read and what this pod wrote: an entry written while the remote is down is read from the mirror meanwhile and goes up
at the next sync. Without a remote the mirror is the record.

Entries are data, not truth: one that is not a JSON object of at most MAX_BYTES, or whose time is not a time, is
not read; what each kind's fields must be is checked by its reader (lineage here, the spend in money's reader).

Lineage: `podkit start-over` and `podkit adopt` begin a new lineage of the run (an entry of kind "lineage"). The
run's current lineage is its newest lineage entry whose identity is this run's (identity.differences finds
nothing); with none, the run is in its first lineage, "", whose generations sit at the top of the names' prefix
(the layout before lineages) unless another run's generations are there, and then it begins one of its own.
Each lineage has its own generations, manifests and lease (remote.Remote's `lineage`): an abandoned lineage is
kept, never restored, never called durable, and another run under the same names blocks nothing of this one's.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

from podkit import log, records
from podkit.areal import identity
from podkit.remote.mover import RemoteError

_log = log.get("remote")
KINDS = ("lineage", "pods", "guards", "restores")
MAX_BYTES = 64 << 10  # no entry podkit writes is near this: a larger object is not one
MAX_ENTRIES = 256  # per kind, the newest by name: a planted flood is read in part
LINEAGE_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
POD = re.compile(r"[^A-Za-z0-9_-]")
NAME = re.compile(r"^(\d{1,20})-([A-Za-z0-9_-]{1,64})\.json$")  # <time_ns>-<pod>.json
SYNC_TIMEOUT_S = 60.0
PENDING = ".pending"  # a mark per write not yet pushed (RunRecord._write)


def pod_id(pod: str) -> str:
    """A pod's name as a part of an object's name (RunPod's ids are already; a hostname may hold dots)."""
    return POD.sub("_", pod)[:64] or "pod"


class RunRecord:
    """The record of the run named `names` ((experiment, trial)), as pod `pod` reads and writes it. `remote` is a
    remote.Remote of the run (any lineage: the record sits beside the lineages), or None: the volume's mirror is
    the record. `run` is the run's id for its money (ledger.run_id: PODKIT_RUN_ID), stamped on every entry."""

    def __init__(self, state_dir: Path, names: tuple[str, str], remote=None, pod: str = "", run: str = "") -> None:
        self.names = names
        self.dir = Path(state_dir) / "run" / names[0] / names[1]
        self.remote = remote
        self.pod = pod_id(pod)
        self.run = run
        self.problem = ""  # what the last sync with the remote said ("" when it worked, or none was made)
        self.lasting = False  # that problem is one trying again does not mend (remote.RemoteError.lasting)
        self.synced = 0.0  # time.monotonic() of the last sync that worked

    @property
    def where(self) -> str:
        """Where the record lives, in the user's words."""
        return f"{self.remote.where(root=True)}/run" if self.remote is not None else str(self.dir)

    # -- writing ----------------------------------------------------------------------------------------------
    def add(self, kind: str, data: dict, push_s: float = SYNC_TIMEOUT_S) -> dict:
        """A new entry of `kind`: written to the mirror, then pushed to the remote within `push_s` (a push that
        fails leaves it in the mirror, pushed at the next sync: self.problem says why). Returns the entry."""
        assert kind in KINDS
        now = time.time()
        entry = {**data, "kind": kind, "time": now, "pod": self.pod, "run": self.run, "names": list(self.names)}
        self._write(kind, f"{time.time_ns():020d}-{self.pod}.json", entry)
        if push_s and self.remote is not None:
            self.push(push_s)
        return entry

    def own(self, kind: str, data: dict, push_s: float = 0.0) -> dict:
        """This pod's own entry of `kind` (`<kind>/<pod>.json`), written over: only this pod writes it."""
        assert kind in KINDS
        entry = {**data, "kind": kind, "time": time.time(), "pod": self.pod, "run": self.run,
                 "names": list(self.names)}
        self._write(kind, f"{self.pod}.json", entry)
        if push_s and self.remote is not None:
            self.push(push_s)
        return entry

    def _write(self, kind: str, name: str, entry: dict) -> None:
        """The entry in the mirror, and a mark that it is still to be pushed (`.pending/`, one mark per write, so
        that a write during a push is pushed by the next one, whatever the filesystem's clock tick)."""
        records.write_json(self.dir / kind / name, entry)
        # marked also without a remote: a start-over before checkpoint.remote was set goes up once it is (a pod's
        # own figures, written over each minute, are marked only with one)
        if self.remote is not None or name != f"{self.pod}.json":
            pending = self.dir / PENDING
            pending.mkdir(parents=True, exist_ok=True)
            (pending / f"{kind}~{name}~{time.time_ns()}-{os.getpid()}").touch()

    def _pending(self) -> tuple[list[str], list[str]]:
        """(the marks to push, the entries they name) now."""
        try:
            marks = sorted(os.listdir(self.dir / PENDING))
        except OSError:
            return [], []
        names = set()
        for m in marks:
            kind, _, rest = m.partition("~")
            name = rest.rpartition("~")[0]
            if kind in KINDS and (name == f"{self.pod}.json" or NAME.match(name)) and (self.dir / kind / name).is_file():
                names.add(f"{kind}/{name}")
        return marks, sorted(names)

    def push(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """This pod's entries written since the last push that worked onto the remote: one rclone call."""
        if self.remote is None:
            return True
        marks, mine = self._pending()
        if mine:
            with tempfile.NamedTemporaryFile("w", suffix=".files") as listing:
                listing.write("\n".join(mine) + "\n")
                listing.flush()
                try:
                    self.remote.rclone("copy", "--files-from-raw", listing.name, str(self.dir),
                                       f"{self.remote.root}/run/", timeout=timeout_s)
                except RemoteError as e:
                    self.problem = f"the run's record could not be written to {self.where} ({e})"
                    self.lasting = e.lasting
                    return False
        for m in marks:  # only the marks read before the push: a write during it has a mark of its own
            try:
                os.unlink(self.dir / PENDING / m)
            except OSError:
                pass
        self.problem = ""
        return True

    @property
    def unpushed(self) -> int:
        """How many of this pod's writes have not reached the remote yet."""
        return len(self._pending()[0])

    def unpushed_kinds(self) -> set[str]:
        """The kinds of this pod's entries that have not reached the remote yet."""
        return {name.partition("/")[0] for name in self._pending()[1]}

    def pull(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """Every entry on the remote into the mirror (what is there already is skipped): one rclone call. This pod's
        own entries too (a pod restarted onto an empty volume keeps its name: a hostname, RunPod's pod id; its
        start-over is the run's), but never its own running figures (`<kind>/<pod>.json`) over what it wrote since."""
        if self.remote is None:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.remote.rclone("copy", f"{self.remote.root}/run/", str(self.dir), "--max-size", str(MAX_BYTES),
                               "--max-depth", "2",
                               "--exclude", f"{self.pod}.json",
                               timeout=timeout_s)
        except RemoteError as e:
            if "directory not found" in str(e).lower():
                return True  # a run without a record yet
            if _full(self.dir):  # rclone's "no space left" is this pod's volume here, not the remote
                self.problem, self.lasting = (f"this pod's volume is full: the run's record cannot be mirrored at "
                                              f"{self.dir} (free space on the volume)"), False
                return False
            self.problem, self.lasting = f"the run's record could not be read from {self.where} ({e})", e.lasting
            return False
        return True

    def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """Push this pod's entries, then pull the others': True when both worked (self.problem says why not)."""
        ok = self.push(timeout_s) and self.pull(timeout_s)
        if ok:
            self.problem, self.synced = "", time.monotonic()
        return ok

    # -- reading ----------------------------------------------------------------------------------------------
    def entries(self, kind: str) -> list[dict]:
        """The entries of `kind` in the mirror, oldest first (by their time, then their name), each checked as
        data: a JSON object of at most MAX_BYTES whose time is a time; `_name` added. Another run's entries under
        these names are returned too: each kind's reader decides what is this run's."""
        d = self.dir / kind
        try:
            found = [n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".")]
        except OSError:
            return []
        # Named by a time past now (planted: no pod writes one) is not read: else a flood of such names took every
        # place of the newest MAX_ENTRIES, and the run's own entries went unread. A pod's own figures
        # (`<pod>.json`, no time in the name) are kept first, as ever.
        latest = (time.time() + records.FUTURE_SKEW_S) * 1e9
        timed = {n: int(m.group(1)) if (m := NAME.match(n)) else latest for n in found}
        names = sorted((n for n in found if timed[n] <= latest), key=lambda n: (timed[n], n),
                       reverse=True)[:MAX_ENTRIES]
        out = []
        for n in names:
            e = _read(d / n)
            if e is not None and e.get("kind") == kind:
                out.append({**e, "_name": n})
        return sorted(out, key=lambda e: (e["time"], e["_name"]))


def _full(path: Path) -> bool:
    """Whether the filesystem of `path` has no room left for the record (a megabyte)."""
    import shutil

    try:
        return shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


def _read(p: Path) -> dict | None:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size > MAX_BYTES:
            return None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    t = data.get("time") if isinstance(data, dict) else None
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0 \
            or t > time.time() + records.FUTURE_SKEW_S:
        return None
    return data


# -- lineage: a pure reading of the lineage entries ---------------------------------------------------------------
def _is_lineage(e: dict) -> bool:
    lid = e.get("id")
    return isinstance(lid, str) and (lid == "" or bool(LINEAGE_ID.match(lid))) and isinstance(e.get("why"), str) \
        and identity.is_record(e.get("identity"))


def same_run(mine: dict, theirs, root: Path) -> bool:
    """Whether identity record `theirs` is this run's (`mine`): identity.differences, THE definition."""
    return identity.is_record(theirs) and not identity.differences(mine, theirs, root)


def current(entries: list[dict], mine: dict, root: Path) -> dict | None:
    """This run's current lineage entry (oldest-first `entries`, RunRecord.entries("lineage")), or None: the run is
    in its first lineage unless another run's holds it (first_owner). Each lineage begun names the one it replaced
    (`parent`): the current one is the newest that no later one of this run's replaced, so a clock stepped back
    between two start-overs does not bring the first back; the times decide only between two begun from one."""
    ours = [e for e in entries if _is_lineage(e) and same_run(mine, e["identity"], root)]
    replaced = {e["parent"] for e in ours if isinstance(e.get("parent"), str) and e["parent"] != e["id"]}
    leaves = [e for e in ours if e["id"] not in replaced]
    return (leaves or ours)[-1] if ours else None


def first_owner(entries: list[dict], root: Path = Path("/nonexistent")) -> dict | None:
    """The identity of the run that claimed the first lineage ("") in the record, or None. A claim of a run that
    parted from it later (its "another-run" entry: two runs claimed it before either uploaded, and the lease told
    them apart) is not an owner's: else its claim, pushed with its parting, took the first lineage from the run whose
    generations are there."""
    parted = [e for e in entries if _is_lineage(e) and e.get("why") == "another-run"]
    for claim in (e for e in entries if _is_lineage(e) and e["id"] == ""):
        if not any(p["time"] >= claim["time"] and same_run(claim["identity"], p["identity"], root) for p in parted):
            return claim["identity"]
    return None


def ours_count(entries: list[dict], mine: dict, root: Path) -> int:
    """How many lineages this run has had: its entries' ids, and the first lineage ("") unless the run began in a
    lineage of its own (another run held the first)."""
    ours = [e for e in entries if _is_lineage(e) and same_run(mine, e["identity"], root)]
    ids = {e["id"] for e in ours}
    if not ours or ours[0]["why"] != "another-run":
        ids.add("")
    return len(ids)


def new_id(now: float | None = None) -> str:
    now = time.time() if now is None else now
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + os.urandom(3).hex()


def describe(ident: dict) -> str:
    """Another run in a few words: "model Qwen/Qwen2.5-0.5B, repo github.com/me/rl"."""
    model = ident.get("model", {}).get("path") if isinstance(ident.get("model"), dict) else None
    repo = ident.get("repo") or "(none: podkit's example)"
    return f"model {str(model or '?')[:120]}, repo {str(repo)[:120]}"


def decide(book: RunRecord, mine: dict, root: Path, first_identity=lambda: None, say=None) -> tuple[str, dict | None]:
    """This run's lineage, from the record's mirror: (its id, its entry or None for the first lineage). A run with
    no lineage of its own takes the first one, "", and claims it in the record, unless another run holds it (a
    claim in the record, else `first_identity()`: the identity of the newest whole generation at the top of the
    names' prefix, or None); then it begins a lineage of its own and says so through `say`."""
    entries = book.entries("lineage")
    cur = current(entries, mine, root)
    if cur is not None:
        return cur["id"], cur
    theirs = first_owner(entries)
    if theirs is None:
        theirs = first_identity()
    if theirs is not None and not same_run(mine, theirs, root):
        entry = book.add("lineage", {"id": new_id(), "why": "another-run", "identity": mine,
                                     "other": describe(theirs)})  # no parent: the first lineage was never its
        if say:
            say(f"another run ({describe(theirs)}) uses this run's names and prefix ({'/'.join(book.names)}): this "
                f"run's checkpoints go to a lineage of their own ({entry['id']}) and never mix with that run's; give "
                "this run its own names (trainer.experiment / trainer.trial) or prefix (checkpoint.remote)")
        return entry["id"], entry
    if first_owner(entries) is None:
        book.add("lineage", {"id": "", "why": "first", "identity": mine}, push_s=0)  # pushed at the next sync
    return "", None


def begin(book: RunRecord, mine: dict, why: str, push_s: float = 30.0, **more) -> dict:
    """A new lineage of the run (`podkit start-over`, `podkit adopt`, a part from another run): its entry, naming the
    lineage it replaces (`parent`: the current one), pushed within `push_s`."""
    cur = current(book.entries("lineage"), mine, Path("/nonexistent"))
    return book.add("lineage", {"id": new_id(), "why": why, "identity": mine, "parent": cur["id"] if cur else "",
                                **more}, push_s=push_s)
