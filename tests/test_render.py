"""supervisord.conf and the docs are checked against the code: the real supervisor parser reads the
shipped file with the rendered settings, and the README's table lists every setting."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from podkit import config, render
from podkit.errors import StageError

pytestmark = pytest.mark.timeout(60)


def parsed(cfg_path, tmp_path):
    cfg = config.load(cfg_path, environ={"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run")})
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "run").mkdir(exist_ok=True)
    return cfg, render.check_supervisord_conf(ROOT / "supervisord.conf", render.environment(cfg, base={}))


@pytest.mark.parametrize("cfg_name", ["default.yaml", "smoke.yaml"])
def test_shipped_supervisord_conf_parses_with_supervisors_own_parser(cfg_name, tmp_path):
    """Both programs in their own process group, trainer stopping before inference, graces from the config."""
    cfg, opts = parsed(ROOT / "configs" / cfg_name, tmp_path)
    progs = {g.name: g.process_configs[0] for g in opts.process_group_configs}
    assert set(progs) == {"logs", "metrics", "sglang", "ray", "trainer", "watchdog"}
    for name in ("sglang", "ray", "trainer", "metrics"):
        assert progs[name].stopasgroup and progs[name].killasgroup
        assert progs[name].stdout_events_enabled and progs[name].redirect_stderr
    assert progs["sglang"].priority < progs["trainer"].priority, "trainer must stop first"
    assert progs["ray"].priority < progs["trainer"].priority, "the launcher's ranks run in Ray: it stops after them"
    assert progs["trainer"].stopwaitsecs == cfg.trainer.stop_grace_s
    assert progs["sglang"].stopwaitsecs == cfg.inference.stop_grace_s
    from supervisor.datatypes import RestartUnconditionally, RestartWhenExitUnexpected

    assert progs["trainer"].autorestart is RestartWhenExitUnexpected and progs["trainer"].exitcodes == [0]
    assert progs["sglang"].autorestart is RestartUnconditionally


def test_supervisord_listens_on_a_unix_socket_only(tmp_path):
    """No inet_http_server; the unix socket is chmod 0700."""
    _, opts = parsed(ROOT / "configs" / "smoke.yaml", tmp_path)
    servers = opts.configroot.supervisord.server_configs
    kinds = [s["family"] for s in servers]
    import socket

    assert kinds == [socket.AF_UNIX]
    assert servers[0]["chmod"] == 0o700


def test_boot_check_names_a_setting_the_conf_needs_but_render_lacks(tmp_path):
    """The cheap boot-time check catches a supervisord.conf that names an unknown setting."""
    conf = tmp_path / "supervisord.conf"
    conf.write_text((ROOT / "supervisord.conf").read_text() + "\n; %(ENV_PODKIT_NO_SUCH)s\n")
    with pytest.raises(StageError, match="no value for PODKIT_NO_SUCH"):
        render.check_env_refs(conf, {k: "x" for k in render.ENV_REF.findall((ROOT / "supervisord.conf").read_text())})


def test_readme_starts_with_the_two_commands():
    """The README's first two commands: the smoke stack, then the tests."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    commands = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    assert commands[:2] == ["make run", "make test"]


def test_readme_settings_table_lists_every_setting_with_its_default():
    """Every setting's env twin and default appear in one row of the README table."""
    rows = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| `")]
    for section, keys in config.SCHEMA.items():
        for key, spec in keys.items():
            env = config.env_name(section, key)
            row = next((r for r in rows if f"`{env}`" in r), None)
            assert row, f"{env} missing from the README settings table"
            default = config._format(spec.default) or '""'
            assert f"`{default}`" in row, f"{env}: README default differs from {default!r}"
