"""The start-up timeline: every phase from the boot to the trainer's first step, with its duration, in
`podkit status`, /metrics and the bundle's status.json, and doctor naming the slowest phase of a slow
start with the caches that were cold. Real supervisord, the smoke stack (SGLang's stand-in prints
SGLang's own start-up lines)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PODKIT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ORDER = ["preflight", "reap", "sync", "setup", "restore", "render", "supervisord", "inference_started", "weights_loaded",
         "graphs_captured", "inference_ready", "first_step"]


def test_status_shows_each_phase_from_the_boot_to_the_first_step(stack_factory):
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="2").start()
    s.wait_step(2)
    t = s.status()["startup"]
    names = [p["phase"] for p in t["phases"]]
    assert [n for n in names if n != "trainer_started"] == ORDER, names
    took = {p["phase"]: p["took_s"] for p in t["phases"]}
    assert took["weights_loaded"] + took["graphs_captured"] >= 1.0, took  # the stand-in's 2 s start-up
    assert 0 < t["total_s"] < 60 and abs(sum(took.values()) - t["total_s"]) < 0.01
    human = subprocess.run([*PODKIT, "status", "--workspace", str(s.workspace)], capture_output=True, text=True,
                           env=s.env, timeout=60).stdout
    assert "start-up: preflight +" in human and "s from boot to the first step" in human, human
    assert s.stop() == 0


def test_doctor_names_the_slowest_phase_of_a_slow_start_and_the_cache_that_was_cold(tmp_path):
    from podkit.views import doctor

    boot = time.time() - 2000
    (tmp_path / "cache" / "flashinfer").mkdir(parents=True)
    (tmp_path / "cache" / "flashinfer" / "sm86.so").write_text("x")  # written during this boot: cold
    warm = tmp_path / "cache" / "sglang" / "old"
    warm.mkdir(parents=True)
    os.utime(warm, (boot - 3600, boot - 3600))  # from an earlier boot: warm
    phases = [{"phase": "render", "at": boot + 1, "took_s": 1.0},
              {"phase": "graphs_captured", "at": boot + 900, "took_s": 899.0},
              {"phase": "first_step", "at": boot + 1000, "took_s": 100.0}]
    pod = SimpleNamespace(ws=tmp_path, st={"startup": {"phases": phases, "total_s": 1000.0, "boot": boot}})
    f = doctor.check_startup_slow(pod, time.time())
    assert f.id == "startup_slow" and "longest phase was graphs captured (899s)" in f.title
    cold = [e for e in f.evidence if e.startswith("cold this boot")]
    assert any("cache/flashinfer" in e for e in cold) and not any("cache/sglang" in e for e in cold), cold
    pod.st["startup"]["total_s"] = 200.0
    assert doctor.check_startup_slow(pod, time.time()) is None
    assert json.dumps(f.to_dict())


def planted_log(ws, *lines):
    """A boot on record a minute ago and inference's log since its start, with `lines` in it."""
    from podkit import records
    from podkit.judge import health

    boot = time.time() - 60
    records.BOOTS.write(ws / ".podkit", [{"time": boot, "took_s": {"preflight": 1.0, "reap": 0.5}}])
    (ws / "logs").mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot + 30))
    (ws / "logs" / "sglang.log").write_text("\n".join([f"{health.START_MARK}sglang", *lines,
                                                        f"[{stamp}] Load weight end. mem usage=1 GB"]) + "\n")
    return boot


def test_a_malformed_stamp_in_the_inference_log_is_skipped_and_named_and_status_metrics_and_doctor_still_work(
        tmp_path):
    """One line `[2026-02-30 12:00:00] Load weight end` raised in the timeline and took down `podkit status`,
    `--health`, doctor and the whole /metrics scrape. Now the line is skipped (the next good one is the
    phase) and the timeline says what it could not read; so is a stamp years ahead and one before year 1."""
    from prometheus_client import generate_latest

    from podkit.judge import startup
    from podkit.views import metrics, status

    boot = planted_log(tmp_path, "[2026-02-30 12:00:00] Load weight end", "[9999-12-31 23:59:59] Load weight end",
                       "[0000-01-01 00:00:00] Capture cuda graph end \x1b[2J")
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {})
    took = {p["phase"]: p["at"] for p in t["phases"]}
    assert abs(took["weights_loaded"] - (boot + 30)) <= 1 and "graphs_captured" not in took, t
    assert len(t["unread"]) == 3 and "2026-02-30" in t["unread"][0] and "day is out of range" in t["unread"][0], t
    human = status.human(status.collect(tmp_path))
    assert "could not read sglang.log: '[2026-02-30 12:00:00] Load weight end'" in human, human
    assert "\x1b" not in human, "a planted escape sequence reached the terminal"
    assert 'podkit_startup_phase_seconds{phase="weights_loaded"}' in generate_latest(
        metrics.registry(tmp_path, 600)).decode()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    for verb in (["status", "--health"], ["status", "--json"], ["doctor"]):
        r = subprocess.run([*PODKIT, *verb, "--workspace", str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (verb, r.stderr[-2000:])


def test_a_boot_record_with_absurd_stage_times_and_a_pipe_or_dev_zero_as_the_log_do_not_hang_or_break_status(
        tmp_path):
    """boots.json's stage durations are data too (NaN, infinity, negative, a list); a pipe in the log's place
    blocked every reader, and /dev/zero would have filled memory."""
    from podkit import records
    from podkit.judge import startup
    from podkit.views import status

    planted_log(tmp_path)
    boots = records.BOOTS.read(tmp_path / ".podkit")
    boots[-1]["took_s"] = {"preflight": float("nan"), "reap": float("inf"), "sync": -5, "setup": [1], "render": 2}
    records.BOOTS.write(tmp_path / ".podkit", boots)
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {})
    assert [p["phase"] for p in t["phases"]] == ["render", "weights_loaded"], t
    assert json.loads(json.dumps(t, allow_nan=False))
    log = tmp_path / "logs" / "sglang.log"
    for planted in ("pipe", "/dev/zero"):
        log.unlink()
        os.mkfifo(log) if planted == "pipe" else log.symlink_to(planted)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
        r = subprocess.run([*PODKIT, "status", "--json", "--workspace", str(tmp_path)], capture_output=True,
                           text=True, timeout=30, env=env)
        assert "Traceback" not in r.stderr and json.loads(r.stdout)["startup"]["phases"], (planted, r.stderr[-2000:])
        r = subprocess.run([*PODKIT, "doctor", "--workspace", str(tmp_path)], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (planted, r.stderr[-2000:])
    assert status.collect(tmp_path)["inference"]["phase"] in ("unknown", "down", "ready")


def test_an_inference_line_from_the_boots_first_second_comes_after_the_stages_that_ran_before_it(tmp_path):
    """SGLang's stamps are whole seconds: on a fast boot (the smoke stack: reap to render in under a second),
    `Load weight end` stamped with the boot's own second sorted before reap. CI run of 75d6e25 saw it."""
    from podkit import records
    from podkit.judge import health, startup

    boot = int(time.time()) - 60 + 0.9  # late in its second, so its truncated second is before it
    records.BOOTS.write(tmp_path / ".podkit", [{"time": boot, "took_s": {"preflight": 0.02, "reap": 0.01,
                                                                         "sync": 0.01, "setup": 0.01,
                                                                         "render": 0.01}}])
    records.CURRENT.write(tmp_path / ".podkit", {"started": boot + 0.06})
    (tmp_path / "logs").mkdir()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot))
    (tmp_path / "logs" / "sglang.log").write_text(f"{health.START_MARK}sglang\n[{stamp}] Load weight end.\n")
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {"sglang": boot + 0.08})
    names = [p["phase"] for p in t["phases"]]
    assert names == ["preflight", "reap", "sync", "setup", "render", "supervisord", "inference_started",
                     "weights_loaded"], t
    assert all(p["took_s"] >= 0 for p in t["phases"]) and t["phases"][-1]["at"] >= boot + 0.08, t


def _sv(t: float) -> str:
    """supervisord's own stamp: local time to the millisecond."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(t % 1 * 1000):03d}"


def _sg(t: float) -> str:
    return "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + " TP0]"


def restarted_boot(ws, boot: float, restart_at: float, asked: str | None):
    """A boot whose inference and trainer started at +10 s and +12 s, trained its first step at +30 s, and whose
    inference was restarted at `restart_at` (asked for by `asked`, or crashed): supervisord's log, inference's log
    with both runs, and the ask (ending.ASKED) in the run dir."""
    from podkit import records
    from podkit.judge import ending, health

    state, logs, run = ws / ".podkit", ws / "logs", ws / "run"
    for d in (state, logs, run):
        d.mkdir(parents=True, exist_ok=True)
    records.BOOTS.write(state, [{"time": boot, "took_s": {"preflight": 1.0, "reap": 1.0, "sync": 1.0, "setup": 1.0,
                                                         "render": 1.0}}])
    records.CURRENT.write(state, {"started": boot + 6, "run_dir": str(run)})
    records.PROGRESS.write(state, {"step": 900, "time": restart_at + 60, "first_step_time": boot + 30})
    end = ("stopped: sglang (terminated by SIGTERM)" if asked else "exited: sglang (exit status 1; not expected)")
    (logs / "supervisord.log").write_text("\n".join([
        f"{_sv(boot - 3600)} INFO spawned: 'sglang' with pid 41",  # the boot before: not this one's
        f"{_sv(boot + 10.25)} INFO spawned: 'sglang' with pid 41",
        f"{_sv(boot + 12.5)} INFO spawned: 'trainer' with pid 42",
        f"{_sv(restart_at - 2)} {'INFO' if asked else 'WARN'} {end}",
        f"{_sv(restart_at)} INFO spawned: 'sglang' with pid 977"]) + "\n")
    run1 = [f"{_sg(boot + 14)} Load weight end. avail mem=0.00 GB", f"{_sg(boot + 20)} Capture cuda graph end.",
            f"{_sg(boot + 22)} The server is fired up and ready to roll!"]
    run2 = [f"{_sg(restart_at + 4)} Load weight end. avail mem=0.00 GB", f"{_sg(restart_at + 9)} Capture cuda graph "
            "end.", f"{_sg(restart_at + 11)} The server is fired up and ready to roll!"]
    (logs / "sglang.log").write_text("\n".join([
        f"{health.START_MARK}sglang (pid 41)", f"{_sg(boot - 3590)} Load weight end.",  # the boot before's
        f"{health.START_MARK}sglang (pid 41)", *run1, f"{health.START_MARK}sglang (pid 977)", *run2]) + "\n")
    if asked:
        ending.ask(run, ["sglang"], asked)
        asks = ending.ASKED.read_owned(run)
        asks[-1]["time"] = restart_at - 3
        ending.ASKED.write(run, asks, mode=0o600)
    return run


def test_a_restart_hours_after_the_boot_is_an_event_on_its_timeline_and_moves_no_phase(tmp_path):
    """Issue 48: after `podkit ctl restart sglang` 5 h in, status said "inference started" at the restart and drew
    the first step before it; a restarted trainer was "trainer started" 5 h in. The boot's phases stay where the
    boot put them (its first run of each program, by supervisord's log), and the restart is an event with who
    asked; a restart nobody asked for says how the run before it ended."""
    from podkit.judge import startup

    boot = float(int(time.time()) - 5 * 3600 - 100)  # whole: SGLang's stamps are
    restarted_boot(tmp_path, boot, boot + 5 * 3600, "you (podkit ctl restart sglang)")
    # supervisord's word on the running processes: the restarted server's start, a trainer restarted too
    now_running = {"sglang": boot + 5 * 3600 + 0.3, "trainer": boot + 5 * 3600 + 30}
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", now_running, restarted={"sglang", "trainer"})
    at = {p["phase"]: round(p["at"] - boot, 2) for p in t["phases"]}
    assert at == {"preflight": 1, "reap": 2, "sync": 3, "setup": 4, "render": 5, "supervisord": 6,
                  "inference_started": 10.25, "trainer_started": 12.5, "weights_loaded": 14, "graphs_captured": 20,
                  "inference_ready": 22, "first_step": 30}, at
    assert t["total_s"] == 30 and [p["phase"] for p in t["phases"]][-1] == "first_step", t
    [ev] = t["events"]
    assert ev["event"] == "inference_restarted" and ev["by_you"] and round(ev["after_s"]) == 5 * 3600, ev
    words = startup.describe(t)
    assert "inference restarted at +5.0h (asked by you: podkit ctl restart sglang)" in words, words

    crashed = tmp_path / "crashed"
    restarted_boot(crashed, boot, boot + 600, None)
    t = startup.timeline(crashed / ".podkit", crashed / "logs", now_running, restarted={"sglang"})
    [ev] = t["events"]
    assert not ev["by_you"] and ev["asked"] == "" and ev["ended"] == "exited: exit status 1; not expected", ev
    assert "inference restarted at +10m (nobody asked for it; exited: exit status 1; not expected)" in \
        startup.describe(t)
    assert {p["phase"]: p["at"] for p in t["phases"]}["inference_ready"] == pytest.approx(boot + 22, abs=1)


def test_without_supervisords_log_a_restarted_programs_start_is_left_out_not_moved_to_the_restart(tmp_path):
    """The same boot with supervisord's log lost (a person's rm, a rotation): what is known of the boot stays, and
    the restarted programs' starts and inference's phases, which only the restart's run shows now, are left out."""
    from podkit.judge import startup

    boot = float(int(time.time()) - 5 * 3600 - 100)  # whole: SGLang's stamps are
    restarted_boot(tmp_path, boot, boot + 5 * 3600, "you (podkit ctl restart sglang)")
    (tmp_path / "logs" / "supervisord.log").unlink()
    t = startup.timeline(tmp_path / ".podkit", tmp_path / "logs", {"sglang": boot + 5 * 3600 + 0.3},
                         restarted={"sglang"})
    names = [p["phase"] for p in t["phases"]]
    assert names == ["preflight", "reap", "sync", "setup", "render", "supervisord", "first_step"], t
    assert t["total_s"] == 30


ASKERS = st.sampled_from(["you (podkit ctl restart sglang)", "you (podkit ctl stop sglang)", "you (podkit resume)",
                          "the watchdog (inference unhealthy for 300s)", "podkit up: a config error", ""])


@given(starts=st.lists(st.floats(0, 50_000), min_size=1, max_size=6, unique=True),
       asks=st.lists(st.tuples(st.sampled_from(["sglang", "trainer", "all"]), ASKERS, st.floats(-100, 50_100)),
                     max_size=8))
@settings(max_examples=300, deadline=None)
def test_a_restart_is_yours_exactly_when_your_ask_is_the_last_one_made_while_the_run_before_it_ran(starts, asks):
    """For any starts of inference and any asks: each start after the first is one event; it is yours only when
    the last ask for inference (or for all) made between the run before's start and it is yours, and an ask
    made before that run's start (it was for the run before) or for another program never makes it yours."""
    from podkit.judge import startup

    boot = 1_000_000.0
    starts = sorted(starts)
    runs = {"sglang": [{"at": boot + s, "pid": i + 100} for i, s in enumerate(starts)]}
    recs = [{"program": p, "by": by, "time": boot + t} for p, by, t in asks]
    events = startup.restarts(runs, recs, boot)
    assert len(events) == len(starts) - 1
    for ev, before, run in zip(events, starts, starts[1:], strict=False):
        made = [a for a in recs if a["program"] in ("sglang", "all") and boot + before - 1 <= a["time"] <= boot + run]
        last = max(made, key=lambda a: a["time"])["by"] if made else ""
        assert ev["at"] == pytest.approx(boot + run) and ev["after_s"] == pytest.approx(run, abs=0.001)
        assert ev["by_you"] == last.startswith("you ") and (ev["asked"] == last or not made), (ev, made)
        assert not ev["by_you"] or any(a["by"].startswith("you ") for a in made), "yours only by your own ask"


def test_your_restarts_of_inference_and_the_trainer_on_a_running_stack_leave_the_boots_timeline_as_it_was(
        stack_factory):
    """Issue 48, live: the smoke stack trains, then `podkit ctl restart sglang` and `podkit ctl restart trainer`.
    Status's start-up phases are exactly the ones it showed before (no "inference started" at the restart, no
    first step drawn before it), and each restart is an event saying you asked for it."""
    s = stack_factory(PODKIT_INFERENCE_STARTUP_DELAY_S="2").start()
    s.wait_step(2)
    before = s.status()["startup"]
    assert [p["phase"] for p in before["phases"]][-1] == "first_step" and before["events"] == [], before

    def ctl(*args):
        r = subprocess.run([*PODKIT, "ctl", "--workspace", str(s.workspace), *args], capture_output=True, text=True,
                           env=s.env, timeout=90)
        assert r.returncode == 0, r.stdout + r.stderr

    for program in ("sglang", "trainer"):
        old = s.pid(program)
        ctl("restart", program)
        wait_for(lambda p=program, o=old: s.pid(p) not in (0, o), 60, what=f"the new {program}")
    wait_for(lambda: s.status()["inference"]["phase"] == "ready", 60, what="the restarted server ready")
    after = wait_for(lambda: (t := s.status()["startup"]) and len(t["events"]) >= 2 and t, 30, 0.5,
                     what="both restarts on the timeline")
    assert after["phases"] == before["phases"] and after["total_s"] == before["total_s"], (before, after)
    mine = {e["program"]: e for e in after["events"] if e["by_you"]}
    assert mine["sglang"]["asked"] == "you (podkit ctl restart sglang)", after["events"]
    assert mine["trainer"]["asked"] == "you (podkit ctl restart trainer)", after["events"]
    human = subprocess.run([*PODKIT, "status", "--workspace", str(s.workspace)], capture_output=True, text=True,
                           env=s.env, timeout=60).stdout
    assert "inference restarted at +" in human and "(asked by you: podkit ctl restart sglang)" in human, human
    assert "trainer restarted at +" in human and "(asked by you: podkit ctl restart trainer)" in human, human
    assert s.stop() == 0


def test_inferences_start_up_phases_stay_once_its_first_runs_lines_have_scrolled_out_of_the_log(tmp_path):
    """Hours of serving push the first run's start-up lines out of the log's tail (and rotation drops them): the
    phases read once are kept for the boot (startup.json), and a planted record of another boot is not used."""
    from podkit.judge import health, startup

    boot = float(int(time.time()) - 5 * 3600 - 100)
    restarted_boot(tmp_path, boot, boot + 5 * 3600, "you (podkit ctl restart sglang)")
    state, logs = tmp_path / ".podkit", tmp_path / "logs"
    before = startup.timeline(state, logs, {}, restarted={"sglang"})
    (logs / "sglang.log").write_text(f"{health.START_MARK}sglang (pid 977)\n" + "Decode batch. #running-req: 1\n"
                                     * 20000)
    after = startup.timeline(state, logs, {}, restarted={"sglang"})
    assert after["phases"] == before["phases"] and "inference_ready" in [p["phase"] for p in after["phases"]], after
    startup.KEPT.write(state, {"boot": boot - 7200, "phases": {"inference_ready": boot - 7000}})
    t = startup.timeline(state, logs, {}, restarted={"sglang"})
    assert "weights_loaded" not in [p["phase"] for p in t["phases"]], t
