"""supervisord event listener: every line a program prints reaches the container's stdout prefixed
with the program's name, and each program state change is recorded for `podkit status`. It notifies
(notify.py) of a program gone FATAL, of training finished and of supervisord beginning to stop. On
RunPod it tells the cost guard (costguard.py, which decides and stops the pod) what happened: a finished run,
a pod that can no longer train, each event (the maximum run time, guard.stop_pod_at, and the budget,
guard.max_spend, are checked on it; the trainer is stopped with its checkpoint first); on RunPod its thread
costguard.Meter keeps what the pod costs in cost.json. The guards are looked up each time, so that `podkit guard set`
changes them on the running pod (guardfile.py).

supervisord writes each program's output to its rotated file under <workspace>/logs/ and emits
PROCESS_LOG events; this listener prints them to its stderr, which supervisord.conf sends to
/dev/stdout. The protocol is read in binary: childutils reads `len` bytes through a text stream,
which desynchronises on the first non-ASCII character a program prints.
"""

from __future__ import annotations

import codecs
import os
import signal
import sys
import threading
import time
import xmlrpc.client
from pathlib import Path

from podkit import log, notify, records
from podkit.host import lease, pid1, supervisord
from podkit.judge import ending, standing
from podkit.money import costguard, guards, ledger

READY = b"READY\n"
OK = b"RESULT 2\nOK"
GUARDS_OFF = {"stop_pod_at": 0.0, "stop_pod_when_finished": "never", "stop_pod_after_s": 0.0, "max_spend": 0.0}


def read_payload(stdin, n: int) -> bytes:
    """supervisord's `len` counts the payload's characters, but it writes UTF-8 (supervisor 4.3,
    process.py:985): a log line with a non-ASCII character (AReaL's stats tables) is longer in bytes,
    and reading `len` bytes would leave the rest to be parsed as the next event's header."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    data, chars = b"", 0
    while chars < n:
        chunk = stdin.read(n - chars)  # each missing character is at least one more byte
        if not chunk:
            break
        data += chunk
        chars += len(decoder.decode(chunk))
    return data


def parse_headers(line: bytes) -> dict[str, str]:
    return dict(tok.split(":", 1) for tok in line.decode(errors="replace").split())


class Pump:
    """`guards` (guardfile.Live) gives the cost guards in force, the pod's settings with `podkit guard set`'s
    changes on top, read each time they are looked at; they act only `on_runpod`."""

    def __init__(self, out, run_dir: Path | None, width: int = 8, state_dir: Path | None = None,
                 trainer_grace_s: float = 0.0, guards=None, on_runpod: bool = False,
                 socket_path: str | None = None) -> None:
        self.out = out
        self.guards, self.on_runpod, self.socket_path = guards, on_runpod, socket_path
        self.deadline = costguard.Deadline(self.guard, lambda key: self.guards.from_file(key), state_dir, self.say,
                                           self.stop_trainer)
        self._idle: costguard.WhenIdle | None = None
        self._yours = None  # the stop you asked for, said once (its time)
        self._full = False  # the trainer's end waits in the run dir for room on the volume
        self._unwritten = False  # programs.json could not be written (said once)
        self.durable_within_s, self._behind = 0.0, ""  # the durability guard (with checkpoint.remote): its limit, its word
        self.trainer_grace_s = trainer_grace_s
        self.state_dir = state_dir
        self.partial: dict[tuple[str, str], str] = {}
        self.run_dir = run_dir
        self.width = width
        self.states = records.PROGRAMS.read(run_dir) if run_dir else {}
        # Counts belong to one supervisord; a new one (new boot) starts them again.
        owner = os.getppid()
        if self.states.get("_supervisord") != owner:
            self.states = {"_supervisord": owner}

    def say(self, line: str) -> None:
        self.out.write(f"{'podkit':<{self.width}} | {line}\n")
        self.out.flush()

    def guard(self, key: str):
        """A cost guard's value in force; off (0, never) outside RunPod or without guards."""
        if self.guards is None:
            return GUARDS_OFF[key]
        value = self.guards.values()[key]  # looked at even off RunPod: a bad guard file is said at once
        return value if self.on_runpod else GUARDS_OFF[key]

    def log(self, name: str, channel: str, data: str) -> None:
        key = (name, channel)
        text = self.partial.pop(key, "") + data
        lines = text.split("\n")
        if lines[-1]:
            self.partial[key] = lines[-1]
        for line in lines[:-1]:
            self.out.write(f"{name:<{self.width}} | {line.rstrip(chr(13))}\n")
        self.out.flush()

    def flush(self, name: str | None = None) -> None:
        for (n, ch), rest in list(self.partial.items()):
            if name is None or n == name:
                self.log(n, ch, rest + "\n")

    def state(self, event: str, headers: dict[str, str]) -> None:
        name = headers.get("processname", "?")
        to = event.removeprefix("PROCESS_STATE_")
        rec = self.states.setdefault(name, {"starts": 0})
        if not isinstance(rec, dict):
            rec = self.states[name] = {"starts": 0}
        if to == supervisord.STARTING:
            rec["starts"] = rec.get("starts", 0) + 1
            rec["started_at"] = time.time()
        if to == supervisord.FATAL:
            rec["fatal_at"] = time.time()
            notify.send("fatal", f"{name} gave up after {rec.get('starts', 0)} starts (FATAL); the container stays "
                        "up: `podkit doctor` names the cause", self.state_dir)
        # STOPPED too: a finished trainer that did not exit, stopped by the watchdog. A process ends once (EXITED
        # or STOPPED), and finished() counts only a record made since its start: one run is told once.
        pid = headers.get("pid", "")
        if name == "trainer" and self.state_dir and (
                to == supervisord.STOPPED or to == supervisord.EXITED and headers.get("expected") == "1"):
            self.finished(int(pid) if pid.isdigit() and int(pid) else rec.get("pid"))
        rec.update(state=to, since=time.time(), pid=int(pid) if pid.isdigit() and int(pid) else rec.get("pid"))
        if name in ("trainer", "sglang", "ray") and self.state_dir:
            self.idle_rule()
        # A program's unfinished last line is flushed when it stops.
        if to in supervisord.GONE:
            self.flush(name)
        if self.run_dir:
            try:
                records.PROGRAMS.write(self.run_dir, self.states)
            except OSError as e:  # the run dir's disk full: the listener goes on from its own events
                if not self._unwritten:
                    self.say(f"cannot record the programs' states in {self.run_dir} ({e.strerror}): a restarted "
                             "listener starts from supervisord's word")
                self._unwritten = True
            else:
                self._unwritten = False

    def trainer_end(self, pid=None) -> ending.End | None:
        """The trainer's own end record, only if it is the end of the run that just ended (an earlier run's "done"
        on the volume says nothing of a trainer that exited 0 without training): by its program's pid when the
        record names one, else since its start (a second's slack: this listener's clock stamps the start late)."""
        started = (self.states.get("trainer") or {}).get("started_at")
        return ending.read(self.state_dir, since=started - 1 if isinstance(started, (int, float)) else None,
                           program_pid=pid, run_dir=self.run_dir)

    def finished(self, pid=None) -> None:
        """An expected exit after the trainer recorded its end (max_steps for the fake trainer, AReaL's
        total steps): a stop also exits 0, but records why."""
        end = self.trainer_end(pid)
        if end is not None and end.family == ending.FINISHED:
            prog = records.PROGRESS.read(self.state_dir)
            step = end.step if isinstance(end.step, int) and not isinstance(end.step, bool) else prog.get("step")
            sent = notify.send("finished", f"training finished {records.at_step(step)} "
                               f"({records.checkpoint_at(prog.get('checkpoint_step'))})", self.state_dir)
            costguard.when_finished(step, self.guard, self.state_dir, self.say, after=sent)

    def standing(self) -> standing.Standing:
        """The pod's standing from this listener's own events (standing.judge: the rule status renders too). A copy
        of them: the cost guard's stopper asks again from its own thread while events come in."""
        return standing.judge(standing.gather(self.state_dir, standing.of_events(dict(self.states)),
                                              run_dir=self.run_dir))

    def cannot_train(self) -> str:
        """Why this pod can no longer train, "" while it can: what supervisord does, whatever the records say (a
        program FATAL, the trainer EXITED or STOPPED not by you, a cluster node's `ray` stopped by its bound); the
        records (the trainer's end) give the words."""
        s = self.standing()
        return s.why if s.stuck else ""

    def idle_rule(self) -> None:
        """Tells the cost guard whether the pod can train, and since when it cannot (costguard.cannot_train); a
        trainer you stopped is said once, with the guard it is not counted by."""
        s, now = self.standing(), time.time()
        yours = s.run == standing.STOPPED_ and not s.stuck
        if yours and self._yours != s.since and self.guard("stop_pod_after_s"):
            self.say(f"{s.why}; the pod is not stopped for it (guard.stop_pod_after_s, "
                     f"{self.guard('stop_pod_after_s'):g} s, counts only a trainer nothing will start)")
        self._yours = s.since if yours else None
        # Counted from the state change itself: a listener restarted since does not start the wait again.
        since = s.since if s.stuck and isinstance(s.since, (int, float)) and s.since <= now else now
        self._idle = costguard.cannot_train(self._idle, s.why if s.stuck else "", s.who or "the trainer", since,
                                            self.guard, self.state_dir, self.say, still=self.cannot_train)

    def room(self) -> None:
        """Once the volume has room again: the trainer's end kept in the run dir put back on it, and podkit's
        reserve made again (records.keep_reserve)."""
        if self.state_dir is None:
            return
        if self.run_dir is not None and not ending.flush_kept(self.state_dir, self.run_dir) and not self._full:
            self._full = True
            self.say("the volume is full: the trainer's end is kept in the run dir until it has room")
        elif self._full and (self.run_dir is None or not ending.KEPT.path(self.run_dir).exists()):
            self._full = False
            self.say("the volume has room again: the trainer's end is on it")
        records.keep_reserve(self.state_dir)

    def durability(self, now: float | None = None) -> str:
        """The durability guard (guard.durable_within_s): a notification once the run trains and its last checkpoint
        on the remote falls further behind than the limit, and a line in the log when one reaches it again. Returns
        why it is behind ("" while it is not)."""
        if not self.durable_within_s or self.state_dir is None:
            return ""
        now = time.time() if now is None else now
        prog = records.PROGRESS.read(self.state_dir)
        d = standing.durable(records.REMOTE.read(self.state_dir), prog.get("step"), ledger.cost(self.state_dir), now,
                             configured=True, run=prog.get("run"))
        why = standing.behind(d, self.durable_within_s, self.standing().run == standing.TRAINING,
                              records.CURRENT.read(self.state_dir).get("started"), now)
        if why and not self._behind:
            self.say(f"[podkit:remote] {why}")
            notify.send("durability", f"{why}; at risk if the pod is lost: {standing.durable_words(d, now)}",
                        self.state_dir)
        elif self._behind and not why:
            self.say("[podkit:remote] the run's checkpoints reach the remote again"
                     + (f": step {d['step']}" if d and d["step"] is not None else ""))
        self._behind = why
        return why

    def stop_trainer(self, why: str = "the maximum run time (guard.stop_pod_at)") -> str:
        """For the maximum run time or the budget (costguard.Deadline, which says `why`): the watchdog first, so
        that it cannot start the trainer again; then the trainer, wait=True: the call returns once it has exited
        (its checkpoint written) or been killed. Says where the checkpoint is."""
        rpc = supervisord.rpc(self.socket_path).supervisor
        if self.run_dir:
            ending.ask(self.run_dir, ["watchdog", "trainer"], why)
        for name in ("watchdog", "trainer"):
            try:
                rpc.stopProcess(name, True)
            except (OSError, xmlrpc.client.Error) as e:  # not running (finished, FATAL): nothing to save
                self.say(f"{name} was not stopped ({e})")
        prog = records.PROGRESS.read(self.state_dir) if self.state_dir else {}
        return records.checkpoint_at(prog.get("checkpoint_step"))

    def handle(self, headers: dict[str, str], payload: bytes) -> None:
        event = headers.get("eventname", "")
        self.deadline.check(time.time())
        if event.startswith("PROCESS_LOG"):
            head, _, data = payload.partition(b"\n")
            h = parse_headers(head)
            self.log(h.get("processname", "?"), h.get("channel", "stdout"), data.decode(errors="replace"))
        elif event.startswith("PROCESS_STATE"):
            self.state(event, parse_headers(payload.split(b"\n", 1)[0]))
        elif event == "SUPERVISOR_STATE_CHANGE_STOPPING":
            notify.stopping(float(os.environ.get(pid1.STOP_DEADLINE_ENV) or 0))  # none past the stop's deadline
            notify.send("stopping", "the pod is stopping (supervisord got SIGTERM: docker stop, a RunPod stop, "
                        f"or podkit up's end); the trainer has {self.trainer_grace_s:g} s to checkpoint",
                        self.state_dir)
        elif event.startswith("TICK") and self.state_dir is not None:
            try:
                lease.renew(self.state_dir)
            except OSError as e:
                self.say(f"cannot renew the workspace lease ({e.strerror})")
            self.room()
            self.idle_rule()  # a guard set on the pod since, or a listener restarted after the trainer stopped
            self.durability()


# What the listener, the last program to stop, waits for a notification in flight: docker stop's default
# budget is 10 s for everything, and a webhook that accepts and never answers must not spend it.
DRAIN_S = 1.0
# What the listener keeps of the stop's deadline after the final upload of the last checkpoint: the run's lease on the
# remote released (one request), then the workspace's and the stop's notification.
FINAL_RESERVE_S = 1.0


def main(cfg) -> int:
    log.to_stderr()  # stdout is the event protocol
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    from podkit.money import guardfile

    pump = Pump(sys.stderr, Path(cfg.run_path), state_dir=cfg.state_dir, trainer_grace_s=cfg.trainer.stop_grace_s,
                on_runpod=costguard.on_runpod(), socket_path=cfg.socket_path)
    pump.guards = guardfile.Live(cfg.workspace_path, {k: getattr(cfg.guard, k) for k in guards.KEYS}, pump.say)
    pump.idle_rule()  # a listener restarted after the trainer stopped for good: the rule holds still
    uploader = None
    if cfg.checkpoint.remote and not (cfg.multi_node and cfg.cluster.rank != 0):
        from podkit.remote import uploader as uploading  # rclone and hashing only with a remote

        pump.durable_within_s = cfg.guard.durable_within_s

        # Here, not a program of its own: the listener outlives every trainer restart and stops last.
        uploader = uploading.Uploader(cfg, pump.say).start()
        # A cost guard's stop uploads the last checkpoint first (its trainer has stopped), then stops the pod.
        costguard.BEFORE_STOP.append(lambda why: uploader.final(cfg.checkpoint.remote_final_s, "the pod stops itself"))
    meter = None
    if pump.on_runpod:  # what the pod costs (cost.json), and what guard.max_spend goes by: the run's, across its pods
        from podkit.money import runmeter

        meter = costguard.Meter(cfg.state_dir, cfg.guard.cost_every_s, cfg.trainer.max_steps, pump.say,
                                runs=runmeter.for_pod(cfg, pump.say)).start()
        if not (cfg.multi_node and cfg.cluster.rank != 0):  # a cluster's head acts on the run's, its nodes' included
            pump.deadline.spent = meter.spent

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not start this again mid-upload
        pump.flush()
        stopping = supervisord.stop_requested(cfg.socket_path, "logs")
        # The run's record learns this pod stopped (its time after is nobody's spend): one small push, beside the
        # last checkpoint's upload rather than out of its time.
        told = threading.Thread(target=meter.final, args=(max(0.1, min(10.0, notify.left() - FINAL_RESERVE_S)),),
                                daemon=True) if stopping and meter else None
        if told:
            told.start()
        if stopping and uploader:
            # supervisord stops this listener last: the trainer has exited with its checkpoint, which goes up
            # within what the stop's deadline leaves (render.stop_budget), the leases' release kept out of it.
            uploader.final(min(cfg.checkpoint.remote_final_s, notify.left() - FINAL_RESERVE_S), "the pod is stopping",
                           "what the stop's deadline left after the trainer (stop_timeout_s)", for_good=True)
            uploader.release(max(0.1, min(30.0, notify.left() - FINAL_RESERVE_S / 2)))
        if told:
            told.join(max(0.0, min(10.0, notify.left() - FINAL_RESERVE_S / 2)))
        # The lease before the notification: a webhook that never answers must not keep the workspace from the
        # next pod (after the upload: the volume's checkpoint is read until then).
        if stopping:
            lease.release(cfg.state_dir)  # the pod is stopping: the workspace is free for the next one
        notify.drain(DRAIN_S)  # the stop's own notification, posted moments ago, within the stop's budget
        # Not SystemExit: a notification still in flight, cut at the stop's deadline, must not wake up in the
        # interpreter's teardown (a traceback on the container's last lines).
        pid1.exit_now(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        stdout.write(READY)
        stdout.flush()
        line = stdin.readline()
        if not line:
            return 0
        headers = parse_headers(line)
        payload = read_payload(stdin, int(headers["len"]))
        try:
            pump.handle(headers, payload)
        finally:
            stdout.write(OK)
            stdout.flush()
