"""The trainer's end, decided on evidence (src/podkit/judge/ending.py): the one table of kinds, the one reader's
freshness rule, the judge on each kind of evidence (staged as records, real processes, a stand-in cgroup
file), and the loop bound counting each kind apart. The stacks that end these ways for real:
tests/judge/test_user_stops.py (the smoke stack, real supervisord), tests/programs/test_programs.py (torchrun, a real OOM
kill), tests/trainer/test_your_code.py (AReaL's trainer)."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, alive
from podkit import records
from podkit.judge import ending, failure, loopbound, verdict

pytestmark = pytest.mark.timeout(60)


def cfg_of(tmp_path, **trainer):
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return SimpleNamespace(state_dir=tmp_path, run_path=tmp_path / "run", socket_path=str(tmp_path / "no.sock"),
                           workspace_path=tmp_path, log_dir=tmp_path / "logs", multi_node=False,
                           trainer=SimpleNamespace(**{"max_failures": 3, "restart_delay_s": 0.0, **trainer}),
                           origin=lambda key: "defaults")


# -- the table ----------------------------------------------------------------------------------------------------
# Strings that equal a kind's name but are not one: the English word, a setting's key, a signal's name in a log.
NOT_KINDS = {("sync.py", "done"), ("settings.py", "max_steps"), ("proc.py", "SIGTERM"),
             ("fake_trainer.py", "SIGTERM")}


def test_the_end_kinds_are_named_as_strings_in_one_module_only():
    """Every other room reads a kind through ending.py's names (ending.CRASH_LOOP, ending.FINAL_KINDS...): a
    kind spelt out elsewhere is a second source of what an end means."""
    names = set(ending.KINDS)
    found = []
    for path in (ROOT / "src" / "podkit").rglob("*.py"):
        if path.name == "ending.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and (path.name, node.value) not in NOT_KINDS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_every_kind_has_its_words_and_every_final_one_its_finding_and_each_count_its_final_kind():
    for k in ending.KINDS.values():
        assert k.words and k.family in (ending.FINISHED, ending.FINAL, ending.STOP, ending.RESTART, ending.FAILURE,
                                        ending.GONE), k.name
        # a failure counts; so does the one stop nobody asked podkit for, when it comes again with no new step
        assert (k.counts is not None) == (k.family == ending.FAILURE or k.name == ending.STRAY), k.name
        if k.family == ending.FINAL:
            assert k.finding.startswith("trainer_") and k.title, k.name
    for c in ending.COUNTS.values():
        assert ending.kind(c.final).family == ending.FINAL
    assert {k.counts for k in ending.KINDS.values() if k.counts} == set(ending.COUNTS)


def test_a_kind_podkit_does_not_know_is_a_failure_never_finished_or_final():
    planted = ending.of({"by": "done-ish", "time": 1.0})
    assert planted.family == ending.FAILURE and planted.kind.counts is None
    assert ending.exit_code(planted, 0) == 1
    for bad in ({"by": 3, "time": 1.0}, {"by": "done"}, {"by": "done", "time": True}, "done", None):
        assert ending.of(bad) is None, bad


def test_an_end_counts_for_a_run_only_when_it_names_that_runs_program_and_came_after_its_start():
    rec = {"by": ending.DONE, "time": 100.0, "program": 42}
    assert ending.of(rec, since=100.0, program_pid=42) is not None
    assert ending.of(rec, since=100.5) is None, "older than the run's start"
    assert ending.of(rec, program_pid=43) is None, "another run's program"
    assert ending.of({"by": ending.DONE, "time": 100.0}, program_pid=43) is not None, "names none: time decides"


# -- the judge ----------------------------------------------------------------------------------------------------
def judge(cfg, rc, started, **kw):
    return verdict.judge(cfg, rc, started, signals=kw.pop("signals", ending.Signals()), **kw)


def test_the_trainers_own_finish_or_refusal_is_its_end_whatever_else_happened(tmp_path):
    cfg = cfg_of(tmp_path)
    started = time.time()
    ending.write(tmp_path, ending.CONFIG_ERROR, "KeyError: 'question' at train.py:3", "rename it")
    asked = ending.Signals()
    asked.at = time.time()
    end = judge(cfg, 2, started, signals=asked)
    assert end.kind.name == ending.CONFIG_ERROR and end.stored and ending.exit_code(end, 2) == 0


def test_a_stop_asked_for_is_a_stop_whatever_the_exit_and_names_who_asked(tmp_path):
    """No supervisord here: whoever runs the program asked; the cut at the end of the grace is said."""
    cfg = cfg_of(tmp_path)
    started = time.time()
    sig = ending.Signals()
    sig.cfg, sig.at, sig.cut = cfg, time.time(), True
    ending.ask(cfg.run_path, ["trainer"], "you (podkit ctl restart trainer)")
    end = judge(cfg, 137, started, signals=sig)
    assert end.kind.name == ending.SIGTERM and end.asked == "you (podkit ctl restart trainer)", end.rec
    assert "message" not in end.rec, "no word of the ranks: none made up"
    assert end.cut and "cut at the end of trainer.stop_grace_s" in end.words()
    assert ending.exit_code(end, 137) == 0 and end.kind.counts is None
    # Its note, for a next start should the program have been killed before it judged
    assert ending.RECEIVED.read_owned(cfg.run_path)["by"] == "you (podkit ctl restart trainer)"


def test_an_ask_made_before_this_program_started_is_not_who_asked_for_its_stop(tmp_path):
    """`podkit ctl stop trainer`, then a new start, then the pod's stop within ASKED_FRESH_S: the old ask was for
    the instance before (its stop already named it); this stop is nobody's ask but the pod's."""
    cfg = cfg_of(tmp_path)
    ending.ask(cfg.run_path, ["trainer"], "you (podkit ctl stop trainer)")
    time.sleep(0.05)
    sig = ending.Signals()
    sig.cfg, sig.started = cfg, time.time()
    sig.at = time.time() + 1
    assert sig.resolve().by != "you (podkit ctl stop trainer)", sig.asked.by
    ending.ask(cfg.run_path, ["trainer"], "the pod's stop")
    later = ending.Signals()
    later.cfg, later.started, later.at = cfg, sig.started, time.time() + 1
    assert later.resolve().by == "the pod's stop"


def test_ranks_that_stopped_on_a_sigterm_the_program_never_got_restart_to_resume(tmp_path):
    cfg = cfg_of(tmp_path)
    started = time.time()
    records.PROGRESS.write(tmp_path, {"step": 4, "stopped": ending.record(ending.SIGTERM, step=4)})
    end = judge(cfg, 0, started)
    assert end.kind.name == ending.STRAY and ending.exit_code(end, 0) == ending.EXIT_RESTART


def test_a_network_error_an_oom_and_the_scripts_own_exception_are_told_apart(tmp_path):
    cfg = cfg_of(tmp_path)
    started = time.time()
    base = {"type": "X", "message": "m", "where": "/r/train.py:3", "time": time.time(), "hint": ""}
    net = judge(cfg, 1, started, err={**base, "type": "URLError", "transient": "could not reach 127.0.0.1:9"})
    assert net.kind.name == ending.NETWORK and net.kind.counts == "outside", net.rec
    assert net.first().startswith("could not reach 127.0.0.1:9: URLError: m at /r/train.py:3"), net.rec
    oom = judge(cfg, 1, started, err={**base, "type": "OutOfMemoryError", "oom": "GPU"})
    assert oom.kind.name == ending.OOM and "out of GPU memory" in oom.first() and "batch" in oom.hint, oom.rec
    own = judge(cfg, 1, started, err={**base, "type": "KeyError"})
    assert own.kind.name == ending.FAILED and own.error["type"] == "KeyError" and own.kind.counts == "script"
    none = judge(cfg, 1, started)
    assert none.kind.name == ending.FAILED and "no exception recorded" in none.first()


def stand_in_cgroup(tmp_path, monkeypatch, kills: int) -> Path:
    """A stand-in for the cgroup's memory.events (a cgroup namespace's root: /sys/fs/cgroup/memory.events)."""
    root = tmp_path / "cgroup"
    root.mkdir(exist_ok=True)
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\n")
    monkeypatch.setenv(ending.CGROUP_ENV, str(root))
    return root / "memory.events"


def silent_rank(cfg, rank: int = 0) -> int:
    """A rank that noted it lives and then ended without going through Python's exit."""
    p = subprocess.Popen([sys.executable, "-c", "import os, sys; from podkit.judge import ending; "
                          "ending.rank_alive(sys.argv[1], int(sys.argv[2]), training=True); "
                          "os.kill(os.getpid(), 9)", str(cfg.run_path), str(rank)])
    p.wait(20)
    return p.pid


def test_a_rank_that_ended_without_a_word_is_out_of_memory_when_the_kernels_oom_count_rose(tmp_path, monkeypatch):
    cfg = cfg_of(tmp_path)
    events = stand_in_cgroup(tmp_path, monkeypatch, 0)
    before = ending.oom_kills()[0]
    records.PROGRESS.write(tmp_path, {"step": 7})
    started = time.time()
    pid = silent_rank(cfg)
    (cfg.log_dir / "trainer.log").write_text(f"E1127 failed (exitcode: -9) local_rank: 0 (pid: {pid}) of binary: x\n")
    events.write_text("oom 2\noom_kill 1\n")  # what the kernel's OOM killer counts
    end = judge(cfg, 1, started, oom_before=before)
    assert end.kind.name == ending.OOM and end.step == 7, end.rec
    assert f"rank 0 (pid {pid}, SIGKILL) killed by the kernel's OOM killer" in end.first(), end.rec
    assert "oom_kill 0 -> 1" in end.evidence[0] and "batch" in end.hint, end.rec


def test_a_rank_killed_without_an_oom_on_record_is_killed_and_a_native_crash_is_the_scripts(tmp_path, monkeypatch):
    cfg = cfg_of(tmp_path)
    stand_in_cgroup(tmp_path, monkeypatch, 4)
    started = time.time()
    pid = silent_rank(cfg)
    (cfg.log_dir / "trainer.log").write_text(f"failed (exitcode: -9) local_rank: 0 (pid: {pid}) of binary: x\n")
    end = judge(cfg, 1, started, oom_before=4)
    assert end.kind.name == ending.KILLED and "SIGKILL that podkit did not send" in end.first(), end.rec
    assert any("no OOM kill on record" in e for e in end.evidence), end.rec
    pid = silent_rank(cfg, 1)
    (cfg.log_dir / "trainer.log").write_text(f"failed (exitcode: -11) local_rank: 1 (pid: {pid}) of binary: x\n")
    end = judge(cfg, 1, started, oom_before=4)
    assert end.kind.name == ending.FAILED and "crashed in native code (SIGSEGV)" in end.first(), end.rec


def test_a_killed_program_is_judged_at_its_next_start_from_the_watchdog_its_stop_note_or_the_oom_count(
        tmp_path, monkeypatch):
    cfg = cfg_of(tmp_path)
    ran = time.time()
    records.WATCHDOG.write(tmp_path, [{"time": time.time(), "action": "restarted", "program": "trainer",
                                       "reason": "no training step for 40s; hung in your workflow at wf.py:9 in "
                                                 "arun_episode", "where": "/r/wf.py:9", "dump": "/w/logs/hang-1.txt"}])
    end = verdict.judge_killed(cfg, ran, 4242)
    assert end.kind.name == ending.HANG and end.where == "/r/wf.py:9" and "asyncio.wait_for" in end.hint, end.rec
    records.WATCHDOG.write(tmp_path, [])
    ending.RECEIVED.write(cfg.run_path, {"pid": 4242, "start": 1, "time": time.time(), "by": "the pod's stop",
                                         "supervisord": True}, mode=0o600)
    end = verdict.judge_killed(cfg, ran, 4242)
    assert end.kind.name == ending.SIGTERM and end.asked == "the pod's stop", end.rec
    events = stand_in_cgroup(tmp_path, monkeypatch, 2)
    events.write_text("oom_kill 3\n")
    end = verdict.judge_killed(cfg, ran, 4343, oom_before=2)
    assert end.kind.name == ending.OOM and "oom_kill 2 -> 3" in end.evidence[0], end.rec


def test_the_oom_count_is_read_from_cgroup_v1_and_v2_and_never_from_a_planted_value(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    monkeypatch.setenv(ending.CGROUP_ENV, str(root))
    assert ending.oom_kills() is None
    (root / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert ending.oom_kills()[0] == 5
    (root / "memory.events").write_text("oom 1\noom_kill 7\n")
    assert ending.oom_kills()[0] == 7
    (root / "memory.events").write_text("oom_kill -1\n")
    (root / "memory" / "memory.oom_control").write_text("oom_kill lots\n")
    assert ending.oom_kills() is None
    assert ending.oom_since("1") == "" and ending.oom_since(None) == ""


# -- network errors that may pass --------------------------------------------------------------------------------
def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def test_a_refused_connection_and_a_503_may_pass_a_404_an_offline_hub_and_a_keyerror_do_not(tmp_path, monkeypatch):
    import http.server
    import socket
    import threading
    import urllib.request

    from conftest import free_port

    port = free_port()  # nothing listens there
    refused = raised(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/data.jsonl", timeout=5))
    assert failure.transient(refused) == f"could not reach 127.0.0.1:{port}", failure.transient(refused)

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(503 if self.path == "/busy" else 404)
            self.end_headers()

        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        busy = raised(lambda: urllib.request.urlopen(f"http://127.0.0.1:{srv.server_port}/busy", timeout=5))
        gone = raised(lambda: urllib.request.urlopen(f"http://127.0.0.1:{srv.server_port}/gone", timeout=5))
    finally:
        srv.shutdown()
        srv.server_close()
    assert failure.transient(busy) == f"could not reach 127.0.0.1:{srv.server_port}"
    assert failure.transient(gone) == ""
    offline = ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")
    assert failure.transient(offline) == ""
    hub = ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")
    assert failure.transient(hub) == "could not reach the hub (dataset 'openai/gsm8k')"
    assert failure.transient(hub, offline=True) == "", "a rehearsal cannot reach the hub: nothing heals it"
    assert "transient" not in failure.classify(hub, {}, place="rehearse"), "stopped once with OVERRIDES= instead"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert failure.transient(hub) == "", "told to stay offline: nothing heals it"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert failure.transient(socket.gaierror(socket.EAI_NONAME, "Name or service not known")) == ""
    assert failure.transient(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    assert failure.transient(KeyError("question")) == "" and failure.transient(FileNotFoundError("x")) == ""
    err = failure.classify(refused, {"type": "URLError"})
    assert err == {"type": "URLError", "transient": f"could not reach 127.0.0.1:{port}"}
    assert failure.classify(MemoryError(), {})["oom"] == "host"
    assert failure.classify(type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})("CUDA out of memory."),
                            {})["oom"] == "GPU"
    assert "oom" not in failure.classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), {}), \
        "a message that says it is not the type that is"


# -- the loop bound, by kind ---------------------------------------------------------------------------------------
def end_of(kind: str, message: str = "", **fields) -> ending.End:
    return ending.End(ending.record(kind, message, **fields))


def test_each_kind_of_end_is_counted_apart_and_stops_for_good_in_its_own_words(tmp_path):
    cfg = cfg_of(tmp_path)
    b = loopbound.Bound(cfg)
    since = time.time()
    for _n in (1, 2):
        assert b.finish(end_of(ending.OOM, "out of host memory before its first step", hint="a smaller batch"), 1,
                        since) == 1
        assert b.finish(end_of(ending.NETWORK, "could not reach 127.0.0.1:9"), 1, since) == 1
    assert (b.rec["ooms"], b.rec["outside"], b.rec["failures"]) == (2, 2, 0), b.rec
    for stop in (end_of(ending.SIGTERM, asked="you (podkit ctl restart trainer)", cut=True), end_of(ending.STALE),
                 end_of(ending.INFERENCE_STOPPED)):
        b.finish(stop, 137, since)
    assert (b.rec["ooms"], b.rec["outside"], b.rec["failures"]) == (2, 2, 0), "a stop asked for counts nothing"
    assert b.finish(end_of(ending.OOM, "out of host memory before its first step", hint="a smaller batch"), 1,
                    since) == 0
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == ending.OOM_LOOP and stopped["last"] == ending.OOM, stopped
    assert stopped["message"].startswith("the trainer ran out of memory 3 times in a row before its first step")
    assert "a smaller batch" in stopped["hint"] and "podkit resume" in stopped["hint"], stopped


def test_a_bound_of_one_stops_at_the_first_counted_end_and_says_once_not_1_times(tmp_path):
    b = loopbound.Bound(cfg_of(tmp_path, max_failures=1))
    assert b.finish(end_of(ending.FAILED, "ValueError: a bad row at train.py:12"), 1, time.time()) == 0
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == ending.CRASH_LOOP, stopped
    assert stopped["message"].startswith("the trainer failed once before its first step without a new step: "
                                         "ValueError: a bad row"), stopped


def test_a_run_that_fails_after_every_new_step_is_never_stopped_but_said_once(tmp_path, monkeypatch):
    cfg = cfg_of(tmp_path)
    told = []
    monkeypatch.setattr(loopbound.Loop, "tell", lambda self, text, event="trainer-stopped": told.append((event, text)))
    for step in range(1, 8):
        b = loopbound.Bound(cfg)
        assert b.hold_off()
        since = time.time()
        records.PROGRESS.write(tmp_path, {"step": step, "resumed_at": step - 1, "time": time.time()})
        assert b.finish(end_of(ending.FAILED, "RuntimeError: after every step at train.py:9"), 1, since) == 1
    assert [e for e, _ in told] == ["trainer-restarting"], told
    assert "failed 5 times in the last hour, each time after a new step" in told[0][1]
    rec = records.TRAINER_LOOP.read(tmp_path)
    assert rec["failures"] == 0 and len(loopbound.failing_with_progress(rec)) == 7


def test_a_sigterm_during_the_back_off_ends_it_at_once_and_counts_nothing(tmp_path):
    """The back-off is podkit's own wait inside the trainer program: a stop there ends the program, judged a
    stop (ending.Stop from the program's signal handler)."""
    cfg_of(tmp_path, restart_delay_s=30.0)  # its run and log dirs
    records.TRAINER_LOOP.write(tmp_path, {"failures": 2, "last_failure": time.time()})
    code = ("import json, sys, types\nfrom podkit.judge import ending, loopbound\n"
            "cfg = types.SimpleNamespace(state_dir=sys.argv[1], run_path=sys.argv[1] + '/run', socket_path='/no/sock',"
            " workspace_path=sys.argv[1], log_dir=sys.argv[1] + '/logs', multi_node=False, origin=lambda k: '',"
            " trainer=types.SimpleNamespace(max_failures=3, restart_delay_s=30.0))\n"
            "ending.SIGNALS.install(cfg)\nprint('ready', flush=True)\n"
            "print(json.dumps({'code': loopbound.run(cfg, lambda: 0)}), flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        out = json.loads(next(ln for ln in p.stdout if ln.startswith("{")))
        assert time.time() - t0 < 5 and out["code"] == 0, out
    finally:
        if alive(p.pid):
            p.kill()
        p.wait(10)
    stopped = records.PROGRESS.read(tmp_path)["stopped"]
    assert stopped["by"] == ending.SIGTERM and "no supervisord" in stopped["asked"], stopped
    assert records.TRAINER_LOOP.read(tmp_path)["failures"] == 2, "counted nothing"


def test_the_fix_fits_where_the_trainer_runs(tmp_path, monkeypatch):
    cfg = SimpleNamespace(origin=lambda key: "env PODKIT_TRAINER_OVERRIDES")
    assert "podkit resume" in ending.fix_code(cfg) and "push" in ending.fix_code(cfg)
    assert "a new boot picks up" in ending.fix_setting(cfg) and "podkit resume" not in ending.fix_setting(cfg)
    monkeypatch.setenv(ending.PLACE_ENV, "rehearse")
    assert "make rehearse" in ending.fix_code(cfg) and "push" not in ending.fix_code(cfg)
    assert "OVERRIDES=" in ending.fix_setting(cfg)
    monkeypatch.setenv(ending.PLACE_ENV, "up")
    assert "podkit up" in ending.fix_resume(cfg)
    monkeypatch.setenv(ending.PLACE_ENV, "planted")
    assert "podkit resume" in ending.fix_resume(cfg), "an unknown place reads as a pod"


# -- a hang, named at the user's frame ---------------------------------------------------------------------------
WORKFLOW = """import asyncio


class MyWorkflow:
    async def arun_episode(self, engine, data):
        await asyncio.Event().wait()  # waits for what never comes
"""
HUNG = """import asyncio, os, sys, threading, time
sys.path.insert(0, sys.argv[2])
from podkit.host import stacks
from my_workflow import MyWorkflow

stacks.on_sigusr2(os.path.join(sys.argv[1], f"stacks-{os.getpid()}.txt"))  # as podkit run trainer registers it


def rollout_thread():
    async def main():
        await asyncio.gather(*(MyWorkflow().arun_episode(None, i) for i in range(2)))
    asyncio.run(main())


threading.Thread(target=rollout_thread, daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.1)  # the trainer's wait for a batch of rollouts
"""


def test_a_workflow_that_awaits_for_ever_is_named_at_its_await_from_the_dump(tmp_path):
    """The await is on no thread's stack (the rollout thread shows its event loop's select): the process's own
    dump of its asyncio tasks (SIGUSR2, stacks.py) has it, and the watchdog's reading names it."""
    from podkit.host import stacks
    from podkit.programs import watchdog

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "my_workflow.py").write_text(WORKFLOW)
    logs = tmp_path / "logs"
    logs.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HUNG, str(logs), str(repo)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        dump = tmp_path / "hang.txt"
        watchdog.dump_stacks(p.pid, dump, logs)
    finally:
        p.kill()
        p.wait(10)
    text = dump.read_text()
    assert stacks.TASKS_END in text, text[-3000:]
    frame = stacks.user_frame(text, [str(repo)])
    line = WORKFLOW.splitlines().index("        await asyncio.Event().wait()  # waits for what never comes") + 1
    assert {k: frame[k] for k in ("where", "function", "task", "shown")} == {
        "where": f"{repo / 'my_workflow.py'}:{line}", "function": "arun_episode", "task": True,
        "shown": f"my_workflow.py:{line}"}, frame
    assert frame["above"] <= stacks.NEAR and frame["top"].startswith("locks.py:"), frame
    assert stacks.describe(frame, True) == f"hung in your workflow at my_workflow.py:{line} in arun_episode"
    assert stacks.user_frame(text, [str(tmp_path / "elsewhere")]) is None
    assert stacks.top_frame(text)["function"] == "<module>", stacks.top_frame(text)


# -- the rest of the story, told from the same record --------------------------------------------------------------
def test_the_boot_history_tells_the_last_end_in_its_kinds_words_at_its_own_step(tmp_path):
    """After a start-over (the progress record's step cleared) the stop is still at step 9; a config error is
    not "stopped cleanly"."""
    from podkit.boot import guard

    previous = {"time": time.time() - 60}
    records.PROGRESS.write(tmp_path, {"step": None, "stopped": ending.record(
        ending.SIGTERM, step=9, asked="the pod's stop (docker stop, a RunPod stop or migration)")})
    said = guard.last_stop(tmp_path, previous)
    assert said == "SIGTERM: the trainer stopped by the pod's stop (docker stop, a RunPod stop or migration) at step 9"
    ending.write(tmp_path, ending.CONFIG_ERROR, "KeyError: 'question'", step=None)
    said = guard.last_stop(tmp_path, previous)
    assert said.startswith("config-error: the trainer stopped for good: its config or code cannot train before its "
                           "first step") and "cleanly" not in said, said
    assert guard.last_stop(tmp_path, {"time": time.time() + 10}).startswith("unknown: no end recorded")


def doctor_pod(tmp_path, progress: dict, boots: list, loop: dict | None = None, programs: dict | None = None):
    from podkit.views import doctor

    state = tmp_path / ".podkit"
    state.mkdir(exist_ok=True)
    records.PROGRESS.write(state, progress)
    records.BOOTS.write(state, boots)
    records.CURRENT.write(state, {"started": boots[-1]["time"]})
    if loop is not None:
        records.TRAINER_LOOP.write(state, loop)
    pod = SimpleNamespace(state=state, progress=records.PROGRESS.read(state), boots=records.BOOTS.read(state),
                          loop=records.TRAINER_LOOP.read(state), programs=programs or {}, cfg=cfg_of(tmp_path),
                          log_tail=lambda program, n=400: [])
    return doctor, pod


def test_doctors_note_on_a_stop_says_what_happened_since_not_that_it_resumed(tmp_path):
    now = time.time()
    boot = {"time": now - 100, "pid": 1, "stages": {}, "outcome": "supervisord",
            "last_stop": "SIGTERM: the trainer stopped by the pod's stop at step 9"}
    doctor, pod = doctor_pod(tmp_path, {"step": 12, "resumed_at": 9, "time": now - 5}, [boot])
    assert doctor.check_last_stop(pod, now).fix.endswith("it resumed from the checkpoint of step 9")
    refused = ending.record(ending.CONFIG_ERROR, "KeyError: 'question' at train.py:3", step=None)
    refused["time"] = now - 50
    doctor, pod = doctor_pod(tmp_path, {"step": 9, "stopped": refused}, [boot])
    f = doctor.check_last_stop(pod, now)
    assert "since, nothing resumed: the trainer stopped for good" in f.fix and "resumed from" not in f.fix, f.fix
    doctor, pod = doctor_pod(tmp_path, {"step": 3, "time": now - 5}, [boot])  # a start-over: from step 0
    assert "it trains from step 0" in doctor.check_last_stop(pod, now).fix


def test_doctor_calls_a_trainer_that_recovered_from_a_failure_a_note_and_restarts_you_asked_for_nothing(tmp_path):
    now = time.time()
    boot = {"time": now - 300, "pid": 1, "stages": {}, "outcome": "supervisord", "last_stop": ""}
    failed = {"time": now - 100, "by": ending.FAILED, "family": ending.FAILURE, "step": 4, "what": "KeyError", "new": True}
    trainer = {"starts": 2, "state": "RUNNING", "started_at": now - 90}
    doctor, pod = doctor_pod(tmp_path, {"step": 7, "resumed_at": 4, "time": now - 1}, [boot],
                             {"boot": now - 300, "ends": [failed]}, {"trainer": trainer})
    f = doctor.check_restarts(pod, now, "trainer", "trainer")
    assert f.severity == "info" and "trains again since" in f.title, f.to_dict()
    doctor, pod = doctor_pod(tmp_path, {"step": 4, "resumed_at": 4, "time": now - 1}, [boot],
                             {"boot": now - 300, "ends": [failed]}, {"trainer": trainer})
    assert doctor.check_restarts(pod, now, "trainer", "trainer").severity == "problem", "no step since: failing"
    asked = {**failed, "by": ending.SIGTERM, "family": ending.STOP}
    doctor, pod = doctor_pod(tmp_path, {"step": 4, "time": now - 1}, [boot], {"boot": now - 300, "ends": [asked] * 3},
                             {"trainer": {**trainer, "starts": 4}})
    assert doctor.check_restarts(pod, now, "trainer", "trainer") is None


def test_the_start_up_timeline_ends_at_the_boots_first_step_and_shows_no_tenths_it_never_measured(tmp_path):
    from podkit.judge import startup

    records.CURRENT.write(tmp_path, {"started": time.time() - 100})
    first = time.time() - 90
    records.PROGRESS.write(tmp_path, {"first_step_time": first})
    p = records.Progress(tmp_path, "fake")  # a trainer restart in the same boot
    p.trained(step=5)
    assert records.PROGRESS.read(tmp_path)["first_step_time"] == first
    records.CURRENT.write(tmp_path, {"started": time.time()})  # a new boot: its own first step
    records.Progress(tmp_path, "fake").trained(step=6)
    assert records.PROGRESS.read(tmp_path)["first_step_time"] > first
    t = {"phases": [{"phase": "graphs_captured", "took_s": 1.0, "whole_s": True},
                    {"phase": "inference_ready", "took_s": 0.0, "whole_s": True},
                    {"phase": "first_step", "took_s": 2.25}], "total_s": 9.0}
    assert "graphs captured +1s, inference ready +<1s, first step +2.2s" in startup.describe(t), startup.describe(t)


def test_status_says_who_stopped_the_trainer_and_shows_a_hostile_exception_as_text(tmp_path):
    from podkit.judge import standing
    from podkit.views import status

    def st(t):  # status.collect's answer, as far as _last_stop reads it: the trainer's record and the standing
        judged = standing.judge(standing.Evidence({}, t["stopped"], now=time.time()))
        return {"trainer": t, "supervisord": {}, "standing": judged.as_dict()}

    t = {"stopped": ending.record(ending.SIGTERM, step=3, asked="you (podkit ctl stop trainer)"), "checkpoint_step": 3}
    assert status._last_stop(st(t)).startswith("the trainer stopped by you (podkit ctl stop trainer) at step 3")
    hostile = ending.record(ending.CRASH_LOOP, "the trainer failed 3 times: ValueError: \x1b[2J<script>x</script>",
                            "fix \x1b]8;;evil\x07it")
    out = status._last_stop(st({"stopped": hostile}))
    assert "\x1b" not in out and "<script>x</script>" in out and "why: the trainer failed 3 times" in out, out


# -- what an adversarial pass found confusable, and is not any more -------------------------------------------------
def test_torchruns_own_sigterm_after_another_ranks_failure_is_that_failure_not_a_stray_stop(tmp_path):
    """Rank 1 raises before training; torchrun SIGTERMs rank 0, which records nothing of a stop unless the
    launcher forwarded one (ending.FORWARDED); and a SIGTERM record with a rank's exception beside it is that
    exception's end, counted as the script's."""
    cfg = cfg_of(tmp_path)
    started = time.time()
    assert not ending.forwarded(cfg.run_path, started)
    ending.FORWARDED.write(cfg.run_path, {"time": time.time()}, mode=0o600)
    assert ending.forwarded(cfg.run_path, started) and not ending.forwarded(cfg.run_path, time.time() + 5)
    records.PROGRESS.write(tmp_path, {"stopped": ending.record(ending.SIGTERM, "stopped before training started")})
    failure.write(cfg.run_path, 1, {"type": "OutOfMemoryError", "message": "CUDA out of memory", "where": "x.py:1",
                                    "time": time.time(), "oom": "GPU"})
    end = judge(cfg, 1, started)
    assert end.kind.name == ending.OOM and end.kind.counts == "oom", end.rec
    failure.write(cfg.run_path, 1, {"type": "KeyError", "message": "'question'", "where": "x.py:1", "time": time.time()})
    end = judge(cfg, 1, started)
    assert end.kind.name == ending.FAILED and end.kind.counts == "script", end.rec


def test_a_rank_torchrun_killed_after_another_ranks_exception_is_fallout_and_an_oom_kill_beside_an_exception_is_oom(
        tmp_path, monkeypatch):
    cfg = cfg_of(tmp_path)
    events = stand_in_cgroup(tmp_path, monkeypatch, 0)
    started = time.time()
    failure.write(cfg.run_path, 1, {"type": "KeyError", "message": "'solution'", "where": "r.py:9", "time": time.time()})
    silent_rank(cfg, 0)
    end = judge(cfg, 1, started, oom_before=0)
    assert end.kind.name == ending.FAILED and end.first() == "KeyError: 'solution' at r.py:9", end.rec
    assert "ended without a word (torchrun's stop)" in end.evidence[0], end.rec
    failure.write(cfg.run_path, 0, {"type": "RuntimeError", "message": "DataLoader worker (pid(s) 77) exited "
                                    "unexpectedly", "where": "t.py:3", "time": time.time() + 0.5})
    (cfg.run_path / "trainer-error-1.json").unlink()
    events.write_text("oom_kill 1\n")  # the kernel killed the loader's worker for memory
    end = judge(cfg, 1, started, oom_before=0)
    assert end.kind.name == ending.OOM and "DataLoader worker" in end.first() and "dataloader workers" in end.hint, \
        end.rec


def test_inference_you_stopped_or_restarted_is_yours_in_whatever_state_supervisord_has_it_now(tmp_path, monkeypatch):
    from podkit.host import supervisord

    cfg = cfg_of(tmp_path)
    started = time.time() - 1
    ending.ask(cfg.run_path, ["sglang"], "you (podkit ctl stop sglang)")
    for state in ("STOPPING", "STOPPED", "RUNNING"):
        monkeypatch.setattr(supervisord, "process_info", lambda sock, name, s=state: {"statename": s,
                                                                                     "start": time.time()})
        end = judge(cfg, 1, started)
        assert end.kind.name == ending.INFERENCE_STOPPED and end.asked == "you (podkit ctl stop sglang)", (state,
                                                                                                           end.rec)
        assert end.kind.counts is None
    (cfg.run_path / "stop-asked.json").unlink()
    ending.ask(cfg.run_path, ["sglang"], "the watchdog (unhealthy)")
    end = judge(cfg, 1, started)
    assert end.kind.name == ending.INFERENCE and "restarted" in end.first(), end.rec


def test_an_end_stamped_ahead_of_this_clock_is_no_end(tmp_path):
    """A planted (or another node's) finish a day ahead would have faked every run's finish, silenced the
    watchdog and stopped the pod."""
    assert ending.of({"by": ending.DONE, "time": time.time() + 3600}) is None
    assert ending.of({"by": ending.DONE, "time": time.time() + 30}) is not None


def test_a_clusters_hang_restart_by_the_watchdog_is_a_hang_not_a_stop(tmp_path):
    cfg = cfg_of(tmp_path)
    sig = ending.Signals()
    sig.cfg, sig.at = cfg, time.time()
    sig.asked = ending.Asked(sig.at, "the watchdog (no training step for 900s)", True, ending.HANG)
    end = judge(cfg, 0, time.time() - 5, signals=sig)
    assert end.kind.name == ending.HANG and end.kind.counts == "hang", end.rec


def test_doctor_reads_a_stop_for_good_as_history_once_a_newer_run_of_the_trainer_is_underway(tmp_path):
    now = time.time()
    boot = {"time": now - 300, "pid": 1, "stages": {}, "outcome": "supervisord", "last_stop": ""}
    final = ending.record(ending.CRASH_LOOP, "the trainer failed 3 times in a row")
    final["time"] = now - 100
    doctor, pod = doctor_pod(tmp_path, {"step": 4, "stopped": final}, [boot])
    from podkit.judge import standing

    def st(state, started=None):  # status.collect's answer, as far as doctor reads it: the programs and the standing
        judged = standing.judge(standing.Evidence({"trainer": standing.Program(state, started=started)}, final, now=now))
        return {"programs": {"trainer": {"state": state, "started": started}}, "standing": judged.as_dict()}

    pod.st = st("EXITED")
    assert doctor.check_trainer_config(pod, now).id == "trainer_crash_loop"
    pod.st = st("RUNNING", now - 50)  # `podkit resume` since
    assert doctor.check_trainer_config(pod, now) is None


def test_doctor_names_a_hang_at_the_line_in_your_workflow_with_a_fix_that_is_an_action(tmp_path):
    now = time.time()
    boot = {"time": now - 300, "pid": 1, "stages": {}, "outcome": "supervisord", "last_stop": ""}
    doctor, pod = doctor_pod(tmp_path, {"step": 4}, [boot])
    records.WATCHDOG.write(pod.state, [{"time": now - 10, "action": "restarted", "program": "trainer",
                                        "reason": "no training step for 40s while inference is ready; hung in your "
                                                  "workflow at my_workflow.py:12 in arun_episode; stacks (py-spy) in "
                                                  "/w/logs/hang-1.txt", "dump": "/w/logs/hang-1.txt",
                                        "where": "/w/repo/my_workflow.py:12", "function": "arun_episode",
                                        "code": "await judge.score(answer)"}])
    f = doctor.check_hang(pod, now)
    assert f.title == ("the trainer hung 1 time(s) in this boot; the last: hung in your workflow at my_workflow.py:12 "
                       "in arun_episode"), f.title
    assert "  await judge.score(answer)" in f.evidence and "/w/repo/my_workflow.py:12" in f.fix, f.to_dict()
    assert "asyncio.wait_for" in f.fix and "doctor" not in f.fix
