"""The run's guards in its record: `podkit guard set` and `guard clear` change the volume's guard file (guardfile.py),
and the log listener keeps the run's record (runrecord.py, kind "guards") in step with it, so that a pod of the
run without that volume (a replacement in another data center, a migrated pod) enforces the same budget and
maximum run time from its start, saying where they came from.

Per guard, the later change of the two wins: by its count of changes (`seq`, one more than the change it followed:
guardfile.after), then by when it was set (`set_at`, the time `podkit guard set` wrote): this
run's newer entry in the file goes into the record (a `guard clear` as a clear), and the record's newer one into
the file (a clear as the file's mark of one). Only this run's entries, on either side: another run's, under
the same names or on the same volume, are neither taken nor changed.

Each entry of the record is data: one of another run, of a key that is no guard, a value the config would refuse,
or set ahead of this clock, is not read. `decide` is pure; `sync` reads, decides, writes.
"""

from __future__ import annotations

import time
from pathlib import Path

from podkit import config
from podkit.errors import ConfigError
from podkit.money import guardfile, guards

AHEAD_S = 300.0  # a guard set further ahead of this clock would win over every later change: not believed


def recorded(entries: list[dict], run: str, now: float | None = None) -> dict:
    """This run's newest guard per key in the record's entries (RunRecord.entries("guards"), oldest first):
    {key: {"value", "over", "set_at", "by"} or {"cleared": True, "set_at", "by"}}."""
    now = time.time() if now is None else now
    out: dict = {}
    for e in entries:
        key, t = e.get("key"), e.get("set_at")
        if e.get("run") != run or key not in guards.KEYS or isinstance(t, bool) \
                or not isinstance(t, (int, float)) or not 0 < t <= now + AHEAD_S:
            continue
        by = e.get("pod") if isinstance(e.get("pod"), str) else "?"
        seq = e.get("seq", 0)
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= guardfile.SEQ_MAX:
            continue
        try:
            if e.get("cleared") is True:
                got = {"cleared": True, "set_at": float(t), "by": by[:64], "seq": seq}
            else:
                got = {"value": config.check("guard", key, e.get("value"), "the run's record", from_env=False),
                       "set_at": float(t), "by": by[:64], "seq": seq}
                if e.get("over") is not None:
                    got["over"] = config.check("guard", key, e["over"], "the run's record", from_env=False)
        except (ConfigError, ArithmeticError, TypeError, ValueError):
            continue
        if key not in out or (got["seq"], got["set_at"]) >= (out[key]["seq"], out[key]["set_at"]):
            out[key] = got
    return out


def came_from(r: dict) -> str:
    return f"the run's record (`podkit guard set` on pod {r['by']}, {time.strftime('%H:%M UTC', time.gmtime(r['set_at']))})"


def decide(mine: dict, rec: dict) -> tuple[dict, dict]:
    """(the file's changes, the record's new entries) for this run's entries in the file (`mine`, guardfile's) and
    in the record (`rec`, recorded()): per key, the one set later goes to the other side."""
    to_file, to_record = {}, {}
    for key in guards.KEYS:
        f, r = mine.get(key), rec.get(key)
        ft = f.get("time") if f else None
        fo = (f.get("seq") or 0, ft) if f and ft is not None else None  # the later change: seq, then time
        ro = (r.get("seq") or 0, r["set_at"]) if r else None
        if fo is not None and (ro is None or fo > ro):
            to_record[key] = f
        elif ro is not None and (fo is None or ro > fo):
            to_file[key] = {"cleared": True, "time": r["set_at"], "seq": r.get("seq") or 0} if r.get("cleared") else \
                {"value": r["value"], "time": r["set_at"], "seq": r.get("seq") or 0, "from": came_from(r),
                 **({"over": r["over"]} if "over" in r else {})}
    return to_file, to_record


def sync(book, workspace: Path, run: str, say, push_s: float = 30.0) -> None:
    """One look: the record's newer guards of this run into the guard file, the file's newer ones into the record
    (its mirror; the caller's sync pushes them). A guard file that cannot be read is left as it is (its readers
    say why); the record then waits."""
    if book is None:
        return
    rec = recorded(book.entries("guards"), run)
    p = guardfile.path(workspace)
    _, problem = guardfile.read(p)
    if problem:
        return
    took: dict = {}
    sent: dict = {}

    def change(mine: dict) -> dict:
        to_file, to_record = decide(mine, rec)
        took.clear(), took.update(to_file)
        sent.clear(), sent.update(to_record)
        return {**mine, **to_file}
    p.parent.mkdir(parents=True, exist_ok=True)
    if guardfile.update(p, change, run, keep_bad=True) is None:
        return
    for key, e in sent.items():
        kept = {"cleared": True} if e.get("cleared") else {"value": e["value"], "over": e.get("over")}
        book.add("guards", {"key": key, "set_at": e["time"], "seq": e.get("seq") or 0, **kept}, push_s=0)
    if sent:
        book.push(push_s)
    for key, e in took.items():
        if not e.get("cleared"):
            say(f"guard.{key} {guards.show(key, e['value'])}: the run's, from {e['from']}, kept in {p}: this pod's "
                "guard file had it not, or an older one (a replacement without the volume, a migrated pod)")
