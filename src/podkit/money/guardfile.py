"""Cost guards changed on a running pod: `<workspace>/.podkit/guards.json`, on the volume.

RunPod restarts a pod whose env is edited ("clearing all data outside your volume mount path"), so the
cost guards of a running pod change here instead: `podkit guard set stop_pod_at=+6h` writes the file
(temp + rename), and what enforces the guards reads it each time it looks, re-reading it only when it
changed (one stat a second at most): the log listener (guard.stop_pod_at, guard.stop_pod_when_finished,
guard.stop_pod_after_s, guard.max_spend) and safe mode (guard.stop_pod_after_s, guard.stop_pod_at).

Each entry names the value it replaced (`over`): it holds while the pod's own setting (config file or
env) is still that value. An env edit on a stopped pod is newer than the file, so it wins at the pod's
next start, and the stale entry is ignored, saying so. The entries are kept per run (run_id()):
`{"runs": {<run>: {<key>: {"value", "over", "time"}}}}`; a run's `guard set` and `guard clear` change its own
and never another run's, and another run's on a reused volume is said, not obeyed. `guard clear` leaves a
mark (`{"cleared": true, "time"}`): the run's record (guardrecord.py, which the log listener keeps in step with
this file) learns of the clear, and a replacement pod does not take the cleared guard back from it. An entry
that came from the run's record says so (`from`). A file of the older shape (`{<key>: {..., "run"}}`) is read
as its entries' runs'.

The file is data on a volume, not trusted: a symlink, a file that is not this user's or that others may
write, more than MAX_BYTES, or any key or value the config itself would refuse, and the whole file is
ignored (logged once per change of the file, naming the file, the key and what is wrong); the pod's own
settings hold. Depends on config, records and log only; stdlib at import (safe mode imports it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from pathlib import Path

from podkit import config, records
from podkit.errors import ConfigError, PodkitError
from podkit.money import guards, ledger, spend
from podkit.money.guards import KEYS, parse, show
from podkit.money.ledger import RUN_ENV, RUN_ID, run_id

NAME = "guards.json"
ENTRY_FIELDS = ("value", "over", "time", "run", "from", "cleared", "seq")
SEQ_MAX = 10**9  # a guard's count of changes (`seq`): more is not a count podkit made
MAX_BYTES = 16384  # four entries of a run take a few hundred bytes
MAX_RUNS = 16  # runs kept in one file: past it the run whose entries are oldest goes (never the writer's own)
LOOK_EVERY_S = 1.0  # the enforcers look often (every event, every 0.2 s): one stat a second at most


def path(workspace) -> Path:
    return Path(workspace) / ".podkit" / NAME


def read(p: Path) -> tuple[dict, str]:
    """The file's entries by run ({run: {key: {"value", "over", "time", "run"[, "from"]} or {"cleared": True,
    "time", "run"}}}), or ({}, what is wrong with it). A missing file is no entries and nothing wrong."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return {}, ""
    except OSError as e:
        return {}, f"cannot be looked at ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return {}, "is a symbolic link (podkit writes a plain file: `podkit guard set`)"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return {}, f"cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return {}, "is not a regular file"
        if st.st_uid != os.getuid():
            return {}, f"is owned by uid {st.st_uid}, not {os.getuid()} (podkit's user): not written by `podkit guard`"
        if st.st_mode & 0o022:
            return {}, f"can be written by others (mode {stat.S_IMODE(st.st_mode):o})"
        if st.st_size > MAX_BYTES:
            return {}, f"is {st.st_size} bytes, more than any guard file ({MAX_BYTES})"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        return {}, f"cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        return {}, f"is more than {MAX_BYTES} bytes"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}, "is not JSON (truncated, empty or binary)"
    if not isinstance(data, dict):
        return {}, f"is JSON {type(data).__name__}, not an object of guards"
    try:
        return _by_run(data, str(p)), ""
    except ConfigError as e:
        return {}, f"{e.key}: {e.problem}"
    except (ArithmeticError, TypeError, ValueError) as e:  # a number no float holds: 1e400 written out
        return {}, f"holds a value that is not a setting ({type(e).__name__})"


def _by_run(data: dict, source: str) -> dict:
    if "runs" not in data:  # the older shape: one entry per key, naming its run
        out: dict = {}
        for key, e in data.items():
            entry = _entry(key, e, source)
            out.setdefault(entry["run"], {})[key] = entry
        return out
    runs = data["runs"]
    if set(data) != {"runs"} or not isinstance(runs, dict) or len(runs) > MAX_RUNS:
        raise ConfigError(source, "runs", f"expected {{\"runs\": {{<run>: {{<key>: ...}}}}}} of at most {MAX_RUNS} "
                          f"runs, got {json.dumps(data)[:80]}")
    out = {}
    for run, entries in runs.items():
        if not RUN_ID.match(run) or not isinstance(entries, dict):
            raise ConfigError(source, f"runs.{run[:64]}", f"not a run id with its guards ({entries!r:.60})")
        out[run] = {key: {**_entry(key, {**e, "run": run} if isinstance(e, dict) else e, source)}
                    for key, e in entries.items()}
    return out


def _entry(key: str, e: object, source: str) -> dict:
    if key not in KEYS:
        raise ConfigError(source, str(key)[:80], "not a guard that changes on a running pod",
                          hint=f"one of {', '.join(KEYS)}")
    if not isinstance(e, dict) or ("value" not in e and e.get("cleared") is not True) or set(e) - set(ENTRY_FIELDS):
        raise ConfigError(source, key, f"expected {{\"value\": ..., \"over\": ..., \"time\": ...}}, got {e!r:.80}")
    run = e.get("run", "")
    if not isinstance(run, str) or not RUN_ID.match(run):
        raise ConfigError(source, key, f"run {run!r:.40} is not a run id")
    t = e.get("time")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool)
                          or not 0 <= t <= time.time() + records.FUTURE_SKEW_S):
        raise ConfigError(source, key, f"time {t!r:.40} is not a time")
    seq = e.get("seq", 0)
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= SEQ_MAX:
        raise ConfigError(source, key, f"seq {seq!r:.40} is not a count of changes")
    if e.get("cleared") is True:  # `podkit guard clear`'s mark: the run's record learns of the clear
        if t is None or "value" in e:
            raise ConfigError(source, key, f"a cleared guard has its time and no value, got {e!r:.80}")
        return {"cleared": True, "time": float(t), "run": run, "seq": seq}
    out = {"value": config.check("guard", key, e["value"], source, from_env=False), "run": run, "seq": seq}
    if e.get("over") is not None:
        out["over"] = config.check("guard", key, e["over"], f"{source} (over)", from_env=False)
    if t is not None:
        out["time"] = float(t)
    if e.get("from") is not None:
        if not isinstance(e["from"], str) or len(e["from"]) > 200 or not e["from"].isprintable():
            raise ConfigError(source, key, f"from {e['from']!r:.40} is not where a guard came from")
        out["from"] = e["from"]
    return out


def live(entries: dict) -> dict:
    """A run's entries that are guards (not `guard clear`'s marks)."""
    return {k: e for k, e in entries.items() if not e.get("cleared")}


@contextlib.contextmanager
def _locked(p: Path):
    """`podkit guard` and the log listener (guardrecord.py) both change the file: one at a time, by a lock on its
    directory (no file of its own beside it), released when the change is written."""
    fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a volume without locks: each write is still whole (temp and rename)
            pass
        yield
    finally:
        os.close(fd)


def update(p: Path, change, run: str | None = None, keep_bad: bool = False) -> dict | None:
    """Run `run`'s entries changed by `change(entries) -> entries` under the lock, every other run's kept; a file
    that cannot be read (what is wrong is said by the readers) is started again, or with `keep_bad` left as it is
    (None). Returns the run's entries."""
    run = run_id() if run is None else run
    with _locked(p):
        by_run, problem = read(p)
        if problem and keep_bad:
            return None
        if problem:
            by_run = {}
        mine = change(dict(by_run.get(run, {})))
        if mine == by_run.get(run, {}) and not problem:
            return mine
        by_run[run] = mine
        _write(p, by_run, keep=run)
    return mine




def resolve(by_run: dict, base: dict, run: str | None = None) -> tuple[dict, dict]:
    """(the values in force, {key: why an entry is not used}) for the pod's settings `base`: this run's entries
    (`read`'s, by run). Another run's (an earlier run's file on a reused volume, another run's pod on the same
    volume) is not this run's to obey, and never replaces this run's."""
    run = run_id() if run is None else run
    values, stale = dict(base), {}
    mine = by_run.get(run, {})
    for key, e in live(mine).items():
        if "over" in e and key in base and e["over"] != base[key]:
            stale[key] = (f"was set over {show(key, e['over'])}, but the pod's setting is now {show(key, base[key])} "
                          f"(an edit of its env or config since): the setting holds; `podkit guard clear {key}`")
        else:
            values[key] = e["value"]
    for other in sorted((r for r in by_run if r != run), key=lambda r: max(
            (e.get("time") or 0 for e in by_run[r].values()), default=0)):
        for key in live(by_run[other]):
            if key not in mine:
                stale[key] = (f"was set by another run ({other or 'one without a run id'}; this one is "
                              f"{run or 'without a run id'}): the pod's setting holds (another run's guard is "
                              f"never this run's: `podkit guard set {key}=...` sets this run's)")
    return values, stale


def _span(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


class Live:
    """The guards in force for an enforcer: the pod's settings (`base`) with the file's valid, current
    entries on top. `values()` is cheap (a stat a second at most) and never raises; every change of the
    file is said once through `say`, none more than once."""

    def __init__(self, workspace, base: dict, say) -> None:
        self.path, self.base, self.say = path(workspace), dict(base), say
        self.run = run_id()
        self.sig: object = "unread"
        self.entries: dict = {}  # this run's guards in the file
        self.stale: dict = {}
        self.said_stale: set[str] = set()
        self.current = dict(base)
        self.next_look = 0.0

    def values(self) -> dict:
        now = time.monotonic()
        if now >= self.next_look:
            self.next_look = now + LOOK_EVERY_S
            try:
                self._look()
            except Exception as e:  # noqa: BLE001 - a guard file must never be what stops an enforcer
                self._say(f"{self.path}: cannot be read ({type(e).__name__}: {e}); the pod's settings hold")
                self.current = dict(self.base)
        return self.current

    def from_file(self, key: str) -> bool:
        """The value in force for `key` is the file's (`podkit guard set`), not the pod's setting."""
        return key in self.entries and key not in self.stale

    def _say(self, msg: str) -> None:
        try:
            self.say(msg)
        except Exception:  # noqa: BLE001 - nor may saying so
            pass

    def _look(self) -> None:
        try:
            st = os.lstat(self.path)
            sig: object = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode, st.st_uid)
        except FileNotFoundError:
            sig = None
        except OSError as e:
            sig = ("error", e.errno)
        if sig == self.sig:
            return
        first, self.sig = self.sig == "unread", sig
        by_run, problem = read(self.path)
        before = self.current
        if problem:
            self._say(f"{self.path} {problem}: ignored, the pod's settings hold "
                      f"({'; '.join(f'guard.{k} {show(k, v)}' for k, v in self.base.items())})")
            by_run = {}
        entries = self.entries = live(by_run.get(self.run, {}))
        self.current, self.stale = resolve(by_run, self.base, self.run)
        stale = self.stale
        for key, why in stale.items():
            if f"{key}: {why}" not in self.said_stale:  # another run's entries stay: said once, not at every change
                self.said_stale.add(f"{key}: {why}")
                self._say(f"{self.path}: guard.{key} {why}")
        for key in KEYS:  # only what this enforcer goes by (safe mode has no budget to say)
            if key in self.base and (self.current[key] != before.get(key) or first and key in entries
                                     and key not in stale):
                src = "the pod's own setting"
                if key in entries and key not in stale:
                    came = entries[key].get("from")
                    src = f"from {came}, kept in {self.path}" if came else f"from {self.path} (`podkit guard set`)"
                self._say(f"guard.{key} is now {show(key, self.current[key])}, {src}")


# -- the verb: `podkit guard show | set KEY=VALUE... | clear [KEY...]` --------------------------------------

def pod_settings(cfg) -> dict:
    """{key: (value, where it comes from)}: the running pod's own settings, as rendered for its programs
    (<run_dir>/podkit.env, local disk) where this is that pod, else this config's."""
    out = {k: (getattr(cfg.guard, k), cfg.origin(f"guard.{k}")) for k in KEYS}
    run_dir = records.CURRENT.read(cfg.workspace_path / ".podkit").get("run_dir")
    try:
        with open(Path(run_dir or "/nonexistent") / "podkit.env", "rb") as f:
            lines = f.read(1 << 16).decode(errors="replace").splitlines()
    except OSError:
        return out
    rendered = dict(line.split("=", 1) for line in lines if "=" in line)
    for key in KEYS:
        raw = rendered.get(config.env_name("guard", key))
        try:
            value = config.check("guard", key, raw, "podkit.env") if raw is not None else None
        except ConfigError:
            value = None
        if value is not None and value != out[key][0]:
            out[key] = (value, "the running pod's settings")
    return out


def report(cfg) -> dict:
    """What `podkit status` and `podkit guard show` print: each guard's value in force and where it comes
    from, and what is wrong with the file, if anything."""
    settings = pod_settings(cfg)
    base = {k: v for k, (v, _) in settings.items()}
    p = path(cfg.workspace_path)
    by_run, problem = read(p)
    run = run_id()
    values, stale = resolve(by_run, base, run)
    entries = live(by_run.get(run, {}))
    guards = {}
    for key in KEYS:
        e = entries.get(key)
        if e and key not in stale:
            ago = f", {_span(time.time() - e['time'])} ago" if "time" in e else ""
            src = f"{e['from']}{ago}, kept in {p}" if e.get("from") else f"{p} (`podkit guard set`{ago})"
        else:
            src = f"config ({settings[key][1]})"
        guards[key] = {"value": values[key], "shown": show(key, values[key]), "from": src,
                       "setting": base[key], "stale": stale.get(key)}
    return {"file": str(p), "problem": f"{p} {problem}: ignored, the pod's settings hold" if problem else None,
            "run": run, "run_from": run_source(), "guards": guards}


def run_source(environ=None) -> str:
    """Where run_id() took this run's id from, in words."""
    environ = os.environ if environ is None else environ
    raw = environ.get(RUN_ENV, "")
    if raw and RUN_ID.match(raw):
        return f"{RUN_ENV}, set by podkit deploy"
    why = f" ({RUN_ENV} {raw[:40]!r} is not a run id)" if raw else ""
    if environ.get("RUNPOD_POD_ID", "").strip():
        return f"RUNPOD_POD_ID: a pod started without podkit deploy{why}"
    return f"none: not on RunPod{why}"


def human(rep: dict) -> list[str]:
    lines = [f"run id: {rep['run'] or '(none)'}  [{rep['run_from']}]"]
    lines += [f"guard.{k:<24} {g['shown']}  [{g['from']}]" for k, g in rep["guards"].items()]
    lines += [f"  WARNING: guard.{k} in {rep['file']} {g['stale']}" for k, g in rep["guards"].items() if g["stale"]]
    if rep["problem"]:
        lines.append(f"  WARNING: {rep['problem']}")
    return lines


def main(cfg, action: str, items: list[str], as_json: bool) -> int:
    state = cfg.workspace_path / ".podkit"
    if not state.is_dir():
        raise PodkitError(f"no podkit workspace at {cfg.workspace_path} (it has no .podkit/)",
                          "pass the pod's workspace: --workspace /workspace, or PODKIT_WORKSPACE")
    p = path(cfg.workspace_path)
    try:
        if action == "set":
            new = _set(cfg, p, items)
        elif action == "clear":
            _clear(p, items)
    except OSError as e:  # a full or read-only volume: said, the guards as they were
        raise PodkitError(f"cannot write {p} ({e.strerror or e}): nothing was {action}, the guards in force are "
                          "unchanged", "free space on the volume (`podkit doctor` names what fills it) or make it "
                          "writable, then run this again") from None
    if action not in ("set", "clear") and items:
        raise ConfigError("command line", "", f"show takes no settings ({' '.join(items)!r})",
                          hint="podkit guard set KEY=VALUE ...")
    rep = report(cfg)
    print(json.dumps(rep, indent=2) if as_json else "\n".join(human(rep)))
    if action != "show" and not as_json:
        print("the running pod applies this within a minute, without a restart (an edit of a RunPod pod's env "
              "restarts it: do that only on a stopped pod)")
    if action == "set" and not as_json:
        for line in forecast(state, new, rep):
            print(line)
    return 0


def forecast(state: Path, new: dict, rep: dict) -> list[str]:
    """What a guard just set does at once, said at the command: a budget at or below the run's spend, or a
    maximum run time already past, stops the trainer and the pod within the minute; a budget on a spend podkit
    cannot tell says so."""

    out = []
    budget = new.get("max_spend")
    safe = records.SAFE_MODE.read(state)
    if budget and rep["guards"]["max_spend"]["value"] == budget and safe:
        out.append(f"the pod is in safe mode ({safe.get('stage')}): no trainer runs and nothing reads its spend, so the "
                   "budget acts once the pod trains; in safe mode guard.stop_pod_after_s and guard.stop_pod_at stop it")
    elif budget and rep["guards"]["max_spend"]["value"] == budget:
        c = ledger.cost(state)
        total = spend.total(c)
        if total is None:
            why = spend.total_sureness(c) if c else "no cost.json yet (the log listener reads RunPod's price)"
            out.append(f"the run's spend is not known here ({why}): the budget acts once it is")
        elif total >= budget:
            out.append(f"the run has spent {spend.cents(total)} ({spend.total_sureness(c)}), at or past this "
                       "budget: the trainer stops with a checkpoint, then the pod, within the minute")
        else:
            out.append(f"the run has spent {spend.cents(total)} ({spend.total_sureness(c)}) of "
                       f"{spend.usd(budget)}")
    at = new.get("stop_pod_at")
    if at and rep["guards"]["stop_pod_at"]["value"] == at and at <= time.time():
        out.append("that time has passed: the pod stops within seconds (it waits in safe mode)" if safe else
                   "that time has passed: the trainer stops with a checkpoint, then the pod, within the minute")
    return out


def _set(cfg, p: Path, items: list[str]) -> dict:
    if not items:
        raise ConfigError("command line", "", "nothing to set", hint="podkit guard set " + guards.EXAMPLES)
    now = time.time()
    new = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip().removeprefix("guard.")
        if not eq:
            raise ConfigError("command line", item, "expected KEY=VALUE", hint="e.g. stop_pod_at=+6h")
        new[key] = parse(key, text, now)
    base = {k: v for k, (v, _) in pod_settings(cfg).items()}
    _, problem = read(p)
    if problem:
        print(f"podkit: warning: {p} {problem}: replaced", flush=True)
    update(p, lambda mine: {**mine, **{key: after(mine, key, {"value": value, "over": base[key], "time": now})
                                       for key, value in new.items()}})
    return new


def after(mine: dict, key: str, entry: dict) -> dict:
    """`entry` as the change that follows the run's entry for `key` in force (`seq` one more): the run's record
    (guardrecord.py) orders a guard's changes by it before their times, so a clock stepped back between two
    `podkit guard set` never brings the earlier value back."""
    return {**entry, "seq": int((mine.get(key) or {}).get("seq") or 0) + 1}


def _write(p: Path, by_run: dict, keep: str) -> None:
    """Every run's entries, each as {key: {value, over, time[, from]}} or a clear's mark; past MAX_RUNS the runs
    whose newest entry is oldest go (never `keep`, the writer's run)."""
    def newest(run: str) -> float:
        return max((e.get("time") or 0.0 for e in by_run[run].values()), default=0.0)
    runs = sorted((r for r in by_run if by_run[r] and r != keep), key=newest, reverse=True)[:MAX_RUNS - 1]
    data = {"runs": {r: {k: {f: v for f, v in e.items() if f != "run"} for k, e in by_run[r].items()}
                     for r in ([keep] if by_run.get(keep) else []) + runs}}
    records.write_json(p, data, mode=0o644)  # temp + fsync + rename
    os.chmod(p, 0o644)  # whatever the umask: the readers refuse a file that others may write


def _clear(p: Path, keys: list[str]) -> None:
    keys = [k.strip().removeprefix("guard.") for k in keys]
    for key in keys:
        if key not in KEYS:
            raise ConfigError("command line", f"guard.{key}", "not a guard that changes on a running pod",
                              hint=config._did_you_mean(key, KEYS) or f"one of {', '.join(KEYS)}")
    now = time.time()
    # a mark, not nothing: the run's record (guardrecord.py) learns of the clear, and never brings the guard back
    update(p, lambda mine: {**mine, **{k: after(mine, k, {"cleared": True, "time": now}) for k in keys or KEYS}})
