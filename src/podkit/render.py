"""The render stage: turn the validated config into supervisord's environment and check that
supervisord.conf, expanded with it, parses with supervisor's own parser before the exec."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from podkit import config, log, programs
from podkit.errors import StageError

_log = log.get("render")


def environment(cfg, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # Programs read the rendered settings from env only: a config file edited after boot cannot
    # give a restarted program different settings from its sibling.
    env.pop("PODKIT_CONFIG", None)
    env.update(cfg.as_env())
    env["PODKIT_PYTHON"] = sys.executable
    env["PODKIT_UID"] = str(os.getuid())
    env["PODKIT_LOG_DIR"] = str(cfg.log_dir)  # <workspace>/logs, or logs/node-<rank> on a cluster's other nodes
    # The ray program first lets this node's trainer ranks finish their step (trainer.stop_grace_s), then Ray drains.
    env["PODKIT_RAY_STOP_WAIT_S"] = str(cfg.trainer.stop_grace_s + 45)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_supervisord_conf(path, env: dict[str, str]):
    """Parse `path` with supervisor's own parser, expanded with `env`; returns the parsed options."""
    # `podkit render` and the tests only: importing supervisor's parser costs half of supervisord's start-up.
    from supervisor.options import ServerOptions

    opts = ServerOptions()
    opts.environ_expansions = {f"ENV_{k}": v for k, v in env.items()}
    opts.configfile = str(path)
    try:
        opts.process_config(do_usage=False)
    except ValueError as e:
        raise StageError("render", f"{path}: {e}", "fix supervisord.conf; `podkit render` checks it") from None
    names = {g.name for g in opts.process_group_configs}
    missing, unknown = set(programs.NAMES) - names, names - set(programs.NAMES)
    if missing or unknown:
        what = ", ".join([*(f"no [program:{n}] section" for n in sorted(missing)),
                          *(f"[program:{n}] is not a podkit program" for n in sorted(unknown))])
        raise StageError("render", f"{path}: {what}",
                         f"supervisord.conf runs exactly podkit's programs: {', '.join(programs.NAMES)}")
    return opts


ENV_REF = re.compile(r"%\(ENV_([A-Za-z0-9_]+)\)s")


def check_env_refs(path, env: dict[str, str]) -> None:
    """The boot-time check: every %(ENV_X)s in supervisord.conf has a value. The full parse by
    supervisor's own parser (`check_supervisord_conf`) costs half of supervisord's start-up, so it
    runs in `podkit render` and in the test suite against the shipped file, not on every boot."""
    missing = sorted({m for m in ENV_REF.findall(Path(path).read_text()) if m not in env})
    if missing:
        raise StageError("render", f"{path}: no value for {', '.join(missing)}",
                         "supervisord.conf names settings podkit does not render; use the shipped file")


def run(cfg, full_check: bool = False) -> dict[str, str]:
    """The stage: supervisord's environment, checked against supervisord.conf, and the run dir's
    files for supervisorctl and people. `full_check` parses supervisord.conf with supervisor's own
    parser (`podkit render`), which costs half of supervisord's start-up, so boot skips it."""
    env = environment(cfg)
    conf = config.packaged("supervisord.conf")
    (check_supervisord_conf if full_check else check_env_refs)(conf, env)
    # supervisorctl cannot expand supervisord.conf's %(ENV_...)s outside supervisord: give it the literal URL.
    (cfg.run_path / "supervisorctl.conf").write_text(f"[supervisorctl]\nserverurl=unix://{cfg.socket_path}\n")
    lines = [f"{k}={v}" for k, v in sorted(cfg.as_env().items())]
    (cfg.run_path / "podkit.env").write_text("\n".join(lines) + "\n")
    _log.info(f"supervisord.conf {'parsed' if full_check else 'checked'}; {len(lines)} settings in {cfg.run_path / 'podkit.env'}")
    return env
