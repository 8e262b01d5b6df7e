"""Cost guards on RunPod: a finished run, a pod waiting in safe mode past guard.stop_pod_after_s, a pod past
its maximum run time or its budget stop the pod through REST API v2's `POST /v2/pods/{id}/action` {"action":
"stop"}; what the pod costs (its price, its bill) is read into cost.json, shown and notified. RunPod is the
loopback stub of tests/runpod_stub.py, which holds every request to RunPod's OpenAPI document; notifications
go to tests/webhook.py's loopback receiver."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stub_pod
from conftest import PODKIT, ROOT, wait_for
from podkit import config, records
from podkit.errors import ConfigError
from podkit.money import costguard, guards, ledger, spend
from podkit.views import status
from runpod_stub import RunPodV2Stub
from stub_pod import KEY, STOP, on_runpod
from webhook import dead_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
runpod_api, receiver = stub_pod.runpod_api, stub_pod.receiver  # the fixtures (tests/stub_pod.py)


def stop_sent(stub: RunPodV2Stub) -> dict:
    """The stop's body; every request carried the pod's key."""
    [body] = [r.body for r in stub.requests if f"{r.method} {r.path}" == STOP]
    assert {r.headers.get("authorization") for r in stub.requests} == {f"Bearer {KEY}"}
    return body


def writes(stub: RunPodV2Stub) -> list[str]:
    """What the pod asked RunPod to do (its reads of its price and bill aside)."""
    return [c for c in stub.calls() if not c.startswith("GET ")]


def test_a_finished_run_on_runpod_stops_its_pod_after_its_checkpoint_and_notification(stack_factory, runpod_api,
                                                                                     receiver):
    """Both notifications carry what the pod cost (cost.json, read from RunPod's price and bill)."""
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      PODKIT_GUARD_COST_EVERY_S="1", **on_runpod(runpod_api.url)).start()
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the stop")
    assert stop_sent(runpod_api) == {"action": "stop"} and writes(runpod_api) == [STOP]
    assert runpod_api.pod("pod-abc123")["status"] == "EXITED"
    assert receiver.events() == ["finished", "pod-stop"], "both notifications are out before the stop"
    assert "training finished at step 12" in receiver.posts[1]["text"]
    for post in receiver.posts:
        assert re.search(r"this pod's cost: \$2\.69/h, (<\$0\.01|\$0\.0\d) spent \(billed\)", post["text"]), post["text"]
        assert post["cost"]["per_hour"] == 2.69 and post["cost"]["source"] == "billed"
    assert s.progress()["checkpoint_step"] == 12 and s.status()["programs"]["trainer"]["state"] == "EXITED"
    assert s.stop() == 0
    assert KEY not in s.stdout() and "stopping pod pod-abc123: training finished at step 12" in s.stdout()


def test_a_finished_runs_self_stop_refused_once_is_tried_again(stack_factory, runpod_api, receiver):
    """One transient API error (a 502) at the moment training finished left the pod up, billing. The
    stop is tried again, and announced once."""
    runpod_api.fail("POST", "/v2/pods/pod-abc123/action", 502, times=3, body=b"Bad Gateway")
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    wait_for(lambda: runpod_api.pod("pod-abc123")["status"] == "EXITED", 60, what="the stop, tried again")
    assert runpod_api.calls().count(STOP) == 4, "two sends (one retry) a try, the second try taken"
    assert receiver.events() == ["finished", "pod-stop"], "one notification for the stop, not one per attempt"
    assert "the pod did not stop; trying again in 2 s" in s.stdout()
    assert s.stop() == 0


@pytest.mark.parametrize("where", ["off RunPod", "never"])
def test_off_runpod_or_with_never_a_finished_run_leaves_the_pod_up(stack_factory, runpod_api, where):
    env = on_runpod(runpod_api.url)
    if where == "off RunPod":
        del env["RUNPOD_POD_ID"]
    else:
        env["PODKIT_GUARD_STOP_POD_WHEN_FINISHED"] = "never"
    s = stack_factory(PODKIT_TRAINER_MAX_STEPS="12", **env).start()
    wait_for(lambda: s.status()["programs"]["trainer"]["state"] == "EXITED", 60, what="the run's end")
    time.sleep(3)
    assert writes(runpod_api) == [] and s.proc.poll() is None
    if where == "off RunPod":
        assert runpod_api.requests == [] and s.status()["cost"] is None, "off RunPod nothing is asked of it"
    assert s.stop() == 0


@pytest.mark.parametrize("runpod", ["answers", "unreachable"])
def test_a_pod_waiting_in_safe_mode_stops_itself_after_stop_pod_after_s(procs, tmp_path, runpod_api, receiver, runpod):
    """A config error (so the setting is read from its env twin alone): after 2 s in safe mode, the
    notification, then podStop. Unreachable RunPod: logged, and safe mode goes on waiting."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    api = runpod_api.url if runpod == "answers" else dead_url().rsplit("/", 1)[0]
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_GUARD_STOP_POD_AFTER_S": "2", "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url, **on_runpod(api)}
    out = tmp_path / "boot.log"
    with open(out, "wb") as f:
        p = procs.spawn([*PODKIT, "boot"], env=env, stdout=f, stderr=subprocess.STDOUT)
    assert "safe mode (config) for" in receiver.one("pod-stop")["text"]
    if runpod == "answers":
        wait_for(lambda: STOP in runpod_api.calls(), 30, what="the stop")
        assert stop_sent(runpod_api) == {"action": "stop"}
    else:
        wait_for(lambda: "RunPod did not stop pod pod-abc123: RunPod's API at" in out.read_text(), 40,
                 what="the failure logged")
    assert receiver.events() == ["safe-mode", "pod-stop"]
    assert p.poll() is None, "safe mode goes on until RunPod's own stop"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0 and KEY not in out.read_text()


def test_the_maximum_run_time_stops_the_trainer_with_its_checkpoint_then_the_pod(stack_factory, runpod_api, receiver):
    """guard.stop_pod_at (what `podkit deploy --max-runtime` sets) passed: supervisord stops the trainer,
    which checkpoints on its SIGTERM, and only then is the pod stopped, with a notification first."""
    # Far enough ahead that the trainer has stepped (and can checkpoint) on a loaded machine.
    at = int(time.time()) + 25
    s = stack_factory(PODKIT_GUARD_STOP_POD_AT=str(at), PODKIT_NOTIFY_WEBHOOK_URL=receiver.url,
                      **on_runpod(runpod_api.url)).start()
    s.wait_step(1)
    assert time.time() < at, "the trainer took longer than the test allows to make its first step"
    wait_for(lambda: STOP in runpod_api.calls(), 90, what="the stop")
    assert stop_sent(runpod_api) == {"action": "stop"}
    prog = s.progress()
    assert prog["stopped"]["by"] == "SIGTERM" and prog["checkpoint_step"] == prog["step"] > 0
    assert s.status()["programs"]["trainer"]["state"] == "STOPPED"
    assert receiver.events() == ["pod-stop"]
    assert "maximum run time" in receiver.posts[0]["text"] and f"step {prog['step']}" in receiver.posts[0]["text"]
    assert s.stop() == 0
    assert "stopping the trainer with a checkpoint, then the pod" in s.stdout()


def test_a_pod_in_safe_mode_past_its_maximum_run_time_stops_at_once(procs, tmp_path, runpod_api, receiver):
    """A config error and guard.stop_pod_at already passed (its env twin, read alone): the sooner of the
    two guards wins, and the notification names the maximum run time."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "pod.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_CONFIG": str(bad), "PODKIT_WORKSPACE": str(ws),
           "PODKIT_GUARD_STOP_POD_AT": str(int(time.time()) - 5), "PODKIT_NOTIFY_WEBHOOK_URL": receiver.url,
           **on_runpod(runpod_api.url)}
    p = procs.spawn([*PODKIT, "boot"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert "guard.stop_pod_at, the maximum run time" in receiver.one("pod-stop")["text"]
    wait_for(lambda: STOP in runpod_api.calls(), 30, what="the stop")
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0


def test_when_and_how_a_pod_stops_lives_in_the_cost_guard_alone():
    """The boot, safe mode and the log listener tell the cost guard what happened; none of them decides when
    the pod stops, makes a stop, retries one or says so. Safe mode is told in one object (safemode.Why),
    which holds data only: nothing in it calls back into the boot."""
    import inspect
    import re

    from podkit.boot import boot, safemode
    from podkit.programs import logs

    owner = re.compile(r"Stopper\(|WhenIdle\(|stop_pod\(|stop_pod_notified|RETRY_MAX_S|RETRY_FOR_S|FIRST_RETRY_S|sooner|guardfile\.Live\(.*limits"
                       r"|\.check\(time\.monotonic|pod-stop")
    for module in (boot, safemode, logs):
        found = [line.strip() for line in inspect.getsource(module).splitlines() if owner.search(line)]
        assert found == [], f"{module.__name__} holds stop-pod logic: {found}"
    assert list(inspect.signature(safemode.wait).parameters) == ["why"]
    why = boot._why(None, None, "config", "a broken file", "fix it")
    assert why.guards["stop_pod_after_s"] == 3600.0 and not any(
        callable(v) for k, v in vars(why).items() if k != "retry")


# -- what the pod costs, and its budget (guard.max_spend) ---------------------------------------------------------
def podkit_guard(s, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*PODKIT, "guard", *args, "--workspace", str(s.workspace)], capture_output=True, text=True,
                          env=s.env, timeout=30)


def test_the_pods_spend_is_recorded_shown_and_its_budget_stops_the_trainer_with_its_checkpoint_then_the_pod(
        stack_factory, runpod_api, receiver):
    """On RunPod the log listener reads the pod's price and bill every guard.cost_every_s into cost.json, which
    `podkit status` shows with the cost of the steps left; a RunPod that stops answering keeps the last read,
    said once. `podkit guard set max_spend=5` on the running pod, then a bill past it: the trainer stops with
    its checkpoint, then the pod, as at the maximum run time, and the notification says what it cost."""
    s = stack_factory(PODKIT_GUARD_COST_EVERY_S="1", PODKIT_TRAINER_MAX_STEPS="100000",
                      PODKIT_NOTIFY_WEBHOOK_URL=receiver.url, **on_runpod(runpod_api.url)).start()
    s.wait_step(3)
    state = s.workspace / ".podkit"
    c = wait_for(lambda: (c := ledger.cost(state)) and c["projected"] is not None and c, 60,
                 what="a cost record with the cost of the steps left")
    assert set(json.loads(records.COST.path(state).read_text())) <= set(records.COST.shape)
    assert (c["per_hour"], c["source"]) == (2.69, "billed") and c["started"] <= c["time"] <= time.time()
    assert c["projected"] > 1, "some 99,990 steps of ~0.1 s at $2.69/h"
    st = s.status()
    assert st["cost"]["per_hour"] == 2.69 and st["cost"]["source"] == "billed"
    shown = subprocess.run([*PODKIT, "status", "--workspace", str(s.workspace)], capture_output=True, text=True,
                           env=s.env, timeout=30).stdout
    assert re.search(r"^cost: \$2\.69/h, (<\$0\.01|\$0\.\d\d) spent \(billed\), ~\$\d+\.\d\d to the end at this pace$",
                     shown, re.M), shown

    runpod_api.fail("GET", "/v2/pods/pod-abc123", 503, times=None)
    wait_for(lambda: "cannot read what pod pod-abc123 costs" in s.stdout(), 30, what="the failed read said")
    held = ledger.cost(state)
    time.sleep(4)
    now = ledger.cost(state)  # the ledger runs on at the last price, and says since when
    assert now["source"] == "estimated" and now["spent"] >= held["spent"] and now["per_hour"] == 2.69, now
    assert "RunPod did not answer" in now["why"] and now["since"] <= now["time"], now
    assert s.stdout().count("cannot read what pod pod-abc123 costs") == 1, "said once, not at every read"
    runpod_api.faults.clear()
    wait_for(lambda: "the pod's cost is read again" in s.stdout(), 30, what="the read again")

    r = podkit_guard(s, "set", "max_spend=$5")
    assert r.returncode == 0, r.stderr
    assert re.search(r"guard\.max_spend +\$5\.00 +\[.*guards\.json \(`podkit guard set`", r.stdout), r.stdout
    wait_for(lambda: "guard.max_spend is now $5.00" in s.stdout(), 30, what="the budget taken")
    time.sleep(2)
    assert STOP not in runpod_api.calls() and s.progress().get("stopped") is None, "under budget: trains on"
    runpod_api.charge("pod-abc123", 5.0)  # hours of GPUs in a moment
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the stop")
    assert stop_sent(runpod_api) == {"action": "stop"} and writes(runpod_api) == [STOP]
    prog = s.progress()
    assert prog["stopped"]["by"] == "SIGTERM" and prog["checkpoint_step"] == prog["step"] > 0
    assert s.status()["programs"]["trainer"]["state"] == "STOPPED"
    text = receiver.one("pod-stop")["text"]
    assert "the run's spend reached its budget ($5.0" in text and "of guard.max_spend $5.00" in text, text
    assert f"last checkpoint at step {prog['checkpoint_step']}" in text and "this pod's cost: $2.69/h, $5.0" in text
    assert s.stop() == 0
    assert "set on the running pod by `podkit guard set`): stopping the trainer with a checkpoint, then the pod" \
        in s.stdout()


def test_the_pods_cost_is_its_bill_or_while_that_does_not_answer_its_price_times_its_running_time(
        tmp_path, runpod_api):
    """One read (costguard.Meter, against the stub): RunPod's bill for the pod, its price and when it started,
    and with trainer.max_steps the steps left at the pace seen between reads; a bill the pod's key may not
    read (403) gives way to the estimate, said once; a RunPod that does not answer keeps the last record."""
    state = tmp_path / ".podkit"
    state.mkdir()
    said: list[str] = []
    m = costguard.Meter(state, 1, total_steps=100, say=said.append, environ=on_runpod(runpod_api.url))
    runpod_api.charge("pod-abc123", 3.0)
    t0 = time.time()
    records.PROGRESS.write(state, {"step": 10, "time": t0 - 5, "pid": 7})
    first = m.read()
    assert ledger.cost(state)["spent"] == first["spent"] and (first["source"], first["projected"]) == ("billed",
                                                                                                       None)
    assert 3.0 < first["spent"] < 3.01 and first["per_hour"] == 2.69
    records.PROGRESS.write(state, {"step": 20, "time": t0, "pid": 7})
    assert m.read()["projected"] == pytest.approx(80 * 0.5 * 2.69 / 3600, rel=1e-3), "80 steps left at 0.5 s each"

    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    assert m.read()["source"] == "read"
    est = m.read()
    # The bill read before, plus the price since: a spend never goes down (a budget's stop is never called off by
    # a bill that stops answering), where the price times this start's running time alone would say ~$0.
    assert est["source"] == "read" and 3.0 < est["spent"] < 3.01, est
    assert sum("billing for pod pod-abc123 did not answer" in line for line in said) == 1

    runpod_api.fail("GET", "/v2/pods/pod-abc123", 404, times=None)
    assert m.read() is None and m.read() is None
    held = ledger.cost(state)  # estimated at the last price since the last good read
    assert held["source"] == "estimated" and held["spent"] >= est["spent"] and m.spent() == held["spent"], held
    assert held["since"] == est["read_at"] and held["why"] == "RunPod did not answer (RunPod has no pod pod-abc123)"
    assert [line for line in said if "cannot read" in line] == [
        "cannot read what pod pod-abc123 costs (RunPod has no pod pod-abc123): its spend is estimated at the last "
        "price, and guard.max_spend goes by it; trying again every 1 s, said again once it works"]
    runpod_api.faults.clear()
    assert m.read()["source"] == "billed" and said[-1].startswith("the pod's cost is read again: $2.69/h, $3.0")


def test_the_budget_goes_by_what_runpod_says_on_a_full_volume_and_a_new_container_starts_from_the_pods_spend(
        tmp_path, runpod_api):
    """cost.json that cannot be written (a volume full of checkpoints): the budget still sees RunPod's spend, and
    the log says the write failed. A new container of the same pod starts from the spend on record (an estimate
    covers one start only); another pod's record is not its spend."""
    state, run = tmp_path / ".podkit", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    records.CURRENT.write(state, {"run_dir": str(run), "started": time.time()})
    said: list[str] = []
    env = on_runpod(runpod_api.url)
    m = costguard.Meter(state, 1, say=said.append, environ=env)
    runpod_api.charge("pod-abc123", 3.0)
    assert 3.0 <= m.read()["spent"] < 3.01
    records.COST.path(state).unlink()
    records.COST.path(state).mkdir()  # cannot be written over
    runpod_api.charge("pod-abc123", 5.0)
    assert m.read() is not None and 8.0 <= m.spent() < 8.01, m.spent()
    assert any("cannot write" in line and "guard.max_spend goes by what RunPod says" in line and
               f"kept in {run}" in line for line in said), said
    # every view reads the spend the budget acts on (issue 56: the page said $1.00 after the guard acted on $6)
    assert 8.0 <= ledger.cost(state, env)["spent"] < 8.01
    records.COST.path(state).rmdir()
    m.read()
    assert not records.COST.path(run).exists(), "back on the volume: the run dir's copy goes"
    again = costguard.Meter(state, 1, say=said.append, environ=env)
    assert again.spent() == m.spent(), "the pod's spend before this container"
    other = costguard.Meter(state, 1, say=said.append, environ={**env, "RUNPOD_POD_ID": "pod-xyz789"})
    assert other.spent() is None


GOOD = {"per_hour": 0.35, "spent": 1.2, "source": "billing", "started": 1.0, "time": None, "projected": 3.1}


@pytest.mark.parametrize("planted, why", [
    ('{"per_hour": 0.35, "spent": 1.2, "sour', "truncated"),
    ("\x00\xff binary", "binary"),
    ({"per_hour": "0.35"}, "a price that is not a number"),
    ({"per_hour": -0.35}, "a negative price"),
    ({"spent": -1}, "a negative spend"),
    ('{"per_hour": 0.35, "spent": NaN, "source": "billing", "time": %(now)s}', "NaN spent"),
    ('{"per_hour": 1e400, "spent": 1.2, "source": "billing", "time": %(now)s}', "an endless price"),
    ({"spent": 1e300}, "a huge spend"),
    ({"per_hour": 10 ** 400}, "a 400-digit price"),
    ({"time": "future"}, "a read stamped days ahead"),
    ({"time": "hour"}, "a read stamped an hour ahead"),
    ({"source": "a guess"}, "a source that is not podkit's"),
    ({"per_hour": True}, "a price that is a boolean"),
])
def test_a_planted_cost_record_is_not_believed(tmp_path, planted, why):
    """cost.json is data on the volume: a record that is corrupt, or holds a price or spend that is not a finite
    amount of money, or was read in the future, is no cost at all: status shows none, and says nothing of it."""
    state = tmp_path / "ws" / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    if isinstance(planted, dict):
        rec = {**GOOD, "time": now, **planted}
        rec["time"] = {"future": now + 3 * 86400, "hour": now + 3600}.get(rec["time"], rec["time"])
        raw = json.dumps(rec)
    else:
        raw = planted % {"now": now} if "%(now)s" in planted else planted
    records.COST.path(state).write_text(raw, errors="surrogateescape")
    assert ledger.cost(state) is None, why
    st = status.collect(tmp_path / "ws")
    assert st["cost"] is None and "cost:" not in status.human(st)


def test_a_good_cost_record_is_one_status_line_and_a_bad_value_in_it_is_dropped(tmp_path):
    """The line `podkit status` prints; a started or projected value that is not one is dropped, not shown."""
    state = tmp_path / "ws" / ".podkit"
    state.mkdir(parents=True)
    records.COST.write(state, dict(GOOD, time=time.time()))
    st = status.collect(tmp_path / "ws")
    assert {k: st["cost"][k] for k in GOOD} == dict(GOOD, source="billed", time=st["cost"]["time"])
    assert "\ncost: $0.35/h, $1.20 spent (billed), ~$3.10 to the end at this pace\n" in status.human(st) + "\n"
    records.COST.write(state, dict(GOOD, time=time.time(), projected=-3.0, started=time.time() + 3600))
    c = ledger.cost(state)
    assert (c["projected"], c["started"], c["spent"]) == (None, None, 1.2)
    assert ledger.words(c) == "$0.35/h, $1.20 spent (billed)"
    assert ledger.words(dict(c, time=time.time() - 1800)).endswith("(read 30 min ago)")


@pytest.mark.parametrize("value, says", [("-5", "-5.0 is below the minimum 0"), (".inf", "is not a finite number"),
                                         (".nan", "is not a finite number"), ("five", "expected a number (USD)")])
def test_a_budget_that_is_not_an_amount_is_a_config_error_naming_the_file_and_the_key(tmp_path, value, says):
    """guard.max_spend: USD, 0 for none; a negative, endless or non-numeric one stops the config with the file,
    the key, what is wrong and a hint, in the file and in its env twin alike."""
    f = tmp_path / "pod.yaml"
    f.write_text(f"guard:\n  max_spend: {value}\n")
    with pytest.raises(ConfigError) as e:
        config.load(f, environ={})
    assert e.value.message.startswith(f"{f}: guard.max_spend: ") and says in e.value.message, e.value.message
    assert "budget" in e.value.hint
    with pytest.raises(ConfigError) as e:
        config.load(environ={"PODKIT_GUARD_MAX_SPEND": "-1"})
    assert e.value.message.startswith("env PODKIT_GUARD_MAX_SPEND: guard.max_spend: -1.0 is below the minimum 0")
    assert config.load(environ={"PODKIT_GUARD_MAX_SPEND": "25.5"}).guard.max_spend == 25.5


def _ago(seconds: float, go: bool = False) -> str:
    t = time.gmtime(time.time() - seconds)
    return time.strftime("%Y-%m-%d %H:%M:%S +0000 UTC" if go else "%Y-%m-%dT%H:%M:%SZ", t)


def test_a_running_pod_priced_zero_whose_bill_cannot_be_read_is_never_at_zero_and_its_budget_acts(tmp_path,
                                                                                               runpod_api):
    """RunPod answers cost 0 for a running pod that started three hours ago, and the pod's key may not read the
    bill: the spend was $0.00 for ever and a $5 budget never acted. Now the GPU catalogue's price for its GPUs
    over its running time ($2.69/h x 3 h), estimated and said once; the budget acts on it."""
    state = tmp_path / ".podkit"
    state.mkdir()
    said: list[str] = []
    runpod_api.pods["pod-abc123"]["startedAt"] = _ago(3 * 3600)
    runpod_api.set_price("pod-abc123", 0.0)
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    m = costguard.Meter(state, 1, say=said.append, environ=on_runpod(runpod_api.url))
    rec = m.read()
    assert rec["source"] == "estimated" and 8.0 <= rec["spent"] < 8.2 and rec["per_hour"] == 2.69, rec
    assert "the GPU catalogue's" in rec["why"] and m.read()["spent"] >= rec["spent"]
    assert sum("the pod's spend is estimated: RunPod shows no price for the running pod" in s for s in said) == 1
    line = ledger.words(ledger.cost(state))
    assert line.startswith("$2.69/h, $8.") and "(estimated since " in line and "catalogue" in line, line
    deadline = costguard.Deadline(lambda k: {"max_spend": 5.0, "stop_pod_at": 0}[k], lambda k: False, state,
                                  said.append, lambda why: "", spent=m.spent)
    assert deadline.due(time.time()) == "max_spend"


def test_a_price_change_never_reprices_the_time_before_it(tmp_path, runpod_api):
    """$90/h for the pod's first seconds, then $900/h: the spend is the first price over the first interval,
    not the new price over the whole start (a $15 budget acted at $24, a $5 one stopped a pod that spent $1)."""
    state = tmp_path / ".podkit"
    state.mkdir()
    runpod_api.pods["pod-abc123"]["startedAt"] = _ago(0)
    runpod_api.set_price("pod-abc123", 90.0)
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    m = costguard.Meter(state, 1, say=lambda _: None, environ=on_runpod(runpod_api.url))
    first = m.read()
    time.sleep(1.0)
    runpod_api.set_price("pod-abc123", 900.0)
    second = m.read()
    ran = second["time"] - runpod_api_started(runpod_api)
    assert second["spent"] < first["spent"] + 90 * (second["time"] - first["time"]) / 3600 + 1e-6
    assert second["spent"] < 0.5 * 900 * ran / 3600, "not re-priced at $900/h over the whole start"
    third = (time.sleep(0.5), m.read())[1]
    assert third["spent"] >= second["spent"] + 900 * 0.5 / 3600 - 1e-6, "the new price from its read on"


def runpod_api_started(stub) -> float:
    from podkit import runpod

    return runpod.started_at(stub.pods["pod-abc123"])


def test_a_go_style_start_time_is_read_and_one_that_cannot_be_counts_from_the_boot(tmp_path, runpod_api):
    state = tmp_path / ".podkit"
    state.mkdir()
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    runpod_api.set_price("pod-abc123", 1.0)
    runpod_api.pods["pod-abc123"]["startedAt"] = _ago(3600, go=True)
    rec = costguard.Meter(state, 1, say=lambda _: None, environ=on_runpod(runpod_api.url)).read()
    assert rec["source"] == "read" and 0.99 < rec["spent"] < 1.02, rec
    records.COST.path(state).unlink()
    runpod_api.pods["pod-abc123"]["startedAt"] = "an hour ago"
    m = costguard.Meter(state, 1, say=lambda _: None, environ=on_runpod(runpod_api.url))
    m.boot -= 1800  # this container booted half an hour ago
    rec = m.read()
    assert rec["source"] == "estimated" and 0.49 < rec["spent"] < 0.52 and "'an hour ago' cannot be read" in rec["why"]
    runpod_api.errors.clear()  # the planted start times are not the document's shape: the stub noted them


def test_a_host_clock_hours_ahead_is_timed_by_runpods_answer_date(tmp_path, runpod_api, monkeypatch):
    """The Meter against the stub with this host's clock 3 h ahead: the pod started an hour ago by RunPod's clock (its
    answers' Date), at $1/h with no bill to read: $1, not $4 (issue 56)."""
    import time as _time

    state = tmp_path / ".podkit"
    state.mkdir()
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    runpod_api.set_price("pod-abc123", 1.0)
    runpod_api.pods["pod-abc123"]["startedAt"] = _ago(3600)
    from types import SimpleNamespace

    real = _time.time  # the stub's Date stays on the real clock: only the Meter's host clock is ahead
    monkeypatch.setattr(costguard, "time", SimpleNamespace(time=lambda: real() + 3 * 3600, monotonic=_time.monotonic,
                                                           sleep=_time.sleep))
    rec = costguard.Meter(state, 1, say=lambda _: None, environ=on_runpod(runpod_api.url)).read()
    assert 0.99 < rec["spent"] < 1.02, rec


def test_a_clock_stepped_back_keeps_the_spend_and_a_replacement_pod_carries_its_runs(tmp_path, runpod_api):
    """cost.json stamped three hours in this clock's future (the clock stepped back): its $8 is kept and counted
    on, said once, where it was dropped for $0. A replacement pod of the same run (PODKIT_RUN_ID) starts from
    the run's spend; a pod of another run does not."""
    state = tmp_path / ".podkit"
    state.mkdir()
    runpod_api.fail("GET", "/v2/billing/pods", 403, times=None)
    runpod_api.pods["pod-abc123"]["startedAt"] = _ago(60)
    env = on_runpod(runpod_api.url, PODKIT_RUN_ID="run-7")
    records.COST.write(state, {"per_hour": 2.69, "spent": 8.0, "source": "read", "started": time.time() - 600,
                               "time": time.time() + 3 * 3600, "pod": "pod-abc123", "run": "run-7"})
    said: list[str] = []
    m = costguard.Meter(state, 1, say=said.append, environ=env)
    assert m.spent() == 8.0 and any("the clock stepped back" in s for s in said), said
    assert m.read()["spent"] >= 8.0
    replacement = runpod_api.add_pod(id="pod-new456", name="podkit-run")
    runpod_api.pods[replacement["id"]]["startedAt"] = _ago(60)
    env2 = {**env, "RUNPOD_POD_ID": "pod-new456"}
    r = costguard.Meter(state, 1, say=said.append, environ=env2).read()
    assert r["pod"] == "pod-new456" and r["run_before"] >= 8.0 and r["spent"] < 0.1 and r["carried_from"] == "pod-abc123"
    assert "this run, with its earlier pods" in ledger.words(ledger.cost(state))
    other = costguard.Meter(state, 1, say=said.append, environ={**env, "RUNPOD_POD_ID": "pod-xyz789",
                                                                "PODKIT_RUN_ID": "run-8"})
    assert other.spent() is None, "another run's pod on the volume"


@pytest.mark.parametrize("source, severity", [("unknown", "problem"), ("estimated", "info")])
def test_doctor_says_when_the_spend_is_unknown_or_estimated_and_what_that_means_for_the_budget(tmp_path, source,
                                                                                            severity):
    """The spend's sureness is said once in the log, and by status, doctor and the page: an unknown spend with a
    budget set is a problem (the budget cannot act), an estimate a note that says why and since when."""
    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    rec = {"per_hour": None, "spent": None, "source": "unknown", "why": "RunPod shows no price for the running pod "
           "(0.0), and the GPU catalogue has none for its GPUs", "time": now, "pod": "pod-abc123"}
    if source == "estimated":
        rec.update(per_hour=2.69, spent=3.2, source="estimated", since=now - 1800, why="RunPod did not answer (HTTP 503)")
    records.COST.write(state, rec)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODKIT_", "RUNPOD_"))}
    r = subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(ws)], capture_output=True, text=True,
                       env={**env, "PODKIT_GUARD_MAX_SPEND": "5", "RUNPOD_POD_ID": "pod-abc123"}, timeout=60)
    found = {f["id"]: f for f in json.loads(r.stdout)["findings"]}
    f = found[f"spend_{source}"]
    assert f["severity"] == severity and "guard.max_spend $5.00" in f["evidence"], f
    if source == "unknown":
        assert "its budget cannot act" in f["title"] and "spend unknown: RunPod shows no price" in f["evidence"][0]
    else:
        assert "$3.20 spent (estimated since " in f["evidence"][0] and "RunPod did not answer" in f["evidence"][0]
    shown = subprocess.run([*PODKIT, "status", "--workspace", str(ws)], capture_output=True, text=True,
                           env={**env, "PODKIT_GUARD_MAX_SPEND": "5"}, timeout=60).stdout
    assert "cost: " in shown and ("spend unknown" in shown if source == "unknown" else "estimated since" in shown)
    assert ("guard.max_spend: once the run has cost $5.00: what it has spent is not known, so the budget cannot act"
            if source == "unknown" else "guard.max_spend: once the run has cost $5.00: $3.20 so far (estimated since "
            ) in shown, shown


def _guards(**values) -> dict:
    base = {"stop_pod_at": 0.0, "stop_pod_when_finished": "auto", "stop_pod_after_s": 7200.0, "max_spend": 0.0}
    return {k: {"value": v} for k, v in {**base, **values}.items()}


def test_each_guards_forecast_says_when_it_would_stop_the_pod_and_on_what():
    """guards.forecast, worked out once for status and the page: the budget by the run's spend and its price
    (now, when it is past; never, when the spend is unknown), the unable-to-train stop from safe mode's start,
    the maximum run time, the finish at the trainer's pace."""
    now = 1_800_000_000.0
    st = {"trainer": {"step": 40}, "programs": {}, "safe_mode": None,
          "cost": {"per_hour": 2.0, "spent": 3.0, "source": "billed", "time": now, "run_before": 0.0}}
    f = guards.forecast(st, _guards(max_spend=5.0, stop_pod_at=now + 3600), now, rate=10.0, total_steps=100)
    assert f["max_spend"]["at"] == now + 3600 and f["max_spend"]["words"] == \
        "once the run has cost $5.00: $3.00 so far (billed), at $2.00/h in 1h00m"
    assert f["stop_pod_at"]["at"] == now + 3600 and f["stop_pod_at"]["words"].endswith("in 1h00m")
    assert f["stop_pod_when_finished"]["at"] == now + 360 and "at this pace in 6m00s" in f["stop_pod_when_finished"]["words"]
    assert f["stop_pod_after_s"]["at"] is None and f["stop_pod_after_s"]["on"] == "the pod trains"
    past = guards.forecast({**st, "cost": {**st["cost"], "spent": 8.0}}, _guards(max_spend=5.0), now)
    assert past["max_spend"]["at"] == now and past["max_spend"]["words"].endswith("it has spent $8.00 (billed): now")
    unknown = guards.forecast({**st, "cost": {"per_hour": None, "spent": None, "source": "unknown", "time": now,
                                                 "why": "no price"}}, _guards(max_spend=5.0), now)
    assert unknown["max_spend"]["at"] is None and "the budget cannot act" in unknown["max_spend"]["words"]
    safe = guards.forecast({**st, "safe_mode": {"since": now - 600},
                               "standing": {"run": "safe-mode", "since": now - 600}}, _guards(), now)
    assert safe["stop_pod_after_s"]["at"] == now - 600 + 7200 and "in safe mode since 10m00s ago" in \
        safe["stop_pod_after_s"]["words"]


def test_the_idle_guards_forecast_counts_what_the_listener_counts():
    """A trainer that exited with no end it could write (standing `ended`, stuck): the forecast says when the pod
    stops, as the listener's cost guard does, where it said "the pod trains"."""
    now = 1_800_000_000.0
    st = {"trainer": {}, "programs": {}, "cost": None,
          "standing": {"run": "ended", "stuck": True, "since": now - 600,
                       "why": "the trainer exited without recording a final end"}}
    f = guards.forecast(st, _guards(), now)["stop_pod_after_s"]
    assert f["at"] == now - 600 + 7200 and "exited without recording a final end" in f["words"], f


def test_a_budget_in_safe_mode_or_before_any_spend_is_read_forecasts_nothing_and_says_why():
    """Safe mode has no cost meter and no trainer: the page said the budget's stop was "in 11m09s" at minute 1 and
    at minute 40 (an old cost.json's spend and price). With no spend read yet, the row said "once the run has cost
    $20.00" and nothing of the spend being unknown."""
    now = 1_800_000_000.0
    old = {"per_hour": 2.0, "spent": 4.6, "source": "billed", "time": now - 7200, "run_before": 0.0}
    safe = guards.forecast({"trainer": {}, "programs": {}, "safe_mode": {"stage": "config", "since": now - 60},
                               "cost": old}, _guards(max_spend=5.0), now)["max_spend"]
    assert safe["at"] is None and safe["on"] == "safe mode" and "nothing reads the spend" in safe["words"], safe
    none = guards.forecast({"trainer": {}, "programs": {}, "cost": None}, _guards(max_spend=20.0), now)["max_spend"]
    assert none["at"] is None and none["words"] == ("once the run has cost $20.00: no spend read yet (the log "
                                                    "listener reads RunPod's price), so the budget cannot act yet")


def test_guard_set_in_safe_mode_says_the_budget_waits_and_on_a_full_volume_fails_without_a_traceback(tmp_path):
    """`podkit guard set max_spend=5` in safe mode said the trainer stops within the minute (there is none, and no
    meter); on a volume that cannot take guards.json it died with a traceback."""
    from podkit import records
    from podkit.money import guardfile

    state = tmp_path / ".podkit"
    state.mkdir()
    records.SAFE_MODE.write(state, {"stage": "sync", "message": "bad remote", "since": time.time()})
    records.COST.write(state, {"per_hour": 2.0, "spent": 9.0, "source": "billed", "time": time.time(), "pod": "p"})
    past = time.time() - 5
    rep = {"guards": {"max_spend": {"value": 5.0}, "stop_pod_at": {"value": past}}}
    said = guardfile.forecast(state, {"max_spend": 5.0, "stop_pod_at": past}, rep)
    assert any("in safe mode (sync)" in line and "acts once the pod trains" in line for line in said), said
    assert "that time has passed: the pod stops within seconds (it waits in safe mode)" in said, said
    assert not any("the trainer stops" in line for line in said), said
    env = {**os.environ, "PODKIT_WORKSPACE": str(tmp_path), "PYTHONPATH": str(ROOT / "src")}
    guards = guardfile.path(tmp_path)
    guards.mkdir(parents=True, exist_ok=True)  # a directory where the file goes: every write fails (EISDIR)
    r = subprocess.run([*PODKIT, "guard", "set", "max_spend=5", "--workspace", str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert "cannot write" in r.stderr + r.stdout and "unchanged" in r.stderr + r.stdout, r.stderr


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 1e4), st.one_of(st.none(), st.floats(0, 1e4)), st.one_of(st.none(), st.floats(0.01, 100)),
       st.floats(0, 1e4))
def test_a_budgets_forecast_is_never_in_the_past_and_never_made_of_an_unknown_spend(budget, spent, price, before):
    now = 1_800_000_000.0
    cost = {"per_hour": price, "spent": spent, "source": "unknown" if spent is None else "read", "time": now,
            "run_before": before}
    f = guards.forecast({"trainer": {}, "programs": {}, "cost": cost}, _guards(max_spend=budget), now)["max_spend"]
    total = spend.total(cost)
    if not budget or total is None:
        assert f["at"] is None
    else:
        assert f["at"] is None or f["at"] >= now
        # "now" exactly when spent; otherwise later, unless the time left is below the clock's resolution at `now`
        # (a budget of 1e-311 dollars above the spend)
        assert (f["at"] == now) == (total >= budget) or now + (budget - total) / price * 3600 == now
