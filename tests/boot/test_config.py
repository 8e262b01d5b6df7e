"""The pod config: validated on load, clear errors (file, key, what is wrong, hint), exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from podkit import config, settings
from podkit.errors import ConfigError
from podkit.money import guards

pytestmark = pytest.mark.timeout(60)


def podkit(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "podkit", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=30)


def write(tmp_path, text: str):
    p = tmp_path / "pod.yaml"
    p.write_text(text)
    return p


def test_unknown_key_gets_a_did_you_mean_and_exit_2_without_traceback(tmp_path):
    """A misspelt key names the file and key, suggests the right one, exits 2, prints no traceback."""
    p = write(tmp_path, "trainer:\n  checkpoint_evry: 5\n")
    r = podkit("--config", str(p), "config")
    assert r.returncode == 2
    assert f"{p}: trainer.checkpoint_evry: unknown key" in r.stderr
    assert "did you mean 'checkpoint_every'?" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_top_level_key_suggests_a_section(tmp_path):
    """A misspelt section is caught too."""
    with pytest.raises(ConfigError, match=r"trainr: unknown key") as e:
        config.load(write(tmp_path, "trainr:\n  seed: 1\n"), environ={})
    assert "did you mean 'trainer'?" in e.value.hint


def test_wrong_type_names_file_key_and_expected_type(tmp_path):
    """`grace_s: soon` is reported as file: key: expected a number (s), got 'soon'."""
    p = write(tmp_path, "reap:\n  grace_s: soon\n")
    r = podkit("--config", str(p), "config")
    assert r.returncode == 2
    assert f"{p}: reap.grace_s: expected a number (s), got 'soon'" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_weight_update_deadline_shorter_than_an_update_is_refused_naming_both_settings(tmp_path):
    """watchdog.weight_update_deadline_s below trainer.weight_update_timeout_s would restart a healthy server in
    the middle of every update (the adversarial pass: 0.001 was accepted)."""
    p = write(tmp_path, "watchdog:\n  weight_update_deadline_s: 0.001\n")
    r = podkit("--config", str(p), "config")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{p}: watchdog.weight_update_deadline_s: 0.001 s is shorter than one weight update" in r.stderr, r.stderr
    assert "trainer.weight_update_timeout_s 120 s" in r.stderr and "at least 120" in r.stderr, r.stderr
    for fine in ("0", "120", "900"):  # 0: 5 x the update timeout; at least one update's limit
        config.load(write(tmp_path, f"watchdog:\n  weight_update_deadline_s: {fine}\n"), environ={})


def test_bad_choice_and_below_minimum_are_rejected(tmp_path):
    """Choices and minimums are enforced with the allowed values in the message."""
    with pytest.raises(ConfigError, match="'sometimes' is not one of auto, always, never"):
        config.load(write(tmp_path, "reap:\n  enabled: sometimes\n"), environ={})
    with pytest.raises(ConfigError, match="below the minimum 1"):
        config.load(write(tmp_path, "trainer:\n  checkpoint_every: 0\n"), environ={})


def test_a_huge_finite_number_is_refused_for_every_numeric_setting_before_anything_sleeps_on_it(tmp_path):
    """1e12 s passed validation and then overflowed a sleep (a program crash-looped to FATAL). Every
    duration and count has a maximum, in the schema and the settings table; past it: a config error
    naming the key, from the file and from the env twin alike."""
    numeric = [(s, k, spec) for s, keys in settings.SCHEMA.items() for k, spec in keys.items()
               if spec.type in (int, float)]
    assert numeric and all(spec.maximum is not None for *_, spec in numeric)
    for section, key, spec in numeric:
        huge = "1000000000000" if spec.type is int else "1e12"
        if spec.maximum >= 1e12:  # lr: a float32's range
            huge = "1e300"
        with pytest.raises(ConfigError, match="above the maximum") as e:
            config.load(environ={config.env_name(section, key): huge})
        assert e.value.key == config.dotted(section, key), e.value
        huge = huge.replace("1e", "1.0e+")  # YAML 1.1's float
        path = write(tmp_path, f"{section}:\n  {key}: {huge}\n" if section else f"{key}: {huge}\n")
        with pytest.raises(ConfigError, match=f"{config.dotted(section, key)}.*above the maximum"):
            config.load(path, environ={})
    r = podkit("config", env={"PATH": "/usr/bin:/bin", "PODKIT_WATCHDOG_INTERVAL_S": "1e12"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "2592000 (30 days)" in r.stderr, r.stderr
    row = next(r for r in config.settings_table().splitlines() if "`PODKIT_WATCHDOG_INTERVAL_S`" in r)
    assert "| 0.1..2592000 |" in row, row


def test_safe_mode_under_a_config_error_reads_no_env_twin_past_its_range(monkeypatch):
    """A broken config's safe mode reads the cost guard's settings from their env twins alone: a huge
    one there is the default, not a timer that overflows."""
    import time

    from podkit.boot import boot

    def limit():
        g = boot._why(None, None, "config", "", "").guards
        return guards.sooner(g["stop_pod_after_s"], g["stop_pod_at"], time.time())

    monkeypatch.setenv("PODKIT_GUARD_STOP_POD_AFTER_S", "1e12")
    monkeypatch.setenv("PODKIT_GUARD_STOP_POD_AT", "1e15")
    assert limit() == (3600.0, "guard.stop_pod_after_s")
    monkeypatch.setenv("PODKIT_GUARD_STOP_POD_AFTER_S", "7200")
    assert limit() == (7200.0, "guard.stop_pod_after_s")


BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi", strict=True)) + "nosuchkey: 1\n"


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded_and_nothing_is_cached(tmp_path):
    """Nine lines of aliases of aliases stand for 9**9 values: refused from the parse, in well under a
    second, and nothing is written to the volume's parse cache (it was: 256 MB on every boot). Only a
    config that passed every check is cached; one alias in a config is fine."""
    import time

    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    env = {"PODKIT_WORKSPACE": str(ws)}
    assert len(BOMB) < 500
    start = time.monotonic()
    with pytest.raises(ConfigError, match="expands to .* values through YAML aliases"):
        config.load(write(tmp_path, BOMB), environ=env)
    assert time.monotonic() - start < 1
    with pytest.raises(ConfigError, match="unknown key"):
        config.load(write(tmp_path, "trainer:\n  checkpoint_evry: 5\n"), environ=env)
    assert not (ws / ".podkit" / "config-cache.json").exists()
    good = write(tmp_path, "reap:\n  grace_s: &wait 7\n  kill_wait_s: *wait\n")
    assert config.load(good, environ=env).reap.kill_wait_s == 7
    assert (ws / ".podkit" / "config-cache.json").exists()


def test_invalid_yaml_reports_line_and_column(tmp_path):
    """A YAML syntax error says where, exit 2."""
    p = write(tmp_path, "trainer:\n  seed: [1, 2\n")
    r = podkit("--config", str(p), "config")
    assert r.returncode == 2 and "invalid YAML" in r.stderr and "line " in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_config_file_is_a_config_error(tmp_path):
    """A config path that does not exist: exit 2 with a hint."""
    r = podkit("--config", str(tmp_path / "nope.yaml"), "config")
    assert r.returncode == 2 and "file not found" in r.stderr


def test_every_key_has_an_env_twin_that_overrides_the_file(tmp_path):
    """PODKIT_<SECTION>_<KEY> overrides the YAML; the env names are unique."""
    assert len(config.ENV_KEYS) == sum(len(k) for k in settings.SCHEMA.values())
    p = write(tmp_path, "reap:\n  grace_s: 2\ntrainer:\n  checkpoint_every: 7\n")
    cfg = config.load(p, environ={"PODKIT_REAP_GRACE_S": "9.5", "PODKIT_WORKSPACE": str(tmp_path)})
    assert cfg.reap.grace_s == 9.5 and cfg.trainer.checkpoint_every == 7
    assert cfg.workspace == str(tmp_path) and cfg.repo.dest == str(tmp_path / "repo")


def test_env_twin_with_a_wrong_type_names_the_variable():
    """A bad env value names the env var and the key."""
    with pytest.raises(ConfigError, match=r"env PODKIT_TRAINER_CHECKPOINT_EVERY: trainer.checkpoint_every: "
                                          r"expected a whole number"):
        config.load(environ={"PODKIT_TRAINER_CHECKPOINT_EVERY": "often"})


def test_unknown_podkit_env_var_is_warned_with_a_suggestion():
    """A typo in an env var is not silently ignored."""
    cfg = config.load(environ={"PODKIT_REAP_GRACE": "3"})
    assert any("PODKIT_REAP_GRACE" in w and "PODKIT_REAP_GRACE_S" in w for w in cfg.warnings)


def test_rendered_env_round_trips_to_the_same_config(tmp_path):
    """Programs reload the config from the env that render exports: it must be the same config."""
    cfg = config.load(ROOT / "configs" / "smoke.yaml", environ={"PODKIT_WORKSPACE": str(tmp_path)})
    again = config.load(environ=cfg.as_env())
    assert again.values == cfg.values


def test_shipped_default_config_is_the_schema_default():
    """configs/default.yaml documents every key and equals what the code uses."""
    assert (ROOT / "configs" / "default.yaml").read_text() == config.render_default_yaml()
    cfg = config.load(ROOT / "configs" / "default.yaml", environ={})
    assert cfg.values == config.load(environ={}).values


def test_shipped_smoke_config_loads():
    """configs/smoke.yaml is valid and runs the stand-in and the fake trainer without reaping."""
    cfg = config.load(ROOT / "configs" / "smoke.yaml", environ={})
    assert cfg.inference.kind == "standin" and cfg.trainer.kind == "fake" and cfg.reap.enabled == "never"


def test_an_edited_config_file_is_read_again_not_served_from_the_parse_cache(tmp_path):
    """The parse cache never hides an edit: a changed file (size or mtime) is parsed again."""
    p = write(tmp_path, "trainer:\n  seed: 1\n")
    assert config.load(p, environ={}).trainer.seed == 1
    assert config.load(p, environ={}).trainer.seed == 1
    p.write_text("trainer:\n  seed: 22\n")
    assert config.load(p, environ={}).trainer.seed == 22
    p.write_text("trainer:\n  checkpoint_evry: 5\n")
    with pytest.raises(ConfigError, match="unknown key"):
        config.load(p, environ={})


def test_a_cluster_node_reads_its_rank_and_addresses_from_runpods_env_and_keeps_its_records_apart(tmp_path):
    from podkit import programs

    env = {"PODKIT_WORKSPACE": str(tmp_path), "NODE_RANK": "1", "PRIMARY_ADDR": "10.65.0.2", "NODE_ADDR": "10.65.0.3"}
    cfg = config.load(ROOT / "configs" / "cluster-2x8.yaml", environ=env)
    c = cfg.cluster
    assert (c.rank, c.head, c.node_addr, c.ifname) == (1, "10.65.0.2", "10.65.0.3", "ens1")
    # Beside rank 0's on the shared volume, never in them: boots, lease, safe mode, logs; a run dir of its own.
    assert cfg.state_dir == tmp_path / ".podkit" / "node-1" and cfg.log_dir == tmp_path / "logs" / "node-1"
    assert cfg.run_path.name.endswith("-n1")
    assert programs.idle_because(cfg, "trainer") and programs.idle_because(cfg, "sglang")
    assert not programs.idle_because(cfg, "ray")
    head = config.load(ROOT / "configs" / "cluster-2x8.yaml", environ={**env, "NODE_RANK": "0", "NODE_ADDR": ""})
    assert head.state_dir == tmp_path / ".podkit" and head.cluster.node_addr == "10.65.0.2"
    assert not programs.idle_because(head, "trainer") and programs.idle_because(head, "sglang")
    single = config.load(environ={"PODKIT_WORKSPACE": str(tmp_path)})
    assert single.cluster.rank == 0 and programs.idle_because(single, "ray") and not single.multi_node


@pytest.mark.parametrize("env, key, words", [
    ({}, "cluster.rank", "NODE_RANK"),                                              # a node that does not know its rank
    ({"NODE_RANK": "2", "PRIMARY_ADDR": "10.65.0.2", "NODE_ADDR": "x"}, "cluster.rank", "rank 2 of a 2-node"),
    ({"NODE_RANK": "1", "NODE_ADDR": "10.65.0.3"}, "cluster.head", "empty on a multi-node run"),
])
def test_a_cluster_node_that_cannot_tell_who_it_is_gets_a_config_error(tmp_path, env, key, words):
    with pytest.raises(ConfigError) as e:
        config.load(ROOT / "configs" / "cluster-2x8.yaml", environ={"PODKIT_WORKSPACE": str(tmp_path), **env})
    assert e.value.key == key and words in e.value.message + e.value.hint, (e.value.key, e.value.message)


@pytest.mark.parametrize("name", ["/abs/path", "../x", "a/b", "..", ".hidden", "x" * 200, "run id"])
def test_a_run_name_that_is_a_path_is_a_config_error_naming_the_key(tmp_path, name):
    """The names become directories that boot clears (<root>/<user>/<experiment>/<trial>): an absolute path
    would make every boot remove <experiment>/run outside podkit's own directories."""
    (tmp_path / "keep").mkdir()
    for key in ("EXPERIMENT", "TRIAL"):
        with pytest.raises(ConfigError, match=rf"env PODKIT_TRAINER_{key}: trainer\.{key.lower()}: .* is not a name"):
            config.load(None, environ={f"PODKIT_TRAINER_{key}": name, "PODKIT_WORKSPACE": str(tmp_path)})
    assert (tmp_path / "keep").is_dir()


def test_podkit_run_id_is_known_and_a_plain_name_is_a_name():
    cfg = config.load(None, environ={"PODKIT_RUN_ID": "run-1a2b", "PODKIT_TRAINER_EXPERIMENT": "myrepo-v2",
                                     "PODKIT_TRAINER_TRIAL": "t1.bigger_model"})
    assert cfg.warnings == [] and (cfg.trainer.experiment, cfg.trainer.trial) == ("myrepo-v2", "t1.bigger_model")
