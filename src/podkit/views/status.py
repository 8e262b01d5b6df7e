"""`podkit status`: each program's state, pid, uptime and restarts, the trainer's progress and the
inference phase, from supervisord (over its unix socket) and the records on the volume."""

from __future__ import annotations

import http.client
import json
import time
import xmlrpc.client
from pathlib import Path

from podkit import programs, records
from podkit.host import proc, supervisord
from podkit.host.supervisord import FATAL, RUNNING, UP
from podkit.judge import ending, failure, health, standing, startup
from podkit.money import guards, ledger

RPC_TIMEOUT_S = 5.0  # status, the page and /metrics wait this long for supervisord, never for ever


def collect(workspace: Path, state_dir: Path | None = None, remote: bool | None = None) -> dict:
    """`state_dir`: this node's records (a cluster's other ranks keep theirs in .podkit/node-<rank>, and
    report themselves, not rank 0); by default the workspace's own. `remote`: whether checkpoint.remote is set
    (None: not known here; remote.json then says)."""
    state_dir = workspace / ".podkit" if state_dir is None else Path(state_dir)
    current = records.CURRENT.read(state_dir)
    out: dict = {"workspace": str(workspace), "supervisord": {"reachable": False}, "programs": {},
                 "trainer": {}, "inference": {}, "safe_mode": records.SAFE_MODE.read(state_dir) or None}
    infos = []
    sock = current.get("socket")
    if sock:
        try:
            server = supervisord.rpc(sock, timeout_s=RPC_TIMEOUT_S)  # alive but not answering: "does not answer"
            infos = server.supervisor.getAllProcessInfo()
            out["supervisord"] = {"reachable": True, "pid": server.supervisor.getPID(), "socket": sock}
        except (OSError, xmlrpc.client.Error, http.client.HTTPException) as e:  # cut mid-answer: no answer
            out["supervisord"] = {"reachable": False, "socket": sock, "error": str(e) or type(e).__name__,
                                  "exited": _gone(current.get("supervisord_pid")),
                                  "started": current.get("started")}
    programs = records.PROGRAMS.read(Path(current["run_dir"])) if current.get("run_dir") else {}
    for info in infos:
        name = info["name"]
        rec = programs.get(name) if isinstance(programs.get(name), dict) else {}
        running = info["statename"] == RUNNING
        out["programs"][name] = {
            "state": info["statename"], "pid": info["pid"] or None,
            "uptime_s": (info["now"] - info["start"]) if running else 0,
            "restarts": max(0, _count(rec.get("starts", 1)) - 1), "exitstatus": info["exitstatus"],
            "fatal": info["statename"] == FATAL, "started": info["start"] if info["statename"] in UP and info["start"] else None,
        }
    # The boot's timeline: a program restarted since its first start is an event on it, never its start
    out["startup"] = startup.timeline(state_dir, workspace / "logs",
                                      {n: p["started"] for n, p in out["programs"].items() if p.get("started")},
                                      restarted={n for n, p in out["programs"].items() if p["restarts"]})
    out["sync"] = records.SYNC.read(state_dir) or None
    out["watchdog"] = records.WATCHDOG.read(state_dir)[-3:]
    boots = records.BOOTS.read(state_dir)
    out["boots"] = {"total": len(boots), "last": boots[-1] if boots else None,
                    "resumed_at": records.RESUME.read(state_dir).get("time")}
    prog = records.PROGRESS.read(state_dir)
    out["trainer"] = {"step": prog.get("step"), "last_progress": prog.get("time"), "loss": prog.get("loss"),
                      "checkpoint_time": prog.get("checkpoint_time"), "weight_update_s": prog.get("weight_update_s"),
                      "checkpoint_step": prog.get("checkpoint_step"), "weight_version": prog.get("weight_version"),
                      "stopped": prog.get("stopped"), "kind": prog.get("kind"), "reward": prog.get("reward"),
                      "resumed_from_step": prog.get("resumed_at"), "logp_gap": prog.get("logp_gap"),
                      "code": prog.get("code"), "run": prog.get("run"), "reattach": prog.get("reattach"),
                      "episodes": failed_episodes(prog),
                      "wandb": prog["wandb"] if isinstance(prog.get("wandb"), str) else None}
    run_dir = Path(current["run_dir"]) if isinstance(current.get("run_dir"), str) and current["run_dir"] else None
    loop = records.kept(records.TRAINER_LOOP, state_dir, run_dir)  # the run dir's copy while the volume is full
    if loop.get("boot") == current.get("started"):
        counts = {c.key: _count(loop.get(c.key)) for c in ending.COUNTS.values()}
        if any(counts.values()):
            # The loop bound's counts in this boot: ends in a row without a new step, by kind.
            out["trainer"]["loop"] = {**counts, "last": (loop.get("error") or {}).get("type")
                                      and failure.summary(loop["error"]), "gave_up": bool(loop.get("gave_up"))}
        out["trainer"]["last_hour"] = last_hour(loop)
    out["cost"] = ledger.cost(state_dir)  # on RunPod: what this pod costs (cost.json, checked); else None
    join = records.RAY_LOOP.read(state_dir)
    if join.get("boot") == current.get("started") and (join.get("failures") or join.get("gave_up")):
        # A cluster node's `ray` that did not join the head (areal/ray_node.py), in this boot.
        out["ray"] = {"head": join.get("head"), "failures": join.get("failures") or 0, "why": join.get("why"),
                      "gave_up": bool(join.get("gave_up"))}
    # The standing, judged once from this evidence (standing.py); every view renders it
    exited = bool(out["supervisord"].get("exited"))
    out["standing"] = standing.judge(standing.gather(
        state_dir, standing.of_supervisord(infos, programs), reachable=out["supervisord"]["reachable"],
        exited=exited, safe_mode=out["safe_mode"], run_dir=run_dir)).as_dict()
    out["durable"] = standing.durable(records.REMOTE.read(state_dir), prog.get("step"), out["cost"], time.time(),
                                      configured=remote, run=prog.get("run"))
    inf = current.get("inference") or {}
    host, port = inf.get("host", "127.0.0.1"), inf.get("port", 30000)
    sglang = out["programs"].get("sglang")
    if out["supervisord"].get("exited"):
        # The pod is not running, so neither is its server: its log's last phase is history, and whatever
        # answers on its port now is not this pod's.
        out["inference"] = {"phase": "stopped"}
    else:
        out["inference"] = {"phase": health.inference_phase(host, port, workspace / "logs" / "sglang.log",
                                                            running=None if sglang is None else sglang["state"] in UP)}
    return out


def _gone(pid) -> bool:
    """The recorded supervisord is certainly gone (a pid not recorded as an int is not known to be)."""
    return isinstance(pid, int) and pid > 0 and proc.read_stat(pid) is None


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 10**15 else 0


def _when(v) -> float | None:
    """A record's Unix time, or None (records.PROGRESS's shape already refuses one that is not a time)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e11 else None


def printable(v, limit: int = 300) -> str:
    """A user's exception text as one printable line (it is data: a planted escape sequence stays out)."""
    return "".join(c if c.isprintable() else " " if c in "\n\t" else "?"
                   for c in str(v if v is not None else ""))[:limit]


def failed_episodes(prog: dict) -> dict | None:
    """Rollout episodes that failed in the user's workflow since the trainer's start (areal/episodes.py), read
    as data; None when none did."""
    ep = prog.get("episodes")
    if not isinstance(ep, dict) or not _count(ep.get("failed")):
        return None
    last = ep.get("last") if isinstance(ep.get("last"), dict) else {}
    out = {"failed": _count(ep["failed"]), "succeeded": _count(ep.get("succeeded")),
           "in_a_row": _count(ep.get("in_a_row")), "limit": _count(ep.get("limit")),
           "tripped": ep.get("tripped") is True, "time": _when(ep.get("time")),
           "last": {k: printable(last.get(k)) for k in ("type", "message", "where", "code", "hint")},
           "unreachable": printable(ep.get("unreachable"), 200), "unreachable_failed": _count(ep.get("unreachable_failed")),
           "unreachable_in_a_row": _count(ep.get("unreachable_in_a_row"))}
    out["own"] = max(out["failed"] - out["unreachable_failed"], 0)  # the workflow's; the rest never reached inference
    # inference's, not the workflow's: every failure never reached it, or the streak that stopped the trainer did
    out["server"] = bool(out["unreachable"]) and (out["unreachable_failed"] >= out["failed"] or (
        out["tripped"] and out["unreachable_in_a_row"] >= out["in_a_row"]))
    return out


def boot_failed(boot) -> str:
    """Why the last boot failed, when `podkit up` recorded it (`podkit boot` waits in safe mode instead)."""
    if not isinstance(boot, dict) or boot.get("outcome") != "failed" or not boot.get("reason"):
        return ""
    stages = boot.get("stages") if isinstance(boot.get("stages"), dict) else {}
    stage = next((n for n, o in stages.items() if o == "failed"), None)
    return (f"failed{' at ' + printable(stage, 40) if stage else ''}: {printable(boot['reason'], 600)}"
            + (f" (fix: {printable(boot['hint'], 400)})" if boot.get("hint") else ""))


def describe_episodes(ep: dict) -> str:
    last = ep["last"]
    total = ep["failed"] + ep["succeeded"]
    if ep["server"]:  # the server, not the workflow: where it was not found says it
        out = (f"rollout episodes that failed: {ep['failed']} of {total} since the trainer's start, none reaching "
               f"inference; the last: {ep['unreachable']}")
    else:
        out = (f"rollout episodes that failed in your workflow: {ep['own']} of {total} "
               f"since the trainer's start; the last: {last['type']}: {last['message']} at {last['where']}")
        if ep["unreachable_failed"]:
            out += f"; {ep['unreachable_failed']} more never reached inference ({ep['unreachable']})"
    if ep["tripped"]:
        out += f" ({ep['in_a_row']} in a row: the trainer was stopped with it, trainer.max_episode_failures)"
    return out + (f" (hint: {last['hint']})" if last["hint"] and not ep["server"] else "")


def _ago(ts) -> str:
    return f"{time.time() - ts:.0f}s ago" if ts else "never"


def last_hour(loop: dict, now: float | None = None) -> dict:
    """The trainer's starts in the last hour and, of its ends, the failures that came after a new step (the loop
    bound never stops a run that makes progress: these say what its restarts cost). The record is data."""
    from podkit.judge import loopbound

    now = time.time() if now is None else now
    started = [t for t in loop.get("started") or [] if isinstance(t, (int, float)) and 0 <= now - t < 3600]
    failing = loopbound.failing_with_progress(loop, now)
    return {"starts": len(started), "failed_after_progress": len(failing),
            "last": printable(failing[-1].get("what")) if failing else ""}


def _last_stop(st: dict) -> str:
    """How the trainer's last run ended, in words: the standing's `last` (its own record, judged this run's or an
    earlier one's by standing.judge)."""
    t, s = st["trainer"], st.get("standing") or {}
    last, ckpt = s.get("last"), records.checkpoint_at(t.get("checkpoint_step"))
    if last is not None and not last["this_run"] and s.get("run") == standing.NOT_RUNNING:
        return (f"the trainer recorded no end since the pod started {_ago(st['supervisord'].get('started'))} "
                f"(killed, out of memory or crashed); last {records.at_step(t.get('step')).removeprefix('at ')}, {ckpt}")
    if last is None:
        return (f"the trainer left no record of an end: last {records.at_step(t.get('step')).removeprefix('at ')} "
                f"{_ago(t.get('last_progress'))}, {ckpt}")
    out = f"{printable(last['said'], 600)} {_ago(last['time'])}, {ckpt}"
    if last["family"] == ending.FINAL and last["first"]:
        out += f"\n    why: {printable(last['first'], 600)}"
    if last["family"] in (ending.FINAL, ending.FAILURE) and last["fix"]:
        out += f"\n    fix: {printable(last['fix'], 600)}"
    return out


def human(st: dict) -> str:
    lines = []
    if st.get("safe_mode"):
        sm = st["safe_mode"]
        lines += [f"SAFE MODE since {_ago(sm.get('since'))}: {sm.get('stage')}: {sm.get('message')}",
                  f"  fix: {sm.get('hint')}" if sm.get("hint") else ""]
        if sm.get("traceback"):
            lines += ["  traceback (last lines):", *("    " + ln for ln in sm["traceback"].rstrip().splitlines()[-8:])]
        lines.append("")
    sv = st["supervisord"]
    if sv.get("reachable") or st.get("safe_mode") or not sv.get("exited"):
        lines.append(f"supervisord: {'pid ' + str(sv.get('pid')) if sv.get('reachable') else 'not reachable'}"
                     + (f" ({sv.get('error')})" if sv.get("error") else ""))
    else:
        lines.append("pod: not running (supervisord has exited); " + _last_stop(st))
    for name, p in st["programs"].items():
        if name == "logs":
            continue
        lines.append(f"  {name:<8} {p['state']:<9} pid {p['pid'] or '-':<7} up {p['uptime_s']:>6}s "
                     f"restarts {p['restarts']}")
    t = st["trainer"]
    lines.append(f"trainer: {records.at_step(t.get('step')).removeprefix('at ')}, last progress "
                 f"{_ago(t.get('last_progress'))}, {records.checkpoint_at(t.get('checkpoint_step'))}, "
                 + (f"weights v{t['weight_version']}" if t.get("weight_version") not in (None, "") else "no weights pushed")
                 + (f", resumed at step {t['resumed_from_step']}" if t.get("resumed_from_step") else ""))
    ra = t.get("reattach") or {}
    if ra.get("count") or ra.get("fell_back"):
        last = ra.get("last") or {}
        lines.append(f"  inference restarts the trainer went on through: {ra.get('count') or 0} re-attached"
                     + (f", {ra['fell_back']} fell back to a trainer restart" if ra.get("fell_back") else "")
                     + (f"; the last {_ago(last.get('time'))}: {last.get('outcome')}"
                        + (f" ({last['why']})" if last.get("outcome") == "fell back" and last.get("why") else "")
                        if last else ""))
    loop = t.get("loop") or {}
    if loop and not loop.get("gave_up"):
        others = [f"{loop[k]} {w}" for k, w in (("hangs", "hang(s)"), ("ooms", "out-of-memory end(s)"),
                                                  ("outside", "end(s) not the script's")) if loop.get(k)]
        lines.append(f"  loop bound: {loop.get('failures') or 0} failure(s) in a row without a new step"
                     + (f" (and {', '.join(others)})" if others else "")
                     + (f"; the last: {loop['last']}" if loop.get("last") else ""))
    hour = t.get("last_hour") or {}
    if hour.get("failed_after_progress", 0) >= 2:
        lines.append(f"  restarts: {hour['starts']} start(s) in the last hour, {hour['failed_after_progress']} after "
                     "a failure that followed a new step (it makes progress, so the loop bound lets it go on; each "
                     f"start costs its resume); the last: {hour['last']}")
    if t.get("episodes"):
        lines.append(f"  {describe_episodes(t['episodes'])}")
    if st.get("ray"):
        lines.append(f"  ray: {cannot_join(st['ray'])}")
    s = st.get("standing") or {}
    if (s.get("state") or {}).get("name") in ("EXITED", "STOPPED", "FATAL", "BACKOFF") and s.get("last"):
        lines.append("  " + _last_stop(st))
    if (s.get("stuck") or s.get("run") in (standing.CANNOT, standing.ENDED)) and sv.get("reachable"):
        lines.append(f"  it cannot train: {printable(s.get('why'), 600)}")
    code = t.get("code") or {}
    if code.get("entry"):
        lines.append(f"code: {code['entry']}" + (f" at {code['commit'][:12]}" if code.get("commit") else "")
                     + (" (with uncommitted changes)" if code.get("dirty") else "")
                     + (f"; run {t['run']}" if t.get("run") else ""))
    if t.get("wandb"):  # the W&B run this run logs into (a start from step 0 opens a new one)
        lines.append(f"W&B run: {t['wandb']}")
    lines.append(f"inference: {st['inference']['phase']}")
    if st.get("startup", {}).get("phases"):
        lines.append(startup.describe(st["startup"]))
    for act in st.get("watchdog") or []:
        lines.append(f"watchdog {_ago(act.get('time'))}: {act.get('action')} {act.get('program')}: {act.get('reason')}")
    sync = st.get("sync")
    if sync:
        lines.append(f"repo: {sync.get('mode')} at {(sync.get('new') or '?')[:12]} ({_ago(sync.get('time'))})"
                     + "".join(f"\n  {n}" for n in sync.get("notes") or []))
    last = (st.get("boots") or {}).get("last")
    if last:
        lines.append(f"boot: {_ago(last.get('time'))}, {last.get('outcome')}; before it: {last.get('last_stop')}")
        if boot_failed(last):
            lines.append(f"  it {boot_failed(last)}")
    if st.get("durable"):
        lines.append(f"checkpoints off the pod: {printable(standing.durable_words(st['durable'], time.time()), 900)}")
    if st.get("cost"):
        lines.append(f"cost: {ledger.words(st['cost'])}")
    if st.get("guards"):
        from podkit.money import guardfile

        lines += ["cost guards (on RunPod; `podkit guard set` changes them on the running pod):",
                  *("  " + ln for ln in guardfile.human(st["guards"]))]
        lines += [f"  guard.{k}: {f['words']}" for k, f in (st.get("forecast") or {}).items()
                  if f.get("at") is not None or k == "max_spend" and (st["guards"]["guards"].get(k) or {}).get("value")]
    return "\n".join(ln for ln in lines if ln is not None)


RESTARTED_STALL_S = 600.0  # the image's HEALTHCHECK start period: what a container start gets


def cannot_join(join: dict) -> str:
    return (f"this node cannot join its cluster: the Ray head at {join.get('head')} " +
            (f"did not take it in {join.get('failures')} starts in a row; `ray` stays stopped until `podkit ctl "
             "start ray`" if join.get("gave_up") else f"did not take it ({join.get('failures')} failed start(s) "
             "in a row, restarting with a back-off)") + f"; the last: {join.get('why')}")


def health_problem(st: dict, progress_timeout_s: float, multi_node: bool = False) -> str | None:
    """None when healthy: supervisord answers, both programs run, inference is ready, and the
    trainer stepped recently (before its first step, Docker's start period covers start-up)."""
    if st.get("safe_mode"):
        return f"safe mode: {st['safe_mode'].get('message')}"
    if not st["supervisord"].get("reachable"):
        return "supervisord is not reachable"
    if st.get("ray"):
        return cannot_join(st["ray"])
    s = st.get("standing") or {}
    # Over: the trainer's own record of finishing, judged this run's (a finished trainer that did not exit is
    # STOPPED by the watchdog: over too)
    finished = s.get("run") == standing.FINISHED
    last = s.get("last") if (s.get("last") or {}).get("this_run") else None
    for name in programs.NAMES:
        p = st["programs"].get(name)
        if name == "trainer" and finished:
            continue  # training is over: nothing is wrong with the pod
        if not p or p["state"] not in UP:
            why = last["first"] if last and last["family"] == ending.FINAL else ""
            return f"{name} is {p['state'] if p else 'missing'}" + (
                f" (stopped for good, {last['kind']}: {printable(why)})" if name == "trainer" and why else "")
    if not multi_node and st["inference"]["phase"] != "ready":  # a cluster's SGLang is AReaL's, in Ray
        return f"inference is {st['inference']['phase']}"
    last = st["trainer"].get("last_progress")
    started = max((p.get("uptime_s") or 0) for p in st["programs"].values())
    trainer = st["programs"].get("trainer") or {}
    if trainer.get("restarts") and not finished:
        # A trainer that keeps restarting is RUNNING or STARTING most of the time: once it has been
        # restarted, no step for RESTARTED_STALL_S (from the pod's start if it never stepped) is a failure,
        # however short each run. A restart that recovers (stale weights, the watchdog) steps before that.
        quiet = time.time() - last if last else started
        if quiet > min(progress_timeout_s, RESTARTED_STALL_S):
            return (f"trainer restarted {trainer['restarts']} time(s) and has not stepped for {quiet:.0f}s "
                    f"(limit {min(progress_timeout_s, RESTARTED_STALL_S):.0f}s once restarted)")
    if last and time.time() - last > progress_timeout_s and started > progress_timeout_s:
        return f"no training progress for {time.time() - last:.0f}s (limit {progress_timeout_s:.0f}s)"
    return None


def main(workspace: Path, as_json: bool, health_check: bool = False, progress_timeout_s: float = 1800,
         multi_node: bool = False, cfg=None) -> int:
    st = collect(workspace, cfg.state_dir if cfg is not None else None,
                 remote=bool(cfg.checkpoint.remote) if cfg is not None else None)
    if cfg is not None and not health_check:
        from podkit.money import guardfile

        st["guards"] = guardfile.report(cfg)  # the values in force and where each comes from
        # when each would stop the pod, on what evidence: worked out once (guards.forecast), rendered here
        st["forecast"] = guards.forecast(st, st["guards"]["guards"], time.time(),
                                            total_steps=cfg.trainer.max_steps)
    if health_check:
        problem = health_problem(st, progress_timeout_s, multi_node)
        print(f"unhealthy: {problem}" if problem else "healthy")
        return 1 if problem else 0
    print(json.dumps(st, indent=2) if as_json else human(st))
    return 0 if st["supervisord"].get("reachable") else 1
