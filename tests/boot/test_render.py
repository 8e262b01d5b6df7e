"""supervisord.conf and the docs are checked against the code: the real supervisor parser reads the
shipped file with the rendered settings, docs/configuration.md holds the settings table the schema
generates, and every relative link in the README and docs/ leads to a file."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from podkit import config, settings
from podkit.boot import render
from podkit.errors import StageError

pytestmark = pytest.mark.timeout(60)


def parsed(cfg_path, tmp_path):
    cfg = config.load(cfg_path, environ={"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run")})
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "run").mkdir(exist_ok=True)
    return cfg, render.check_supervisord_conf(ROOT / "supervisord.conf", render.environment(cfg, base={}))


@pytest.mark.parametrize("cfg_name", ["default.yaml", "smoke.yaml"])
def test_shipped_supervisord_conf_parses_with_supervisors_own_parser(cfg_name, tmp_path):
    """Both programs in their own process group, trainer stopping before inference, graces from the config
    as the stop budget cuts them (render.stop_budget)."""
    cfg, opts = parsed(ROOT / "configs" / cfg_name, tmp_path)
    progs = {g.name: g.process_configs[0] for g in opts.process_group_configs}
    assert set(progs) == {"logs", "metrics", "page", "sglang", "ray", "trainer", "watchdog"}
    for name in ("sglang", "ray", "trainer", "metrics", "page"):
        assert progs[name].stopasgroup and progs[name].killasgroup
        assert progs[name].stdout_events_enabled and progs[name].redirect_stderr
    assert progs["sglang"].priority < progs["trainer"].priority, "trainer must stop first"
    assert progs["ray"].priority < progs["trainer"].priority, "the launcher's ranks run in Ray: it stops after them"
    budget = render.stop_budget(cfg)
    assert progs["trainer"].stopwaitsecs == int(budget["PODKIT_TRAINER_STOP_GRACE_S"]) <= cfg.trainer.stop_grace_s
    assert progs["sglang"].stopwaitsecs == int(budget["PODKIT_INFERENCE_STOP_GRACE_S"]) <= cfg.inference.stop_grace_s
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


SETTINGS_BEGIN, SETTINGS_END = "<!-- settings:begin -->\n", "\n<!-- settings:end -->"
REGENERATE = ("regenerate it: paste the output of `PYTHONPATH=src python -c 'from podkit import config; "
              "print(config.settings_table())'` between the markers in docs/configuration.md")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def test_settings_table_generated_from_the_schema_lists_every_setting_with_its_default():
    """Each setting has one row with its env twin and its default, in the schema's order."""
    rows = config.settings_table().splitlines()
    assert rows[:2] == ["| setting | env var | default | unit | range | meaning |", "|---|---|---|---|---|---|"]
    expected = [(config.env_name(s, k), config._format(spec.default) or '""')
                for s, keys in settings.SCHEMA.items() for k, spec in keys.items()]
    assert len(rows) == 2 + len(expected)
    for row, (env, default) in zip(rows[2:], expected, strict=True):
        assert f"| `{env}` | `{default}` |" in row, f"{env}: row {row!r}"


def test_configuration_page_holds_exactly_the_generated_settings_table():
    """A setting added or changed in the schema fails here until docs/configuration.md is regenerated."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert text.count(SETTINGS_BEGIN) == 1 and text.count(SETTINGS_END) == 1, \
        f"docs/configuration.md needs one {SETTINGS_BEGIN.strip()} ... {SETTINGS_END.strip()} pair; {REGENERATE}"
    between = text.split(SETTINGS_BEGIN, 1)[1].split(SETTINGS_END, 1)[0]
    assert between == config.settings_table(), f"docs/configuration.md's settings table is stale; {REGENERATE}"


def links(text: str) -> list[str]:
    """The targets of a markdown text's links, outside fenced code blocks and inline code."""
    prose = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    prose = re.sub(r"(`+).+?\1", "", prose, flags=re.S)
    return LINK.findall(prose) + REFERENCE.findall(prose)


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file_without_an_anchor():
    """A page moved or renamed breaks no link, and no link relies on a heading's anchor staying put."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    broken = []
    for page in pages:
        for target in links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
                continue
            if "#" in target:
                broken.append(f"{page.relative_to(ROOT)}: {target} (an anchor)")
            elif not (page.parent / target).is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
    assert not broken, "\n".join(broken)
