"""PID 1 is total and trusts nothing it finds (bad bytes, bad values, corrupt records, a hostile /tmp):
every input here is staged for real against `podkit boot`, and each must end in safe mode that names
the file and key, or in a boot that goes on, never in a traceback or an exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PODKIT, ROOT, free_port, smoke_env, wait_for
from podkit import config, records

pytestmark = [pytest.mark.timeout(120)]


class Boot:
    """`podkit boot` as the container runs it, with its output in a file."""

    def __init__(self, procs, tmp_path, env: dict, ws=None) -> None:
        self.ws = ws or tmp_path / "ws"
        self.out = tmp_path / "boot.log"
        self.env = env
        self.p = procs.spawn([*PODKIT, "boot"], env=env, stdout=open(self.out, "wb"), stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def safe_mode(self, *words: str) -> str:
        wait_for(lambda: "SAFE MODE" in self.text() or self.p.poll() is not None, 30, what="safe mode")
        text = self.text()
        assert self.p.poll() is None, f"podkit boot exited ({self.p.returncode}): a restart loop\n{text}"
        assert "Traceback" not in text.split("SAFE MODE")[0] or "unexpected" in text
        for w in words:
            assert w in text, text
        return text

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(20)


def env_for(tmp_path, **extra) -> dict:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    return smoke_env(ws, free_port(), **extra)


BAD_CONFIGS = [
    # (name, file bytes, words the safe mode banner must show)
    ("not-utf8", b"trainer:\n  experiment: caf\xe9\n", ["not UTF-8", "line 2"]),
    ("binary", bytes(range(256)) * 4, ["not UTF-8"]),
    ("top-level-list", b"- a\n- b\n", ["expected a mapping of settings, got list"]),
    ("section-scalar", b"trainer: 7\n", ["trainer: expected a section"]),
    ("nan", b"reap:\n  grace_s: .nan\n", ["reap.grace_s", "not a finite number"]),
    ("port-range", b"inference:\n  port: 70000\n", ["inference.port", "above the maximum 65535"]),
    ("huge", b"# " + b"x" * (2 << 20) + b"\n", ["larger than 1 MiB"]),
    ("gpus", b"inference:\n  gpus: 0,0\n", ["inference.gpus", "listed twice"]),
]


@pytest.mark.parametrize("name, data, words", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_config_file_waits_in_safe_mode_naming_file_and_key(procs, tmp_path, name, data, words):
    """Bytes that are not a pod config end in safe mode that says where and what; the boot is recorded."""
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_bytes(data)
    b = Boot(procs, tmp_path, env_for(tmp_path, PODKIT_CONFIG=str(cfg)))
    b.safe_mode(str(cfg), *words)
    boots = records.BOOTS.read(b.ws / ".podkit")
    assert boots and boots[-1]["outcome"] == "safe-mode" and boots[-1]["stages"] == {"config": "failed"}
    assert b.stop() == 0


BAD_ENV = [
    ("PODKIT_REAP_GRACE_S", "nan", "not a finite number"),
    ("PODKIT_WATCHDOG_INTERVAL_S", "inf", "not a finite number"),
    ("PODKIT_INFERENCE_PORT", "0", "below the minimum 1"),
    ("PODKIT_TRAINER_SEED", "-1", "below the minimum 0"),
    ("PODKIT_TRAINER_SEED", str(2**40), "above the maximum"),
    ("PODKIT_REPO_URL", "https://example.com/a\nPODKIT_INFERENCE_HOST=0.0.0.0", "control character"),
    ("PODKIT_RUN_DIR", "/tmp/" + "d" * 120, "unix socket path holds at most 107"),
]


@pytest.mark.parametrize("var, value, words", BAD_ENV, ids=[f"{v}={x[:12]}" for v, x, _ in BAD_ENV])
def test_a_bad_env_twin_waits_in_safe_mode_naming_it(procs, tmp_path, var, value, words):
    b = Boot(procs, tmp_path, env_for(tmp_path, **{var: value}))
    b.safe_mode(f"env {var}", words)
    assert b.stop() == 0


@pytest.mark.parametrize("extra", ["--host 0.0.0.0", "--api-key=guessable", "--port 8000"])
def test_extra_args_cannot_undo_the_host_and_api_key_rule(procs, tmp_path, extra):
    """SGLang's argparse takes the last of a repeated flag: extra_args may not set what podkit sets."""
    env = env_for(tmp_path, PODKIT_CONFIG=str(ROOT / "configs" / "a40-1gpu.yaml"), PODKIT_DEVICES="",
                  PODKIT_INFERENCE_EXTRA_ARGS=extra)
    b = Boot(procs, tmp_path, env)
    b.safe_mode("env PODKIT_INFERENCE_EXTRA_ARGS: inference.extra_args: sets --")
    assert b.stop() == 0


def test_an_env_twin_that_is_not_utf8_waits_in_safe_mode(procs, tmp_path):
    """os.environ keeps undecodable bytes as surrogates; they must not reach a program or a file."""
    env = env_for(tmp_path)
    env = {k.encode(): v.encode() for k, v in env.items()}
    env[b"PODKIT_TRAINER_EXPERIMENT"] = b"run-\xff\xfe"
    b = Boot(procs, tmp_path, env)
    b.safe_mode("env PODKIT_TRAINER_EXPERIMENT", "not UTF-8")
    assert b.stop() == 0


def test_a_percent_in_the_workspace_path_is_a_config_error(procs, tmp_path):
    """supervisord expands '%' in the paths it reads: refused before it starts."""
    ws = tmp_path / "run%(x)s"
    ws.mkdir()
    b = Boot(procs, tmp_path, smoke_env(ws, free_port()), ws=ws)
    b.safe_mode("workspace", "contains '%'")
    assert b.stop() == 0


def test_an_unexpected_exception_in_boot_is_recorded_and_shown_with_its_traceback(procs, tmp_path):
    """A bug-shaped failure (here: the run dir's supervisorctl.conf is a directory, so render's write
    raises IsADirectoryError, which no stage expects) waits in safe mode with the traceback in the
    log, in the boot history and in `podkit status`."""
    env = env_for(tmp_path, PODKIT_RUN_DIR=str(tmp_path / "run"))
    (tmp_path / "run" / "supervisorctl.conf").mkdir(parents=True)
    b = Boot(procs, tmp_path, env)
    text = b.safe_mode("podkit failed with IsADirectoryError", "this is a bug in podkit")
    assert "Traceback (most recent call last)" in text
    last = records.BOOTS.read(b.ws / ".podkit")[-1]
    assert last["outcome"] == "safe-mode" and "IsADirectoryError" in last["traceback"]
    st = subprocess.run([*PODKIT, "status", "--workspace", str(b.ws)], capture_output=True, text=True, env=env,
                        timeout=30)
    assert "traceback (last lines)" in st.stdout and "IsADirectoryError" in st.stdout
    assert b.stop() == 0


# -- records found on the volume ------------------------------------------------------------------------------
CORRUPTIONS = {"truncated": b'{"step": 12, "ti', "empty": b"", "binary": b"\x00\xff\xfe\x80" * 64,
               "wrong-shape": None, "list-for-object": b"[1, 2, 3]"}


def wrong_shape(name: str) -> bytes:
    """Valid JSON of the right kind whose every field has the wrong type."""
    rec = next(r for r in records.STATE_RECORDS if r.name == name)
    shape = rec.shape[0] if isinstance(rec.shape, list) else rec.shape
    bad = {k: ([1] if t is not list and not isinstance(t, list) else 7) for k, t in shape.items()}
    return json.dumps([bad] if isinstance(rec.shape, list) else bad).encode()
PROBE = """
import json, os, sys
def execve(path, argv, env):
    print("REACHED", argv[0]); sys.stdout.flush(); os._exit(0)
os.execve = execve
from podkit.cli import main
main(["boot"])
"""


@pytest.mark.parametrize("record", [r.name for r in records.STATE_RECORDS])
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_record_is_treated_as_missing_and_kept_aside(tmp_path, record, kind):
    """Every record under .podkit/ may be truncated, empty, binary or of the wrong shape: boot reaches
    supervisord, status and doctor answer, and the bad copy is kept beside it."""
    env = env_for(tmp_path)
    state = tmp_path / "ws" / ".podkit"
    state.mkdir(parents=True)
    data = CORRUPTIONS[kind] if kind != "wrong-shape" else wrong_shape(record)
    (state / record).write_bytes(data)
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:  # safe mode waits: say why
        raise AssertionError(f"boot did not reach supervisord:\n{(e.stdout or b'').decode(errors='replace')}") from None
    assert r.returncode == 0 and "REACHED" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (state / record).write_bytes(data)  # boot rewrites some records itself (current, safe mode)
    for verb in (["status", "--json"], ["doctor", "--json"]):
        v = subprocess.run([*PODKIT, *verb, "--workspace", str(tmp_path / "ws")], capture_output=True, text=True,
                           env=env, timeout=60)
        assert "Traceback" not in v.stderr and json.loads(v.stdout), (verb, v.stderr)
    if data:  # an empty file has nothing to keep
        assert list(state.glob(f"{record}.bad-*")), f"the bad {record} was not kept aside"


def absurd(rec: records.Record, how: str) -> str:
    """The record's numbers made absurd: every one a 400-digit integer (huge), or every time a day and more
    ahead (future) or Infinity (infinite), the other numbers plausible."""
    shape = rec.shape[0] if isinstance(rec.shape, list) else rec.shape
    times = {"future": time.time() + 1e6, "infinite": float("inf"), "huge": 10**400}
    data = {k: times[how] if t is records.TIME else 10**400 if how == "huge" else 3
            for k, t in shape.items() if t in (records.TIME, int, records.NUMBER)}
    return json.dumps([data] if isinstance(rec.shape, list) else data)


@pytest.mark.parametrize("how", ["huge", "future", "infinite"])
def test_a_record_with_absurd_numbers_is_set_aside_and_status_and_metrics_go_on(tmp_path, how):
    """A 400-digit integer broke every /metrics scrape and `podkit status`; a step stamped in the future
    silenced the hang watchdog until the clock reached it (it reads progress.json's time). Such a record
    is not one: treated as missing, kept aside."""
    from prometheus_client.exposition import generate_latest

    from podkit.views import metrics, status

    state = tmp_path / "ws" / ".podkit"
    state.mkdir(parents=True)
    for rec in records.STATE_RECORDS:
        (state / rec.name).write_text(absurd(rec, how))
        assert rec.read(state) == rec.empty and list(state.glob(f"{rec.name}.bad-*")), rec.name
        (state / rec.name).write_text(absurd(rec, how))
    # progress.json's time is what the watchdog reads: none to trust, so a stall is timed from the start.
    json.dumps(status.collect(tmp_path / "ws"), default=str)
    for rec in records.STATE_RECORDS:
        (state / rec.name).write_text(absurd(rec, how))
    assert b"podkit_supervisord_up" in generate_latest(metrics.registry(tmp_path / "ws", 600))


# -- /tmp is shared ---------------------------------------------------------------------------------------------
def test_a_run_dir_planted_as_a_symlink_is_refused(procs, tmp_path):
    """Someone made the run dir's name a symlink (to a dir of theirs): podkit will not put its
    control socket there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    run = tmp_path / "run"
    run.symlink_to(theirs)
    b = Boot(procs, tmp_path, env_for(tmp_path, PODKIT_RUN_DIR=str(run)))
    b.safe_mode(f"run dir {run} is a symbolic link")
    assert not (theirs / "supervisor.sock").exists()
    assert b.stop() == 0


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user owns")
def test_a_run_dir_owned_by_another_user_is_refused(procs, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, 65534, 65534)
    b = Boot(procs, tmp_path, env_for(tmp_path, PODKIT_RUN_DIR=str(run)))
    b.safe_mode("is owned by uid 65534")
    assert b.stop() == 0


def test_a_run_dir_of_ours_that_others_could_write_is_tightened(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    r = subprocess.run([sys.executable, "-c", PROBE], env=env_for(tmp_path, PODKIT_RUN_DIR=str(run)),
                       capture_output=True, text=True, timeout=60)
    assert "REACHED" in r.stdout, r.stdout + r.stderr
    assert (os.stat(run).st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file another user owns")
def test_a_planted_config_cache_does_not_steer_the_config(tmp_path):
    """A parse cache that another user owns, or anyone may write, is ignored: only the file counts."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    cfg = tmp_path / "pod.yaml"
    cfg.write_text("trainer:\n  seed: 3\n")
    import zlib

    raw = cfg.read_bytes()
    planted = {"key": [str(cfg), zlib.crc32(raw), len(raw)], "data": {"trainer": {"seed": 666}}}
    cache = records.CONFIG_CACHE.path(ws / ".podkit")
    env = {"PODKIT_WORKSPACE": str(ws), "PATH": os.environ["PATH"]}
    for owner, mode in ((65534, 0o644), (os.getuid(), 0o666)):
        cache.write_text(json.dumps(planted))
        os.chown(cache, owner, owner)
        os.chmod(cache, mode)
        r = subprocess.run([*PODKIT, "--config", str(cfg), "config"], capture_output=True, text=True, env=env,
                           timeout=30)
        # "seed: 666", not "666": the run dir's name is a hash that may hold it
        assert "seed: 3" in r.stdout and "seed: 666" not in r.stdout, (owner, mode, r.stdout)
        cache.unlink()


# -- small ones -------------------------------------------------------------------------------------------------
def test_status_under_a_broken_config_shows_the_safe_mode(procs, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = env_for(tmp_path, PODKIT_CONFIG=str(bad))
    b = Boot(procs, tmp_path, env)
    b.safe_mode("checkpoint_evry")
    st = subprocess.run([*PODKIT, "status"], capture_output=True, text=True, env=env, timeout=30)
    assert "SAFE MODE" in st.stdout and "checkpoint_evry: unknown key" in st.stdout
    assert "warning" in st.stderr and "Traceback" not in st.stderr
    assert b.stop() == 0


def test_resume_of_a_workspace_that_is_not_one_says_so_and_creates_nothing(tmp_path):
    typo = tmp_path / "worksapce"
    r = subprocess.run([*PODKIT, "resume", "--workspace", str(typo)], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"]})
    assert r.returncode == 1 and "no podkit workspace" in r.stderr and not typo.exists()


def test_the_readme_settings_and_shipped_configs_still_load(tmp_path):
    """The new limits do not refuse anything shipped."""
    from podkit import config

    for name in ("default.yaml", "smoke.yaml", "a40-1gpu.yaml", "a40-2gpu.yaml", "a40-4gpu.yaml"):
        config.load(ROOT / "configs" / name, environ={"PODKIT_WORKSPACE": str(tmp_path)})


@pytest.mark.parametrize("context, extra, refused", [
    ("2048", "--enable-metrics", True),                            # below the A40's 4096-token bucket
    ("2048", "--enable-metrics --disable-piecewise-cuda-graph", False),
    ("2048", "--chunked-prefill-size 2048", False),                # the buckets end at the chunk
    ("4096", "--enable-metrics", False),                           # the shipped A40 configs
    ("4096", "--piecewise-cuda-graph-max-tokens=8192", True),
])
def test_a_context_shorter_than_sglangs_piecewise_graphs_is_refused_at_boot(procs, tmp_path, context, extra,
                                                                           refused):
    """SGLang 0.5.10 captures piecewise CUDA graphs up to chunked_prefill_size tokens (4096 on an A40) and its
    warm-up crashes when --context-length is below that: found at boot, with the two fixes named."""
    from podkit.areal import checks

    cfg = config.load(ROOT / "configs" / "a40-1gpu.yaml", environ={
        "PODKIT_INFERENCE_CONTEXT_LENGTH": context, "PODKIT_INFERENCE_EXTRA_ARGS": extra})
    assert bool(checks._piecewise(cfg.inference.context_length, cfg.inference.extra_args)) == refused
    if context == "2048" and refused:
        env = env_for(tmp_path, PODKIT_CONFIG=str(ROOT / "configs" / "a40-1gpu.yaml"), PODKIT_DEVICES="",
                      PODKIT_INFERENCE_CONTEXT_LENGTH=context)
        b = Boot(procs, tmp_path, env)
        b.safe_mode("inference.context_length: 2048 is below SGLang's largest piecewise CUDA graph (4096 tokens",
                    "--disable-piecewise-cuda-graph")
        assert b.stop() == 0


@pytest.mark.parametrize("version, refused", [("0.5.10.post1", False), ("0.5.23", True), ("0.6.1", True),
                                              ("0.5.12", False)])
def test_an_sglang_newer_than_podkits_command_line_is_refused_naming_the_flag(version, refused):
    """SGLang 0.5.23 removed --cuda-graph-max-bs: an image with it is refused by name, not by argparse."""
    from podkit.areal import checks

    cfg = config.load(ROOT / "configs" / "a40-4gpu.yaml", environ={})
    problems = checks.sglang_version(cfg, version)
    assert bool(problems) == refused
    if refused:
        [(key, what, hint)] = problems
        assert key == "inference.cuda_graph_max_bs" and "--cuda-graph-max-bs" in what and version in what
        assert "0.5.10" in hint
    off = config.load(ROOT / "configs" / "a40-4gpu.yaml", environ={"PODKIT_INFERENCE_CUDA_GRAPH_MAX_BS": "0"})
    assert checks.sglang_version(off, version) == []
