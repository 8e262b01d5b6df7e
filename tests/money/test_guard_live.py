"""Cost guards changed on a running pod (`podkit guard`, <workspace>/.podkit/guards.json): RunPod restarts a
pod whose env is edited, so the guards are read live from a file on the volume instead.

RunPod's API is never reached here: the pod's own stop goes to a dead loopback URL, and every other HTTP(S)
request of the stack to a dead proxy, so the tests assert on what the pod does itself (the trainer's stop and
checkpoint, its records, its log lines), not on the API call, whose client is being rewritten."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time

import pytest

from conftest import PODKIT, wait_for
from podkit import records, settings
from podkit.money import guardfile, ledger
from webhook import Receiver, dead_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def on_runpod(**extra) -> dict[str, str]:
    """A RunPod pod's variables with an API nobody answers."""
    dead = dead_url().rsplit("/", 1)[0]
    return {"RUNPOD_POD_ID": "pod-guard123", "RUNPOD_API_KEY": "rpa_not_a_real_key_0123456789",
            "RUNPOD_API_BASE_URL": dead, "http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead,
            "HTTPS_PROXY": dead, "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost", **extra}


def guard(workspace, *args, env=None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in (env or os.environ).items() if not k.startswith("PODKIT_")}
    return subprocess.run([*PODKIT, "guard", *args, "--workspace", str(workspace)], capture_output=True, text=True,
                          env=e if env is None else env, timeout=30)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_maximum_run_time_moved_earlier_stops_the_trainer_with_its_checkpoint_without_a_restart(stack_factory):
    """A pod deployed with a day to run; `podkit guard set` moves its end to seconds from now: at that time the
    trainer is stopped with its checkpoint, by the same supervisord (no restart), and status says why."""
    s = stack_factory(PODKIT_GUARD_STOP_POD_AT=str(int(time.time()) + 86400), **on_runpod()).start()
    supervisord = s.proc.pid
    s.wait_step(1)
    at = int(time.time()) + 6
    r = guard(s.workspace, "set", f"stop_pod_at={at}", env=s.env)
    assert r.returncode == 0, r.stderr
    assert "guards.json (`podkit guard set`" in r.stdout
    st = json.loads(subprocess.run([*PODKIT, "status", "--json", "--workspace", str(s.workspace)], env=s.env,
                                   capture_output=True, text=True, timeout=30).stdout)
    assert st["guards"]["guards"]["stop_pod_at"]["value"] == at
    assert "podkit guard set" in st["guards"]["guards"]["stop_pod_at"]["from"]
    assert st["guards"]["guards"]["stop_pod_after_s"]["from"] == "config (defaults)"
    wait_for(lambda: (s.progress().get("stopped") or {}).get("by") == "SIGTERM", 90, what="the trainer's stop")
    prog = s.progress()
    assert prog["stopped"]["time"] >= at and prog["checkpoint_step"] == prog["step"] > 0
    wait_for(lambda: s.status()["programs"]["trainer"]["state"] == "STOPPED", 30, what="trainer STOPPED")
    assert s.status()["supervisord"]["pid"] == supervisord and s.proc.poll() is None, "no restart"
    out = s.stdout()
    assert "guard.stop_pod_at is now" in out and "from " + str(guardfile.path(s.workspace)) in out
    assert "set on the running pod by `podkit guard set`): stopping the trainer with a checkpoint" in out
    assert s.stop() == 0


def test_a_corrupt_then_planted_guard_file_is_ignored_once_each_and_the_setting_holds(stack_factory, tmp_path):
    """Garbage, then a symlink to a file that would give the run a day more: each is said once (however many
    events come), and the pod's own maximum run time stops the trainer all the same."""
    at = int(time.time()) + 25
    s = stack_factory(PODKIT_GUARD_STOP_POD_AT=str(at), **on_runpod()).start()
    s.wait_step(1)
    p = guardfile.path(s.workspace)
    p.write_bytes(b"\x00\xffnot json{{")
    p.chmod(0o644)
    wait_for(lambda: "is not JSON" in s.stdout(), 20, what="the corrupt file logged")
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(json.dumps({"stop_pod_at": {"value": time.time() + 86400}}))
    p.unlink()
    p.symlink_to(elsewhere)
    wait_for(lambda: "is a symbolic link" in s.stdout(), 20, what="the symlink logged")
    wait_for(lambda: (s.progress().get("stopped") or {}).get("by") == "SIGTERM", 90, what="the trainer's stop")
    assert s.progress()["stopped"]["time"] >= at
    out = s.stdout()
    assert out.count("is not JSON") == 1 and out.count("is a symbolic link") == 1, "once per change of the file"
    assert "ignored, the pod's settings hold (guard.stop_pod_at" in out
    assert "set by podkit deploy --max-runtime): stopping the trainer" in out
    assert s.stop() == 0


def test_the_verb_refuses_a_bad_value_with_exit_2_and_writes_nothing(tmp_path):
    """Each value is checked as the config checks it; a guard read only at boot is named as such."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    for item, words in (("stop_pod_at=+6x", "'+6x' is not a duration from now"),
                        ("stop_pod_at=43200", "43200 is a Unix time in 1970-2001"),
                        ("stop_pod_after_s=40d", "is above the maximum 2592000 (30 days)"),
                        ("stop_pod_when_finished=sometimes", "'sometimes' is not one of auto, never"),
                        ("max_boots=3", "read when the pod boots"),
                        ("stop_pod_atx=1", "did you mean 'stop_pod_at'?"),
                        ("stop_pod_at", "expected KEY=VALUE")):
        r = guard(ws, "set", item)
        assert r.returncode == 2, (item, r.stdout, r.stderr)
        assert r.stderr.startswith("podkit: error: command line: ") and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not guardfile.path(ws).exists()
    r = guard(ws, "set", "stop_pod_at=+2h", "stop_pod_after_s=90m", "stop_pod_when_finished=never")
    assert r.returncode == 0, r.stderr
    data = json.loads(guardfile.path(ws).read_text())["runs"][""]  # the entries of this run (none: not on RunPod)
    assert data["stop_pod_after_s"]["value"] == 5400 and data["stop_pod_when_finished"]["value"] == "never"
    assert abs(data["stop_pod_at"]["value"] - (time.time() + 7200)) < 60 and data["stop_pod_at"]["over"] == 0
    assert [p.name for p in (ws / ".podkit").iterdir()] == ["guards.json"], "written by rename, no temp left"
    assert stat.S_IMODE(guardfile.path(ws).stat().st_mode) == 0o644
    assert guard(ws, "clear", "stop_pod_at").returncode == 0
    # a clear leaves its mark: the run's record learns of it, and never brings the guard back
    left = guardfile.live(guardfile.read(guardfile.path(ws))[0][""])
    assert set(left) == {"stop_pod_after_s", "stop_pod_when_finished"}
    assert guard(ws, "clear").returncode == 0 and guardfile.live(guardfile.read(guardfile.path(ws))[0][""]) == {}
    assert json.loads(guard(ws, "show", "--json").stdout)["guards"]["stop_pod_at"]["from"] == "config (defaults)"


def test_a_budget_is_set_on_a_running_pod_in_dollars_and_a_bad_one_is_refused(tmp_path):
    """`podkit guard set max_spend=...` (guard.max_spend, USD; $ optional; 0: none) is checked as the config
    checks it: a negative, endless or wordy one is exit 2 with nothing written; a good one is shown in dollars
    and cleared like the others."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    for item, words in (("max_spend=-1", "guard.max_spend: -1.0 is below the minimum 0"),
                        ("max_spend=inf", "guard.max_spend: 'inf' is not a finite number"),
                        ("max_spend=lots", "guard.max_spend: expected a number (USD), got 'lots'")):
        r = guard(ws, "set", item)
        assert r.returncode == 2 and r.stderr.startswith("podkit: error: command line: ") and words in r.stderr, \
            r.stderr
    assert not guardfile.path(ws).exists()
    r = guard(ws, "set", "max_spend=$25.5")
    assert r.returncode == 0, r.stderr
    assert json.loads(guardfile.path(ws).read_text())["runs"][""]["max_spend"] == {
        "value": 25.5, "over": 0.0, "time": pytest.approx(time.time(), abs=60), "seq": 1}
    assert "guard.max_spend                $25.50  [" in r.stdout, r.stdout
    rep = json.loads(guard(ws, "show", "--json").stdout)["guards"]["max_spend"]
    assert rep["value"] == 25.5 and "podkit guard set" in rep["from"] and rep["setting"] == 0
    assert guard(ws, "clear", "max_spend").returncode == 0 and guardfile.read(guardfile.path(ws))[0][""] == {
        "max_spend": {"cleared": True, "time": pytest.approx(time.time(), abs=60), "run": "", "seq": 2}}
    assert "guard.max_spend                0 (no budget)  [config (defaults)]" in guard(ws).stdout


def test_a_budget_at_or_below_the_runs_spend_says_at_the_command_that_the_pod_stops_and_a_tiny_one_shows_as_set(
        tmp_path):
    """`guard set max_spend=5` on a run that has spent $8 said nothing of the stop it caused within a minute;
    `max_spend=1e-9` showed as "$0.00" (read as no budget). Now the command says what the run has spent, how sure
    that is, and that the trainer and the pod stop; a spend podkit does not know is said as such."""
    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    env = {**on_runpod(), "PATH": os.environ["PATH"]}
    r = guard(ws, "set", "max_spend=5", env=env)
    assert r.returncode == 0 and "the run's spend is not known here (no cost.json yet" in r.stdout, r.stdout
    records.COST.write(state, {"per_hour": 2.69, "spent": 8.0, "source": "billed", "time": time.time(),
                               "pod": "pod-guard123", "run": "pod-pod-guard123"})
    r = guard(ws, "set", "max_spend=5", env=env)
    assert "the run has spent $8.00 (billed), at or past this budget: the trainer stops with a checkpoint, then " \
           "the pod, within the minute" in r.stdout, r.stdout
    r = guard(ws, "set", "max_spend=25", env=env)
    assert "the run has spent $8.00 (billed) of $25.00" in r.stdout and "stops" not in r.stdout.split("minute")[-1]
    r = guard(ws, "set", "max_spend=1e-9", env=env)
    assert "guard.max_spend                $0.000000001  [" in r.stdout and "at or past this budget" in r.stdout, \
        r.stdout


def test_doctor_and_status_name_a_guard_file_that_is_not_in_force(tmp_path):
    """A file the pod ignores is a problem doctor names, with the file and what is wrong; status shows it too."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    guardfile.path(ws).write_text(json.dumps({"stop_pod_at": {"value": "tomorrow"}}))
    guardfile.path(ws).chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_")}
    r = subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(ws)], capture_output=True, text=True,
                       env=env, timeout=60)
    found = {f["id"]: f for f in json.loads(r.stdout)["findings"]}
    assert r.returncode == 1 and "guard_file_ignored" in found
    assert "guard.stop_pod_at: expected a number (s), got 'tomorrow'" in found["guard_file_ignored"]["evidence"][0]
    r = subprocess.run([*PODKIT, "status", "--workspace", str(ws)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert "guard.stop_pod_at              0 (no maximum run time)  [config (defaults)]" in r.stdout
    assert "WARNING: " + str(guardfile.path(ws)) + " guard.stop_pod_at: expected a number" in r.stdout


def test_an_env_edit_on_a_stopped_pod_wins_over_an_older_override(tmp_path):
    """An override holds while the pod's setting is the one it replaced: a later env edit (on a stopped pod)
    takes effect at the next start, and the override is said to be stale."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    first, edited = int(time.time()) + 3600, int(time.time()) + 7200
    env = {**os.environ, "PODKIT_WORKSPACE": str(ws), "PODKIT_GUARD_STOP_POD_AT": str(first)}
    env.pop("PODKIT_CONFIG", None)
    assert guard(ws, "set", "stop_pod_at=+10h", env=env).returncode == 0
    rep = json.loads(guard(ws, "show", "--json", env=env).stdout)["guards"]["stop_pod_at"]
    assert rep["value"] > edited and "podkit guard set" in rep["from"] and rep["stale"] is None
    env["PODKIT_GUARD_STOP_POD_AT"] = str(edited)
    rep = json.loads(guard(ws, "show", "--json", env=env).stdout)["guards"]["stop_pod_at"]
    assert rep["value"] == edited and rep["from"] == "config (env PODKIT_GUARD_STOP_POD_AT)"
    assert "the setting holds; `podkit guard clear stop_pod_at`" in rep["stale"]


def test_an_earlier_runs_overrides_on_a_reused_volume_are_not_obeyed(tmp_path):
    """A new run (`podkit deploy` gives each its PODKIT_RUN_ID) on a volume whose guards.json an earlier run
    wrote: its stop_pod_at (long past) and stop_pod_when_finished=never are another run's, said stale; the
    pod's own settings hold. The same run (a replacement keeps the id) still obeys them."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    env = {**os.environ, "PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_ID": "run-old"}
    env.pop("PODKIT_CONFIG", None)
    assert guard(ws, "set", "stop_pod_at=+1h", "stop_pod_when_finished=never", env=env).returncode == 0
    same = json.loads(guard(ws, "show", "--json", env=env).stdout)["guards"]
    assert same["stop_pod_when_finished"]["value"] == "never" and same["stop_pod_at"]["value"] > time.time()
    env["PODKIT_RUN_ID"] = "run-new"
    new = json.loads(guard(ws, "show", "--json", env=env).stdout)["guards"]
    assert new["stop_pod_when_finished"]["value"] == "auto" and new["stop_pod_at"]["value"] == 0
    assert "was set by another run (run-old; this one is run-new)" in new["stop_pod_at"]["stale"]


@pytest.mark.parametrize("case", ["huge", "group-writable", "unknown key", "bad value", "not an entry",
                                  "number past float", "fifo", "a list"])
def test_a_guard_file_that_is_not_podkits_is_refused_naming_what_is_wrong(tmp_path, case):
    """Untrusted data on the volume: every way it can be wrong is a reason, never an exception or a value."""
    p = tmp_path / "guards.json"
    entry = {"value": time.time() + 60}
    content = {"huge": json.dumps({"stop_pod_at": entry}) + " " * guardfile.MAX_BYTES,
               "unknown key": json.dumps({"max_boots": {"value": 3}}),
               "bad value": json.dumps({"stop_pod_after_s": {"value": -5}}),
               "not an entry": json.dumps({"stop_pod_at": 1}),
               "number past float": '{"stop_pod_after_s": {"value": 1' + "0" * 400 + "}}",
               "a list": "[1, 2]", "group-writable": json.dumps({"stop_pod_at": entry})}.get(case)
    if case == "fifo":
        os.mkfifo(p, 0o600)
    else:
        p.write_text(content)
        os.chmod(p, 0o664 if case == "group-writable" else 0o644)
    entries, problem = guardfile.read(p)
    assert entries == {} and problem
    why = {"huge": "more than any guard file", "group-writable": "can be written by others (mode 664)",
           "unknown key": "max_boots: not a guard", "bad value": "stop_pod_after_s: -5.0 is below the minimum 0",
           "not an entry": "stop_pod_at: expected", "number past float": "not a setting",
           "fifo": "not a regular file", "a list": "not an object of guards"}[case]
    assert why in problem, problem


def test_the_live_guards_say_each_change_once_and_never_raise(tmp_path, monkeypatch):
    """Looked at a thousand times, a file that changes twice is said twice; a good file's value is in force,
    a bad one's is not."""
    monkeypatch.setattr(guardfile, "LOOK_EVERY_S", 0.0)
    (tmp_path / ".podkit").mkdir()
    said: list[str] = []
    live = guardfile.Live(tmp_path, {"stop_pod_at": 0.0, "stop_pod_when_finished": "auto",
                                     "stop_pod_after_s": 3600.0}, said.append)
    p = guardfile.path(tmp_path)
    p.write_text("{")
    p.chmod(0o644)
    for _ in range(1000):
        assert live.values()["stop_pod_after_s"] == 3600.0
    p.write_text(json.dumps({"stop_pod_after_s": {"value": 60, "over": 3600.0}}))
    os.chmod(p, 0o644)
    for _ in range(1000):
        assert live.values()["stop_pod_after_s"] == 60.0
    assert live.from_file("stop_pod_after_s") and not live.from_file("stop_pod_at")
    assert len(said) == 2 and "is not JSON" in said[0] and said[1].startswith("guard.stop_pod_after_s is now 60 s")


def test_a_pod_waiting_in_safe_mode_stops_itself_sooner_when_stop_pod_after_s_is_shortened(procs, tmp_path,
                                                                                          receiver):
    """A config error keeps the pod in safe mode for guard.stop_pod_after_s (an hour); `podkit guard set` makes
    it a second, and the waiting pod announces its stop at once, naming the change."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url, **on_runpod()}
    out = tmp_path / "boot.log"
    with open(out, "wb") as f:
        p = procs.spawn([*PODKIT, "boot"], env=env, stdout=f, stderr=subprocess.STDOUT)
    receiver.one("safe-mode")
    time.sleep(2)
    assert "pod-stop" not in receiver.events()
    r = guard(ws, "set", "stop_pod_after_s=1", env={k: v for k, v in env.items() if k != "PODKIT_CONFIG"})
    assert r.returncode == 0, r.stderr
    assert "set by `podkit guard set`" in receiver.one("pod-stop")["text"]
    assert "[podkit:guard] guard.stop_pod_after_s is now 1 s" in out.read_text()
    assert p.poll() is None, "safe mode goes on"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0


def test_a_console_started_pod_obeys_no_earlier_runs_guards_and_keeps_its_own_across_a_restart(stack_factory):
    """A pod started from RunPod's console (RUNPOD_POD_ID, no PODKIT_RUN_ID) on a volume whose guards.json
    earlier runs wrote: a maximum run time two days past (a run without a run id, as a console pod was) and
    stop_pod_when_finished=never (another pod's). It stopped the new pod a second after its boot; now both are
    said stale, the trainer trains on, and the pod's own run id (pod-<RUNPOD_POD_ID>) is shown. A guard set on
    this pod holds across its restart (RunPod keeps the pod's id); deploy's PODKIT_RUN_ID wins over both."""
    now = time.time()
    s = stack_factory(**on_runpod())
    p = guardfile.path(s.workspace)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({
        "stop_pod_at": {"value": now - 2 * 86400, "over": 0.0, "time": now - 2 * 86400 - 60, "run": ""},
        "stop_pod_when_finished": {"value": "never", "over": "auto", "time": now - 86400, "run": "pod-other456"}}))
    p.chmod(0o644)
    s.start()
    s.wait_step(3)
    assert not s.progress().get("stopped") and s.status()["programs"]["trainer"]["state"] in ("STARTING", "RUNNING")
    out = s.stdout()
    assert "maximum run time was reached" not in out
    assert ("guard.stop_pod_at was set by another run (one without a run id; this one is pod-pod-guard123): the "
            "pod's setting holds") in out
    assert "guard.stop_pod_when_finished was set by another run (pod-other456; this one is pod-pod-guard123)" in out
    rep = json.loads(guard(s.workspace, "show", "--json", env=s.env).stdout)
    assert rep["run"] == "pod-pod-guard123" and "RUNPOD_POD_ID" in rep["run_from"]
    g = rep["guards"]
    assert g["stop_pod_at"]["value"] == 0 and g["stop_pod_when_finished"]["value"] == "auto"
    assert g["stop_pod_at"]["stale"] and g["stop_pod_when_finished"]["stale"]

    r = guard(s.workspace, "set", "stop_pod_at=+1h", env=s.env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("run id: pod-pod-guard123  [RUNPOD_POD_ID: a pod started without podkit deploy]")
    runs = json.loads(p.read_text())["runs"]
    assert "stop_pod_at" in runs["pod-pod-guard123"] and runs[""]["stop_pod_at"]["value"] < now, "another run's kept"
    wait_for(lambda: "guard.stop_pod_at is now" in s.stdout(), 20, what="the new maximum run time taken")
    assert s.stop() == 0

    seen = len(s.stdout())
    s.start()  # the same pod restarted: RunPod keeps RUNPOD_POD_ID
    wait_for(lambda: "guard.stop_pod_at is now" in s.stdout()[seen:], 30, what="the guard read at the restart")
    assert f"from {p} (`podkit guard set`)" in s.stdout()[seen:]
    g = json.loads(guard(s.workspace, "show", "--json", env=s.env).stdout)["guards"]["stop_pod_at"]
    assert g["stale"] is None and g["value"] > time.time() + 3000 and "podkit guard set" in g["from"]
    assert s.stop() == 0

    deployed = {**s.env, "PODKIT_RUN_ID": "run-deploy1"}  # `podkit deploy` names the run: it wins
    rep = json.loads(guard(s.workspace, "show", "--json", env=deployed).stdout)
    assert rep["run"] == "run-deploy1" and rep["run_from"] == "PODKIT_RUN_ID, set by podkit deploy"
    assert "(pod-pod-guard123; this one is run-deploy1)" in rep["guards"]["stop_pod_at"]["stale"]


def test_the_run_id_is_the_deploys_else_the_runpod_pods_else_none():
    """One place decides it: a valid PODKIT_RUN_ID; else pod-<RUNPOD_POD_ID>, cut to a run id's characters and
    length; else none (compose, a local box)."""
    assert ledger.run_id({"PODKIT_RUN_ID": "a1b2", "RUNPOD_POD_ID": "xyz"}) == "a1b2"
    assert ledger.run_id({"PODKIT_RUN_ID": "no/good", "RUNPOD_POD_ID": "xyz"}) == "pod-xyz"
    assert ledger.run_id({"RUNPOD_POD_ID": "ab c.d/" + "e" * 80}) == ("pod-ab_c_d_" + "e" * 80)[:64]
    assert ledger.RUN_ID.match(ledger.run_id({"RUNPOD_POD_ID": "é" * 70}))
    assert ledger.run_id({"RUNPOD_POD_ID": " "}) == "" and ledger.run_id({}) == ""


def test_the_guards_are_one_table_read_by_the_guard_file_the_listener_the_cli_and_every_view():
    """guards.TABLE: one row per guard; a new guard is a row there and a Field in settings.py. The guard file's
    keys, the listener's enforced lines, the CLI's help and the forecast every view renders all come from it."""
    from podkit import cli, config
    from podkit.money import costguard, guards

    assert guards.KEYS == tuple(guards.TABLE) and set(guards.TABLE) <= set(settings.SCHEMA["guard"])
    assert set(costguard._THREAD) == set(costguard._ASKED) == {k for k, g in guards.TABLE.items() if g.enforced}
    shown = cli.parser().format_help()
    assert all(k in " ".join(shown.split()) for k in guards.TABLE), shown
    st = {"trainer": {"step": 1}, "programs": {}, "cost": None}
    values = {k: {"value": getattr(config.load(None, environ={}).guard, k)} for k in guards.TABLE}
    f = guards.forecast(st, values, time.time())
    assert set(f) == set(guards.TABLE) and all(v["words"] and "at" in v and v["on"] for v in f.values()), f
    for k, g in guards.TABLE.items():
        assert g.example.startswith(f"{k}=") and guards.parse(k, g.example.split("=", 1)[1], time.time()) \
            is not None, k
