"""The hang watchdog, a supervised program (`podkit run watchdog`).

Trainer: no step for `trainer_stall_s` while inference answers (before the run's first step: no CPU time, I/O
or log output from its ranks for that long, and no first step by `trainer_first_step_s`) -> its Python stacks (py-spy, where
installed; else the kernel's view from /proc) go to <workspace>/logs/hang-<time>.txt, then the
trainer is restarted and resumes from its checkpoint. A trainer whose run finished is never restarted:
one still running `trainer_stall_s` after its finish record (a non-daemon thread keeps the script alive)
is dumped once and stopped for good, and the run counts as finished (a run stopped for good, one whose script
never trained, likewise: a final end is never restarted as a hang). Inference: past its start-up but not
answering /health for `inference_unhealthy_s` -> restarted; so is one whose weight update has been in
flight for `weight_update_deadline_s` (no generation check runs during one, and generation waits behind
it). Start-up phases (loading weights, CUDA graph capture, warm-up; read from SGLang's own log lines) are
not hangs: they have their own deadline, `startup_deadline_s` (docs/failures.md: a run "stuck" for 10
minutes was capturing CUDA graphs). Every action is logged and recorded in
<workspace>/.podkit/watchdog.json for status and doctor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import xmlrpc.client
from pathlib import Path

from podkit import log, notify, records
from podkit.host import proc, stacks, supervisord
from podkit.judge import ending, health

_log = log.get("watchdog")
MAX_BACKOFF_S = 700.0  # loopbound.MAX_DELAY_S and a margin: a back-off said to last longer is not one
ENDED_S = 60.0  # a run that ended: its program exits within supervisord's startsecs (programs.run), and leftovers
STARTUP = ("starting", "loading_weights", "weights_loaded", "capturing_cuda_graphs", "cuda_graphs_captured",
           "warming_up")


def _py_spy(pid: int) -> str | None:
    spy = proc.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return None
    # A process that cannot be suspended (stopped, or mid-syscall in a hang) is read without suspending. Full
    # file names: the user's frame is told by its path (stacks.user_frame).
    for extra in ([], ["--nonblocking"]):
        try:
            r = subprocess.run([spy, "dump", "--full-filenames", *extra, "--pid", str(pid)], capture_output=True,
                               text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode == 0 and "Thread " in r.stdout:
            return r.stdout
    return None


def _faulthandler(pid: int, path: Path) -> str | None:
    """Ask the process itself (SIGUSR2, registered by `podkit run trainer`: stacks.on_sigusr2) and read what it
    wrote: its threads at once, then its asyncio tasks once its main thread runs Python again (a few seconds at
    most are waited for them)."""
    before = path.stat().st_size if path.exists() else None
    if before is None:
        return None
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return None
    t0, text = time.monotonic(), ""
    until = t0 + 2.0  # the threads come from C, at once
    extended = False
    while time.monotonic() < until:
        time.sleep(0.1)
        try:
            with open(path, "rb") as f:
                f.seek(before)
                text = f.read(4 << 20).decode(errors="replace")
        except OSError:
            return None
        if stacks.TASKS_END in text:
            return text
        if text and not extended:  # the tasks come from Python once its main thread runs Python: 2 s more, once
            until, extended = time.monotonic() + 2.0, True
    return text or None


class Busy:
    """Before a run's first step, whether the trainer is busy (loading a model, preparing data: its CPU time, its
    I/O or its log moves) or waits (a hang): the last time anything moved. The ranks are watched, not the
    trainer program or torchrun, which poll the process table and their workers while the ranks wait."""

    CPU_SHARE = 0.02  # of one core, over the time since the last look
    IO_BYTES = 1 << 20

    def __init__(self) -> None:
        self.last: tuple | None = None
        self.at = 0.0
        self.moved = 0.0

    def seen(self, pid: int, log_file: Path, now: float, floor: float) -> float:
        procs = proc.processes()
        kids = [c for c in procs if c.ppid == pid]
        watched = [p for k in kids for p in proc.descendants(k.pid, procs)] or [pid]  # the ranks (fake: itself)
        cpu = io = 0
        for p in watched:
            cpu += cpu_ticks(p)
            io += io_bytes(p)
        try:
            size = log_file.stat().st_size
        except OSError:
            size = 0
        sig = (pid, cpu, io, size)
        if self.last is None or self.last[0] != pid or self.moved < floor:
            self.moved = now  # a first look has nothing to compare with: the stall counts from it
        elif sig[1:] != self.last[1:]:
            tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
            if (cpu - self.last[1]) / tick >= self.CPU_SHARE * max(now - self.at, 0.1) or \
                    io - self.last[2] >= self.IO_BYTES or size != self.last[3]:
                self.moved = now
        self.last, self.at = sig, now
        return self.moved


def cpu_ticks(pid: int) -> int:
    """The process's user and system CPU time, in clock ticks (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[11]) + int(rest[12])
    except (OSError, ValueError, IndexError):
        return 0


def io_bytes(pid: int) -> int:
    """What the process read and wrote, any file or socket (/proc/<pid>/io rchar + wchar)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields.get(b"rchar", 0)) + int(fields.get(b"wchar", 0))
    except (OSError, ValueError):
        return 0


def dump_stacks(pid: int, path: Path, stacks_dir: Path) -> str:
    """The Python stacks of `pid` and its descendants (torchrun and its ranks) into `path`: py-spy's where it
    attaches, and the process's own (its threads by faulthandler, its asyncio tasks: a workflow's await is on
    no thread's stack) where it registered them; the kernel's view always. Returns what worked."""
    lines = [f"# hang dump of pid {pid} and its children at {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    used = set()
    for p in [pid, *proc.descendants(pid)]:
        lines.append(f"\n## pid {p}")
        text = _py_spy(p)
        if text:
            used.add("py-spy")
        own = _faulthandler(p, stacks_dir / f"stacks-{p}.txt")
        if own:
            used.add("faulthandler")
            text = f"{text}\n{own}" if text else own
        lines.append(text or "(no Python stacks: py-spy could not attach and the process did not answer SIGUSR2)")
        for what in ("status", "wchan", "stack"):
            try:
                lines.append(f"### /proc/{p}/{what}\n" + Path(f"/proc/{p}/{what}").read_text())
            except OSError as e:
                lines.append(f"### /proc/{p}/{what}: {e.strerror}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return "+".join(sorted(used)) or "/proc only"


# Above SGLang's own SGLANG_HEALTH_CHECK_TIMEOUT (20 s): SGLang answers a generation probe (200 or 503)
# before the client gives up, so no probe is left queued in its scheduler by podkit going away.
GENERATION_TIMEOUT_S = 30.0


class GenerationProbe:
    """The rare real check: one /health_generate at a time, in a thread (it may take SGLang's 20 s), never
    while a weight update is in flight. After a failure it looks again sooner."""

    def __init__(self, host: str, port: int, every_s: float, retry_s: float) -> None:
        self.host, self.port, self.every_s, self.retry_s = host, port, every_s, retry_s
        self.thread: threading.Thread | None = None
        self.started = 0.0
        self.result: bool | None = None
        self.failed = False

    def maybe_start(self, now: float, updating: bool) -> None:
        if not self.every_s or updating or (self.thread is not None and self.thread.is_alive()):
            return
        if now - self.started < (min(self.every_s, self.retry_s) if self.failed else self.every_s):
            return
        self.started = now
        self.thread = threading.Thread(target=self._run, name="generation-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = health.probe(self.host, self.port, timeout=GENERATION_TIMEOUT_S, path="/health_generate")

    def take(self) -> bool | None:
        """The result of a probe that finished since the last call, once."""
        if self.thread is None or self.thread.is_alive() or self.result is None:
            return None
        result, self.result = self.result, None
        self.failed = not result
        return result


class Watchdog:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.w = cfg.watchdog
        self.inf = cfg.inference
        self.state_dir = cfg.state_dir
        self.unhealthy_since: float | None = None
        self.generation_failed_since: float | None = None
        self.gen = GenerationProbe(cfg.inference.host, cfg.inference.port, self.w.generation_probe_s,
                                   self.w.inference_unhealthy_s / 3)
        # A weight update that never ends would keep the generation check off for ever: past this, a hang.
        self.update_deadline_s = self.w.weight_update_deadline_s or 5 * cfg.trainer.weight_update_timeout_s
        self.update_since: float | None = None  # when this watchdog first saw the update in flight
        self.busy = Busy()  # before a run's first step: the last time the trainer did anything
        self.update_ended = -1  # where the last update that ended ended in the log (health.update_in_flight)
        self.server = supervisord.rpc(cfg.socket_path)
        self.finished_stopped: float | None = None  # the finish record whose trainer was stopped

    def record(self, action: str, program: str, reason: str, **extra) -> None:
        _log.warn(f"{action} {program}: {reason}")
        notify.send("watchdog", f"the watchdog {action} {program}: {reason}", self.state_dir)
        actions = records.WATCHDOG.read(self.state_dir)[-49:]
        actions.append({"time": time.time(), "action": action, "program": program, "reason": reason, **extra})
        try:
            records.WATCHDOG.write(self.state_dir, actions)
        except OSError as e:
            _log.error(f"cannot record the action ({e.strerror}); the log line above is all there is")

    def restart(self, name: str, why: str = "", kind: str = "") -> None:
        ending.ask(self.cfg.run_path, [name], f"the watchdog ({why or 'a restart'})", kind)
        self.server.supervisor.stopProcess(name, True)
        self.server.supervisor.startProcess(name, False)

    def kill_and_restart(self, name: str, pid: int) -> None:
        """A hung trainer gets nothing from its stop grace (its checkpoint comes at the end of a step that
        does not end): its process group (supervisord makes each program a group's leader) is killed at
        once, and supervisord's own restart, or ours, starts it again."""
        try:
            if os.getpgid(pid) != pid:
                return self.restart(name)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        until = time.monotonic() + 60
        while time.monotonic() < until:
            info = self.info(name)
            if info["statename"] in (supervisord.RUNNING, supervisord.STARTING) and info["pid"] != pid:
                return  # restarted by supervisord (an unexpected exit)
            if info["statename"] in supervisord.GONE:
                try:
                    self.server.supervisor.startProcess(name, False)
                except xmlrpc.client.Fault as e:
                    if "ALREADY_STARTED" not in e.faultString:
                        raise
                return
            time.sleep(0.2)

    def info(self, name: str) -> dict:
        return self.server.supervisor.getProcessInfo(name)

    def check_inference(self, now: float) -> bool:
        """True when inference answers /health."""
        info = self.info("sglang")
        if info["statename"] != supervisord.RUNNING:
            self.unhealthy_since = None
            return False  # supervisord's own restarts deal with a dead process
        if health.probe(self.inf.host, self.inf.port, timeout=min(5.0, self.w.interval_s * 2)):
            self.unhealthy_since = None
            return self.check_generation(now)
        phase = health.phase_from_log(self.cfg.log_dir / "sglang.log")
        up_for = now - info["start"]
        if phase in STARTUP:
            if up_for > self.w.startup_deadline_s:
                self.record("restarted", "sglang", f"still {phase} after {up_for:.0f}s "
                            f"(startup_deadline_s {self.w.startup_deadline_s:.0f})")
                self.restart("sglang")
            return False
        self.unhealthy_since = self.unhealthy_since or now
        if now - self.unhealthy_since >= self.w.inference_unhealthy_s:
            self.record("restarted", "sglang", f"past start-up ({phase}) but /health has not answered for "
                        f"{now - self.unhealthy_since:.0f}s")
            self.unhealthy_since = None
            self.restart("sglang")
        return False

    def check_generation(self, now: float) -> bool:
        """Live: now the rare generation check. A failed one is unhealthy until one passes; past
        inference_unhealthy_s of that, inference is restarted. No check starts during a weight update, and an
        update in flight past its deadline is a hang: inference is restarted."""
        result = self.gen.take()
        if result:
            self.generation_failed_since = None
        elif result is False:
            self.generation_failed_since = self.generation_failed_since or now
            _log.warn("inference answers /health but its one-token generation check (/health_generate) failed")
        ended = health.update_in_flight(self.cfg.log_dir / "sglang.log")
        if ended is None:
            self.update_since = None
        elif self.update_since is None or ended not in (-1, self.update_ended):  # -1: the end scrolled out of view
            self.update_since = now
        self.update_ended = self.update_ended if ended in (None, -1) else ended
        if self.update_since is not None and now - self.update_since >= self.update_deadline_s:
            self.record("restarted", "sglang", f"a weight update has been in flight for {now - self.update_since:.0f}s "
                        f"(weight_update_deadline_s {self.update_deadline_s:.0f}): generation waits behind it, "
                        "so the server counts as hung")
            self.update_since = self.generation_failed_since = None
            self.restart("sglang")
            return False
        self.gen.maybe_start(now, ended is not None)
        if self.generation_failed_since is None:
            return True
        if now - self.generation_failed_since >= self.w.inference_unhealthy_s:
            self.record("restarted", "sglang", f"live, but its generation check has failed for "
                        f"{now - self.generation_failed_since:.0f}s")
            self.generation_failed_since = None
            self.restart("sglang")
        return False

    def check_trainer(self, now: float, inference_ready: bool = True) -> None:
        info = self.info("trainer")
        if info["statename"] != supervisord.RUNNING:
            return
        # This trainer's own finish (an earlier run's record on the volume says nothing of it): not a hang,
        # whatever inference does.
        end = ending.read(self.state_dir, since=info["start"], program_pid=info["pid"], run_dir=self.cfg.run_path)
        if end is not None and end.family in (ending.FINISHED, ending.FINAL):
            return self.check_finished(now, info, end)  # a final end stays final: never restarted as a hang
        if not inference_ready:
            return
        prog = records.PROGRESS.read(self.state_dir)
        last = prog.get("time") or 0
        if last > now + 60:  # a step stamped ahead of this clock (another's, or this one stepped back)
            last = 0
        floor = self.run_started(info, now)  # a fresh trainer gets the full window
        if floor is None:
            return  # podkit's own back-off before the next start: not a hang
        if self.cfg.multi_node:  # waiting for a node is explained, not a hang; each (re)start gets the full window
            rec = records.CLUSTER.read(self.state_dir)
            if rec.get("state") != "running":
                return
            floor = max(floor, rec.get("since") or 0)
        since = now - max(last, floor)
        first = last < floor  # no step in this run yet: loading, preparing data, the first step
        over = False
        if first:
            busy = self.busy.seen(info["pid"], self.cfg.log_dir / "trainer.log", now, floor)
            bound = self.w.trainer_first_step_s
            over = bool(bound) and now - floor >= bound
            if over:
                words = f"no first step {now - floor:.0f}s after the run's start (watchdog.trainer_first_step_s " \
                        f"{bound:.0f}), busy or not"
            else:
                since = now - max(floor, busy)
                words = f"no first step, and no CPU, I/O or log output from the trainer, for {since:.0f}s"
        else:
            words = f"no training step for {since:.0f}s"
        if since < self.w.trainer_stall_s and not over:
            return
        dump = self.cfg.log_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        tool = dump_stacks(info["pid"], dump, self.cfg.log_dir)
        frame = self.hang_frame(dump)
        words = f"{words} while inference is ready; {frame[0]}"
        self.record("restarted", "trainer", f"{words}; stacks ({tool}) in {dump}", dump=str(dump), **frame[1])
        if self.cfg.multi_node:  # the cluster launcher's own stop cancels AReaL's tasks on every node
            self.restart("trainer", words, ending.HANG)  # a hang, not a stop, to the judge
        else:
            self.kill_and_restart("trainer", info["pid"])

    def run_started(self, info: dict, now: float) -> float | None:
        """When the trainer program's run began: its start, or later, once podkit's own back-off (inside the
        program, loopbound.py) has passed; None while there is no run to stall: during the back-off, and in the
        moments after the run ended while the program waits to exit. The loop record is data: only this
        program's, only times that fit it; anything else gives the full window from the program's start."""
        loop = records.kept(records.TRAINER_LOOP, self.state_dir, self.cfg.run_path)
        start = float(info["start"])
        if loop.get("boot") != records.CURRENT.read(self.state_dir).get("started") or loop.get("program") != info["pid"]:
            return start
        phase, until, ended, running = (loop.get(k) for k in ("phase", "backoff_until", "ended_at", "running"))
        if phase == "backoff" and isinstance(until, (int, float)) and now - 5 < until <= now + MAX_BACKOFF_S:
            return None
        if phase == "ended" and isinstance(ended, (int, float)) and 0 <= now - ended < ENDED_S:
            return None
        if phase == "running" and isinstance(running, (int, float)) and start - 1 <= running <= now:
            return max(start, running)
        return start

    def hang_frame(self, dump: Path) -> tuple[str, dict]:
        """The hang in words ("hung in your workflow at my_workflow.py:42 in arun_episode") and its frame's fields
        for the record (where, function, code), read from the dump."""
        try:
            text = dump.read_text(errors="replace")
        except OSError:
            return "the dump could not be read", {}
        frame = stacks.user_frame(text, self.user_roots())
        mine = frame is not None
        frame = frame or stacks.top_frame(text)
        if frame is None:
            return stacks.describe(None, False), {}
        path, _, line = frame["where"].rpartition(":")
        code = ""
        try:
            import linecache

            code = linecache.getline(path, int(line)).strip()[:300]
        except (ValueError, OSError):
            pass
        return stacks.describe(frame, mine), {"where": frame["where"], "function": frame["function"], "code": code}

    def user_roots(self) -> list[str]:
        """The user's code: the synced checkout when trainer.entry names a script in it, else podkit's example."""
        if self.cfg.trainer.kind != "areal":
            return []
        if self.cfg.trainer.entry:
            return [str(self.cfg.repo.dest)]
        return [str(Path(__file__).resolve().parent.parent / "areal" / "example")]

    def check_finished(self, now: float, info: dict, end: ending.End) -> None:
        """A trainer still running after its finish record, or its final one (stopped for good: a script that
        never trained): what is left after PPOTrainer.train returned is the script's own end (a last eval, an
        upload), given as long as a step may take (trainer_stall_s); past that, something (a non-daemon thread)
        keeps it alive. Dumped once, then stopped for good: never restarted, so a final end stays final."""
        stopped = end.rec
        since = now - stopped["time"]
        if since < self.w.trainer_stall_s or self.finished_stopped == stopped["time"]:
            return
        self.finished_stopped = stopped["time"]  # once per run, even if the stop below fails
        dump = self.cfg.log_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        tool = dump_stacks(info["pid"], dump, self.cfg.log_dir)
        what = f"the run finished {records.at_step(stopped.get('step'))}" if end.family == ending.FINISHED else \
            f"the trainer stopped for good ({end.kind.name})"
        self.record("stopped", "trainer", f"{what} but the trainer did not exit for {since:.0f}s (a non-daemon "
                    f"thread?): stacks ({tool}) in {dump}", dump=str(dump))
        self.stop_for_good(info["pid"], what)

    def stop_for_good(self, pid: int, what: str = "the run finished") -> None:
        """supervisord's stop first, so it never restarts the trainer; then SIGKILL for all of its tree:
        a finished trainer's ranks ignore SIGTERM (the hooks' handler only asks the training loop to stop)
        and torchrun starts them in sessions of their own, out of reach of supervisord's group kill. What
        the trainer started elsewhere carries its mark (proc.OWNER_ENV), and no next start will clear it."""
        procs = proc.processes()
        mine = {pid, *proc.descendants(pid, procs)}  # taken first: once killed, their children are orphans
        why = "the finished trainer's" if what.startswith("the run finished") else "the trainer stopped for good"
        targets = {p.pid: proc.Target.of(p, reason=why) for p in procs if p.pid in mine or p.pgid == pid}
        targets.update({t.pid: t for t in proc.marked(self.state_dir, {"trainer": why}) if t.pid not in targets})
        ending.ask(self.cfg.run_path, ["trainer"], f"the watchdog ({what}, the trainer did not exit)")
        try:
            self.server.supervisor.stopProcess("trainer", False)
        except xmlrpc.client.Fault as e:
            if "NOT_RUNNING" not in e.faultString:
                raise
        # Targets carry their start times: a pid that exited meanwhile and was reused is not signalled.
        proc.stop(list(targets.values()), grace_s=0, kill_wait_s=10)

    def run(self) -> int:
        _log.info(f"watching: trainer stall {self.w.trainer_stall_s:.0f}s, inference unhealthy "
                  f"{self.w.inference_unhealthy_s:.0f}s, start-up deadline {self.w.startup_deadline_s:.0f}s, "
                  f"weight update deadline {self.update_deadline_s:.0f}s")
        # A hang is seen within a quarter of its limit past it, however long interval_s is.
        every = min(self.w.interval_s, self.w.trainer_stall_s / 4)
        while True:
            time.sleep(every)
            now = time.time()
            try:
                # A cluster's SGLang is AReaL's (in Ray): the trainer's steps are what is left to watch.
                self.check_trainer(now, self.cfg.multi_node or self.check_inference(now))
            except (OSError, xmlrpc.client.Error) as e:
                _log.warn(f"supervisord did not answer ({e}); trying again")


def main(cfg) -> int:
    return Watchdog(cfg).run()
