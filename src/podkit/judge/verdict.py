"""The judge of a trainer run's end: gather, then decide.

`gather` puts every piece of evidence of one run's end into one record first (Kubernetes'
ContainerStateTerminated is the model: exit code, signal, message, start and end, plus podkit's own); `decide`
names the end from that record alone. `decide` is a pure function: no file, clock, process or environment is
read in it, so that it can be tested over generated evidence (tests/judge/test_verdict.py), and it decides by what
caused what (the order and timing of events, each exception's own type and chain), never by which source is
read first.

The evidence, one dict (every field may be missing or None):
  rc          the program's exit code (torchrun's, the fake trainer's main); None: the program was killed
  started     when the run started; finished: when it was judged
  program     the trainer program's pid
  place       where the trainer runs: "pod", "up", "rehearse" (ending.place)
  own         the trainer's own record of this run (progress.json's `stopped`: finished, refused, ...)
  asked       this program's stop: {at, by, supervisord, kind, cut}; for a killed program, the note it left
  errors      every rank's exception since the start (failure.py's records, with their facts: oom, transient,
              unreachable, volume, checkpoint, base, through, alloc_bytes, memory_bytes)
  signalled   the stop signals ranks got since the start: [{rank, signal, at, forwarded}]
  silent      the ranks that ended without going through Python's exit: [{rank, pid, signal, exit}]
  oom         the kernel's OOM kills in the run's cgroup since the start, in words ("": none); cgroup: where
              the count was read ("": nowhere)
  oom_late    the same since the last step (or the finish) rank 0 noted; None: it noted none
  inference   supervisord's word on inference: {state, start, stop, ready, asked: [{by, at}]}; None on a cluster
  progress    {step, time}: the last step this run recorded and when
  hang        the watchdog's restart of this run: {time, reason, where, dump}
  lease       who holds the workspace when another pod took it ("": this pod, or nobody)

What each kind means and its words are ending.py's; the invariants the judge keeps are written in
docs/failures.md ("How a trainer run's end is judged") and checked by property tests.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

from podkit import records
from podkit.judge import ending

SLACK_S = 1.0  # an exception stamped this close before an ask is counted after it (two processes' clocks)
SETTLE_S = 30.0  # after inference says it is ready, the requests it dropped while down are failing out


def _t(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# -- decide ------------------------------------------------------------------------------------------------------
def decide(ev: dict) -> dict:
    """The end of the run `ev` describes: an end record's fields (ending.record adds its time and program)."""
    step = (ev.get("progress") or {}).get("step")
    errors = sorted((e for e in ev.get("errors") or [] if isinstance(e, dict) and _t(e.get("time")) is not None),
                    key=lambda e: (e["time"], repr(sorted(e.items(), key=repr))))  # a tie: by content, not order
    own = ev.get("own") if isinstance(ev.get("own"), dict) and _t((ev.get("own") or {}).get("time")) is not None \
        and (ev.get("own") or {}).get("by") != ending.ENDED else None  # "no record" is never a record's word
    okind = ending.kind(own.get("by")) if own else None
    asked = ev.get("asked") if isinstance(ev.get("asked"), dict) and _t((ev.get("asked") or {}).get("at")) else None
    silent = [s for s in ev.get("silent") or [] if isinstance(s, dict)]
    if own and okind.family == ending.GONE:
        return own
    if asked is None and ev.get("rc") is not None:  # a rank signalled directly, before any failure: a stop
        asked = kill_of(ev, errors, silent)
    if own and okind.family == ending.FINISHED:
        return after_finish(ev, own, asked, errors, silent, step)
    if ev.get("rc") is None:  # the program was killed before it judged: what it left, in the old judge's order
        return killed(ev, own, asked, errors, step)
    if asked is not None:
        at = asked["at"]
        first = [e for e in errors if e["time"] < at - SLACK_S]  # raised before the ask: a cause of its own
        if own and okind.family in (ending.FINAL, ending.FAILURE) and own["time"] < at - SLACK_S:
            return own  # refused (or inference never came) before anyone asked for a stop
        if not first:
            return stopped(ev, asked, own, step)
        errors = first
    elif own and okind.family in (ending.FINAL, ending.FAILURE):
        if okind.name in (ending.NEVER_TRAINED, ending.ENDED_EARLY) and errors and errors[0]["time"] < own["time"]:
            # A rank failed first; torchrun's SIGTERM then ended this one through the script's own handler.
            return of_error(ev, errors[0], silent, step)
        return own  # the trainer's own word: refused, never trained, inference never came
    elif own and (okind.family == ending.RESTART or okind.family == ending.STOP and okind.name != ending.SIGTERM):
        return own  # the stale-weights restart, inference stopped: the trainer's own word, restarted
    if own and okind.name == ending.SIGTERM and not errors:
        # The ranks stopped on a SIGTERM this program never got: someone signalled them.
        return {"by": ending.STRAY, "message": own.get("message", ""), "step": own.get("step", step),
                "asked": "a SIGTERM sent to the ranks, not to the trainer program (someone's kill)"}
    if errors and died_first(ev, silent):
        # A rank the kernel or a crash killed (torch's agent saw it die; no stop signal reached it) went first: the
        # other ranks' exceptions ("Connection closed by peer") are its fallout.
        end = of_silence(ev, silent, step, before=_t(errors[0]["time"]))
        end["evidence"] = [*(end.get("evidence") or []), f"then rank {errors[0].get('rank', '?')}: {summary(errors[0])} "
                           "(its fallout)"]
        return end
    if errors:
        return of_error(ev, errors[0], silent, step)
    return of_silence(ev, silent, step)


DEATHS = {"SIGKILL", "SIGBUS", "SIGSEGV", "SIGABRT", "SIGILL", "SIGFPE"}  # a rank's end that no rank's failure causes


def died_first(ev: dict, silent: list) -> list:
    """The ranks that ended without a word by a kill or a crash (the signal torch's agent reported) and got no stop
    signal first (torchrun's teardown SIGTERMs the others, which notes it): they died before any rank failed."""
    noted = {s.get("rank") for s in ev.get("signalled") or [] if isinstance(s, dict)}
    return [s for s in silent if s.get("signal") in DEATHS and s.get("rank") not in noted]


def after_finish(ev: dict, own: dict, asked: dict | None, errors: list, silent: list, step) -> dict:
    """A run that recorded its finish: finished, unless something failed after it. After a finish, a failure is
    a failure: rank 0's exception (what runs after train(): a push), any rank's exception out of a later train()
    call, a rank that died without a word (a signal, os._exit(n)), an OOM kill since the finish, a non-zero exit
    nothing else explains. Another rank's own exception after the finish is teardown noise (rank 0 still runs)."""
    late = [e for e in errors if e["time"] > own["time"]
            and (e.get("rank", 0) in (0, None) or e.get("through") == "train")]
    noise = [e for e in errors if e["time"] > own["time"] and e not in late]
    rc = ev.get("rc")
    failed = rc not in (0, None)
    dead = [s for s in silent if s.get("signal") or s.get("exit") or failed]
    # An OOM kill counted from the finish's note (a kill the run stepped past is not after it) that ended the
    # program or a rank: one of another process (inference) with the trainer's exit 0 is not the trainer's.
    oom = (ev.get("oom_late") or "") if dead or rc != 0 else ""
    done = f"after training finished ({records.at_step(own.get('step'))}, its checkpoint whole): "
    if asked is not None and (late[0]["time"] >= asked["at"] - SLACK_S if late else dead or oom or failed):
        return stopped(ev, asked, own, step)  # what failed after the finish, the stop cut short (a push)
    if late:
        end = of_error({**ev, "oom": "", "oom_late": None}, late[0], [], own.get("step", step))
        end["message"] = done + (end.get("message") or summary(late[0]))
        return end
    if dead or oom:
        end = of_silence({**ev, "hang": None, "inference": None, "rc": rc or 1, "oom": oom}, dead,
                         own.get("step", step))
        end["message"] = done + str(end.get("message") or "")
        return end
    if failed and not noise:
        return {"by": ending.FAILED, "step": own.get("step", step),
                "message": f"{done}the trainer then exited {rc} with no exception recorded (logs/"
                           f"{ev.get('name') or 'trainer'}.log has what it printed)"}
    return own


def killed(ev: dict, own: dict | None, asked: dict | None, errors: list, step) -> dict:
    """A program killed before it judged its run (the watchdog's hang restart, the OOM killer, supervisord's
    SIGKILL after the grace): its own record, the SIGTERM it noted, the watchdog's restart, the kernel's count.
    The ranks' notes and errors from after the kill are its aftermath (the next start stops what was left)."""
    if own and ending.kind(own.get("by")).family in (ending.FINAL, ending.GONE):
        return own
    if asked is not None:
        return stopped(ev, asked, own, step)
    hang = ev.get("hang") if isinstance(ev.get("hang"), dict) else None
    cut = _t((hang or {}).get("time"))
    before = [e for e in errors if cut is None or e["time"] < cut]
    if hang:  # the watchdog's restart first, as before: its kill is what the kernel and the ranks then saw
        return of_silence({**ev, "oom": "", "signalled": []}, [], step)
    if not ev.get("oom") and before:
        return of_error(ev, before[0], [], step)
    return of_silence({**ev, "signalled": []}, [], step)


def kill_of(ev: dict, errors: list, silent: list) -> dict | None:
    """The first stop signal a rank got that the trainer program did not hand on, as the ask it is: someone's
    kill (restarted to resume, never counted). Not when a rank failed before it or ended without a word:
    torchrun stops the other ranks after one ends."""
    stray = sorted((s for s in ev.get("signalled") or [] if isinstance(s, dict) and not s.get("forwarded")
                    and _t(s.get("at")) is not None), key=lambda s: s["at"])
    if not stray or silent or any(e["time"] <= stray[0]["at"] for e in errors):
        return None
    s = stray[0]
    return {"at": s["at"], "supervisord": False,
            "by": f"a {s.get('signal') or 'stop signal'} sent to rank {s.get('rank', '?')}, not by podkit (someone's "
                  "kill)"}


def stopped(ev: dict, asked: dict, own: dict | None, step) -> dict:
    fields = {"asked": asked.get("by") or "", "cut": bool(asked.get("cut")) or None,
              "step": own.get("step") if own and own.get("step") is not None else step}
    at = _t(asked.get("at"))
    if at is not None and asked.get("noted"):
        fields["evidence"] = [str(asked["noted"])]
    elif at is not None and ev.get("clock"):
        fields["evidence"] = [f"a SIGTERM at {ev['clock']}, asked by {asked.get('by')}"]
    if asked.get("kind") == ending.HANG:  # the watchdog's restart of a hung trainer (a cluster's): a hang
        return {"by": ending.HANG, "message": asked.get("by", ""), "hint": ending.hang_fix({}), **fields}
    kind = ending.SIGTERM if asked.get("supervisord") else ending.STRAY
    return {"by": kind, "message": (own or {}).get("message", "") if own and own.get("by") == ending.SIGTERM else "",
            **fields}


def inference_at(ev: dict, t: float | None) -> str:
    """Inference at the moment `t`: "asked" (you stopped or restarted it), "stopped" (on request), "restarted"
    (down, and not back yet), "down", or "" (up, or back: a step since its restart, or ready a while)."""
    inf = ev.get("inference")
    if not isinstance(inf, dict) or not inf.get("state"):
        return ""
    started = _t(ev.get("started")) or 0.0
    asks = [a for a in inf.get("asked") or [] if isinstance(a, dict) and _t(a.get("at")) is not None
            and a["at"] >= started]
    yours = [a for a in asks if str(a.get("by") or "").startswith("you")]
    state = inf.get("state")
    up = state in ("STARTING", "RUNNING")
    stop, start = _t(inf.get("stop")), _t(inf.get("start"))
    if not up and t is not None and stop is not None and stop > started and \
            t < min([stop] + [a["at"] for a in asks if a["at"] <= stop]
                    + ([start] if start is not None and started < start <= stop else [])) - SLACK_S:
        # Raised while inference was still up: it went down (its ask, supervisord's stop time; a start during the
        # run: the instance before it was gone by then) after.
        return ""
    if not up:
        if yours:
            return "asked"
        if state == "STOPPED" or state == "STOPPING" and not asks:
            return "stopped"  # only a stop puts it there
        return "restarted" if state == "STOPPING" else "down"
    if start is None or start <= started:
        return ""  # up all along
    # Restarted during the run: from the ask (or the new start) until it was back.
    gone = min([start] + [a["at"] for a in asks if a["at"] <= start])
    back = [x for x in (_t((ev.get("progress") or {}).get("time")),) if x is not None and x > start]
    ready = _t(inf.get("ready"))
    if ready is not None and ready >= start:
        back.append(ready + SETTLE_S)
    if t is None:
        t = _t(ev.get("finished"))
    if t is None or t < gone - SLACK_S or back and t >= min(back):
        return ""
    return "asked" if yours else "restarted"


def _inference_end(ev: dict, inf: str, step, said: str, e: dict | None, rc) -> dict:
    if inf in ("asked", "stopped"):
        asks = [a for a in ((ev.get("inference") or {}).get("asked") or []) if isinstance(a, dict)]
        by = str(asks[-1].get("by") or "") if asks else ""
        return {"by": ending.INFERENCE_STOPPED, "step": step, "asked": by or None,
                "message": f"inference was stopped or restarted {'by ' + by if by else 'on request'} "
                           f"(`podkit ctl start sglang` starts a stopped one again){said}"}
    return {"by": ending.INFERENCE, "step": step, "where": (e or {}).get("where"), "error": e,
            "message": f"inference was {inf} while the trainer ran" + (said or f" (exit {rc})")}


def of_error(ev: dict, e: dict, silent: list, step) -> dict:
    """The end caused by the rank's exception `e` (the earliest: a rank that failed because it did, in a
    collective or in torchrun's teardown, is its fallout)."""
    rc = ev.get("rc")
    said = f"; the run ended with {summary(e)}"
    base = {"step": step, "where": e.get("where"), "error": e}
    oom = ev.get("oom") or ""
    if not silent and ev.get("oom_late") is not None:
        oom = ev["oom_late"]  # no rank was killed: a kill the run stepped past was another process's, not this end
    if e.get("volume"):
        return {**base, "by": ending.VOLUME, "message": f"the volume is {VOLUME_WORDS.get(e['volume'], 'failing')} "
                f"({e['volume']}) {records.at_step(step)}: {summary(e)}",
                "hint": ending.kind(ending.VOLUME_LOOP).fix}
    if e.get("checkpoint"):
        return {**base, "by": ending.CHECKPOINT, "message": f"the recover checkpoint cannot be loaded: {summary(e)}",
                "hint": e.get("hint") or ending.kind(ending.CHECKPOINT).fix}
    if e.get("oom") == "host" and isinstance(e.get("alloc_bytes"), int) and isinstance(e.get("memory_bytes"), int) \
            and e["alloc_bytes"] > e["memory_bytes"]:
        return {**base, "by": ending.FAILED, "message": summary(e),
                "hint": f"it asked for {size(e['alloc_bytes'])} at once, more than this machine has "
                        f"({size(e['memory_bytes'])}): a shape or a size in the code, not the pod's memory"}
    if e.get("oom"):
        return {**base, "by": ending.OOM, "evidence": [oom] if oom else None, "hint": ending.oom_fix(e["oom"]),
                "message": f"out of {e['oom']} memory {records.at_step(step)}: {summary(e)}"}
    if oom:
        who = ", ".join(f"rank {s.get('rank')}" for s in silent)
        killed = f"{who} killed by the kernel's OOM killer" if silent else "the kernel's OOM killer killed a process"
        return {**base, "by": ending.OOM, "evidence": [oom], "hint": ending.oom_fix("host"),
                "message": f"out of host memory {records.at_step(step)}: {killed}{said}"}
    inf = inference_at(ev, _t(e.get("time")))
    if inf:
        return _inference_end(ev, inf, step, said, e, rc)
    if e.get("unreachable"):  # the episodes' trip, every failure of it inference's
        return {**base, "by": ending.INFERENCE, "message": str(e["unreachable"]), "hint": e.get("hint", "")}
    if e.get("transient"):
        return {**base, "by": ending.NETWORK, "message": f"{e['transient']}: {summary(e)}", "hint": e.get("hint", "")}
    interrupted = e.get("base") == "KeyboardInterrupt"
    if interrupted and any(isinstance(s, dict) and s.get("signal") == "SIGINT" for s in ev.get("signalled") or []):
        return {"by": ending.STRAY, "step": step, "asked": "a SIGINT sent to a rank, not by podkit (someone's Ctrl-C "
                "or kill -INT)"}
    message = summary(e)
    if interrupted:  # no SIGINT came (every rank notes its own): the script's own raise, counted like any failure
        message += " (no SIGINT came: the script raised it itself)"
    if rc == 0:
        message += (" (raised in train(); your script caught it and exited 0)" if e.get("through") == "train"
                    else " (the script then exited 0)")
    fallout = [f"then {', '.join('rank ' + str(s.get('rank')) for s in silent)} ended without a word (torchrun's "
               "stop)"] if silent else None
    return {**base, "by": ending.FAILED, "message": message, "hint": e.get("hint", ""), "evidence": fallout}


def of_silence(ev: dict, silent: list, step, before: float | None = None) -> dict:
    """No rank said why: the ranks that ended without a word, the kernel, inference, the exit code. `before`: they
    ended before then (another rank's fallout was raised), so inference is asked about then."""
    rc = ev.get("rc")
    oom = ev.get("oom") or ""
    who = ", ".join(f"rank {s.get('rank')} (pid {s.get('pid')}{', ' + s['signal'] if s.get('signal') else ''})"
                    for s in silent)
    sigs = {s.get("signal") for s in silent if s.get("signal")}
    if "SIGBUS" in sigs:
        return {"by": ending.SHM, "step": step, "evidence": [f"{who}: SIGBUS"],
                "message": f"{who} crashed with SIGBUS: a write past the end of shared memory (/dev/shm full: the "
                           "DataLoader's workers and NCCL use it) or a driver fault",
                "hint": "give the container more shared memory (docker run --shm-size 16g, compose's shm_size; "
                        "RunPod pods have it sized by RAM), or fewer dataloader workers"}
    if oom:
        killed = f"{who} killed by the kernel's OOM killer" if silent else "the trainer was killed by the kernel's " \
                                                                            "OOM killer"
        return {"by": ending.OOM, "step": step, "evidence": [oom], "hint": ending.oom_fix("host"),
                "message": f"out of host memory {records.at_step(step)}: {killed}"}
    hang = ev.get("hang") if isinstance(ev.get("hang"), dict) else None
    if hang:
        return {"by": ending.HANG, "step": step, "where": hang.get("where"), "hint": ending.hang_fix(hang),
                "message": str(hang.get("reason") or "no step for watchdog.trainer_stall_s"),
                "evidence": [f"the watchdog's restart ({hang.get('dump') or 'no dump'})"]}
    inf = inference_at(ev, before)
    if inf and (rc != 0 or silent):
        return _inference_end(ev, inf, step, "", None, rc)
    if sigs & NATIVE_CRASH:
        return {"by": ending.FAILED, "step": step,
                "message": f"{who} crashed in native code ({', '.join(sorted(sigs))}): no Python exception (a CUDA "
                           "or extension fault; logs/trainer.log has what it printed)"}
    exits = [s for s in silent if not s.get("signal")]
    if exits and len(exits) == len(silent) and (rc == 0 or any(s.get("exit") for s in exits)):
        code = next((s["exit"] for s in exits if s.get("exit")), rc or 0)
        return {"by": ending.FAILED, "step": step,
                "message": f"{who} ended with exit {code} without going through Python's exit (os._exit) and "
                           f"without finishing its run {records.at_step(step)}",
                "hint": "a rank that calls os._exit ends the run without its record or checkpoint: raise instead, "
                        "or return from the script"}
    cgroup = ev.get("cgroup") or ""
    if silent or rc is None or rc in (137, -9):
        who = who or ("the trainer program" if rc is None else f"the trainer (exit {rc})")
        return {"by": ending.KILLED, "step": step,
                "message": f"{who} ended without a word: killed by {'/'.join(sorted(sigs)) or 'a signal'} that "
                           "podkit did not send" + ("" if rc is not None else " (no watchdog restart, no stop asked "
                                                    "for, no OOM kill on record)"),
                "hint": "an OOM kill leaves no trace where the cgroup cannot be read: check `dmesg` on the host; "
                        "else find who sends it",
                "evidence": ["no OOM kill on record" + (f" ({cgroup})" if cgroup else
                                                        " (no memory cgroup to read here)")]}
    if rc == 0:
        if ev.get("lease"):
            return {"by": ending.LEASE_LOST, "step": step, "message": f"another pod holds the workspace: {ev['lease']}"}
        return {"by": ending.ENDED, "step": step}
    return {"by": ending.FAILED, "step": step,
            "message": f"exit {rc}, no exception recorded (logs/{ev.get('name') or 'trainer'}.log has what it printed)"}


NATIVE_CRASH = {"SIGSEGV", "SIGABRT", "SIGILL", "SIGFPE"}
VOLUME_WORDS = {"ENOSPC": "full", "EDQUOT": "over its quota", "EIO": "failing (an I/O error)",
                "ESTALE": "gone from under the trainer (a stale network file handle)", "EROFS": "read-only"}


def summary(e: dict) -> str:
    first = str(e.get("message") or "").strip().splitlines()
    return f"{e.get('type', 'error')}: {first[0] if first else ''}".rstrip(": ") + \
        (f" at {e['where']}" if e.get("where") else "")


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- gather ------------------------------------------------------------------------------------------------------
def gather(cfg, rc, started: float, err: dict | None = None, oom_before=None, signals=None, name: str = "trainer",
           program_pid: int | None = None, killed: bool = False) -> dict:
    """Every piece of evidence of the run this program (or, `killed`, the program `program_pid` before it)
    started at `started`, read once."""
    import os

    from podkit.host import lease
    from podkit.judge import failure

    pid = os.getpid() if program_pid is None and not killed else program_pid
    ev: dict = {"rc": None if killed else rc, "started": started, "finished": time.time(), "program": pid,
                "place": ending.place(cfg), "name": name}
    own = ending.read(cfg.state_dir, since=started, program_pid=pid, run_dir=cfg.run_path)
    ev["own"] = own.rec if own is not None else None
    prog = records.PROGRESS.read(cfg.state_dir)
    ev["progress"] = {"step": prog.get("step"),
                      "time": prog.get("time") if isinstance(prog.get("step"), int) else None}
    if killed:
        got = ending.RECEIVED.read_owned(cfg.run_path)
        if got and got.get("pid") == program_pid and (got.get("time") or 0) >= started:
            ev["asked"] = {"at": got["time"], "by": got.get("by"), "supervisord": bool(got.get("supervisord")),
                           "noted": "it was killed after the stop's grace (supervisord's SIGKILL)"}
        hung = [a for a in records.WATCHDOG.read(cfg.state_dir) if a.get("program") == "trainer"
                and a.get("action") == "restarted" and (a.get("time") or 0) >= started]
        if hung:
            ev["hang"] = {k: hung[-1].get(k) for k in ("time", "reason", "where", "dump")}
    elif signals is not None and signals.at is not None:
        asked = signals.resolve()
        if asked is not None:
            ev["asked"] = {"at": asked.at, "by": asked.by, "supervisord": asked.supervisord, "kind": asked.kind,
                           "cut": bool(signals.cut)}
            ev["clock"] = time.strftime("%H:%M:%S", time.localtime(asked.at))
    errors = failure.all_since(cfg.run_path, started, pid)
    if err:
        errors = [{**err, "time": err.get("time") or time.time()}, *errors]
    ev["errors"] = errors
    ev["signalled"] = ending.rank_signals(cfg.run_path, started)
    if not killed:
        ev["silent"] = ending.silent_ranks(cfg.run_path, started, Path(cfg.log_dir) / f"{name}.log")
    ev["oom"] = ending.oom_since(oom_before)
    ev["oom_late"] = ending.oom_since_step(cfg.run_path, started)
    kills = ending.oom_kills()
    ev["cgroup"] = kills[1] if kills else ""
    ev["inference"] = inference(cfg, started)
    try:
        ev["lease"] = lease.lost(cfg.state_dir) or ""
    except Exception:  # noqa: BLE001 - the lease is data: what cannot be read takes nothing away
        ev["lease"] = ""
    return ev


def inference(cfg, started: float) -> dict | None:
    """supervisord's word on inference (its state, when it last started and stopped), the asks for its stop since
    `started`, and when its current instance said it was ready (its log); None on a cluster (AReaL's servers, in Ray) or with no supervisord to ask."""
    from podkit.host import supervisord
    from podkit.judge import startup

    if getattr(cfg, "multi_node", False):
        return None
    info = supervisord.process_info(cfg.socket_path, "sglang") or {}
    if not info:
        return None
    asks = [{"by": str(a.get("by"))[:200], "at": a.get("time")} for a in ending.ASKED.read_owned(cfg.run_path)
            if a.get("program") in ("sglang", "all") and (a.get("time") or 0) >= started]
    out = {"state": info.get("statename"), "start": info.get("start"), "stop": info.get("stop"), "asked": asks}
    if (info.get("start") or 0) > started:
        try:
            out["ready"] = startup.log_times(Path(cfg.log_dir) / "sglang.log").get("inference_ready")
        except Exception:  # noqa: BLE001 - a log is data
            pass
    return out


# -- the judgement, as an End ---------------------------------------------------------------------------------------
def judge(cfg, rc: int, started: float, err: dict | None = None, oom_before=None,
          signals: ending.Signals = ending.SIGNALS, name: str = "trainer") -> ending.End:
    """How the run this program started at `started` ended: its evidence gathered, then decided.
    `err` is the exception this process saw itself (the fake trainer runs in-process)."""
    ev = gather(cfg, rc, started, err, oom_before, signals, name)
    return _end(decide(ev), ev)


def judge_killed(cfg, ran: float, program_pid: int | None, oom_before=None) -> ending.End:
    """How the previous run ended when its program was killed before it could say (it never judged): the same
    judge, on what that program left (its own record, the SIGTERM it noted, the watchdog's hang restart, the
    OOM killer's count)."""
    ev = gather(cfg, None, ran, oom_before=oom_before, program_pid=program_pid, killed=True)
    return _end(decide(ev), ev)


def _end(fields: dict, ev: dict) -> ending.End:
    """The judged end as an End: the trainer's own record as it was stored, or a new record of this moment."""
    own = ev.get("own")
    if fields is own:
        return ending.End(own, stored=True)
    fields = {k: v for k, v in fields.items() if v is not None}
    by, message, hint = fields.pop("by"), fields.pop("message", ""), fields.pop("hint", "")
    rc = ev.get("rc")
    sig = next((s.get("signal") for s in ev.get("silent") or [] if isinstance(s, dict) and s.get("signal")), None)
    if sig is None and isinstance(rc, int) and rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
    return ending.End(ending.record(by, message, hint, rc=rc, signal=sig, started=ev.get("started"), program=ev.get("program"),
                      **fields))
