"""The pod's standing, worked out once: what the trainer is doing now and how its last run ended (Kubernetes'
`state` and `lastState`), whether the run can still train and why not, and how much of it is durable (the last
step whose checkpoint is off the pod, and what is at risk since).

`judge(Evidence)` is a pure rule over gathered evidence (tests/judge/test_standing.py states its invariants and checks
them over generated evidence); `gather` reads that evidence from the records, `of_supervisord` and `of_events`
turn supervisord's answer or the log listener's events into it. status.collect puts the standing in its answer;
status, doctor, metrics, the page and the log listener's cost guard render it and never work it out again."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from podkit import records
from podkit.host.supervisord import BACKOFF, EXITED, FATAL, RUNNING, STARTING, STOPPED, STOPPING
from podkit.judge import ending
from podkit.money import spend

# What the run is doing, in a word: `run` of the standing.
TRAINING, STARTING_, RESTARTING, FINISHED, STOPPED_, CANNOT, ENDED, NOT_RUNNING, UNKNOWN, SAFE_MODE, NO_TRAINER = (
    "training", "starting", "restarting", "finished", "stopped", "cannot-train", "ended", "not-running", "unknown",
    "safe-mode", "no-trainer")
RUNS = (TRAINING, STARTING_, RESTARTING, FINISHED, STOPPED_, CANNOT, ENDED, NOT_RUNNING, UNKNOWN, SAFE_MODE,
        NO_TRAINER)
SLACK_S = 1.0  # supervisord's start times are whole seconds and the listener stamps a start late


@dataclass(frozen=True)
class Program:
    """One program as supervisord (or the listener's events) has it: its state, since when, its last start and
    the pid of its last process (None where not known)."""
    state: str
    since: float | None = None
    started: float | None = None
    pid: int | None = None


@dataclass(frozen=True)
class Evidence:
    """What the standing is judged on. `reachable`: supervisord answers (None: not asked, the listener is its own
    evidence); `exited`: the recorded supervisord is certainly gone; `end`: the trainer's last end record, raw."""
    programs: dict[str, Program]
    end: dict | None = None
    ray_loop: dict = field(default_factory=dict)
    safe_mode: dict | None = None
    reachable: bool | None = True
    exited: bool = False
    booted: float | None = None  # this boot's start (records.CURRENT)
    now: float = 0.0
    asked: tuple = ()  # the stops asked for the trainer ({"by", "time"}, oldest first: ending.ASKED in the run dir)


@dataclass(frozen=True)
class Standing:
    run: str                 # one of RUNS
    can_train: bool | None   # None: not known (supervisord does not answer)
    why: str                 # why it cannot train, or what it does instead ("" while it trains)
    who: str                 # what must start again for it to train: "the trainer", "`ray`", "" (nothing will)
    since: float | None      # when the trainer entered its state (the stop's wait counts from it)
    state: dict              # the trainer now: {"name", "since", "pid"}
    last: dict | None        # its last end: {"kind", "family", "words", "time", "step", "this_run", ...}
    # The pod does not train and supervisord will not start its trainer (FATAL, EXITED, STOPPED not by you), whatever
    # the records say: what guard.stop_pod_after_s counts (autostop: idle is observed, the records give the words)
    stuck: bool = False

    def as_dict(self) -> dict:
        return {"run": self.run, "can_train": self.can_train, "why": self.why, "who": self.who,
                "since": self.since, "state": self.state, "last": self.last, "stuck": self.stuck}


def _this_run(end: ending.End | None, trainer: Program | None, booted: float | None) -> bool:
    """The end is the one of the trainer's last run: recorded since its start (since the boot where its start is
    not known), and by its process where both name one (an earlier run's "done" on the volume says nothing of a
    trainer that exited since)."""
    if end is None:
        return False
    start = trainer.started if trainer is not None and trainer.started is not None else booted
    if start is not None and (end.time or 0) < start - SLACK_S:
        return False
    named, pid = end.rec.get("program"), trainer.pid if trainer is not None else None
    return not (pid and isinstance(named, int) and not isinstance(named, bool) and named != pid)


def _last(end: ending.End | None, this_run: bool) -> dict | None:
    if end is None:
        return None
    return {"kind": end.kind.name, "family": end.family, "words": end.words(), "said": end.said(),
            "time": end.time, "step": end.step if isinstance(end.step, int) and not isinstance(end.step, bool)
            else None, "first": end.first(), "fix": end.hint or end.kind.fix or "", "this_run": this_run}


def judge(ev: Evidence) -> Standing:
    """The standing from the evidence alone (no clock, no files): the first rule that holds, in the order a
    person asks: is it up at all, is it stuck for good, did it finish, is it training."""
    end = ending.of(ev.end, now=ev.now or None)
    trainer = ev.programs.get("trainer")
    this_run = _this_run(end, trainer, ev.booted)
    last = _last(end, this_run)
    state = {"name": trainer.state if trainer else None, "since": trainer.since if trainer else None,
             "pid": trainer.pid if trainer else None}

    def out(run, can, why="", who="", since=None, stuck=False):
        return Standing(run, can, why, who, since, state, last, stuck)

    if ev.safe_mode:
        sm = ev.safe_mode
        return out(SAFE_MODE, False, f"in safe mode ({sm.get('stage')}): {sm.get('message')}", "",
                   sm.get("since") if isinstance(sm.get("since"), (int, float)) else None)
    if ev.reachable is False:
        return out(NOT_RUNNING, None, "the pod is not running (supervisord has exited)") if ev.exited else \
            out(UNKNOWN, None, "supervisord does not answer")
    for name in ("trainer", "sglang", "ray"):
        p = ev.programs.get(name)
        if p is not None and p.state == FATAL:
            return out(CANNOT, False, f"{name} FATAL (supervisord gave up starting it)", {"trainer": "the trainer",
                       "ray": "`ray`"}.get(name, name), p.since, stuck=True)
    ray = ev.programs.get("ray")
    loop = ev.ray_loop if isinstance(ev.ray_loop, dict) else {}
    if ray is not None and ray.state == EXITED and loop.get("gave_up") is True and \
            _num(loop.get("last_failure")) >= (_num(ray.started) or 0) - SLACK_S:
        return out(CANNOT, False, f"this node cannot join its cluster (the Ray head at {loop.get('head')})", "`ray`",
                   ray.since, stuck=True)
    if trainer is None:
        return out(NO_TRAINER, None, "no trainer program on this node")
    if trainer.state in (EXITED, STOPPED) and resuming(ev.asked, trainer, ev.now):
        return out(RESTARTING, True, "`podkit resume` is syncing and setting up the fix: it starts the trainer once "
                   "that is done", "the trainer", trainer.since)
    # A final end stays final (STOPPED too: the watchdog stops one whose script did not exit)
    if this_run and end.family == ending.FINAL and trainer.state in (EXITED, STOPPED):
        return out(CANNOT, False, f"the trainer stopped for good ({end.kind.name})", "the trainer", trainer.since,
                   stuck=True)
    if this_run and end.family == ending.FINISHED and trainer.state in (EXITED, STOPPED):
        return out(FINISHED, False, f"it finished its run {records.at_step(end.step)}", "", trainer.since)
    if trainer.state == STOPPED:
        by = stopped_by(ev.asked, trainer)
        if by.startswith("you"):  # on purpose: the pod stays up, whatever guard.stop_pod_after_s says
            return out(STOPPED_, True, f"the trainer is stopped by {by}: the cost guard leaves the pod up "
                       "(`podkit ctl start trainer` starts it)", "the trainer", trainer.since)
        return out(STOPPED_, True, f"the trainer is stopped ({f'by {by}' if by else 'not by podkit ctl'}) and nothing "
                   "will start it (`podkit ctl start trainer` does)", "the trainer", trainer.since, stuck=True)
    if trainer.state == EXITED:
        # Exited 0 (anything else is restarted) without a final or finished end of its own: nothing restarts it.
        return out(ENDED, None, f"the trainer exited ({last['words']}) and nothing will start it" if last and
                   last["this_run"] else "the trainer exited without recording a final end", "the trainer",
                   trainer.since, stuck=True)
    if trainer.state in (BACKOFF, STOPPING):
        return out(RESTARTING, True, "the trainer is restarting", "the trainer", trainer.since)
    if trainer.state == STARTING:
        return out(STARTING_, True, "", "", trainer.since)
    if trainer.state == RUNNING:
        return out(TRAINING, True, "", "", trainer.since)
    return out(UNKNOWN, None, f"the trainer is {trainer.state}", "the trainer", trainer.since)


def stopped_by(asked, trainer: Program) -> str:
    """Who asked for the trainer's stop that left it STOPPED: the last ask for it ("all" included) made within
    ending.ASKED_FRESH_S before the stop (since its start where the stop's time is not known); "" when nobody said."""
    at, start = trainer.since, trainer.started
    found = ""
    for a in asked if isinstance(asked, (list, tuple)) else ():
        t = _time(a.get("time")) if isinstance(a, dict) else None
        if t is None or a.get("program") not in ("trainer", "all") or not isinstance(a.get("by"), str):
            continue
        # since the trainer's last start (a stop you asked for may take its whole stop grace), else ASKED_FRESH_S
        lo = start - SLACK_S if start is not None else at - ending.ASKED_FRESH_S if at is not None else None
        if lo is not None and lo <= t and (at is None or t <= at + 5):
            found = a["by"][:200]
    return found


RESUME_HOLD_S = 1800.0  # `podkit resume` syncs and sets up the fix before it starts the trainer: no stop meanwhile


def resuming(asked, trainer: Program, now: float) -> bool:
    """`podkit resume` is under way for this stopped trainer: its ask came since the trainer stopped, within
    RESUME_HOLD_S."""
    since = trainer.since if trainer.since is not None else trainer.started
    for a in asked if isinstance(asked, (list, tuple)) else ():
        t = _time(a.get("time")) if isinstance(a, dict) else None
        if t is not None and a.get("kind") == "resume" and a.get("program") in ("trainer", "all") and \
                (since is None or t >= since - SLACK_S) and 0 <= now - t < RESUME_HOLD_S:
            return True
    return False


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else 0.0


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _time(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e11 else None


# -- the evidence, gathered ---------------------------------------------------------------------------------------
def of_supervisord(infos: list[dict], listener: dict) -> dict[str, Program]:
    """supervisord's getAllProcessInfo, with the listener's record (programs.json) for the pid of a process that
    has exited (supervisord says 0 then)."""
    out = {}
    for info in infos:
        name, state = info.get("name"), info.get("statename")
        rec = listener.get(name) if isinstance(listener.get(name), dict) else {}
        gone = state in (EXITED, STOPPED, BACKOFF, FATAL)
        start, stop = _time(info.get("start")), _time(info.get("stop"))
        pid = info.get("pid") or _int(rec.get("pid")) or None
        out[name] = Program(state, (stop or _time(rec.get("since"))) if gone else start, start, pid)
    return out


def of_events(states: dict) -> dict[str, Program]:
    """The log listener's own record of the programs' state changes (programs.json's shape)."""
    return {name: Program(rec.get("state"), _time(rec.get("since")), _time(rec.get("started_at")), _pid(rec.get("pid")))
            for name, rec in states.items() if isinstance(rec, dict) and isinstance(rec.get("state"), str)}


def _pid(v) -> int | None:
    """A pid recorded as something else (corrupt) is no process: it matches no end record's."""
    return None if v is None else _int(v) or -1


def gather(state_dir: Path, programs: dict[str, Program], reachable: bool | None = True, exited: bool = False,
           safe_mode: dict | None = None, now: float | None = None, run_dir: Path | None = None) -> Evidence:
    """The evidence from the records: the trainer's end (ending.read_kept: the volume's, or the run dir's copy
    while the volume is full), and the stops asked for (the run dir's, where it is known)."""
    return Evidence(programs, ending.read_kept(state_dir, run_dir), records.kept(records.RAY_LOOP, state_dir, run_dir),
                    safe_mode, reachable, exited, _time(records.CURRENT.read(state_dir).get("started")),
                    time.time() if now is None else now,
                    tuple(ending.ASKED.read_owned(run_dir)) if run_dir is not None else ())


# -- durability: what is off the pod ---------------------------------------------------------------------------------
def durable(remote: dict | None, step, cost: dict | None, now: float, configured: bool | None = None,
            run=None) -> dict | None:
    """The last step whose checkpoint is whole on the remote (records.REMOTE) and its age, what is at risk since
    (steps, and dollars at the price in force, with how sure that is), and the last upload's failure if it came
    after. None when the run has no remote (`configured` False, or no record and not told). `run`: the run the
    trainer records (progress.json); a record of another run (a volume a new run reuses) is not this run's."""
    remote = remote if isinstance(remote, dict) else {}
    if isinstance(run, str) and run and isinstance(remote.get("run"), str) and remote["run"] and remote["run"] != run:
        remote = {}  # nothing of this run off the pod yet (with a remote), never another run's step as its
    if configured is False or configured is None and not remote:
        return None
    up = remote.get("uploaded") if isinstance(remote.get("uploaded"), dict) else {}
    last = remote.get("last") if isinstance(remote.get("last"), dict) else {}
    d_step, d_time = _int(up.get("step")), _time(up.get("time"))
    rest = remote.get("restore") if isinstance(remote.get("restore"), dict) else {}
    if rest.get("outcome") == "restored" and _int(rest.get("step")) is not None and \
            (d_step is None or rest["step"] > d_step):
        # restored from the remote at a boot (a replacement pod without a network volume): on the remote, uploaded
        # by an earlier pod of the run when, this pod does not know
        d_step, d_time, up = rest["step"], None, {}
    step = _int(step)
    out = {"step": d_step, "time": d_time, "age_s": max(0.0, now - d_time) if d_time else None,
           "where": up["where"][:600] if isinstance(up.get("where"), str) else "",
           "at_risk_steps": max(0, step - (d_step or 0)) if step is not None else None,
           "at_risk_usd": None, "usd_sureness": "unknown", "failing": None}
    price = (cost or {}).get("per_hour")
    if isinstance(price, (int, float)) and price > 0 and cost.get("source") != "unknown":
        # the pod's time since the durable step (or since the run's start on this pod when nothing is durable)
        # (this pod's: an earlier pod's upload, before this pod started, does not count this pod's price from it)
        since = max((t for t in (d_time, _time((cost or {}).get("started"))) if t is not None), default=None)
        if since is not None:
            out["at_risk_usd"] = round(price * max(0.0, now - since) / 3600, 6)
            # the GPU catalogue's list price (RunPod showed none) is an estimate, even under a bill
            out["usd_sureness"] = "estimated" if cost.get("source") == "estimated" or \
                cost.get("price_from") == "catalogue" else "read"
    # `last` is the uploader's newest attempt: a failure since the last whole upload, or whatever its stamp once the
    # clock was stepped back past that upload (stamped ahead of now)
    if last.get("outcome") == "failed" and ((_time(last.get("time")) or 0) >= (d_time or 0)
                                            or d_time is not None and d_time > now + ending.FUTURE_S):
        out["failing"] = {"step": _int(last.get("step")), "why": str(last.get("why") or "")[:600],
                          "time": _time(last.get("time"))}
    out["blocked"], out["final"] = None, None

    def since(rec: dict) -> bool:  # nothing whole went up after it (or the upload's stamp is ahead of the clock)
        return (_time(rec.get("time")) or 0) >= (d_time or 0) or d_time is not None and d_time > now + ending.FUTURE_S
    lease = remote.get("lease") if isinstance(remote.get("lease"), dict) else {}
    if lease.get("outcome") == "blocked" and since(lease):
        # another pod holds the run's lease on the remote and nothing went up since: this pod's steps stay on its disk
        out["blocked"] = {"why": str(lease.get("why") or "")[:600], "time": _time(lease.get("time"))}
    final = remote.get("final") if isinstance(remote.get("final"), dict) else {}
    if final.get("outcome") in ("failed", "uploading") and since(final) and \
            (_int(final.get("step")) is None or d_step is None or final["step"] > d_step):
        # the pod's stop uploaded nothing newer (failed, or cut while "uploading" by the stop's kill)
        out["final"] = {"outcome": final["outcome"], "step": _int(final.get("step")),
                        "why": str(final.get("why") or "")[:600], "time": _time(final.get("time"))}
    # the boot's restore: under way (with its bytes), or given up (the trainer started without the remote's newest)
    out["restore"] = None
    if rest.get("outcome") in ("restoring", "retrying", "failed"):
        total, done = _int(rest.get("total")), _int(rest.get("got"))
        out["restore"] = {"outcome": rest["outcome"], "step": _int(rest.get("step")),
                          "where": str(rest.get("where") or "")[:600], "why": str(rest.get("why") or "")[:600],
                          "got": done if done is not None and done >= 0 else None,
                          "total": total if total is not None and total >= 0 else None,
                          "time": _time(rest.get("time"))}
    # the remote holds a newer whole generation of this lineage than this pod's checkpoint (the uploader saw it)
    ahead = remote.get("ahead") if isinstance(remote.get("ahead"), dict) else {}
    a_step = _int(ahead.get("step"))
    out["ahead"] = {"step": a_step, "where": str(ahead.get("where") or "")[:600], "from": _int(ahead.get("from")),
                    "time": _time(ahead.get("time"))} \
        if a_step is not None and (step is None or step < a_step) else None
    # the lineage the steps belong to, named when the run has had more than one (a start-over, an adopt)
    lin = remote.get("lineage") if isinstance(remote.get("lineage"), dict) else {}
    count = _int(lin.get("count"))
    out["lineage"] = {"id": str(lin.get("id") or "")[:64] or "the first", "why": str(lin.get("why") or "")[:40],
                      "since": _time(lin.get("since")), "count": count} if count is not None and count > 1 else None
    return out


def durable_words(d: dict, now: float) -> str:
    """durable() in a line: "step 40 is off the pod (12m ago); at risk: 3 steps, ~$0.09 (read)"."""
    if d["step"] is None and (d.get("ahead") or (d.get("restore") or {}).get("outcome") in ("failed", "retrying")):
        out = "nothing this pod trained is off the pod yet"  # the remote may hold the run's older pods' steps
    elif d["step"] is None:
        out = "no checkpoint of this run is off the pod yet"
    else:
        out = f"step {d['step']} is off the pod ({_ago(d['age_s'])}" + (f", {d['where']}" if d["where"] else "") + ")"
    risk = []
    if d["at_risk_steps"]:
        risk.append(f"{d['at_risk_steps']} step(s)")
    if d["at_risk_usd"] is not None and (d["at_risk_steps"] or d["step"] is None):
        risk.append(f"~{spend.cents(d['at_risk_usd'])} ({d['usd_sureness']})")
    if risk:
        out += "; at risk if the pod is lost: " + ", ".join(risk)
    if d["failing"] and not (d.get("final") and d["final"]["step"] == d["failing"]["step"]):  # said once, below
        f = d["failing"]
        out += f"; the last upload failed ({_ago(now - f['time']) if f['time'] else 'when unknown'}" + \
            (f", step {f['step']}" if f["step"] is not None else "") + f"): {f['why']}"
    if d.get("blocked"):
        out += f"; nothing uploaded since {_ago(now - d['blocked']['time']) if d['blocked']['time'] else 'when unknown'}" \
            f": {d['blocked']['why']}"
    if d.get("final"):
        out += "; " + final_words(d["final"], now)
    if d.get("lineage"):
        lin = d["lineage"]
        out += f"; lineage {lin['id']} of {lin['count']}" + (f" (begun by {lin['why']}" + (
            f" {_ago(now - lin['since'])})" if lin.get("since") else ")") if lin.get("why") else "")
    if d.get("restore"):
        out += "; " + restore_words(d["restore"], now)
    if d.get("ahead"):
        out += "; " + ahead_words(d["ahead"])
    return out


def restore_words(r: dict, now: float) -> str:
    """The boot's restore, while under way or once given up."""
    if r["outcome"] == "restoring":
        size = f" ({(r['got'] or 0) / 1e6:.0f} of {r['total'] / 1e6:.0f} MB)" if r["total"] is not None else ""
        return f"restoring step {r['step']} from {r['where'] or 'the remote'}{size}"
    if r["outcome"] == "retrying":
        return f"restoring: the remote could not be read ({r['why']}), trying again"
    return (f"the boot's restore gave up ({_ago(now - r['time']) if r['time'] else 'when unknown'}): {r['why']}; the "
            "trainer started without the remote's newest checkpoint")


def ahead_words(a: dict) -> str:
    """The remote is ahead of this pod: what it holds, what this pod trains from, and the two ways on."""
    mine = f"step {a['from']}" if a["from"] is not None else "none"
    return (f"the remote holds a newer checkpoint of this lineage, step {a['step']} ({a['where'] or 'remote'}), than "
            f"this pod's ({mine}): this pod's steps are not uploaded under it. To train on from step {a['step']}: "
            "`podkit ctl stop trainer`, `podkit restore`, `podkit ctl start trainer`; to make this pod's line "
            "the run's: `podkit adopt` (a new lineage from this pod's checkpoint)")


def final_words(f: dict, now: float) -> str:
    """The stop's upload of the last checkpoint, when it did not put that checkpoint on the remote."""
    what = f"step {f['step']}" if f["step"] is not None else "the last checkpoint"
    when = _ago(now - f["time"]) if f["time"] else "when unknown"
    if f["outcome"] == "uploading":
        return f"the stop's upload of {what} began ({when}) and has not said it ended (a kill cuts it)"
    return f"at the stop ({when}), {what} was NOT uploaded: {f['why']}"


def _ago(s) -> str:
    if s is None:
        return "when unknown"
    s = max(0, int(s))  # a clock stepped back since: not "-50s ago"
    return f"{s // 3600}h{s % 3600 // 60:02d}m ago" if s >= 3600 else f"{s // 60}m ago" if s >= 60 else f"{s}s ago"


def behind(d: dict | None, limit_s: float, training: bool, started: float | None, now: float) -> str:
    """The durability guard (guard.durable_within_s): why the last durable step is too far behind ("" while it is
    not): a run that trains, whose newest durable checkpoint (or, with none, its start on this pod) is older than
    the limit while there are steps at risk."""
    if not d or not limit_s or not training:
        return ""
    t = d["time"] or started
    if t is None or now - t <= limit_s or not d["at_risk_steps"]:  # None: no step recorded, none at risk
        return ""
    what = f"the last durable checkpoint is step {d['step']}, {_ago(now - t)}" if d["step"] is not None else \
        f"no checkpoint of this run has reached the remote since it started {_ago(now - t)}"
    why = f" (the last upload: {d['failing']['why']})" if d["failing"] else ""
    return f"{what}, more than guard.durable_within_s ({limit_s:g} s){why}"
