"""The real programs' launchers: SGLang's command line, AReaL under torchrun, and what each checks before
exec. The command lines themselves are checked by SGLang's and AReaL's own parsers in test_validate.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, hold, smoke_env
from podkit import config
from podkit.areal import checks, command, discovery, launch
from podkit.boot import preflight
from podkit.errors import ConfigError
from podkit.programs import sglang

pytestmark = pytest.mark.timeout(60)
POD_CONFIGS = ["a40-1gpu.yaml", "a40-2gpu.yaml", "a40-4gpu.yaml"]


def load(name="a40-4gpu.yaml", tmp_path=None, **env):
    environ = {"PODKIT_WORKSPACE": str(tmp_path or "/workspace"), **env}
    return config.load(ROOT / "configs" / name, environ=environ)


@pytest.mark.parametrize("name", POD_CONFIGS)
def test_shipped_a40_configs_pass_preflight_and_name_their_areal_config(name):
    cfg = load(name)
    assert cfg.inference.kind == "sglang" and cfg.trainer.kind == "areal"
    assert Path(cfg.trainer.areal_config).is_file()
    assert Path(cfg.trainer.areal_config).parent == ROOT / "configs" / "areal"
    assert checks.programs(cfg) == []
    assert cfg.inference.attention_backend != "fa3", "fa3 is a Hopper kernel; A40 is Ampere"


def test_sglang_command_line_comes_from_the_pod_config():
    cfg = load("a40-4gpu.yaml", PODKIT_INFERENCE_EXTRA_ARGS="--log-level info")
    argv = sglang.command(cfg, environ={})
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags["--model-path"] == cfg.inference.model and flags["--host"] == "127.0.0.1"
    assert flags["--attention-backend"] == "flashinfer" and flags["--tp-size"] == "1"
    assert flags["--context-length"] == "4096" and flags["--mem-fraction-static"] == "0.85"
    assert argv[-2:] == ["--log-level", "info"] and "--api-key" not in argv
    env = sglang.environment(cfg, environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["HF_HOME"] == "/workspace/hf"


def test_a_flag_podkit_owns_is_written_and_refused_from_one_table(monkeypatch):
    """SGLang's command line and the extra_args check read one table (checks.SGLANG_FLAGS): every flag
    podkit writes is refused in extra_args, and a row added to the table is on the command line."""
    cfg = load("a40-4gpu.yaml", PODKIT_INFERENCE_CUDA_GRAPH_MAX_BS="8", PODKIT_INFERENCE_EXTRA_ARGS="--log-level info")
    owned = [w for w in sglang.command(cfg, environ={"SGLANG_API_KEY": "k"})[3:-2] if w.startswith("--")]
    assert "--cuda-graph-max-bs" in owned and "--config" in owned
    assert all(checks._owned_flags(f"{f} 1") for f in owned), owned
    assert checks.OWNED_FLAGS == {name: key for flag, aliases, key, _ in checks.SGLANG_FLAGS
                                  for name in (flag, *aliases)}
    row = ("--served-model-name", (), "inference.model", lambda cfg: "policy")
    monkeypatch.setattr(checks, "SGLANG_FLAGS", (*checks.SGLANG_FLAGS, row))
    assert sglang.command(cfg, environ={})[-4:] == ["--served-model-name", "policy", "--log-level", "info"]


def test_sglang_beyond_loopback_without_an_api_key_is_a_config_error(tmp_path):
    cfg = load(tmp_path=tmp_path, PODKIT_INFERENCE_HOST="0.0.0.0")
    assert [p[0] for p in checks.sglang(cfg, environ={})] == ["inference.host"]
    assert checks.sglang(cfg, environ={"SGLANG_API_KEY": "k"}) == []


def test_preflight_names_the_file_and_key_of_a_program_problem(tmp_path):
    pod = tmp_path / "pod.yaml"
    pod.write_text((ROOT / "configs" / "a40-4gpu.yaml").read_text().replace('gpus: "1,2,3"', 'gpus: "0,1,2"')
                   .replace("areal/grpo-a40-4gpu.yaml", str(ROOT / "configs/areal/grpo-a40-4gpu.yaml")))
    cfg = config.load(pod, environ={"PODKIT_WORKSPACE": str(tmp_path / "ws"), "PODKIT_DEVICES": ""})
    with pytest.raises(ConfigError) as e:
        preflight.run(cfg)
    assert e.value.source == str(pod) and e.value.key == "trainer.gpus"
    assert "also serve inference" in e.value.problem


def areal_shaped(tmp_path) -> Path:
    """An AReaL config shaped like AReaL's own examples: recovery off, xccl weight updates, and backends
    sized for 8 GPUs (d4 + d4)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs/areal/grpo-a40-4gpu.yaml").read_text())
    data["recover"]["mode"] = "disabled"
    data["actor"]["weight_update_mode"] = "xccl"
    data["actor"]["backend"] = "fsdp:d4p1t1"
    data["rollout"]["backend"] = "sglang:d4p1t1"
    del data["actor"]["attn_impl"]  # AReaL's default, flash_attention_2
    path = tmp_path / "gsm8k_grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_areal_example_shaped_config_runs_as_it_is_with_what_podkit_depends_on_set_and_named(tmp_path):
    cfg = load(PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)))
    assert checks.programs(cfg) == []
    changed = {s.key: (s.was, s.value) for s in checks.settings(cfg)[0]}
    assert changed == {"recover.mode": ("disabled", "auto"), "actor.weight_update_mode": ("xccl", "disk"),
                       "actor.backend": ("fsdp:d4p1t1", "fsdp:d3"), "rollout.backend": ("sglang:d4p1t1", "sglang:d1"),
                       "actor.attn_impl": (None, "sdpa")}
    from podkit.areal.command import overrides

    argv = overrides(cfg)
    assert {"++recover.mode=auto", "++actor.weight_update_mode=disk", "++actor.backend=fsdp:d3",
            "++rollout.backend=sglang:d1"} <= set(argv), argv
    # podkit's own YAMLs already say so: nothing to set, nothing to say.
    assert checks.settings(load())[0] == []


def test_user_overrides_that_contradict_what_podkit_depends_on_are_refused_all_at_once(tmp_path):
    cfg = load(tmp_path=tmp_path / "ws", PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)), PODKIT_DEVICES="",
               PODKIT_RUN_DIR=str(tmp_path / "run"), PODKIT_TRAINER_OVERRIDES="actor.weight_update_mode=xccl ++recover.mode=disabled actor.backend=fsdp:d4")
    with pytest.raises(ConfigError) as e:
        preflight.run(cfg)
    msg = e.value.message
    assert e.value.key == "trainer.overrides" and "sets recover.mode=disabled, but podkit needs auto" in msg, msg
    assert "sets actor.weight_update_mode=xccl, but podkit needs disk" in msg, msg
    assert "sets actor.backend=fsdp:d4, but podkit needs fsdp:d3: trainer.gpus '1,2,3' gives the trainer 3" in msg


def test_overrides_in_hydras_other_syntaxes_that_turn_off_what_podkit_needs_are_refused_at_boot_too(tmp_path):
    """The boot's fast path reads a deletion (~key) and a flat dict (section={key:value}) as well; the trainer
    checks the config AReaL ends up with whatever the syntax (tests/trainer/test_run_identity.py)."""
    cfg = load(tmp_path=tmp_path / "ws", PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)), PODKIT_DEVICES="",
               PODKIT_RUN_DIR=str(tmp_path / "run"),
               PODKIT_TRAINER_OVERRIDES="~recover.mode actor={weight_update_mode:xccl}")
    with pytest.raises(ConfigError) as e:
        preflight.run(cfg)
    msg = e.value.message
    assert "deletes recover.mode (~recover.mode), where podkit sets recover.mode=auto" in msg, msg
    assert "sets actor.weight_update_mode=xccl, but podkit needs disk" in msg, msg


def test_a_lora_config_is_refused_at_boot_naming_where_lora_is_set_instead_of_failing_after_the_model_loads(
        tmp_path):
    """AReaL's LoRA example (actor.use_lora: true) under podkit: AReaL 1.0.4 raises "LoRA is only supported in
    single-controller mode" in RLTrainer's start, after the model loaded, and its hint (scheduler.type=local)
    would have AReaL start a second SGLang. The boot names the YAML and the key instead; from
    trainer.overrides, it names those; `use_lora: false` is no problem."""
    import yaml

    data = yaml.safe_load(areal_shaped(tmp_path).read_text())
    data["actor"].update(use_lora=True, lora_rank=32, lora_alpha=16, target_modules=["all-linear"])
    data["rollout"]["use_lora"] = "${actor.use_lora}"  # as AReaL's examples write it
    lora = tmp_path / "gsm8k_grpo_lora.yaml"
    lora.write_text(yaml.safe_dump(data))
    cfg = load(tmp_path=tmp_path / "ws", PODKIT_TRAINER_AREAL_CONFIG=str(lora), PODKIT_DEVICES="",
               PODKIT_RUN_DIR=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as e:
        preflight.run(cfg)
    assert e.value.key == "trainer.areal_config", e.value
    assert f"{lora} sets actor.use_lora: True" in e.value.message, e.value.message
    assert "single-controller mode" in e.value.message and "set actor.use_lora and rollout.use_lora false" in e.value.hint, e.value
    for on in ("y", "1", "ON", "2"):  # what OmegaConf reads as true for a bool field
        assert checks.programs(load(PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)),
                                    PODKIT_TRAINER_OVERRIDES=f"actor.use_lora={on}")), on
    for off in ("false", "0", "no", "n", "${actor.use_lora}"):
        assert not checks.programs(load(PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)),
                                        PODKIT_TRAINER_OVERRIDES=f"'actor.use_lora={off}'")), off
    problems = checks.programs(load(PODKIT_TRAINER_AREAL_CONFIG=str(areal_shaped(tmp_path)),
                                    PODKIT_TRAINER_OVERRIDES="++rollout.use_lora=True"))
    assert [(k, what.startswith("sets rollout.use_lora=True, but AReaL")) for k, what, _ in problems] == [
        ("trainer.overrides", True)], problems
    assert "ask SGLang for a LoRA adapter on every request" in problems[0][1], problems
    data["actor"]["use_lora"] = False
    lora.write_text(yaml.safe_dump(data))
    assert checks.programs(load(PODKIT_TRAINER_AREAL_CONFIG=str(lora))) == []


@pytest.mark.parametrize("env, key, words", [
    ({"PODKIT_INFERENCE_TP": "2"}, "inference.tp", "names 1 GPU"),
    ({"PODKIT_TRAINER_GPUS": "1,2", "PODKIT_TRAINER_OVERRIDES": "actor.backend=fsdp:d3"}, "trainer.overrides",
     "sets actor.backend=fsdp:d3, but podkit needs fsdp:d2"),
    ({"PODKIT_TRAINER_AREAL_CONFIG": "/nonexistent.yaml"}, "trainer.areal_config", "does not exist"),
    ({"PODKIT_INFERENCE_KIND": "standin"}, "trainer.kind", "needs a server that generates"),
    ({"PODKIT_TRAINER_KIND": "fake"}, "trainer.kind", "sglang cannot load"),
    ({"PODKIT_INFERENCE_KIND": "standin-lm"}, "inference.model", "not a local model directory"),
    ({"PODKIT_TRAINER_CPU_RANKS": "1"}, "trainer.cpu_ranks", "but trainer.gpus is"),
    ({"PODKIT_TRAINER_OVERRIDES": "a='b"}, "trainer.overrides", "No closing quotation"),
])
def test_a_setup_that_cannot_train_is_refused_before_supervisord_starts(env, key, words):
    problems = checks.programs(load(**env))
    assert any(k == key and words in what for k, what, _ in problems), problems


def test_one_gpu_pod_shares_the_gpu_only_with_a_small_sglang_share():
    cfg = load("a40-1gpu.yaml")
    assert cfg.trainer.gpus == cfg.inference.gpus == "0" and checks.programs(cfg) == []
    greedy = load("a40-1gpu.yaml", PODKIT_INFERENCE_MEM_FRACTION_STATIC="0.85")
    assert [p[0] for p in checks.programs(greedy)] == ["trainer.gpus"]


def test_backend_gpu_counts():
    assert checks.backend_gpus("fsdp:d3") == 3
    assert checks.backend_gpus("sglang:d2t2") == 4
    assert checks.backend_gpus("sglang.d1t1p1+d3t1p1") is None  # the seeds' old syntax: AReaL decides


def test_trainer_runs_under_torchrun_in_spmd_mode_pointed_at_sglang(tmp_path):
    cfg = load("a40-4gpu.yaml", tmp_path, PODKIT_TRAINER_OVERRIDES="total_train_epochs=3")
    argv = command.command(cfg)
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nnodes"]
    assert argv[argv.index("--nproc-per-node") + 1] == "3"
    script = argv[argv.index("--nproc-per-node") + 2]
    assert Path(script).name == "bootstrap.py" and Path(script).is_file()
    assert argv[argv.index("--config") + 1] == cfg.trainer.areal_config
    over = argv[argv.index("--config") + 2:]
    # Weight updates on local disk (the run dir); what must outlive the container on the volume.
    assert f"++cluster.fileroot={cfg.run_path}/areal" in over and "++experiment_name=podkit" in over
    assert all(f"++{k}.fileroot={tmp_path}/areal" in over for k in ("saver", "recover", "stats_logger", "evaluator"))
    assert f"++cluster.name_resolve.nfs_record_root={cfg.trainer.name_resolve_root}" in over
    assert over[-1] == "total_train_epochs=3"
    env = command.environment(cfg, environ={})
    assert env["AREAL_SPMD_MODE"] == "1" and env["AREAL_LLM_SERVER_ADDRS"] == "127.0.0.1:30000"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,3"
    assert env["NCCL_CUMEM_ENABLE"] == env["NCCL_NVLS_ENABLE"] == "0"


def test_trainer_waits_for_inference_then_clears_stale_discovery_and_starts_torchrun(procs, tmp_path, monkeypatch):
    """A leftover name_resolve record would send AReaL to a dead server: gone before torchrun starts."""
    port = free_port()
    root = tmp_path / "nr"
    stale = discovery.trial_dir(str(root), "podkit", "run") / "llm_server" / "0"
    stale.parent.mkdir(parents=True)
    stale.write_text("127.0.0.1:1")  # a dead server's address
    cfg = load("a40-4gpu.yaml", tmp_path, PODKIT_INFERENCE_PORT=str(port),
               PODKIT_TRAINER_NAME_RESOLVE_ROOT=str(root), PODKIT_INFERENCE_READY_TIMEOUT_S="30")
    execs = []
    monkeypatch.setattr(launch, "supervise", lambda argv, env, run_dir, grace_s, stopping: execs.append((argv, env, grace_s)) or 0)

    def start_standin_later():
        time.sleep(1.5)  # the trainer starts first and must wait
        env = smoke_env(tmp_path / "standin-ws", port, PODKIT_INFERENCE_STARTUP_DELAY_S="0")
        procs.spawn([sys.executable, "-m", "podkit", "run", "sglang"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    threading.Thread(target=start_standin_later).start()
    t0 = time.monotonic()
    launch.main(cfg)
    assert time.monotonic() - t0 >= 1.5 and not stale.exists()
    (argv, env, grace_s), = execs
    assert "--standalone" in argv and env["AREAL_LLM_SERVER_ADDRS"] == f"127.0.0.1:{port}"
    assert grace_s == cfg.trainer.stop_grace_s  # the launcher cuts a step that outlasts supervisord's grace


def test_both_stand_ins_answer_sglangs_shared_routes_alike_from_one_handler(tmp_path):
    """The smoke stand-in and the generating one share one handler (standin.Handler): a route neither
    serves, weights that are not on disk, and /v1/models get the same answers from both."""
    import json
    import urllib.error
    import urllib.request
    from http.server import ThreadingHTTPServer
    from types import SimpleNamespace

    from podkit.programs import standin, standin_lm

    engine = SimpleNamespace(model_path="m", weight_version="default", context_length=4096,
                             model=SimpleNamespace(config=SimpleNamespace(model_type="qwen2", architectures=None)))
    handlers = [standin.make_handler(standin.State("m")), standin_lm.make_handler(engine)]
    assert all(issubclass(h, standin.Handler) for h in handlers)

    def ask(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data),
                                        timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    answers = []
    for handler in handlers:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        port = httpd.server_address[1]
        try:
            models = ask(port, "/v1/models")
            models[1]["data"][0]["created"] = 0
            answers.append([ask(port, "/nowhere"), models,
                            ask(port, "/update_weights_from_disk", {"model_path": str(tmp_path / "gone")})])
        finally:
            httpd.shutdown()
            httpd.server_close()
    assert answers[0] == answers[1] and answers[0][0] == (404, {"detail": "Not Found"})
    assert answers[0][2][0] == 400 and "does not exist" in answers[0][2][1]["message"]


def test_trainer_stops_waiting_when_supervisord_reports_inference_dead_and_waits_for_it_stopped_on_request(tmp_path):
    """FATAL: nothing will start it again. STOPPED: a person stopped it (`podkit ctl stop sglang`), and will start it
    again: waited for without a limit (here until the trainer is asked to stop), never a failure."""
    from podkit.judge import health

    cfg = load("a40-4gpu.yaml", tmp_path, PODKIT_INFERENCE_PORT=str(free_port()), PODKIT_INFERENCE_READY_TIMEOUT_S="1")
    t0 = time.monotonic()
    why = health.wait_for_inference(cfg, is_dead=lambda: "FATAL", interval=0.1)
    assert "FATAL" in why and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    why = health.wait_for_inference(cfg, is_dead=lambda: "STOPPED", interval=0.1,
                                    stopping=lambda: time.monotonic() - t0 > 3)
    assert why == "stopping" and time.monotonic() - t0 >= 3, "past inference.ready_timeout_s (1 s): no limit"


def test_sglang_start_waits_for_an_old_server_to_let_go_of_its_gpu(procs, devices):
    """A restart that begins while the old server's schedulers still hold the GPU would fail with
    'busy or unavailable': the start waits for them, and ignores holders of other GPUs."""
    cfg = load(PODKIT_DEVICES=f"{devices}/nvidia*", PODKIT_INFERENCE_GPUS="0")
    assert sglang.device_files(cfg) == [str(devices / "nvidia0")]
    other, _ = hold(procs, "fd", devices / "nvidia1")
    old, _ = hold(procs, "mmap", devices / "nvidia0")
    left = sglang.wait_devices_free(cfg, timeout_s=0.5, interval=0.1)
    assert [h.pid for h in left] == [old]

    def let_go():
        time.sleep(1)
        os.kill(old, 9)

    threading.Thread(target=let_go).start()
    t0 = time.monotonic()
    assert sglang.wait_devices_free(cfg, timeout_s=20, interval=0.1) == []
    assert 0.8 < time.monotonic() - t0 < 15
    assert os.path.exists(f"/proc/{other}")


def test_sglang_program_refuses_to_start_on_a_held_gpu_and_says_who_holds_it(procs, devices, tmp_path):
    holder, _ = hold(procs, "fd", devices / "nvidia0")
    env = {**os.environ, "PODKIT_CONFIG": str(ROOT / "configs/a40-4gpu.yaml"), "PODKIT_WORKSPACE": str(tmp_path),
           "PODKIT_DEVICES": f"{devices}/nvidia*", "PODKIT_INFERENCE_GPU_FREE_TIMEOUT_S": "0.5"}
    r = subprocess.run([sys.executable, "-m", "podkit", "run", "sglang"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1
    assert f"{holder} (" in r.stdout + r.stderr and "busy or unavailable" in r.stdout + r.stderr


def test_pod_config_and_areal_config_agree_on_the_sglang_settings():
    """podkit launches SGLang from the pod config; AReaL's own `sglang:` section must say the same."""
    import yaml

    for name in POD_CONFIGS:
        cfg = load(name)
        areal = yaml.safe_load(Path(cfg.trainer.areal_config).read_text())
        s = areal["sglang"]
        assert s["attention_backend"] == cfg.inference.attention_backend == "flashinfer", name
        assert s["mem_fraction_static"] == cfg.inference.mem_fraction_static, name
        assert s["context_length"] == cfg.inference.context_length, name
        assert areal["rollout"]["max_concurrent_rollouts"] == cfg.inference.cuda_graph_max_bs, name
        assert areal["actor"]["path"] == cfg.inference.model, name
        assert shlex.split(cfg.trainer.overrides) == []


RANK_SCRIPT = """
import os, signal, sys, time
out = sys.argv[1]
def stop(*_):
    time.sleep(1.0)  # the end of the step in flight and its recover checkpoint
    open(os.path.join(out, "checkpointed-" + os.environ["RANK"]), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "ready-" + os.environ["RANK"]), "w").close()
while True:
    time.sleep(0.1)
"""
LAUNCH = ("import json, os, sys; from pathlib import Path; from podkit.areal.launch import supervise; "
          "sys.exit(supervise(json.loads(sys.argv[1]), dict(os.environ), Path(sys.argv[2]), float(sys.argv[3]) or None))")


def start_supervised_torchrun(procs, tmp_path, script_text=RANK_SCRIPT, grace_s=0.0, rank_args=()):
    import json

    script = tmp_path / "rank.py"
    script.write_text(script_text)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            str(script), str(out), *rank_args]
    p = procs.spawn([sys.executable, "-c", LAUNCH, json.dumps(argv), str(tmp_path), str(grace_s)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_ready = lambda: all((out / f"ready-{r}").exists() for r in (0, 1))  # noqa: E731
    from conftest import wait_for

    wait_for(wait_ready, 40, what="both torchrun ranks to start")
    return p, out


@pytest.mark.timeout(90)
def test_sigterm_reaches_the_ranks_not_torchrun_so_the_step_ends_with_a_checkpoint(procs, tmp_path):
    """torchrun answers SIGTERM with a 30 s countdown to SIGKILL (hard-coded before torch 2.12); the
    launcher keeps it out of supervisord's stop and hands SIGTERM to the ranks, which finish and exit 0."""
    import signal

    p, out = start_supervised_torchrun(procs, tmp_path)
    p.send_signal(signal.SIGTERM)
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 0, log
    assert {f.name for f in out.iterdir() if f.name.startswith("checkpointed")} == {"checkpointed-0", "checkpointed-1"}
    assert "death signal" not in log and "SIGTERM: passing it to the 2 worker process(es)" in log
    assert not (tmp_path / "torchrun.json").exists()


@pytest.mark.timeout(90)
def test_a_step_that_never_ends_after_sigterm_is_cut_by_the_launcher_so_no_rank_outlives_it(procs, tmp_path):
    """A rank whose step never ends (a reward stuck in a loop, a hung collective) ignored the SIGTERM;
    supervisord SIGKILLed the launcher after the grace, and the ranks, in sessions of their own, lived on
    holding their GPUs (after `podkit up` had exited, nothing ever killed them). The launcher now kills them
    itself just before the grace runs out, and exits."""
    import json
    import signal

    from conftest import alive, wait_for

    stuck = RANK_SCRIPT.replace("time.sleep(1.0)  # the end of the step in flight and its recover checkpoint",
                                "time.sleep(3600)  # a step that never ends").replace(
        'open(os.path.join(out, "ready-"', "from podkit.judge import ending  # in train(): as the hooks note it\n"
        'ending.rank_alive(os.path.dirname(out), int(os.environ["RANK"]), training=True)\nopen(os.path.join(out, "ready-"')
    p, out = start_supervised_torchrun(procs, tmp_path, stuck, grace_s=3.0)
    record = tmp_path / "torchrun.json"
    wait_for(lambda: len(json.loads(record.read_text())["groups"]) == 3, 20, what="both ranks recorded")
    everyone = [g for g, _ in json.loads(record.read_text())["groups"]]
    for pid in everyone:
        procs.track(pid)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    log, _ = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert 2.0 <= took < 3.0 + 5.0, (took, log)  # 2.5 s: within the grace, before supervisord's SIGKILL (3 s)
    assert "did not end within trainer.stop_grace_s (3 s)" in log and p.returncode != 0, log
    wait_for(lambda: not any(alive(pid) for pid in everyone), 10, what="the ranks and torchrun to be gone")
    assert not list(out.glob("checkpointed-*")) and not record.exists()


@pytest.mark.timeout(90)
def test_a_rank_writing_its_recover_checkpoint_when_the_grace_runs_out_is_not_cut(procs, tmp_path):
    """AReaL writes the recover checkpoint in place: cut in the middle, the last good one would be lost. A rank
    marks its save (records.SAVING_PREFIX in the run dir); the launcher leaves it to finish."""
    import json
    import signal

    from conftest import alive, wait_for
    from podkit import records

    saving = RANK_SCRIPT.replace(
        "time.sleep(1.0)  # the end of the step in flight and its recover checkpoint",
        "open(os.path.join(sys.argv[2], 'recover-saving-' + os.environ['RANK']), 'w').close(); time.sleep(3600)")
    assert records.SAVING_PREFIX == "recover-saving-"
    (tmp_path / f"{records.SAVING_PREFIX}9").write_text("a killed rank's, from before")
    p, out = start_supervised_torchrun(procs, tmp_path, saving, grace_s=2.0, rank_args=[str(tmp_path)])
    assert not (tmp_path / f"{records.SAVING_PREFIX}9").exists()  # cleared at the launch
    record = tmp_path / "torchrun.json"
    wait_for(lambda: len(json.loads(record.read_text())["groups"]) == 3, 20, what="both ranks recorded")
    everyone = [g for g, _ in json.loads(record.read_text())["groups"]]
    for pid in everyone:
        procs.track(pid)
    p.send_signal(signal.SIGTERM)
    time.sleep(3.5)
    assert p.poll() is None and all(alive(pid) for pid in everyone[1:]), "a save in progress was cut"
    p.send_signal(signal.SIGKILL)  # supervisord's last resort
    p.wait(10)
    for pid in everyone:  # what the next launch would do (clear_leftovers); they hold the log pipe open
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = p.stdout.read()
    assert "while a rank writes its recover checkpoint: not cutting it" in log, log


@pytest.mark.timeout(90)
def test_ranks_left_by_a_killed_launcher_are_killed_before_the_next_torchrun(procs, tmp_path):
    """supervisord's last resort is SIGKILL. torchrun dies with its launcher (PDEATHSIG), but it starts
    each rank in a session of its own, so the ranks live on holding their GPUs, out of reach of
    supervisord's killasgroup. The launcher recorded their groups; the next launch kills them first."""
    import json
    import signal

    from conftest import alive, wait_for

    p, out = start_supervised_torchrun(procs, tmp_path)
    record = tmp_path / "torchrun.json"
    wait_for(lambda: len(json.loads(record.read_text())["groups"]) == 3, 20, what="both ranks recorded")
    torchrun, *ranks = [g for g, _ in json.loads(record.read_text())["groups"]]
    for pid in (torchrun, *ranks):
        procs.track(pid)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    wait_for(lambda: not alive(torchrun), 10, what="torchrun to die with its launcher")
    time.sleep(1)
    assert all(alive(r) for r in ranks), "torchrun's ranks outlive it (their own sessions)"
    assert sorted(command.clear_leftovers(tmp_path)) == sorted(ranks) and not record.exists()
    wait_for(lambda: not any(alive(r) for r in ranks), 10, what="the left ranks to be gone")


def test_a_ray_nodes_recorded_workers_are_cleared_by_the_same_helper_as_torchruns_ranks(procs, tmp_path):
    """One helper clears what a killed launcher left, whichever record names the groups: a Ray node's
    (ray-node.json) workers are killed and that record removed; torchrun's record is left alone."""
    from conftest import alive, wait_for
    from podkit import records
    from podkit.host.proc import read_stat

    worker = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    records.RAY_NODE.write(tmp_path, {"groups": [[worker.pid, read_stat(worker.pid).starttime]]})
    records.TORCHRUN.write(tmp_path, {"groups": []})
    assert command.clear_leftovers(tmp_path, records.RAY_NODE) == [worker.pid]
    wait_for(lambda: worker.poll() is not None and not alive(worker.pid), 10, what="the left worker to be gone")
    assert not records.RAY_NODE.path(tmp_path).exists() and records.TORCHRUN.path(tmp_path).exists()


def test_a_pid_reused_by_a_younger_process_is_not_killed(procs, tmp_path):
    import json

    from conftest import alive
    from podkit.host.proc import read_stat

    other = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    record = tmp_path / "torchrun.json"
    record.write_text(json.dumps({"groups": [[other.pid, read_stat(other.pid).starttime + 10**9]]}))
    assert command.clear_leftovers(tmp_path) == [] and alive(other.pid)


@pytest.mark.timeout(60)
def test_trainer_rank0_flags_stale_weights_when_a_restarted_server_serves_base_weights(procs, tmp_path):
    """The AReaL entry script's watcher, against the stand-in's /model_info: weights it pushed (version
    5) are served, so nothing is flagged; a server answering `default` has restarted, so the flag is
    set and every rank stops after the step in flight (tests/trainer/test_rehearsal.py runs the whole path)."""
    import json
    import threading
    import urllib.request

    from conftest import wait_for
    from podkit import config
    from podkit.areal.hooks import Progress, watch_served_weights
    from podkit.judge.health import probe

    port = free_port()
    env = smoke_env(tmp_path / "ws", port, PODKIT_INFERENCE_STARTUP_DELAY_S="0")
    server = procs.spawn([sys.executable, "-m", "podkit", "run", "sglang"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    wait_for(lambda: probe("127.0.0.1", port), 20, what="the stand-in")
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"w" * 1024)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/update_weights_from_disk", method="POST",
                                 data=json.dumps({"model_path": str(weights), "weight_version": "5"}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()
    cfg = config.load(environ={**env, "PODKIT_TRAINER_STALE_WEIGHTS_CHECK_S": "1"})
    progress = Progress(cfg)
    progress.write(step=5, weight_version="5")
    stale = threading.Event()
    threading.Thread(target=watch_served_weights, args=(cfg, progress, f"127.0.0.1:{port}", "", stale),
                     daemon=True).start()
    time.sleep(3.5)
    assert not stale.is_set(), "served weights are the pushed ones: training goes on"

    server.terminate()
    server.wait(10)
    procs.spawn([sys.executable, "-m", "podkit", "run", "sglang"], env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)  # restarted: nothing pushed yet, weight_version "default"
    wait_for(stale.is_set, 20, what="the watcher to flag the base weights")


def test_trainer_entry_reads_its_areal_yaml_from_the_checkout_and_is_looked_for_only_after_the_sync(tmp_path):
    """Before the sync (preflight) the checkout is not there: its files are looked for after it (the sync
    stage), where a missing entry or YAML is a config error naming the key."""
    cfg = load(PODKIT_REPO_URL="https://example.invalid/me/repo", PODKIT_REPO_DEST=str(tmp_path / "repo"),
               PODKIT_TRAINER_ENTRY="train.py", PODKIT_TRAINER_AREAL_CONFIG="conf/grpo.yaml")
    assert cfg.trainer.areal_config == str(tmp_path / "repo" / "conf" / "grpo.yaml")
    before = [k for k, _, _ in checks.programs(cfg) if k.startswith("trainer.")]
    assert "trainer.entry" not in before and "trainer.areal_config" not in before, before
    after = {k: what for k, what, _ in checks.programs(cfg, synced=True)}
    assert "train.py does not exist in the checkout" in after["trainer.entry"], after
    assert "does not exist" in after["trainer.areal_config"], after
    (tmp_path / "repo" / "conf").mkdir(parents=True)
    (tmp_path / "repo" / "train.py").write_text("")
    (tmp_path / "repo" / "conf" / "grpo.yaml").write_text((ROOT / "configs/areal/grpo-a40-4gpu.yaml").read_text())
    assert not [p for p in checks.programs(cfg, synced=True) if p[0] in ("trainer.entry", "trainer.areal_config")]


@pytest.mark.parametrize("entry, words", [
    ("/abs/train.py", "not a path inside the checkout"),
    ("../elsewhere.py", "not a path inside the checkout"),
    ("pkg.mod:", "not package.module:function"),
    ("pkg-x.mod:main", "not package.module:function"),
])
def test_an_entry_outside_the_checkout_or_not_a_module_function_is_refused(entry, words, tmp_path):
    cfg = load(PODKIT_REPO_URL="https://example.invalid/me/repo", PODKIT_REPO_DEST=str(tmp_path),
               PODKIT_TRAINER_ENTRY=entry)
    assert any(k == "trainer.entry" and words in what for k, what, _ in checks.entry(cfg)), checks.entry(cfg)


def test_an_entry_without_a_repo_is_refused_at_preflight(tmp_path):
    cfg = load(PODKIT_REPO_DEST=str(tmp_path / "none"), PODKIT_TRAINER_ENTRY="train.py")
    assert any(k == "trainer.entry" and "no training repo" in what for k, what, _ in checks.programs(cfg))
