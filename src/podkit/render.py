"""The render stage: turn the validated config into supervisord's environment and check that
supervisord.conf, expanded with it, parses with supervisor's own parser before the exec."""

from __future__ import annotations

import os
import sys

from podkit import config, log
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
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_supervisord_conf(path, env: dict[str, str]) -> None:
    from supervisor.options import ServerOptions

    opts = ServerOptions()
    opts.environ_expansions = {f"ENV_{k}": v for k, v in env.items()}
    opts.configfile = str(path)
    try:
        opts.process_config(do_usage=False)
    except ValueError as e:
        raise StageError("render", f"{path}: {e}", "fix supervisord.conf; `podkit render` checks it") from None
    names = sorted(g.name for g in opts.process_group_configs)
    for want in ("sglang", "trainer"):
        if want not in names:
            raise StageError("render", f"{path}: no [program:{want}] section", "podkit supervises sglang and trainer")


def write(cfg) -> dict[str, str]:
    env = environment(cfg)
    conf = config.packaged("supervisord.conf")
    check_supervisord_conf(conf, env)
    # supervisorctl cannot expand supervisord.conf's %(ENV_...)s outside supervisord: give it the literal URL.
    (cfg.run_path / "supervisorctl.conf").write_text(f"[supervisorctl]\nserverurl=unix://{cfg.socket_path}\n")
    lines = [f"{k}={v}" for k, v in sorted(cfg.as_env().items())]
    (cfg.run_path / "podkit.env").write_text("\n".join(lines) + "\n")
    _log.info(f"supervisord.conf checked; {len(lines)} settings in {cfg.run_path / 'podkit.env'}")
    return env
