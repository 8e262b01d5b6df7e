"""The user's own code trains: examples/my-repo (its own config class, JSONL data, reward and workflow
subclass) pushed to a local bare remote, synced by the boot and run as trainer.entry by podkit's
bootstrap under torchrun: AReaL 1.0.4's real trainer on CPU under the real supervisord, against
podkit's generating STAND-IN for SGLang (not SGLang), with rehearse/cpu-overrides on the repo's YAML,
as `make rehearse REPO=examples/my-repo ENTRY=train.py` runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from areal_stack import CPU_OVERRIDES, EXAMPLE, PYTHON, example_remote, repo_env
from chromium import CHROMIUM, browser
from conftest import PODKIT, wait_for, wheel
from podkit import records
from podkit.areal import identity

pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("areal"), pytest.mark.timeout(600),
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(sh rehearse/env.sh))")]

# What a user's script may do that would break podkit's stop: its own SIGTERM handler, which here would
# end the rank at once, mid-step, without a recover checkpoint or a stop record.
OWN_SIGTERM = ("import os, signal\n"
               "signal.signal(signal.SIGTERM, lambda *_: os._exit(1))  # the script's own handler\n")
# A checkout that vendors AReaL: on sys.path first, it would shadow the installed, patched AReaL.
VENDORED_AREAL = 'raise ImportError("the vendored copy of areal was imported")\n'


def test_your_repo_trains_under_its_own_names_stops_with_a_checkpoint_despite_its_sigterm_handler_and_resumes_only_itself(
        rehearsal, tmp_path):
    """The repo's YAML, shaped like AReaL's own examples, runs as it is (podkit sets what it depends on and
    says so), and names the run myrepo/t0: AReaL's directories carry the names, and the checkpoint a
    record of its run. The pod's stop ends the step in flight with a checkpoint, whatever the script's own
    SIGTERM handler says; a new commit of the repo resumes it, and a checkpoint AReaL cannot load stops it
    once instead of training over it from step 0. Another entry on the same volume under the
    same names does not: it stops once, saying why, and `podkit start-over` moves the old run aside (kept)
    and trains from step 1. At the end its workflow awaits for ever, and the rank's own dump (the watchdog's)
    names the line; the pod's stop then cuts the hung step, and it is a stop."""
    # Its own requirement (a wheel in the repo: no index here), installed by the setup stage.
    train = (EXAMPLE / "train.py").read_text().replace(
        "import sys\n", "import sys\n" + OWN_SIGTERM + "import podkit_demo_dep  # from requirements.txt\n", 1)
    # The repo's YAML is shaped like AReaL's own examples: recovery off, xccl, backends for 8 GPUs.
    yaml = areal_shaped((EXAMPLE / "config.yaml").read_text()).replace(
        "experiment_name: my-repo\ntrial_name: gsm8k-v1\n", "experiment_name: myrepo\ntrial_name: t0\n", 1)
    remote = example_remote(tmp_path, with_files=lambda work: wheel(work / "wheels"),
                            **{"train.py": train, "other.py": train, "config.yaml": yaml,
                               "areal/__init__.py": VENDORED_AREAL, "my_workflow.py": HANGING_WORKFLOW,
                               "requirements.txt": "./wheels/podkit_demo_dep-1.0-py3-none-any.whl\n"})
    s = rehearsal(**repo_env(remote, PODKIT_REPO_SETUP="pip install --no-index -r requirements.txt")).start()
    p = s.wait_step(3, timeout=300)
    # The synced commit trains, and says so.
    assert p["code"] == {"entry": "train.py", "commit": remote.head(), "dirty": False}, p
    log = s.log("trainer")
    assert "run myrepo/t0 (experiment_name from " in log
    assert (f"podkit sets over {s.workspace / 'repo' / 'config.yaml'}: recover.mode disabled -> auto (podkit resumes "
            "every restart") in log and "actor.weight_update_mode xccl -> disk (" in log, log[-3000:]
    assert "actor.backend fsdp:d4p1t1 -> fsdp:d1 (trainer.cpu_ranks 1 gives" in log, log[-3000:]
    assert f"running {s.workspace / 'repo' / 'train.py'} under podkit's hooks" in log
    env_python = json.loads((s.workspace / ".podkit" / "setup.json").read_text())["python"]
    assert f"starting {env_python} -m torch.distributed.run" in log  # the repo's env, not the image's Python
    assert f"{s.workspace / 'repo' / 'areal'} is not used" in log  # the vendored copy, named
    assert isinstance(p.get("reward"), float) and p.get("on_policy_logp_gap"), p
    root = identity.save_root(str(s.workspace / "areal"), "myrepo", "t0")
    owner = json.loads((root / identity.RECORD).read_text())
    assert owner["names"] == ["myrepo", "t0"] and owner["entry"] == "train.py", owner
    assert owner["model"]["shape"] == {"hidden_size": 64, "layers": 2, "vocab": 224}, owner
    assert p["run"] == "myrepo/t0" and "; run myrepo/t0" in s.podkit("status").stdout, p
    # The pod's stop: the step in flight ends with its recover checkpoint, whatever the script's handler says.
    assert s.stop() == 0
    p = s.progress()
    assert p["stopped"]["by"] == "SIGTERM" and p["checkpoint_step"] == p["step"], p
    assert identity.has_checkpoint(root) and (s.workspace / "areal" / "logs" / "root" / "myrepo" / "t0").is_dir()
    stopped_at = p["step"]
    # A fix pushed meanwhile: the next boot syncs the new commit and resumes the run from that checkpoint.
    fixed = remote.commit("README.md", "fixed\n")
    again = time.time()
    s.start()
    p = s.wait_fresh_step(stopped_at + 1, again, timeout=300)
    assert p["resumed_at"] == stopped_at and p["code"]["commit"] == fixed, p
    assert "[podkit:setup] reusing" in s.stdout()  # installed once
    # A checkpoint AReaL cannot load (a file of it gone, as when the trainer's rank count changed): AReaL would
    # train from step 0 and write over it. The trainer stops once instead, and the checkpoint stays. (On the
    # running pod: the user's stop writes the checkpoint, the user's start finds it unloadable.)
    r = subprocess.run([*PODKIT, "ctl", "--workspace", str(s.workspace), "stop", "trainer"], capture_output=True,
                       text=True, env=s.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    pkl = root / "recover_info" / "dataloader_info.pkl"
    pkl.rename(pkl.with_name("dataloader_info.aside"))
    since = time.time()
    s.rpc().supervisor.startProcess("trainer", False)
    stopped = _refusal(s, since)
    assert f"AReaL could not load the recover checkpoint in {root}" in stopped["message"], stopped
    assert "podkit start-over" in stopped["hint"] and (s.progress().get("step") or 0) >= stopped_at + 1
    pkl.with_name("dataloader_info.aside").rename(pkl)
    assert s.stop() == 0
    # Another script under the same names on this volume: not resumed from this run's checkpoint.
    s.env["PODKIT_TRAINER_ENTRY"] = "other.py"
    since = time.time()
    s.start()
    stopped = _refusal(s, since)
    assert f"the recover checkpoint in {root} belongs to another run" in stopped["message"], stopped
    assert "it was trained by train.py, this run runs other.py" in stopped["message"], stopped
    assert "own trial name" in stopped["hint"] and "podkit start-over" in stopped["hint"], stopped
    assert identity.has_checkpoint(root)  # nothing removed, and one start: no loop
    assert s.log("trainer").count(f"running {s.workspace / 'repo' / 'other.py'} under") == 1
    # The second way on: the old run set aside (kept), this one trains from the start.
    moved = time.time()
    r = s.podkit("start-over")
    assert r.returncode == 0 and "nothing deleted" in r.stdout and "started the trainer" in r.stdout, r.stdout + r.stderr
    kept = [d for d in root.parent.iterdir() if d.name.startswith("t0.set-aside-")]
    assert len(kept) == 1 and identity.has_checkpoint(kept[0]), kept
    # Training started from scratch (not resumed) and the run's record is the new run's.
    p = wait_for(lambda: (p := s.progress()).get("time", 0) > moved and (p.get("code") or {}).get("entry") ==
                 "other.py" and "resumed_at" in p and p, 240, interval=0.5, what="the new run to start training")
    assert p["resumed_at"] is None and p.get("step", 0) <= 1, p
    assert json.loads((root / identity.RECORD).read_text())["entry"] == "other.py"
    # The workflow awaits for ever (a judge that never answers): the rank's own dump of its asyncio tasks,
    # read as the watchdog reads it, names the line; the pod's stop during that step is a stop (cut at the end
    # of the grace when the step waits on the hung episode; episodes started before it may still end the step).
    checkout = s.workspace / "repo"
    (checkout / "hang.flag").touch()
    wait_for(lambda: (checkout / "hung.flag").exists(), 180, interval=1, what="an episode to hang")
    from podkit.host import stacks
    from podkit.programs import watchdog

    dump = s.workspace / "logs" / "hang-test.txt"
    watchdog.dump_stacks(s.pid("trainer"), dump, s.workspace / "logs")
    frame = stacks.user_frame(dump.read_text(), [str(checkout)])
    line = HANGING_WORKFLOW.splitlines().index("            await asyncio.Event().wait()  # never answers") + 1
    assert frame and frame["shown"] == f"my_workflow.py:{line}" and frame["function"] == "arun_episode", frame
    assert stacks.describe(frame, True) == f"hung in your workflow at my_workflow.py:{line} in arun_episode"
    assert s.stop() == 0
    stopped = s.progress()["stopped"]
    assert stopped["by"] == "SIGTERM" and "the pod's stop" in stopped["asked"], stopped
    assert stopped.get("message", "") != "None", stopped


def areal_shaped(yaml: str) -> str:
    """A podkit-ready AReaL YAML made like AReaL's own examples, which podkit runs as they are."""
    for ours, theirs in (('backend: "sglang:d1"', 'backend: "sglang:d4p1t1"'),
                         ('backend: "fsdp:d1"', 'backend: "fsdp:d4p1t1"'),
                         ("weight_update_mode: disk", "weight_update_mode: xccl"), ("mode: auto", "mode: disabled")):
        assert ours in yaml, ours
        yaml = yaml.replace(ours, theirs, 1)
    return yaml


def _refusal(s, since: float, timeout: float = 240) -> dict:
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "config-error"
                       and st.get("time", 0) > since and st, timeout, interval=0.5,
                       what="the trainer to record a config error")
    wait_for(lambda: s.rpc().supervisor.getProcessInfo("trainer")["statename"] == "EXITED", 60,
             what="the trainer to stay stopped")
    return stopped


# A failure during training in the user's own code, the same on every run: the data is read lazily (a
# transform on access, in the dataloader's worker processes), and row 8's answer is not a number. In the
# file's order, with no generation ahead of the trainer (max_head_offpolicyness 0), AReaL reads batch 2
# (rows 8-11) only once step 1's weights are served, after step 1's record: step 1 trains, and every run,
# resumed at step 1, reads that batch again before a new step. (The example's offpolicyness 2 lets AReaL
# read batches ahead while step 1 is still waiting, and a run could fail before its first step.)
LAZY_ROWS = ('''def jsonl_dataset(path: str, hint: str):
    """Rows read as they are used."""
    rows = load_dataset("json", data_files=path, split="train")

    def to_prompt(batch):
        return {"messages": [[{"role": "user", "content": f"{q}\\n{hint}"}] for q in batch["question"]],
                "answer": [str(int(a)) for a in batch["answer"]]}

    return rows.with_transform(to_prompt)
''')
IN_ORDER = "++train_dataset.shuffle=false ++rollout.max_head_offpolicyness=0"
BAD_ROW = 8


def lazy_rows_with_a_bad_row(checkout) -> None:
    train = (EXAMPLE / "train.py").read_text()
    start = train.index("def jsonl_dataset")
    end = train.index("def main")
    (checkout / "train.py").write_text(train[:start] + LAZY_ROWS + "\n\n" + train[end:])
    rows = (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    bad["answer"] = "n/a"
    rows[BAD_ROW] = json.dumps(bad)
    (checkout / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")


def test_a_script_that_cannot_train_stops_the_trainer_once_naming_the_file_and_line(rehearsal, tmp_path):
    """An import error (found before the wait for inference), an agent workflow (SPMD mode has no proxy
    workers): each found before the first step, each a config error once, never a restart loop. Then a script that
    raises at step 2 on every run: the loop bound (trainer.max_failures 1 here: each real start costs seconds of CPU)
    stops it, in the script's own words, on the run's page too. The user fixes the checkout and starts the trainer
    again, as the hint says."""
    broken = (EXAMPLE / "train.py").read_text().replace("from my_reward import", "from my_rewards import", 1)
    remote = example_remote(tmp_path, **{"train.py": broken})
    since = time.time()
    s = rehearsal(**repo_env(remote, PODKIT_TRAINER_RESTART_DELAY_S="1", PODKIT_TRAINER_MAX_FAILURES="1",
                             PODKIT_TRAINER_MAX_EPISODE_FAILURES="8", PODKIT_TRAINER_EPISODE_FAILURE_WINDOW_S="0",
                             PODKIT_TRAINER_OVERRIDES=f"{CPU_OVERRIDES} {IN_ORDER}")).start()
    checkout = s.workspace / "repo"
    stopped = _refusal(s, since)
    line = broken.splitlines().index("from my_rewards import boxed_answer_reward") + 1
    assert f"{checkout / 'train.py'}:{line}" in stopped["message"] and "my_rewards" in stopped["message"], stopped
    assert "push" in stopped["hint"], stopped
    assert "found before waiting for inference" in s.log("trainer") and "torch.distributed.run" not in s.log("trainer")
    doc = json.loads(s.podkit("doctor", "--json").stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "trainer_config_error")
    assert any("my_rewards" in e for e in finding["evidence"]) and finding["fix"] == stopped["hint"], finding

    # An agent workflow: refused when train() starts, before any rollout. (A data file that is not there, like
    # any exception before training, is the bootstrap's walk below: no stack needed.)
    agent = (EXAMPLE / "train.py").read_text().replace(
        "trainer.train(workflow=workflow(config.gconfig),",
        "trainer.train(workflow=lambda data: 0.0,  # an agent workflow: any callable\n                      ")
    (checkout / "train.py").write_text(agent)
    since = time.time()
    s.rpc().supervisor.startProcess("trainer", False)
    stopped = _refusal(s, since)
    assert "agent workflow" in stopped["message"] and "SPMD" in stopped["hint"], stopped
    line = next(i for i, ln in enumerate(agent.splitlines(), 1) if "trainer.train(" in ln)
    assert f"train(workflow=...) at {checkout / 'train.py'}:{line}" in stopped["message"], stopped  # the user's line
    assert s.progress().get("step") is None  # refused before the first step
    assert s.log("trainer").count("[podkit:run] starting trainer") == 2  # once per start: no loop

    # Step 1 trains, then every run fails at step 2 (after its resume): the first failure follows a new step and
    # restarts at once; the second does not, and trainer.max_failures 1 (the smoke stack walks the default 3)
    # stops it after 2 starts.
    lazy_rows_with_a_bad_row(checkout)
    since = time.time()
    s.rpc().supervisor.startProcess("trainer", False)
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "crash-loop"
                       and st.get("time", 0) > since and st, 400, interval=1, what="the loop bound")
    took = time.time() - since
    starts = s.log("trainer").count("[podkit:run] starting trainer") - 2
    assert starts == 2, s.log("trainer")[-5000:]
    # Step 1 or 2: the rollout thread reads batch 2 ahead, and whether step 2's rollouts were all in before the
    # read failed is a race inside AReaL (run 24 saw step 2). Every run after the first fails at that step.
    assert re.search(r"failed once after step [12] without a new step", stopped["message"]), stopped
    assert "ValueError: invalid literal for int() with base 10: 'n/a'" in stopped["message"], stopped
    line = (checkout / "train.py").read_text().splitlines().index(
        '                "answer": [str(int(a)) for a in batch["answer"]]}') + 1
    doc = json.loads(s.podkit("doctor", "--json").stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "trainer_crash_loop")
    assert any(e.startswith("ValueError: invalid literal for int() with base 10: 'n/a' at "
                            f"{checkout / 'train.py'}:{line}") for e in finding["evidence"]), finding
    assert not any("ChildFailedError" in e for e in finding["evidence"]), finding
    health = s.podkit("status", "--health")
    assert health.returncode == 1 and "crash-loop" in health.stdout, health.stdout
    print(f"a bad row every run: {starts} starts, stopped after {took:.0f}s; doctor: {finding['evidence'][1]}")
    # The run's page in a real browser (loopback: no login): the failure in the script's own words, the steps
    # it trained drawn.
    assert CHROMIUM, "no chromium: `make sysdeps` installs Debian's (as root)"
    dom = browser(tmp_path / "chromium", "--dump-dom", f"http://127.0.0.1:{s.env['PODKIT_PAGE_PORT']}/")
    assert "ValueError: invalid literal for int() with base 10: 'n/a'" in dom, dom[-3000:]
    assert re.search(r'<polyline class="line" data-points="[1-9]', dom), "the steps it trained, drawn"

    # A reward function that raises on every call (it reads a field this data names otherwise), in AReaL's
    # rollout thread: AReaL logs each failed episode and tries the next, for ever, without a step.
    # trainer.max_episode_failures (8 here) in a row stop the trainer with the reward's own exception, named
    # at its line (AReaL runs it in a process pool: the traceback comes back as text), and the loop bound
    # counts it: one start without a new step (trainer.max_failures 1), then stopped for good.
    (checkout / "train.py").write_text((EXAMPLE / "train.py").read_text())
    (checkout / "data" / "train.jsonl").write_text((EXAMPLE / "data" / "train.jsonl").read_text())
    reward = (EXAMPLE / "my_reward.py").read_text().replace(
        "    found = BOXED.findall(completions)",
        '    expected = _data["solution"]  # this data names it "answer"\n    found = BOXED.findall(completions)')
    assert reward != (EXAMPLE / "my_reward.py").read_text()
    (checkout / "my_reward.py").write_text(reward)
    line = next(i for i, ln in enumerate(reward.splitlines(), 1) if '_data["solution"]' in ln)
    logged = s.log("trainer").count("Workflow execution failed")
    since = time.time()
    s.rpc().supervisor.startProcess("trainer", False)
    stopped = wait_for(lambda: (st := s.progress().get("stopped") or {}).get("by") == "crash-loop"
                       and st.get("time", 0) > since and st, 400, interval=1, what="the loop bound on failed episodes")
    assert "KeyError: 'solution'" in stopped["message"], stopped
    assert f"{checkout / 'my_reward.py'}:{line}" in stopped["message"], stopped
    # One start: no new step in it (trainer.max_failures 1)
    assert s.log("trainer").count("[podkit:run] starting trainer") - 2 - starts == 1, s.log("trainer")[-5000:]
    ep = s.progress()["episodes"]
    assert ep["tripped"] and ep["in_a_row"] >= 8 and ep["succeeded"] == 0, ep
    # Bounded: the start stops after 8 in a row (and those already in flight), not millions of lines.
    failed = s.log("trainer").count("Workflow execution failed") - logged
    assert 8 <= failed <= 40, failed
    doc = json.loads(s.podkit("doctor", "--json").stdout)
    finding = next(f for f in doc["findings"] if f["id"] == "episodes_failing")
    assert finding["severity"] == "problem" and "in a row" in finding["title"], finding
    assert finding["evidence"][0].startswith(f"KeyError: 'solution' at {checkout / 'my_reward.py'}:{line}"), finding
    assert "rollout episodes that failed in your workflow" in s.podkit("status").stdout
    print(f"a reward that always raises: 1 start, {failed} failed episodes logged; doctor: {finding['title']}")

    assert s.stop() == 0


# examples/my-repo's workflow, made to await for ever once hang.flag is in the checkout (its cwd).
HANGING_WORKFLOW = (EXAMPLE / "my_workflow.py").read_text().replace(
    "from areal.workflow.rlvr import RLVRWorkflow\n",
    "import asyncio\nimport os\n\nfrom areal.workflow.rlvr import RLVRWorkflow\n") + """
    async def arun_episode(self, engine, data):
        if os.path.exists("hang.flag"):
            open("hung.flag", "w").close()
            await asyncio.Event().wait()  # never answers
        return await super().arun_episode(engine, data)
"""


def test_an_entry_that_is_not_in_the_checkout_waits_in_safe_mode_at_boot(rehearsal, tmp_path):
    """Looked for after the sync (preflight cannot: the checkout is not there yet), before supervisord."""
    remote = example_remote(tmp_path)
    s = rehearsal(**repo_env(remote, PODKIT_TRAINER_ENTRY="trian.py"))
    s.procs.workspaces.add(str(s.workspace))
    s.proc = s.procs.spawn([PYTHON, "-m", "podkit", "boot"], env=s.env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    safe = wait_for(lambda: records.SAFE_MODE.read(s.workspace / ".podkit"), 90, what="safe mode")
    assert "trainer.entry" in safe["message"] and "trian.py" in safe["message"], safe
    assert safe["hint"], safe
    time.sleep(2)
    assert s.proc.poll() is None  # PID 1 waits, explaining itself: no restart loop
    assert (s.workspace / "repo" / "train.py").exists()  # the checkout is synced and kept
    assert s.stop() == 0
