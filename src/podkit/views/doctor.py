"""`podkit doctor`: inspect a live pod (or a workspace after the fact) and name the cause of a
failure, with its evidence and the fix. Each check is one failure of docs/failures.md; none needs
a person to read logs. Exit 1 when a problem is found (`info` findings do not count).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

from podkit import records
from podkit.boot import guard
from podkit.host import gpu, proc, supervisord
from podkit.judge import ending, health, startup
from podkit.money import ledger
from podkit.programs.watchdog import STARTUP
from podkit.views import status

# A log line is error evidence by an error's own marks: a traceback, an exception's name, CUDA's and the kernel's
# words for running out of memory, a fatal signal, an ERROR level. Not by a word it shares with progress: SGLang's
# "Capture cuda graph end. ... avail mem=0.00 GB" is an INFO line of every start.
ERROR_MARK = re.compile(r"Traceback \(most recent call last\)|\b(?:[A-Z]\w*)?(?:Error|Exception)\b|CUDA out of memory"
                        r"|\bout of memory\b|OutOfMemory|\bKilled\b|Segmentation fault|core dumped|\bFATAL\b"
                        r"|\bCRITICAL\b|\bERROR\b|(?:^|\s)error: |\bSIG(?:SEGV|ABRT|BUS|ILL|FPE)\b|NCCL error")
# A level below ERROR at the line's head ("INFO:", "[... TP0] WARNING ..."): whatever it says after it is not one
LOW_LEVEL = re.compile(r"\b(?:INFO|DEBUG|WARNING|WARN|NOTICE)\b")


def is_error(line: str) -> bool:
    """An error line of a program's log: an error mark (ERROR_MARK) not preceded by a lower level's tag."""
    m = ERROR_MARK.search(line)
    if m is None:
        return False
    low = LOW_LEVEL.search(line, 0, 80)
    return low is None or m.start() < low.start()


def error_evidence(lines: list[str], n: int = 5) -> list[str]:
    """The last `n` error lines (is_error) of a log's tail, each one printable line."""
    return [status.printable(ln.strip(), 400) for ln in lines if is_error(ln)][-n:]
OOM_LINE = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)|oom-kill", re.I)


class Finding:
    def __init__(self, id: str, title: str, evidence: list[str], fix: str, severity: str = "problem") -> None:
        self.id, self.title, self.evidence, self.fix, self.severity = id, title, evidence, fix, severity

    def to_dict(self) -> dict:
        return {"id": self.id, "severity": self.severity, "title": self.title, "evidence": self.evidence,
                "fix": self.fix}


class Pod:
    """What doctor reads: podkit's records on the volume, the logs, and supervisord when it answers."""

    def __init__(self, cfg, workspace: Path) -> None:
        self.cfg = cfg
        self.ws = workspace
        self.state = cfg.state_dir if cfg is not None and Path(cfg.workspace_path) == Path(workspace) else \
            workspace / ".podkit"
        self.logs = workspace / "logs"
        self.st = status.collect(workspace, self.state, bool(cfg.checkpoint.remote) if cfg is not None else None)
        current = records.CURRENT.read(self.state)
        self.programs = records.PROGRAMS.read(Path(current["run_dir"])) if current.get("run_dir") else {}
        self.progress = records.PROGRESS.read(self.state)
        self.boots = records.BOOTS.read(self.state)
        self.loop = records.TRAINER_LOOP.read(self.state)

    def log_tail(self, program: str, n: int = 400) -> list[str]:
        return health.tail(self.logs / f"{program}.log")[-n:]


def _ago(ts: float | None, now: float) -> str:
    return f"{now - ts:.0f}s ago" if ts else "never"


def check_rollouts_starved(pod: Pod, now: float) -> Finding | None:
    phase = pod.st["inference"]["phase"]
    waiting = [ln for ln in pod.log_tail("trainer", 200) if re.search(r"waiting for (rollouts|training batch)", ln, re.I)]
    if phase in ("ready", "stopped") + STARTUP or not waiting:  # stopped: the pod is not running
        return None
    return Finding("rollouts_starved", "the trainer waits for rollouts because inference is " + phase,
                   [f"inference phase: {phase}", f"trainer's last step: {pod.progress.get('step')} "
                    f"({_ago(pod.progress.get('time'), now)})", f"trainer log: {waiting[-1].strip()}"],
                   "the trainer is not the problem: read the tail of logs/sglang.log; supervisord restarts a dead "
                   "server and the watchdog an unresponsive one (`podkit ctl restart sglang` to force it)")


def check_restart_loop(pod: Pod, now: float) -> Finding | None:
    recent = guard.recent(pod.state, pod.cfg.guard.window_s, now)
    safe = (pod.st.get("safe_mode") or {}).get("stage") == "guard"
    if len(recent) < 3 and not safe:
        return None
    stops = sorted({b.get("last_stop", "") for b in recent[1:]})
    return Finding("restart_loop", f"restart loop: {len(recent)} boots in the last {pod.cfg.guard.window_s:.0f}s",
                   [f"boot at {time.strftime('%H:%M:%S', time.localtime(b['time']))}: {b.get('outcome')}"
                    + (f" ({b.get('reason')})" if b.get("reason") else "") for b in recent[-5:]]
                   + [f"stopped before: {s}" for s in stops[:3]],
                   "a crash at a fixed step is often this loop, not training: find the failing stage above; "
                   "`podkit resume` once it is fixed")


AREAL_UPDATE_WAIT_S = 120.0  # areal 1.0.4 remote_inf_engine.py:1389: name_resolve.wait(update_name, timeout=120)
AREAL_UPDATE_TIMEOUT = re.compile(r"Timeout waiting for key '[^']*/update_weights_from_disk/(\d+)'")
AREAL_UPDATE_DONE = re.compile(r"Loading weights from disk done in ([\d.]+)s")


def check_weight_update(pod: Pod, now: float) -> Finding | None:
    """Weight pushes near or past their limit: the fake trainer's `weight update ... took/timed out`
    lines against trainer.weight_update_timeout_s; AReaL's own lines against its fixed 120 s wait for
    the trainer's save (a timeout) and the time each update took."""
    lines = pod.log_tail("trainer")
    if pod.cfg.trainer.kind == "areal":
        limit, where = AREAL_UPDATE_WAIT_S, "AReaL's fixed wait"
        slow = [ln.strip() for ln in lines if AREAL_UPDATE_TIMEOUT.search(ln)
                or ((m := AREAL_UPDATE_DONE.search(ln)) and float(m.group(1)) > limit / 2)]
        hint = ("the update files go to local disk (<run_dir>/areal); a slow or full container disk makes the "
                "trainer's save miss AReaL's 120 s: check `df` in the pod, or use a smaller model per GPU")
    else:
        limit, where = pod.cfg.trainer.weight_update_timeout_s, "trainer.weight_update_timeout_s"
        slow = [ln.strip() for ln in lines if re.search(r"weight update .* (timed out|took)", ln)]
        hint = ("raise trainer.weight_update_timeout_s, checkpoint less often, or move the shared root off a "
                "slow network volume (see workspace_slow)")
    if not slow:
        return None
    return Finding("weight_update_slow", f"weight updates are slow against their {limit:.0f}s limit ({where})",
                   slow[-3:], hint)


def check_workspace(pod: Pod, now: float, min_free_bytes: int, min_mb_s: float) -> list[Finding]:
    out = []
    try:
        vfs = os.statvfs(pod.ws)
    except OSError as e:
        return [Finding("workspace_missing", f"workspace {pod.ws} cannot be read", [str(e)], "mount the volume")]
    free = vfs.f_bavail * vfs.f_frsize
    total = vfs.f_blocks * vfs.f_frsize
    if free < min_free_bytes:
        out.append(Finding("workspace_full", f"workspace {pod.ws} is nearly full",
                           [f"{free / 2**30:.2f} GiB free of {total / 2**30:.1f} GiB (needs {min_free_bytes / 2**30:.1f})"],
                           "delete old checkpoints you no longer need, or grow the volume; a full disk "
                           "corrupts nothing (checkpoints are atomic) but stops training"))
    probe = pod.state / f".doctor-write-{os.getpid()}"
    size = 16 << 20
    try:
        t0 = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        mb_s = size / 2**20 / (time.perf_counter() - t0)
    except OSError as e:
        return out + [Finding("workspace_unwritable", f"workspace {pod.ws} cannot be written", [str(e)],
                              "mount it read-write with free space")]
    finally:
        probe.unlink(missing_ok=True)
    if mb_s < min_mb_s:
        out.append(Finding("workspace_slow", f"workspace {pod.ws} writes at {mb_s:.0f} MB/s",
                           [f"16 MiB written and fsynced at {mb_s:.1f} MB/s (expected >= {min_mb_s:.0f})"],
                           "checkpoints and disk weight updates will be slow; use the pod's local disk for "
                           "the shared root, or a faster volume"))
    return out


KMSG_STAMP = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]")
OOM_MEMCG = re.compile(r"oom-kill:.*task_memcg=([^,\s]*),.*\bpid=(\d+)")


def memcg() -> str | None:
    """This process's memory cgroup, as the kernel names it in its log ("/process_api/x"); None unknown."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hier, ctrl, path = line.split(":", 2)
            if "memory" in ctrl.split(",") or hier == "0" and ctrl == "":
                return path
    except (OSError, ValueError):
        pass
    return None


def _below(path: str, root: str) -> bool:
    return root in ("/", "") or path == root or path.startswith(root.rstrip("/") + "/")


def check_oom(pod: Pod, now: float, cgroup_dir: Path) -> Finding | None:
    """An OOM kill in this container (its cgroup's count), or one the kernel logged since this boot: the
    kernel's log outlives containers and boots, and an old line is not this run's."""
    evidence = []
    try:
        events = dict(line.split() for line in (cgroup_dir / "memory.events").read_text().splitlines() if line)
        if int(events.get("oom_kill", 0)):
            evidence.append(f"{cgroup_dir}/memory.events: oom_kill {events['oom_kill']}, oom {events.get('oom', '?')}")
    except (OSError, ValueError):
        pass
    booted = pod.boots[-1].get("time") if pod.boots else None
    try:
        kernel_up = now - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        kernel_up = None
    try:
        kmsg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout.splitlines()
        ours = memcg()
        # The kernel names the killed task's memory cgroup: a kill in another container's (or a sibling's) is not
        # this pod's. Without a name (an older kernel), the time decides alone.
        foreign = {m.group(2) for ln in kmsg if (m := OOM_MEMCG.search(ln))
                   and ours is not None and not _below(m.group(1), ours)}
        for ln in kmsg:
            m, hit = KMSG_STAMP.match(ln), OOM_LINE.search(ln)
            pid = next((g for g in (hit.groups() if hit else ()) if g and g.isdigit()), None) or \
                ((OOM_MEMCG.search(ln) or [None, None, None])[2])
            if not hit or pid in foreign or (booted and kernel_up is not None and m
                                              and kernel_up + float(m.group(1)) < booted - 5):
                continue  # another cgroup's, or before this boot
            evidence.append(ln.strip())
        evidence = evidence[:1] + evidence[1:][-3:]
    except (OSError, subprocess.SubprocessError):
        pass
    if not evidence:
        return None
    return Finding("oom_kill", "a process was killed for lack of memory (OOM)", evidence,
                   "host memory, not GPU: lower the dataloader workers or batch size, or pick a pod with more RAM")


def yours(pod: Pod, program: str) -> tuple[list[dict], list[dict]]:
    """This boot's restarts of `program` (status's timeline events): (those you asked for, the others). Without
    supervisord's log, only the asks are known: each of yours since supervisord's start stands for one."""
    events = [e for e in ((getattr(pod, "st", None) or {}).get("startup") or {}).get("events") or []
              if isinstance(e, dict) and e.get("program") == program]
    if events:
        return [e for e in events if e.get("by_you")], [e for e in events if not e.get("by_you")]
    current = records.CURRENT.read(pod.state)
    run_dir, since = current.get("run_dir"), current.get("started") or 0
    asks = ending.ASKED.read_owned(Path(run_dir)) if isinstance(run_dir, str) and run_dir else []
    return [{"event": f"{startup.PROGRAM_WORD.get(program, program)}_restarted", "program": program,
             "asked": str(a.get("by")), "by_you": True} for a in asks
            if isinstance(a, dict) and a.get("program") in (program, "all") and (a.get("time") or 0) >= since
            and startup.by_you(str(a.get("by") or ""))], []


def problem_restarts(restarted: int, asked: list[dict]) -> int:
    """The restarts that say something is wrong: all but those you asked for (a crash, the watchdog's)."""
    return max(0, restarted - len(asked))


def check_restarts(pod: Pod, now: float, program: str, what: str) -> Finding | None:
    rec = pod.programs.get(program) if isinstance(pod.programs.get(program), dict) else {}
    starts = rec.get("starts", 0)
    end = trainer_end(pod) if program == "trainer" else None
    if starts < 2 or end is not None and end.family == ending.FINAL:
        return None  # the loop bound's (or the refusal's) finding names the cause
    loop = getattr(pod, "loop", None) or {}
    if program == "trainer" and loop.get("boot") == records.CURRENT.read(pod.state).get("started") and \
            loop.get("ends") and not [e for e in loop["ends"] if isinstance(e, dict) and e.get("family") ==
                                      ending.FAILURE]:
        return None  # every end of this boot was a stop asked for or a restart podkit wanted: nothing failed
    asked, others = yours(pod, program)
    wrong = problem_restarts(starts - 1, asked)
    if not wrong:
        return Finding(f"{what}_restarts", f"{what} restarted {starts - 1} time(s), each asked by you",
                       [startup.event_words(e) for e in asked[-3:]], "nothing to fix: a restart you asked for is "
                       "not a failure", "info")
    err = last_error(pod) if program == "trainer" else {}
    # The rank's own exception when it recorded one: torchrun's ChildFailedError lines say only that a rank failed.
    errors = error_lines(err) if err else error_evidence(pod.log_tail(program))
    if end is not None and end.family == ending.FAILURE:
        errors = [f"the last end: {status.printable(end.words(), 600)}"] + errors
    fatal = rec.get("state") == supervisord.FATAL
    by_watchdog = [a.get("reason") for a in records.WATCHDOG.read(pod.state) if a.get("program") == program]
    # Recovered: the trainer runs and has stepped since its last start; what ended it before is history, a note.
    since = rec.get("started_at")
    recovered = program == "trainer" and not fatal and rec.get("state") == supervisord.RUNNING and \
        isinstance(since, (int, float)) and (pod.progress.get("time") or 0) > since and \
        isinstance(pod.progress.get("step"), int) and pod.progress.get("step") != pod.progress.get("resumed_at")
    return Finding(f"{what}_restarts", f"{what} restarted {wrong} time(s)" + (", then gave up (FATAL)"
                   if fatal else ", and trains again since" if recovered else "")
                   + (f" (and {len(asked)} time(s) on your request, not counted)" if asked else ""),
                   [startup.event_words(e) for e in others[-2:]]
                   + (errors or [f"no error lines in logs/{program}.log (killed from outside?)"])
                   + [f"watchdog: {r}" for r in by_watchdog[-2:]],
                   "the last error lines above say why; a kill with no error is often an OOM (see oom_kill) or "
                   "the watchdog (.podkit/watchdog.json)" + ("; the trainer resumes from its latest checkpoint"
                                                             if program == "trainer" else ""),
                   "info" if recovered else "problem")


def check_safe_mode(pod: Pod, now: float) -> Finding | None:
    sm = pod.st.get("safe_mode")
    if not sm:
        return None
    return Finding("safe_mode", f"podkit is in safe mode: the {sm.get('stage')} stage failed",
                   [sm.get("message", ""), f"since {_ago(sm.get('since'), now)}"],
                   (sm.get("hint") or "fix the cause") + "; then `podkit resume` (or restart the container)")


def check_gpu_busy(pod: Pod, now: float) -> Finding | None:
    devices = gpu.match_devices(pod.cfg.devices)
    ours = {p.get("pid") for p in pod.st["programs"].values() if p.get("pid")}
    holders = [h for h in gpu.holders(devices)[0] if h.pid not in ours and not _descends(h.pid, ours)]
    exclusive = [g for g in (gpu.smi_state() or []) if g["compute_mode"].lower().startswith("exclusive")]
    if not holders and not exclusive:
        return None
    return Finding("gpu_busy", "the GPUs are held by processes that are not this pod's programs",
                   [h.describe() for h in holders]
                   + [f"GPU {g['index']} compute mode {g['compute_mode']}" for g in exclusive],
                   "`podkit reap` stops them (TERM, then KILL); in Exclusive_Process mode a second context fails "
                   "with 'busy or unavailable'")


def _descends(pid: int, ancestors: set) -> bool:
    seen = set()
    while pid > 1 and pid not in seen:
        if pid in ancestors:
            return True
        seen.add(pid)
        st = proc.read_stat(pid)
        if st is None:
            return False
        pid = st.ppid
    return False


def check_startup_phase(pod: Pod, now: float) -> Finding | None:
    phase = pod.st["inference"]["phase"]
    sglang = pod.st["programs"].get("sglang") or {}
    if phase not in STARTUP or not sglang.get("uptime_s"):
        return None
    lasted = sglang["uptime_s"]
    limit = pod.cfg.watchdog.startup_deadline_s
    late = lasted > limit
    return Finding("startup_phase", f"inference is {phase.replace('_', ' ')} for {lasted:.0f}s: "
                   + ("past its deadline" if late else "not stuck"),
                   [f"phase from logs/sglang.log: {phase}", f"start-up deadline {limit:.0f}s"],
                   "loading weights and capturing CUDA graphs print little for minutes; wait" if not late else
                   "the watchdog restarts it; if it repeats, look at GPU memory and the model path",
                   "problem" if late else "info")


STARTUP_SLOW_S = 600.0  # boot to first step on an A40 with warm caches: a few minutes


def check_startup_slow(pod: Pod, now: float) -> Finding | None:
    """A start-up past STARTUP_SLOW_S: its slowest phase, and the caches that were cold for it."""
    t = pod.st.get("startup") or {}
    if not t.get("phases") or (t.get("total_s") or 0) <= STARTUP_SLOW_S:
        return None
    slow = max(t["phases"], key=lambda p: p["took_s"])
    what, dirs = startup.COLD.get(slow["phase"], (slow["phase"], ()))
    cold = startup.cold_caches(pod.ws, dirs, t["boot"])
    return Finding("startup_slow", f"start-up took {t['total_s']:.0f}s to the first step; the longest phase was "
                   f"{slow['phase'].replace('_', ' ')} ({slow['took_s']:.0f}s): {what}",
                   [startup.describe(t)] + [f"cold this boot (empty, or all of it written during it): {d}" for d in cold],
                   "a second start on this volume reuses what this one cached" if cold else
                   "the caches were warm: the time went to the work itself (model size, GPU, the repo's setup)",
                   "info")


def check_nccl_ifname(pod: Pod, now: float, environ, net_dir: Path) -> Finding | None:
    try:
        ifaces = sorted(os.listdir(net_dir))
    except OSError:
        return None
    bad = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        value = environ.get(var)
        if not value:
            continue
        exclude = value.startswith("^")
        names = [n for n in value.lstrip("^=").split(",") if n]
        exact = value.lstrip("^").startswith("=")
        hits = [i for i in ifaces for n in names if (i == n if exact else i.startswith(n))]
        if not exclude and not hits:
            bad.append(f"{var}={value}: no interface matches (this machine has {', '.join(ifaces)})")
    if not bad:
        return None
    return Finding("nccl_ifname", "NCCL/Gloo interface settings name interfaces this machine does not have", bad,
                   "unset them or set them to an interface listed above; a mismatch hangs init_process_group")


def check_nan_loss(pod: Pod, now: float) -> Finding | None:
    loss = pod.progress.get("loss")
    if loss is None or (isinstance(loss, (int, float)) and math.isfinite(loss)):
        return None
    return Finding("nan_loss", f"the training loss is {loss} {records.at_step(pod.progress.get('step'))}",
                   [f"progress.json: step {pod.progress.get('step')}, loss {loss}"],
                   "lower the learning rate or clip gradients (max_grad_norm); resume from a checkpoint taken "
                   "before it diverged")


def last_error(pod: Pod) -> dict:
    """The user's own exception from the trainer's last failure (failure.py), as the loop bound kept it."""
    rec = getattr(pod, "loop", None) or {}
    if rec.get("boot") != records.CURRENT.read(pod.state).get("started"):
        return {}  # an earlier boot's: this one's trainer has not failed
    err = rec.get("error") or {}
    return err if err.get("type") else {}


def error_lines(err: dict) -> list[str]:
    from podkit.judge import failure

    out = [f"{failure.summary(err)}" + (f" (rank {err['rank']})" if err.get("rank") else "")]
    if err.get("code"):
        out.append(f"  {err['code']}")
    tb = [ln for ln in str(err.get("traceback") or "").splitlines() if ln.strip()]
    return out + [f"traceback: {ln.strip()}" for ln in tb[-4:] if ln.strip().startswith("File ")]


def trainer_end(pod: Pod) -> ending.End | None:
    """The trainer's last end, unless a newer run of it is underway (`podkit resume` after a stop for good: the
    record stays until the next end, and is history meanwhile)."""
    end = ending.of(pod.progress.get("stopped"))
    s = (getattr(pod, "st", None) or {}).get("standing") or {}
    # the standing judged whose end it is (standing.py): an earlier run's, while the trainer is up again, is history
    if end is not None and (s.get("state") or {}).get("name") in supervisord.UP and \
            not (s.get("last") or {}).get("this_run"):
        return None
    return end


def check_trainer_config(pod: Pod, now: float) -> Finding | None:
    """The trainer stopped for good (a final kind of ending.py): why, in the user's words, and the fix."""
    end = trainer_end(pod)
    if end is None or end.family != ending.FINAL:
        return None
    lines = [status.printable(ln, 600) for ln in str(end.message or "").splitlines() if ln.strip()]
    if end.kind.name == ending.CRASH_LOOP:
        lines = lines[:1] + error_lines(last_error(pod))
    elif end.where:
        lines = lines[:1] + [f"at {status.printable(end.where, 400)}"] + lines[1:]
    if end.kind.name == ending.HANG_LOOP:
        hung = [a for a in records.WATCHDOG.read(pod.state) if a.get("program") == "trainer" and a.get("code")]
        lines += [f"  {status.printable(hung[-1]['code'])}"] if hung else []
        lines += [f"dump: {status.printable(hung[-1].get('dump'))}"] if hung and hung[-1].get("dump") else []
    lines += [f"evidence: {status.printable(e, 400)}" for e in (end.evidence or [])[:3] if isinstance(e, str)]
    # The trainer records its own fix (a script's import error, an agent workflow); the kind's is the fallback.
    return Finding(end.kind.finding, end.kind.title, lines[:10] or ["(no message recorded)"],
                   status.printable(end.hint, 800) or end.kind.fix or "fix what the evidence names; then "
                   "`podkit resume`")


def check_hang(pod: Pod, now: float) -> Finding | None:
    """The watchdog restarted a hung trainer in this boot: where it hung, in the user's code when it was (a
    workflow's await, a reward stuck in a loop), with the dump. The loop bound's own stop (hang-loop) says it."""
    end = trainer_end(pod)
    if end is not None and end.kind.name == ending.HANG_LOOP:
        return None
    booted = pod.boots[-1].get("time") if pod.boots else None
    hung = [a for a in records.WATCHDOG.read(pod.state) if a.get("program") == "trainer"
            and a.get("action") == "restarted" and (a.get("time") or 0) >= (booted or 0)]
    if not hung:
        return None
    last = hung[-1]
    where = stacks_words(last)
    return Finding("trainer_hung", f"the trainer hung {len(hung)} time(s) in this boot; the last: {where}",
                   [status.printable(last.get("reason"), 600)] + ([f"  {status.printable(last['code'])}"]
                                                                  if last.get("code") else []),
                   ending.hang_fix(last) + "; the watchdog restarts it meanwhile (the loop bound stops it after "
                   "trainer.max_failures hangs in a row without a new step)")


def stacks_words(action: dict) -> str:
    reason = str(action.get("reason") or "")
    m = re.search(r"(hung in your \w+ at [^;]+|no frame of your code on any stack; waiting at [^;]+)", reason)
    return status.printable(m.group(1), 300) if m else "(no frame named: see the dump)"


def check_failing_after_progress(pod: Pod, now: float) -> Finding | None:
    """A run that fails after every new step: never stopped (each start is progress), but each start costs its
    resume (minutes on a GPU): named once it has cost a few starts in the last hour."""
    from podkit.judge import loopbound

    loop = getattr(pod, "loop", None) or {}
    if loop.get("boot") != records.CURRENT.read(pod.state).get("started"):
        return None
    failing = loopbound.failing_with_progress(loop, now)
    if len(failing) < loopbound.TELL_RESTARTS:
        return None
    steps = [e.get("step") for e in failing if isinstance(e.get("step"), int)]
    return Finding("trainer_failing_after_progress",
                   f"the trainer failed {len(failing)} times in the last hour, each after a new step"
                   + (f" (steps {steps[0]} to {steps[-1]})" if steps else ""),
                   [f"the last: {status.printable(failing[-1].get('what'), 600)}",
                    f"{status.last_hour(loop, now)['starts']} start(s) in the last hour: each resumes, trains a step "
                    "and fails again, so the loop bound never stops it"],
                   "fix the failure above (it is the same every time); "
                   + ending.fix_code(pod.cfg))


def check_notify(pod: Pod, now: float) -> Finding | None:
    rec = records.NOTIFY.read(pod.state)
    if not rec.get("failing_since"):
        return None
    return Finding("notify_failing", "notifications are not delivered: the webhook refuses or does not answer",
                   [f"notify.json: failing since {_ago(rec['failing_since'], now)}: {rec.get('error', '?')}"],
                   "check PODKIT_NOTIFY_WEBHOOK_URL (a revoked Slack or Discord webhook answers 404; the pod "
                   "must reach it); each event tries again, and the log says when it works")


def check_last_stop(pod: Pod, now: float) -> Finding | None:
    """A stop asked for before this boot (docker stop, a RunPod stop or migration, podkit ctl): nothing wrong
    with it; and what happened since, from the records (resumed, started over, or nothing yet)."""
    if not pod.boots:
        return None
    boot = pod.boots[-1]
    last = str(boot.get("last_stop", ""))
    if not last.startswith(ending.SIGTERM + ":"):
        return None
    booted = boot.get("time") or 0
    prog = pod.progress
    end = ending.of(prog.get("stopped"), since=booted)
    if isinstance(prog.get("resumed_at"), int) and (prog.get("time") or 0) >= booted:
        since = f"it resumed from the checkpoint of step {prog['resumed_at']}"
    elif end is not None and end.family == ending.FINAL:
        since = f"since, nothing resumed: {status.printable(end.said(), 400)}"
    elif isinstance(prog.get("step"), int) and (prog.get("time") or 0) >= booted:
        since = f"since, it trains from step 0 (no checkpoint of its run to resume; step {prog['step']} now)"
    else:
        since = "no step since this boot yet"
    return Finding("stopped_by_sigterm", "the run before this boot was stopped on request", [status.printable(last, 600)],
                   f"nothing is wrong with that stop; {since}", "info")


def check_boot_failed(pod: Pod, now: float) -> Finding | None:
    """`podkit up` stopped at a stage (a config error, a sync that failed) and exited: no safe mode records it."""
    boot = pod.boots[-1] if pod.boots else None
    why = status.boot_failed(boot)
    if not why:
        return None
    stages = boot.get("stages") if isinstance(boot.get("stages"), dict) else {}
    return Finding("boot_failed", f"the last boot ({_ago(boot.get('time'), now)}) {why.split(' (fix: ')[0]}",
                   [f"boot via {status.printable(boot.get('via') or 'boot', 20)}; stages: "
                    + ", ".join(f"{status.printable(n, 20)} {status.printable(o, 20)}" for n, o in stages.items())],
                   status.printable(boot.get("hint"), 400) or "fix what it names, then run it again", "problem")


def check_episodes(pod: Pod, now: float) -> Finding | None:
    """Rollout episodes that fail in the user's workflow (areal/episodes.py): AReaL logs each and drops it, so
    a reward that raises for some answers trains on the rest, and one that always raises never trains."""
    ep = status.failed_episodes(pod.progress)
    if ep is None:
        return None
    last = ep["last"]
    if ep["server"]:
        return Finding("episodes_inference_unreachable",
                       f"{ep['failed']} rollout episode(s) failed: {ep['unreachable']}"
                       + (f" ({ep['in_a_row']} in a row: the trainer was stopped with it)" if ep["tripped"] else ""),
                       [f"{ep['unreachable_failed']} of {ep['failed']} failed episode(s) never reached inference",
                        f"the last {_ago(ep['time'], now)}; trainer.max_episode_failures {ep['limit'] or 'off'}"],
                       "nothing answered at inference's address, not your code: logs/sglang.log says whether the "
                       "server went down and why (on a cluster, the trainer's log: AReaL's launcher runs it); on one "
                       "pod supervisord starts it again, on a cluster AReaL's recover run starts a new one and the "
                       "run resumes from its checkpoint",
                       "problem" if ep["tripped"] else "info")
    title = (f"{ep['own']} rollout episode(s) failed in your workflow"
             + (f" ({ep['in_a_row']} in a row, none succeeding: the trainer was stopped with it)" if ep["tripped"]
                else f" of {ep['failed'] + ep['succeeded']}: the steps train on the episodes that did not fail"))
    evidence = [f"{last['type']}: {last['message']} at {last['where']}"] + ([last["code"]] if last["code"] else [])
    if ep["unreachable_failed"]:
        evidence.append(f"{ep['unreachable_failed']} more never reached inference (the last: {ep['unreachable']})")
    evidence.append(f"the last {_ago(ep['time'], now)}; trainer.max_episode_failures {ep['limit'] or 'off'}")
    return Finding("episodes_failing", title, evidence, (last["hint"] + "; " if last["hint"] else "")
                   + "fix it in the workflow or its reward function (logs/trainer.log has each traceback, "
                   "'Workflow execution failed')",
                   # a rare failure (a flaky judge) is a note; one episode in ten is training on a biased sample
                   "problem" if ep["tripped"] or ep["own"] * 10 >= ep["failed"] + ep["succeeded"] else "info")


def check_reattach(pod: Pod, now: float) -> Finding | None:
    """The last inference restart the trainer could not go on through (areal/reattach.py), and why."""
    ra = pod.progress.get("reattach") or {}
    last = ra.get("last") or {}
    if last.get("outcome") != "fell back":
        return None
    return Finding("inference_reattach_fell_back",
                   f"inference restarted {_ago(last.get('time'), now)} and the trainer could not re-attach: it "
                   "restarted to push its weights (a trainer restart, not a failure)",
                   [f"why: {last.get('why')}", f"version {last.get('version')}; re-attached {ra.get('count') or 0} "
                    f"time(s), fell back {ra.get('fell_back') or 0} time(s) on this volume"],
                   "inference down longer than inference.ready_timeout_s: its log (logs/sglang.log) says why it "
                   "did not start; the weights not on disk: leave <fileroot>'s weight_update_v<N> in place while "
                   "training; trainer.on_inference_restart restart turns re-attaching off", "info")


def check_cluster(pod: Pod, now: float) -> Finding | None:
    """A multi-node run that waits for a node, or whose nodes do not share the workspace."""
    rec = records.CLUSTER.read(pod.state)
    state = rec.get("state")
    if state not in ("waiting-for-nodes", "volume-not-shared", "gave-up"):
        return None
    missing = [m for m in rec.get("missing") or [] if isinstance(m, dict)]
    evidence = [f"node rank {m.get('rank')} ({m.get('addr')}): {m.get('why')}" for m in missing] or [rec.get("why", "")]
    evidence.append(f"since {_ago(rec.get('since'), now)}; trainer's last step: {pod.progress.get('step')}")
    if state == "gave-up":
        return Finding("cluster_gave_up", "the cluster's run stopped restarting: no step between restarts", evidence,
                       "read logs/trainer.log around the restarts; fix, then `podkit ctl start trainer`")
    if state == "volume-not-shared":
        return Finding("cluster_volume", "the cluster's nodes do not share the workspace", evidence,
                       "mount one network volume at the workspace on every node; then `podkit ctl start trainer`")
    return Finding("cluster_node_missing", f"the run waits for {len(missing) or 'a'} node(s) of the cluster",
                   evidence, "start the node again (its `ray` program joins the head at cluster.head); the run resumes "
                   "from its checkpoint when it is back. `podkit ctl stop trainer` ends the wait")


def check_cluster_join(pod: Pod, now: float) -> Finding | None:
    """A worker node whose `ray` did not join its head: nothing of the run can be placed on it."""
    join = pod.st.get("ray")
    if not join:
        return None
    return Finding("cluster_join", f"this node cannot join its cluster: the Ray head at {join.get('head')} does not "
                   "take it",
                   [f"the last start: {join.get('why')}", f"{join.get('failures')} start(s) in a row did not join"
                    + ("; `ray` stays stopped (trainer.max_failures)" if join.get("gave_up") else "")],
                   f"start rank 0 (its `ray` program is the head at {join.get('head')}); check cluster.head and "
                   "cluster.ray_port, and that the port is open between the nodes; then `podkit ctl start ray`")


def check_guard_file(pod: Pod, now: float) -> Finding | None:
    """A `podkit guard set` that the pod does not apply: the file is ignored (corrupt, planted, not podkit's)
    or an entry was set over a setting that has changed since."""
    from podkit.money import guardfile

    rep = guardfile.report(pod.cfg)
    stale = [f"guard.{k} {g['stale']}" for k, g in rep["guards"].items() if g["stale"]]
    if rep["problem"]:
        return Finding("guard_file_ignored", "the cost guards changed with `podkit guard set` are not in force",
                       [rep["problem"], *stale], "`podkit guard set KEY=VALUE` writes it again (or `podkit guard "
                       "clear` removes it); `podkit guard` shows what is in force")
    if stale:
        return Finding("guard_file_stale", "a `podkit guard set` entry gave way to a newer setting of the pod", stale,
                       "nothing is wrong if the pod's env was edited on purpose; else `podkit guard set` again", "info")
    return None


def examine(cfg, workspace: Path, *, environ=None, cgroup_dir: Path = Path("/sys/fs/cgroup"),
            net_dir: Path = Path("/sys/class/net"), min_free_bytes: int = 5 << 30, min_mb_s: float = 20.0,
            now: float | None = None) -> list[Finding]:
    environ = os.environ if environ is None else environ
    now = time.time() if now is None else now
    pod = Pod(cfg, workspace)
    found = [check_rollouts_starved(pod, now), check_restart_loop(pod, now), check_weight_update(pod, now),
             *check_workspace(pod, now, min_free_bytes, min_mb_s), check_oom(pod, now, cgroup_dir),
             check_restarts(pod, now, "sglang", "inference"), check_restarts(pod, now, "trainer", "trainer"),
             check_safe_mode(pod, now), check_gpu_busy(pod, now), check_startup_phase(pod, now),
             check_startup_slow(pod, now),
             check_nccl_ifname(pod, now, environ, net_dir), check_nan_loss(pod, now), check_trainer_config(pod, now),
             check_hang(pod, now), check_failing_after_progress(pod, now),
             check_notify(pod, now), check_last_stop(pod, now), check_boot_failed(pod, now), check_episodes(pod, now), check_reattach(pod, now), check_cluster(pod, now), check_cluster_join(pod, now),
             check_guard_file(pod, now), check_spend(pod, now), check_durable(pod, now)]
    return [f for f in found if f is not None]


def check_spend(pod: Pod, now: float) -> Finding | None:
    """What the run costs, when podkit is not sure of it: unknown (a budget cannot act) is a problem when a budget
    is set; an estimate is a note that says why and since when; a ledger not looked at for 10 minutes is a note."""
    from podkit.money import guardfile, spend

    c = pod.st.get("cost")
    if not c:
        return None
    budget = guardfile.report(pod.cfg)["guards"]["max_spend"]["value"] if pod.cfg is not None else 0
    line = [ledger.words(c, now)] + ([f"guard.max_spend {spend.usd(budget)}"] if budget else [])
    run = c.get("total") if isinstance(c.get("total"), dict) else None
    if run and run.get("source") == "estimated" and c["source"] != "unknown":  # this pod's is sure, the run's is not
        return Finding("spend_estimated", "what this run has spent is an estimate: some of its pods' spend could not "
                       "be read", line, "nothing to do: the budget goes by the estimate, which counts each pod's time "
                       "at its price until it stopped; RunPod's console shows the bill (a key that may read other "
                       "pods' bills makes it exact)", "info")
    if c["source"] == "unknown":
        return Finding("spend_unknown", "what this run has spent is not known" + (": its budget cannot act" if budget
                                                                                   else ""), line,
                       "RunPod shows no price for the pod and the GPU catalogue none for its GPUs: watch the spend in "
                       "RunPod's console, or stop the pod by time (`podkit guard set stop_pod_at=+6h`)",
                       "problem" if budget else "info")
    if c["source"] == "estimated":
        return Finding("spend_estimated", "what this run has spent is an estimate", line,
                       "nothing to do: the spend and the budget go by the estimate until RunPod answers; "
                       "RunPod's console shows the bill", "info")
    if now - c["time"] > 600:
        return Finding("spend_stale", f"what this run has spent was last looked at {(now - c['time']) / 60:.0f} min "
                       "ago", line, "the log listener looks every guard.cost_every_s: `podkit ctl status logs`", "info")
    return None


def main(cfg, workspace: Path, as_json: bool) -> int:
    findings = examine(cfg, workspace)
    problems = [f for f in findings if f.severity == "problem"]
    if as_json:
        print(json.dumps({"ok": not problems, "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        if not findings:
            print("nothing wrong found")
        for f in findings:
            print(f"{'PROBLEM' if f.severity == 'problem' else 'note'}: {f.title}")
            for e in f.evidence:
                print(f"  - {e}")
            print(f"  fix: {f.fix}")
    return 1 if problems else 0


def check_durable(pod: Pod, now: float) -> Finding | None:
    """With checkpoint.remote: checkpoints that do not reach it (the upload's failure, in the user's terms), a last
    durable checkpoint further behind than guard.durable_within_s, or another run's checkpoint refused at boot."""
    from podkit.judge import standing
    from podkit.remote.remote import WAYS_ON

    remote = pod.cfg is not None and bool(pod.cfg.checkpoint.remote)
    if pod.cfg is not None and not remote:
        return None  # no remote for this run: an earlier run's remote.json on the volume is not its durability
    d = pod.st.get("durable") or (standing.durable({}, pod.progress.get("step"), pod.st.get("cost"), now,
                                                   configured=True) if remote else None)
    if not d:
        return None
    line = [status.printable(standing.durable_words(d, now), 900)]
    if d["failing"]:
        return Finding("upload_failing", "checkpoints are not reaching checkpoint.remote", line,
                       "fix what the failure names; the uploader tries again at the next checkpoint (or within "
                       "5 minutes), and `podkit logs logs` shows each try", "problem")
    if d.get("final"):
        return Finding("final_upload_failed", "the last checkpoint did not reach checkpoint.remote when the pod stopped",
                       line, "the volume still holds it: start a pod on this volume (it uploads it), or copy it up "
                       "yourself; give the stop more time with checkpoint.remote_final_s", "problem")
    if d.get("ahead"):
        return Finding("remote_ahead", "the remote holds a newer checkpoint of this run's lineage than this pod trains "
                       "from", [status.printable(standing.ahead_words(d["ahead"]), 900)],
                       "to train on from the remote's: `podkit ctl stop trainer`, `podkit restore`, `podkit ctl start "
                       "trainer`; to make this pod's line the run's instead: `podkit adopt` (a new lineage from this "
                       "pod's checkpoint)", "problem")
    if (d.get("restore") or {}).get("outcome") == "failed":
        return Finding("restore_failed", "the boot could not restore the run's checkpoint from checkpoint.remote",
                       [status.printable(standing.restore_words(d["restore"], now), 900)],
                       "fix what it names (the endpoint, the credentials, the volume's room); once the remote answers "
                       "the uploader says whether it holds a newer checkpoint than this pod's; `podkit restore` (the "
                       "trainer stopped) restores it", "problem")
    if d.get("blocked"):
        return Finding("remote_lease_held", "another pod of this run holds its lease on checkpoint.remote", line,
                       "two pods of one run never upload into one generation: stop the other pod (`podkit deploy "
                       "stop`), or wait; its lease lapses guard.lease_s after it stops renewing it", "problem")
    limit = pod.cfg.guard.durable_within_s if pod.cfg is not None else 0
    training = (pod.st.get("standing") or {}).get("run") == standing.TRAINING
    why = standing.behind(d, limit, training, records.CURRENT.read(pod.state).get("started"), now)
    if why:
        return Finding("durable_behind", "the run's last durable checkpoint is far behind", [status.printable(why, 900)],
                       "a checkpoint is uploaded once AReaL's recover checkpoint (or the fake trainer's) is whole: "
                       "save more often (AReaL's recover.freq_steps / freq_secs), or raise guard.durable_within_s",
                       "problem")
    rest = records.REMOTE.read(pod.state).get("restore") or {}
    booted = (pod.boots[-1].get("time") or 0) if pod.boots else 0
    if rest.get("outcome") == "refused" and (rest.get("time") or 0) >= booted - 60:
        return Finding("restore_refused", "a checkpoint on the remote was not restored at this boot",
                       [f"step {rest.get('step')}: {status.printable(rest.get('why'), 600)}"],
                       "another run's (or a damaged) generation is never restored: " + WAYS_ON, "info")
    return None
