"""The user's own code, in-process: the bootstrap and podkit's hooks run under AReaL's Python without a pod
(no supervisord, no server, no trainer steps), so these share no stack and run beside the real-trainer
lane. The real trainer on the same code: tests/trainer/test_your_code.py. With them, AReaL's code that podkit
patches, checked in-process (the rehearsals run it: tests/trainer/test_rehearsal.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from test_your_code import VENDORED_AREAL

from areal_stack import CPU_OVERRIDES, EXAMPLE, JUDGED, PYTHON, areal_batch, areal_run
from conftest import ROOT, free_port

pytestmark = [pytest.mark.rehearsal, pytest.mark.timeout(300),
              pytest.mark.skipif(not PYTHON and not os.environ.get("CI"),
                                 reason="no AReaL environment: run `make test` (or set AREAL_PYTHON="
                                        "$(sh rehearse/env.sh))")]


EXAMPLE_YAML = ("import sys; sys.path.insert(0, '.'); from train import MyConfig; "
                "from areal.api.cli_args import load_expr_config; "
                "c, _ = load_expr_config(sys.argv[1:], MyConfig); "
                "print('|'.join(map(str, (type(c).__name__, c.hint, c.train_dataset.path, c.train_dataset.batch_size, "
                "c.actor.dtype))))")
WORKFLOW_DEP = ("import json, sys; sys.path[:0] = [sys.argv[1]]\n"
                "from podkit.areal.hooks import _import_error\n"
                "print(json.dumps([_import_error('mywf.W'), _import_error('mywff.W')]))")


@pytest.fixture(scope="module")
def areal_reads(tmp_path_factory) -> dict:
    """What the tests below read of AReaL's code, in one AReaL process (areal_stack.BATCH): the patched code's
    hashes and the trainer's LoRA refusal as AReaL ships them first, the patches applied again and again last."""
    tmp = tmp_path_factory.mktemp("areal-reads")
    over = [*CPU_OVERRIDES.split(), f"++cluster.fileroot={tmp}", f"++stats_logger.fileroot={tmp}"]
    lines = (ROOT / "configs/areal/grpo-cpu.yaml").read_text().splitlines()
    at = lines.index("rollout:") + 1
    lines.insert(at, "  max_concurent_rollouts: 8")
    (tmp / "config.yaml").write_text("\n".join(lines) + "\n")
    (tmp / "mywf.py").write_text("import not_installed_dep  # the workflow's own dependency\n\nclass W:\n    pass\n")
    got = areal_batch([("facts", AREAL_FACTS, [], None, {}),
                       ("yaml", EXAMPLE_YAML, ["--config", "config.yaml", *over], str(EXAMPLE), {"RANK": "1"}),
                       ("misspelt", MISSPELT, [str(tmp / "config.yaml")], None, {}),
                       ("episodes", EPISODES_SCRIPT, [], None, {}),
                       ("workflow-dep", WORKFLOW_DEP, [str(tmp)], str(tmp), {}),
                       ("twice", PATCHED_TWICE + "print(json.dumps(twice))", [], None, {})])
    for name, r in got.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    return {"tmp": tmp, "misspelt_line": at + 1,
            **{name: json.loads(r.stdout.strip().splitlines()[-1]) if name != "yaml" else
               r.stdout.strip().splitlines()[-1] for name, r in got.items()}}


def test_the_example_repos_yaml_loads_into_its_own_config_class_through_areals_loader(areal_reads):
    """AReaL's own loader is the judge of the repo's YAML, with the CPU overrides on top."""
    got = areal_reads["yaml"]
    assert got == "MyConfig|Please put your final answer within \\boxed{}.|data/train.jsonl|4|float32", got


def test_the_bootstrap_runs_a_module_function_entry_from_the_checkout_with_nothing_of_podkits_shadowing(tmp_path):
    """trainer.entry package.module:function is called with argv, cwd the checkout, the checkout first on
    sys.path: its own `launch.py` (a name podkit/areal also has) is the one imported, and its vendored
    areal/ is not (the installed AReaL is, named in a warning). A script that never calls PPOTrainer.train
    is told that no steps were recorded."""
    repo = tmp_path / "ws" / "repo"
    (repo / "mytrain").mkdir(parents=True)
    (repo / "areal").mkdir()
    (repo / "areal" / "__init__.py").write_text(VENDORED_AREAL)
    (repo / "launch.py").write_text("WHO = 'the repo'\n")
    (repo / "mytrain" / "__init__.py").write_text("")
    (repo / "mytrain" / "cli.py").write_text(
        "import json, os, sys\n"
        "import areal, launch\n"
        "def main(argv):\n"
        "    json.dump({'argv': argv, 'cwd': os.getcwd(), 'launch': launch.WHO, 'areal': areal.__file__,\n"
        "               'path': sys.path},\n"
        "              open(os.environ['OUT'], 'w'))\n")
    out = tmp_path / "out.json"
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_TRAINER_ENTRY": "mytrain.cli:main", "PODKIT_REPO_URL": "https://example.invalid/r.git",
           "PODKIT_RUN_DIR": str(tmp_path / "run"), "OUT": str(out), "RANK": "0"}
    r = areal_run(str(ROOT / "src" / "podkit" / "areal" / "bootstrap.py"), "--config", "x.yaml", "a=1",
                  env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["argv"] == ["--config", "x.yaml", "a=1"] and got["cwd"] == str(repo), got
    assert got["launch"] == "the repo" and "site-packages" in got["areal"], got
    assert got["path"][0] == str(repo) and str(ROOT / "src" / "podkit" / "areal") not in got["path"], got["path"]
    said = r.stdout + r.stderr
    assert f"{repo / 'areal'} is not used" in said and "without calling PPOTrainer.train" in said, said[-2000:]


# The bootstrap in one process, entry after entry (AReaL imported once): each failure before training stops
# the trainer once, in the script's own words.
WALK = """
import json, os, sys
sys.path.insert(0, os.environ["SRC"])
from podkit import records
from podkit.areal import bootstrap
out = []
for entry in sys.argv[1:]:
    os.environ["PODKIT_TRAINER_ENTRY"] = entry
    rc = bootstrap.main(["--config", "x.yaml"])
    out.append({"entry": entry, "rc": rc, **records.PROGRESS.read(os.environ["PODKIT_WORKSPACE"] + "/.podkit")})
print(json.dumps(out))
"""


def test_an_exception_before_training_is_the_scripts_own_named_with_its_line_and_a_hint_that_fits(tmp_path):
    """A `main` that takes no argument, a data field named differently, a hub dataset the pod cannot reach, a
    data file that is not in the checkout, a script that never trains (returning, or by sys.exit(0)): each
    stops once (exit 2, or 0 for the script that ended), recorded with the exception, the file and line in
    the user's code, and a hint for that kind."""
    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / "noargs.py").write_text("import sys\n\n\ndef main():\n    print('never called')\n")
    (repo / "data.jsonl").write_text('{"problem": "1+1", "answer": 2}\n{"problem": "2+2", "answer": 4}\n')
    (repo / "rows.py").write_text("from datasets import load_dataset\n\n"
                                  "rows = load_dataset('json', data_files='data.jsonl', split='train')\n"
                                  "rows = rows.map(lambda r: {'prompt': r['question']})\n")
    (repo / "hub.py").write_text("from datasets import load_dataset\n\n"
                                 "train = load_dataset('openai/gsm8k', 'main', split='train')\n")
    (repo / "never.py").write_text("def main(argv):\n    pass\n")
    (repo / "exits.py").write_text("import sys\n\n\ndef main():\n    return 0\n\n\nsys.exit(main())\n")
    (repo / "nofile.py").write_text("from datasets import load_dataset\n\n"
                                    "rows = load_dataset('json', data_files='data/missing.jsonl', split='train')\n")
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_REPO_URL": "https://example.invalid/r.git", "PODKIT_RUN_DIR": str(tmp_path / "run"),
           "RANK": "0", "SRC": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    r = areal_run("-c", WALK, "noargs:main", "rows.py", "nofile.py", "never.py", "exits.py", "hub.py", env=env,
                  cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    noargs, rows, nofile, never, exits, hub = (p["stopped"] for p in json.loads(r.stdout.strip().splitlines()[-1]))
    assert noargs["by"] == "config-error" and f"{repo / 'noargs.py'}:4" in noargs["message"], noargs
    assert "TypeError: main() takes 0 positional arguments but 1 was given" in noargs["message"], noargs
    assert "podkit calls main(argv)" in noargs["hint"] and "def main(argv=None)" in noargs["hint"], noargs
    assert f"{repo / 'rows.py'}:4" in rows["message"] and "KeyError: 'question'" in rows["message"], rows
    assert "`r` has no field 'question'; its fields are problem, answer" in rows["hint"], rows
    assert f"{repo / 'hub.py'}:3" in hub["message"] and "ConnectionError" in hub["message"], hub
    assert "could not fetch dataset 'openai/gsm8k' from the hub" in hub["hint"] and "HF_HOME=" in hub["hint"], hub
    assert never["by"] == "never-trained" and "never.py ended without calling PPOTrainer.train" in never["message"]
    assert exits["by"] == "never-trained" and "exits.py ended without" in exits["message"], "sys.exit(0) too"
    assert nofile["by"] == "config-error" and f"{repo / 'nofile.py'}:3" in nofile["message"], nofile
    assert "FileNotFoundError" in nofile["message"] and "missing.jsonl" in nofile["message"], nofile
    # Each rank's own record, for doctor: the exception and the user's frame, not torchrun's wrapper (the last
    # entry's).
    err = json.loads((tmp_path / "run" / "trainer-error-0.json").read_text())
    assert err["type"] == "ConnectionError" and err["where"] == f"{repo / 'hub.py'}:3", err


def test_a_workflow_whose_own_dependency_is_missing_is_told_apart_from_a_wrong_import_path(areal_reads):
    dep, path = areal_reads["workflow-dep"]
    assert "No module named 'not_installed_dep'" in dep[0] and "imports not_installed_dep, which is not installed" \
        in dep[1], dep
    assert "fix the import path" in path[1], path


AREAL_FACTS = """
import inspect, json
from podkit.areal import patches as p
from areal.trainer.rl_trainer import PPOTrainer
print(json.dumps({"version": p.areal_version(), "hashes": p.check(), "pinned": p.PINNED,
                  "lora": inspect.getsource(PPOTrainer._init_rollout)}))
"""


def test_patches_still_match_the_areal_they_were_written_for(areal_reads):
    got = areal_reads["facts"]
    assert got["version"] == "1.0.4"
    assert got["hashes"] == got["pinned"], "AReaL code that podkit patches changed: re-read areal_patches.py"


def test_areal_still_refuses_lora_under_torchrun_as_the_boots_lora_refusal_says(areal_reads):
    """checks._lora refuses actor.use_lora at boot because AReaL's trainer refuses it in SPMD mode (podkit's
    launch sets AREAL_SPMD_MODE=1). When an AReaL upgrade trains LoRA there, this fails: drop the refusal."""
    from podkit import config
    from podkit.areal import checks, command

    cfg = config.load(ROOT / "configs/cpu-rehearsal.yaml", environ={})
    assert command.environment(cfg, {})["AREAL_SPMD_MODE"] == "1"
    src = areal_reads["facts"]["lora"]
    assert checks.AREAL_LORA_REFUSAL in src and "not is_single_controller()" in src, src[:2000]


PATCHED_TWICE = """
import json
from podkit.areal import patches as p
from areal.engine.fsdp_engine import FSDPEngine
from areal.engine.sglang_remote import SGLangBackend
import areal.infra.remote_inf_engine as rie

originals = (FSDPEngine._prepare_mb_list, SGLangBackend.build_disk_weight_update_requests, rie.arequest_with_retry)
p.apply(api_key="k", ride_out_s=5.0)
for again in (p.packed_mask, p.version_weight_updates, lambda: p.apply(api_key="k", ride_out_s=5.0)):
    again()
now = (FSDPEngine._prepare_mb_list, SGLangBackend.build_disk_weight_update_requests, rie.arequest_with_retry)


class Engine:
    def step(self):
        return 1


installed = p.patch_once(Engine, "step", lambda original: lambda self: original(self) + 1)
again = p.patch_once(Engine, "step", lambda original: lambda self: original(self) + 10)
twice = {"helper": [installed is Engine.step, again, Engine().step()],
         "layers": [[hasattr(f, m) for m in ("_podkit", "_podkit_ride_out", "_podkit_api_key")]
                    for f in (now[0], now[1], now[2], now[2].__wrapped__)],
         "originals": [now[0].__wrapped__ is originals[0], now[1].__wrapped__ is originals[1],
                       now[2].__wrapped__.__wrapped__ is originals[2]]}
"""


def test_areals_patches_wrap_once_however_often_they_are_applied(areal_reads):
    """Each patch goes through patches.patch_once: applied again in the same process it wraps nothing
    twice; the request function carries the ride-out and API-key wrappers, each once, around AReaL's own."""
    got = areal_reads["twice"]
    assert got["layers"] == [[True, False, False], [True, False, False], [False, False, True],
                             [False, True, False]], got
    assert all(got["originals"]), got
    assert got["helper"] == [True, None, 2], got


def test_packed_micro_batches_get_per_sequence_attention_with_sdpa_and_eager():
    r = areal_run(str(ROOT / "tests" / "rehearsal" / "packed_mask.py"), str(free_port()))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for impl in ("sdpa", "eager"):
        assert max(got[impl]["patched"]) < 1e-5, got
        # Without the patch the second and third packed sequences see the first (the bug is real here).
        assert min(got[impl]["unpatched"][1:]) > 1e-2, got


def test_the_cpu_config_differs_from_the_a40_one_only_where_marked():
    a40 = (ROOT / "configs/areal/grpo-a40-1gpu.yaml").read_text().splitlines()
    cpu = (ROOT / "configs/areal/grpo-cpu.yaml").read_text().splitlines()
    body = lambda lines: [ln for ln in lines if not ln.startswith("#")]  # noqa: E731
    a40, cpu = body(a40), body(cpu)
    assert len(a40) == len(cpu)
    changed = [(a, c) for a, c in zip(a40, cpu, strict=True) if a != c]
    assert changed and all("# CPU:" in c for _, c in changed), changed
    assert len(changed) <= 10


GENERATION_HOLD = """
import asyncio, json, sys, threading, time, urllib.request
import aiohttp
from podkit.areal import patches as p
from podkit.areal.reattach import GENERATION as gen
import areal.infra.remote_inf_engine as rie
from areal.infra.remote_inf_engine import RemoteInfEngine

addr, weights = sys.argv[1], sys.argv[2]
p.apply(ride_out_s=20.0)
gen.active = True
engine = RemoteInfEngine.__new__(RemoteInfEngine)
engine.lock = threading.Lock()
engine.set_version(3)  # what the step loop calls after its push: the trainer pushed version 3

def push():  # rank 0's re-push, 1.5 s after the restart
    time.sleep(1.5)
    body = json.dumps({"model_path": weights, "weight_version": "3"}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{addr}/update_weights_from_disk", data=body,
                           headers={"Content-Type": "application/json"}), timeout=10).read()

async def generate():
    async with aiohttp.ClientSession() as session:
        return await rie.arequest_with_retry(session=session, addr=addr, endpoint="/generate",
                                             payload={"text": "1+1=", "sampling_params": {"max_new_tokens": 4}},
                                             method="POST", max_retries=2, timeout=30)

threading.Thread(target=push, daemon=True).start()
t0 = time.monotonic()
answer = asyncio.run(generate())
print(json.dumps({"version": answer["meta_info"]["weight_version"], "took": time.monotonic() - t0,
                  "engine": gen.version}))
"""


def test_generation_after_a_push_is_held_until_the_trainers_weights_are_served_again(procs, tmp_path):
    """AReaL's own request function, patched (patches.ride_out_restarts), against the stand-in for SGLang
    serving the base weights, as a restarted server does: the answer from the base weights is dropped and
    the request sent again once version 3 is served (areal/reattach.py; the rehearsal runs the whole path)."""
    import subprocess
    import sys

    from conftest import smoke_env, wait_for
    from podkit.judge.health import probe

    port = free_port()
    procs.spawn([sys.executable, "-m", "podkit", "run", "sglang"],
                env=smoke_env(tmp_path / "ws", port, PODKIT_INFERENCE_STARTUP_DELAY_S="0"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: probe("127.0.0.1", port), 20, what="the stand-in")
    weights = tmp_path / "weight_update_v3"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(b"w" * 1024)
    r = areal_run("-c", GENERATION_HOLD, f"127.0.0.1:{port}", str(weights), timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"] == "3" and got["engine"] == 3 and got["took"] >= 1.4, got
    assert "inference answered from the base weights (it restarted) after this trainer pushed version 3" in r.stdout


RIDE_OUT = """
import asyncio, json, sys, threading, time
import aiohttp
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from podkit.areal import patches as p
import areal.infra.remote_inf_engine as rie

port = int(sys.argv[1])
p.apply(ride_out_s=20.0)
up = {}

class Answer(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"success": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass

def come_back():  # a server that was down comes back 3 s in
    time.sleep(3.0)
    server = ThreadingHTTPServer(("127.0.0.1", port), Answer)
    up["at"] = time.monotonic()
    server.serve_forever()

async def one(delay):
    await asyncio.sleep(delay)
    async with aiohttp.ClientSession() as session:
        await rie.arequest_with_retry(session=session, addr=f"127.0.0.1:{port}", endpoint="/pause_generation",
                                      payload={}, method="POST", max_retries=3, timeout=10)
    return time.monotonic()

async def main():
    return await asyncio.gather(*(one(d) for d in (0.0, 0.4, 0.8, 1.2, 1.6)))

threading.Thread(target=come_back, daemon=True).start()
print(json.dumps([end - up["at"] for end in asyncio.run(main())]))
"""


def test_requests_riding_out_a_restart_go_on_within_a_quarter_second_of_the_server_being_back(tmp_path):
    """The trainer's own requests (its push, pause and continue among them) while inference restarts: AReaL's
    retries waited 1 s between tries and podkit's ride-out 2 s more, so the push came up to 2 s after the server
    was back (issue 47's lost re-attach speed). Five requests, started at different moments of the outage, each
    go on within a poll (patches.RIDE_OUT_POLL_S) of the server's return."""
    r = areal_run("-c", RIDE_OUT, str(free_port()), timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lags = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(lag >= 0 for lag in lags) and max(lags) < 0.75, lags


MISSPELT = """
import json, sys
from areal.api.cli_args import GRPOConfig, load_expr_config
from podkit.areal import hooks
argv = ["--config", sys.argv[1]]
try:
    load_expr_config(argv, GRPOConfig)
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "hint": hooks.unknown_key(e, argv)}))
"""


def test_a_misspelt_key_in_the_areal_yaml_is_named_at_its_line_with_the_field_it_may_have_meant(areal_reads):
    """AReaL's own loader refuses the key (omegaconf's ConfigKeyError, full_key only); the refusal's hint adds
    the YAML's file and line and the nearest field of the config class."""
    got, yaml_path = areal_reads["misspelt"], areal_reads["tmp"] / "config.yaml"
    assert got["type"] == "ConfigKeyError", got
    assert got["hint"] == (f"{yaml_path}:{areal_reads['misspelt_line']} sets rollout.max_concurent_rollouts: "
                           "InferenceEngineConfig has no 'max_concurent_rollouts'; did you mean "
                           "'max_concurrent_rollouts'?; "), got


EPISODES_SCRIPT = """
import asyncio, json, logging, types
from areal.infra import workflow_executor as we
from podkit.areal import episodes as E

tripped = []
ex = we.WorkflowExecutor.__new__(we.WorkflowExecutor)
ex.config = types.SimpleNamespace(check_trajectory_format=False, dump_to_file=False, enable_rollout_tracing=False)
ex._expected_trajectory_keys = None
ex._staleness_manager = types.SimpleNamespace(on_rollout_rejected=lambda: None, on_rollout_accepted=lambda: None)
ex.inference_engine, ex.logger = None, logging.getLogger("podkit-test")
ex._dispatcher = types.SimpleNamespace(_set_thread_exception=lambda e: tripped.append(f"{type(e).__name__}: {e}"))
ex.logger.disabled = True  # AReaL logs each failure with its traceback
records = []
E.EPISODES.progress = types.SimpleNamespace(update=lambda **kw: records.append(kw["episodes"]))
E.WRITE_EVERY_S = 0.0
create = E.watch(we.WorkflowExecutor._create_workflow_task)


class W:
    def __init__(self, out):
        self.out = out

    async def arun_episode(self, engine, data):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


def run(out, accept=None, n=1):
    for i in range(n):
        asyncio.run(create(ex, we._RolloutTaskInput(task_id=i, data={}, workflow=W(out), should_accept_fn=accept))())


def state():
    e = E.EPISODES
    return [e.failed, e.succeeded, e.in_a_row, e.tripped]


def reject_all(traj):
    return False


def broken(traj):
    raise ValueError("my filter broke")


E.EPISODES.limit, E.EPISODES.window_s = 3, 3600.0
out = {}
run(None, n=2)                                  # the workflow's own rejection: the code ran
run({"a": 1}, accept=reject_all)                # rejected by should_accept_fn: the code ran
out["rejections"] = state()
run(KeyError("solution"), n=2)
run({"a": 1})                                   # a trajectory AReaL used
out["reset"] = state()
run([1, 2], n=2)                                # not a dict: AReaL's assert, after arun_episode returned
run({"a": 1}, accept=broken)
out["window"] = state() + [list(tripped)]       # 3 in a row, but within the window: no stop yet
E.EPISODES.window_s = 0.0
run(KeyError("solution"))
out["tripped"] = state() + [list(tripped)]
run(KeyError("solution"))                       # written after the trip: still says tripped
out["records"] = [r["tripped"] for r in records[-2:]]
out["last"] = records[-1]["last"]
ex.inference_engine = types.SimpleNamespace(_engine=types.SimpleNamespace(addresses=["127.0.0.9:30000"]))


def request_error(addr):  # AReaL's request helper's words (http.py), after a prompt of 20000 tokens
    return RuntimeError(f"Failed after 5 retries each. Payload: {{'input_ids': {list(range(20000))}}}. Addr: {addr}. "
                        "Endpoint: /generate. Last error: ClientConnectorError(ConnectionKey(host='x', port=1))")


run(request_error("127.0.0.9:30000"), n=2)      # the engine's own server down: inference's
run(request_error("10.0.0.1:8000"))             # a judge the workflow calls: the workflow's
run(request_error("127.0.0.9:30000"))
r = records[-1]
out["servers"] = [r["unreachable_failed"], r["unreachable_in_a_row"], r["unreachable"], r["last"]["type"]]
print(json.dumps(out))
"""


def test_episodes_are_counted_as_the_users_code_did_in_areals_own_task_function(areal_reads):
    """AReaL's real _create_workflow_task, wrapped as patches.watch_episodes wraps it: the workflow's own None and
    should_accept_fn's rejection are the code working; an exception from either, or a trajectory AReaL cannot use
    (checked after arun_episode returned), is a failure; a success ends a streak; the streak must also span
    trainer.episode_failure_window_s; the trip hands the last exception over once, and the record keeps it."""
    got = areal_reads["episodes"]
    assert got["rejections"] == [0, 3, 0, False], got
    assert got["reset"] == [2, 4, 0, False], got
    assert got["window"] == [5, 4, 3, False, []], got
    assert got["tripped"] == [6, 4, 4, True, ["KeyError: 'solution'"]], got
    assert got["records"] == [True, True] and got["last"]["type"] == "KeyError", got
    # Episodes that never reached the engine's own server are inference's, counted apart; a judge's address is not.
    assert got["servers"][:3] == [3, 1, "inference unreachable at 127.0.0.9:30000 (/generate: ClientConnectorError)"]
    assert got["servers"][3] == "RuntimeError", got["servers"]  # the judge's failure, the workflow's last (was KeyError)


def test_the_misspelt_keys_line_is_found_in_its_own_section_not_the_first_with_that_name():
    from podkit.areal.hooks import yaml_line

    lines = ["experiment_name: x", "actor:", "  lr: 1", "  optimizer:", "    lr: 2", "ref:", "  # a comment",
             "  lr: 3", "  scheduling_spec:", "    - task_type: worker", "      lr: 9", "rollout:",
             "  max_concurent_rollouts: 8"]
    assert [yaml_line(lines, p.split(".")) for p in ("ref.lr", "actor.lr", "actor.optimizer.lr",
                                                     "rollout.max_concurent_rollouts", "rollout.lr")] == \
        [8, 3, 5, 13, None]


def test_an_episode_that_could_not_reach_inference_is_named_as_the_server_not_the_workflow(tmp_path):
    """AReaL's own request function (areal/infra/utils/http.py) against a port nothing listens on: the
    RuntimeError it raises, wrapped as AReaL's rollout thread hands it to the trainer, is named as inference
    unreachable at that address, with a hint that it is the server, not the user's code; one that got an
    answer and failed otherwise (an HTTP error) is not."""
    port = free_port()
    script = f"""
import asyncio, http.server, json, threading
from areal.infra.utils.http import arequest_with_retry
from podkit.judge import failure

async def ask(addr):
    try:
        await arequest_with_retry(addr, "/generate", {{"text": "Addr: 1.2.3.4:5. Endpoint: /x. Last error: ClientOSError"}},
                                  max_retries=2, retry_delay=0.1, timeout=5)
    except RuntimeError as e:
        return e

class Failing(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.send_response(500)
        self.end_headers()

    def log_message(self, *a):
        pass


answering = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
threading.Thread(target=answering.serve_forever, daemon=True).start()
down = asyncio.run(ask("127.0.0.1:{port}"))
answered = asyncio.run(ask(f"127.0.0.1:{{answering.server_address[1]}}"))
wrapped = RuntimeError("Background thread failed")  # AReaL's dispatcher: raise ... from the thread's exception
wrapped.__cause__ = down
try:  # the user's code failing while it handled one: its own
    try:
        raise down
    except RuntimeError:
        {{}}["solution"]
except KeyError as e:
    handled = e
at = failure.unreachable_at
print(json.dumps([at(down), at(wrapped), failure.describe(wrapped, ["{tmp_path}"])["hint"], at(answered), str(answered)[-600:],
                  at(handled), at(RuntimeError("x"))]))
"""
    r = areal_run("-c", script, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    direct, wrapped, hint, answered, said, handled, other = json.loads(r.stdout.strip().splitlines()[-1])
    assert direct == wrapped == {"addr": f"127.0.0.1:{port}", "endpoint": "/generate", "error": "ClientConnectorError"}
    assert f"nothing answered at 127.0.0.1:{port} (/generate: ClientConnectorError)" in hint, hint
    assert "not your code" in hint and "judge" in hint, hint
    assert answered is None and "Last error: ClientResponseError" in said, said  # an HTTP error is an answer
    assert handled is None and other is None


# Runs of the bootstrap, one per [entry, argv, env] of argv[1] (a JSON list), in one process: what each raised
# (what may pass goes to the loop bound), its record and its rank's error record.
RUNS = """
import json, os, sys
sys.path.insert(0, os.environ["SRC"])
from podkit import records
from podkit.areal import bootstrap
out = []
for entry, argv, env in json.loads(sys.argv[1]):
    os.environ.update(env, PODKIT_TRAINER_ENTRY=entry)
    print("starting", flush=True)
    try:
        rc, raised = bootstrap.main(argv), None
    except BaseException as e:
        rc, raised = None, type(e).__name__
    ws = os.environ["PODKIT_WORKSPACE"]
    err = records.Record("trainer-error-0.json", records.ERROR).read(os.environ["PODKIT_RUN_DIR"])
    out.append({"rc": rc, "raised": raised, "stopped": records.PROGRESS.read(ws + "/.podkit").get("stopped"),
                "error": err})
    for k in env:
        os.environ.pop(k)
print(json.dumps(out))
"""


def test_what_may_pass_goes_to_the_loop_bound_a_missing_files_key_is_named_and_a_sigterm_before_train_ends_at_once(
        tmp_path):
    """A refused connection before training is raised for the loop bound (its back-off, then a retry), named by
    what it could not reach; a data file the loaded config names is named by its key as well as the line that
    read it; in a rehearsal, a hub dataset's fix is an override, not the volume; and a SIGTERM while the script is
    still in its own code ends the rank within seconds, as a stop, with nothing in flight."""
    import signal
    import subprocess

    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    port = free_port()  # nothing listens: the data mirror is down
    (repo / "mirror.py").write_text(f"import urllib.request\n\n"
                                    f"urllib.request.urlopen('http://127.0.0.1:{port}/data.jsonl', timeout=5)\n")
    (repo / "cfgdata.py").write_text(
        "import sys\nfrom datasets import load_dataset\nfrom areal.api.cli_args import GRPOConfig, load_expr_config\n\n"
        "config, _ = load_expr_config(sys.argv[1:], GRPOConfig)\n"
        "rows = load_dataset('json', data_files=config.train_dataset.path, split='train')\n")
    (repo / "hub.py").write_text("from datasets import load_dataset\n\n"
                                 "train = load_dataset('openai/gsm8k', 'main', split='train')\n")
    (repo / "slow.py").write_text("import time\n\nprint('loading', flush=True)\ntime.sleep(120)  # data to prepare\n")
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"),
           "PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_REPO_URL": "https://example.invalid/r.git",
           "PODKIT_RUN_DIR": str(tmp_path / "run"), "RANK": "0", "SRC": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
           "PYTHONPATH": str(ROOT / "src")}

    yaml = str(ROOT / "configs" / "areal" / "grpo-cpu.yaml")
    runs = [["mirror.py", [], {}],
            ["cfgdata.py", ["--config", yaml, "train_dataset.path=data/missing.jsonl", "experiment_name=e",
                            "trial_name=t", f"cluster.fileroot={tmp_path / 'fr'}", f"recover.fileroot={tmp_path / 'fr'}"],
             {}],
            ["hub.py", [], {"_PODKIT_PLACE": "rehearse"}]]
    r = areal_run("-c", RUNS, json.dumps(runs), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    mirror, data, hub = json.loads(r.stdout.strip().splitlines()[-1])
    assert mirror["raised"] == "URLError" and mirror["error"]["transient"] == f"could not reach 127.0.0.1:{port}", \
        mirror
    assert (mirror["stopped"] or {}).get("by") != "config-error", "a network error is not the script's config"
    stopped = data["stopped"]
    assert stopped["by"] == "config-error" and f"{repo / 'cfgdata.py'}:6" in stopped["message"], stopped
    assert "train_dataset.path names a file that is not there" in stopped["hint"], stopped
    assert "OVERRIDES='train_dataset.path=" in hub["stopped"]["hint"] and "make rehearse" in hub["stopped"]["hint"]
    assert "push" not in hub["stopped"]["hint"], hub["stopped"]

    def sigterm_while_loading(forwarded: bool) -> tuple[float, dict]:
        p = subprocess.Popen([PYTHON, "-c", RUNS, json.dumps([["slow.py", [], {}]])], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert next(ln for ln in p.stdout if ln.strip() == "loading")  # in the script's own code: before train()
            if forwarded:  # as the launcher notes it before it hands the stop to the ranks
                from podkit.judge import ending

                ending.FORWARDED.write(tmp_path / "run", {"time": time.time()}, mode=0o600)
            t0 = time.time()
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
        return time.time() - t0, json.loads(out.strip().splitlines()[-1])[0]

    # torchrun's own SIGTERM (another rank failed): the rank ends, and says nothing of a stop: the failed rank's
    # record is how the run ended.
    # "at once": not after the script's 120 s of loading (a torch interpreter's own end takes seconds here)
    took, teardown = sigterm_while_loading(False)
    assert took < 20 and teardown["rc"] == 1 and (teardown["stopped"] or {}).get("by") != "SIGTERM", teardown
    took, slow = sigterm_while_loading(True)
    assert took < 20 and slow["rc"] == 0 and slow["raised"] is None, (took, slow)
    assert slow["stopped"]["by"] == "SIGTERM" and "before training started" in slow["stopped"]["message"], slow


def test_every_way_out_of_a_script_before_training_is_recorded_and_judged_by_its_cause(tmp_path):
    """torch's CheckpointException (a BaseException), a real full disk (/dev/full), sys.exit(3), someone's
    SIGINT, and the usual `SIGTERM -> sys.exit(0)` handler under someone's kill of the rank: each is
    recorded by the bootstrap and named by its cause, none as "your script never trained" or a crash loop; a
    KeyboardInterrupt the script raised itself, with no SIGINT, is its failure (a stray stop is never counted)."""
    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / "ckpt.py").write_text(  # a recover checkpoint cut in the middle of its save, loaded as AReaL does (DCP)
        "import os, torch\nimport torch.distributed.checkpoint as dcp\n\nd = os.environ['CKPT']\n"
        "dcp.save({'w': torch.zeros(64, 64)}, checkpoint_id=d)\n"
        "open(os.path.join(d, '__0_0.distcp'), 'r+b').truncate(100)\n"
        "dcp.load({'w': torch.zeros(64, 64)}, checkpoint_id=d)\n")
    (repo / "ckptfull.py").write_text(  # the same save on a full volume: the volume's, not the checkpoint's
        "import os, torch\nimport torch.distributed.checkpoint as dcp\n\n"
        "dcp.save({'w': torch.zeros(256, 256)}, checkpoint_id=os.environ['FULL'] + '/recover')\n")
    (repo / "full.py").write_text("with open('/dev/full', 'w') as f:\n    f.write('config: yaml')\n")
    (repo / "exit3.py").write_text("import sys\n\nsys.exit(3)\n")
    (repo / "ctrlc.py").write_text("import os, signal, time\n\n"
                                   "os.kill(os.getpid(), signal.SIGINT)  # someone's kill -INT of this rank\n"
                                   "time.sleep(5)\n")
    (repo / "ownki.py").write_text("raise KeyboardInterrupt  # the script's own: no SIGINT came\n")
    (repo / "big.py").write_text("import numpy as np\n\nrewards = np.zeros((1 << 20, 1 << 20, 8))  # a shape bug\n")
    (repo / "handler.py").write_text(
        "import os, signal, sys, time\n\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the usual handler\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # someone's kill of this rank, while the script loads\n"
        "time.sleep(5)\n")
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_REPO_URL": "https://example.invalid/r.git", "PODKIT_RUN_DIR": str(tmp_path / "run"),
           "RANK": "0", "SRC": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "CKPT": str(tmp_path / "recover")}
    # A volume that fills: an 8 KiB tmpfs in a mount namespace of this run's own (gone with it).
    full = tmp_path / "full"
    full.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=8k tmpfs "{full}" && exec "$0" "$@"',
                        PYTHON, "-c", JUDGED, "ckpt.py", "ckptfull.py", "full.py", "exit3.py", "ctrlc.py", "big.py",
                        "handler.py", "ownki.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env, "FULL": str(full)},
                       # as on a pod: SIGINT not ignored (an xdist worker's ignored SIGINT is inherited through exec)
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt, ckptfull, full, exit3, ctrlc, big, handler, ownki = json.loads(r.stdout.strip().splitlines()[-1])
    assert ckptfull["by"] == "volume-error" and "ENOSPC" in ckptfull["message"], ckptfull
    assert big["by"] == "script-error" and "Unable to allocate 64.0 TiB" in big["message"], big
    assert "asked for 64.0 TiB at once, more than this machine has" in big["hint"], big
    assert ckpt["by"] == "checkpoint-unloadable" and "CheckpointException" in ckpt["message"], ckpt
    assert "podkit start-over" in ckpt["hint"], ckpt
    assert full["by"] == "volume-error" and "ENOSPC" in full["message"] and "free space" in full["hint"], full
    assert exit3["by"] == "script-error" and "SystemExit: 3" in exit3["message"], exit3
    assert f"{repo / 'exit3.py'}:3" in exit3["message"], exit3
    assert ctrlc["by"] == "stray SIGTERM" and "SIGINT" in ctrlc["asked"], ctrlc
    assert ownki["by"] == "script-error" and "no SIGINT came" in ownki["message"], ownki
    assert handler["by"] == "stray SIGTERM" and "sent to rank 0, not by podkit" in handler["asked"], handler


def test_a_rank_that_dies_by_sigbus_or_os_exit_under_torchrun_is_named_by_what_torchrun_saw(tmp_path):
    """Real torchrun, real ranks through podkit's bootstrap: a rank killed by a real SIGBUS (a read past the end of
    a mapped file, as a full /dev/shm does) is shared memory; a rank's os._exit(3) is its exit, not a kill; its
    os._exit(0) mid-run is a failure, not "no record" (torchrun exits 0 for it)."""
    from podkit import config
    from podkit.judge import verdict

    repo = tmp_path / "ws" / "repo"
    repo.mkdir(parents=True)
    (repo / "sigbus.py").write_text(
        "import mmap, os, tempfile\n\nf = tempfile.NamedTemporaryFile(dir=os.environ['SHM'])\nf.write(b'x' * 8192)\n"
        "f.flush()\nm = mmap.mmap(f.fileno(), 8192)\nf.truncate(0)\nm[4096]  # past the end: SIGBUS\n")
    (repo / "exit3.py").write_text("import os\n\nos._exit(3)\n")
    (repo / "exit0.py").write_text("import os\n\nos._exit(0)\n")
    (tmp_path / "shm").mkdir()
    (tmp_path / "ws" / "logs").mkdir(parents=True)
    env = {"PODKIT_CONFIG": str(ROOT / "configs" / "cpu-rehearsal.yaml"), "PODKIT_WORKSPACE": str(tmp_path / "ws"),
           "PODKIT_REPO_URL": "https://example.invalid/r.git", "PODKIT_RUN_DIR": str(tmp_path / "run"),
           "SHM": str(tmp_path / "shm"), "HF_HUB_OFFLINE": "1"}
    cfg = config.load(ROOT / "configs" / "cpu-rehearsal.yaml", environ={**env, "PODKIT_TRAINER_ENTRY": "x.py"})
    judged = {}
    for entry in ("sigbus.py", "exit3.py", "exit0.py"):
        started = time.time()
        r = areal_run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                      "--master-port", str(free_port()), str(ROOT / "src" / "podkit" / "areal" / "bootstrap.py"),
                      "--config", "x.yaml", env={**env, "PODKIT_TRAINER_ENTRY": entry}, cwd=tmp_path, timeout=120)
        (tmp_path / "ws" / "logs" / "trainer.log").write_text(r.stdout + r.stderr)
        judged[entry] = (r.returncode, verdict.decide(verdict.gather(cfg, r.returncode, started)))
    rc, end = judged["sigbus.py"]
    assert rc != 0 and end["by"] == "shared-memory" and "SIGBUS" in end["message"], (rc, end)
    assert "--shm-size" in end["hint"], end
    rc, end = judged["exit3.py"]
    assert end["by"] == "script-error" and "exit 3 without going through Python's exit" in end["message"], (rc, end)
    rc, end = judged["exit0.py"]
    assert rc == 0 and end["by"] == "script-error" and "exit 0" in end["message"], (rc, end)
