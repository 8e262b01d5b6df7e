"""The render stage: turn the validated config into supervisord's environment and check that
supervisord.conf, expanded with it, parses with supervisor's own parser before the exec."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

from podkit import config, log, programs
from podkit.errors import StageError
from podkit.host import pid1

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
    env.update(stop_budget(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


PAGE_TOKEN_FILE = "page-token"  # in the run dir (local disk, 0700): the page program's secret, no one else's


def hand_page_token(cfg, env: dict[str, str]) -> None:
    """The page's token goes to the page alone: supervisord hands its environment to every program (the user's
    trainer among them), so it is taken out of that and written to the run dir, 0600, where the page reads it
    (page.token). Without one, a file a run before left is removed."""
    from podkit.areal.checks import PAGE_TOKEN_ENV

    token = env.pop(PAGE_TOKEN_ENV, None)
    path = cfg.run_path / PAGE_TOKEN_FILE
    if not token:
        path.unlink(missing_ok=True)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)


MARGIN_S = 1.5  # the stop ends this long before the container's stop timeout: PID 1's own exit, a loaded host
OWN_S = 1.0     # podkit's own part of the stop: watchdog, inference, metrics, the listener, supervisord's turns


def stop_budget(cfg) -> dict[str, str]:
    """The stop as one deadline inside the container's stop timeout (stop_timeout_s), as supervisord's
    environment. The rules, in the order they apply:
    1. PID 1 kills whatever still runs MARGIN_S before the stop timeout, and exits by itself
       (PODKIT_STOP_DEADLINE_S, counted from the SIGTERM: pid1.patch_supervisord).
    2. podkit's own work gets OWN_S of that: the programs supervisord stops after the trainer, one by one.
    3. The trainer gets what is left, in whole seconds (stopwaitsecs): trainer.stop_grace_s, cut to it.
    4. Inference gets its stop_grace_s and the ray program the trainer's grace and Ray's drain (45 s), each
       cut to the deadline: after the trainer, the deadline decides.
    5. A notification gets what remains of the deadline, none past it (notify.py).
    6. The log listener stops last, after the trainer has exited with its checkpoint, and uploads that checkpoint
       (checkpoint.remote) in what the deadline leaves, less its own second (programs/logs.py FINAL_RESERVE_S),
       at most checkpoint.remote_final_s: its stopwaitsecs is the whole deadline, so supervisord never kills it
       first; PID 1's kill at the deadline is the bound. The trainer's checkpoint comes first: the upload is never
       given time the trainer's grace needs (a checkpoint that is not written cannot be uploaded).
    The programs read the trainer's grace as trainer.stop_grace_s: the checkpoint it must fit is theirs."""
    deadline = cfg.stop_timeout_s - MARGIN_S
    trainer = max(1, min(cfg.trainer.stop_grace_s, int(deadline - OWN_S)))
    return {pid1.STOP_DEADLINE_ENV: f"{deadline:g}", "PODKIT_TRAINER_STOP_GRACE_S": str(trainer),
            "PODKIT_LOGS_STOP_WAIT_S": str(max(1, math.ceil(deadline))),
            "PODKIT_INFERENCE_STOP_GRACE_S": str(max(1, min(cfg.inference.stop_grace_s, int(deadline)))),
            "PODKIT_RAY_STOP_WAIT_S": str(max(1, min(trainer + 45, int(deadline))))}


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
    hand_page_token(cfg, env)
    conf = config.packaged("supervisord.conf")
    (check_supervisord_conf if full_check else check_env_refs)(conf, env)
    # supervisorctl cannot expand supervisord.conf's %(ENV_...)s outside supervisord: give it the literal URL.
    (cfg.run_path / "supervisorctl.conf").write_text(f"[supervisorctl]\nserverurl=unix://{cfg.socket_path}\n")
    grace = int(env["PODKIT_TRAINER_STOP_GRACE_S"])
    if grace < cfg.trainer.stop_grace_s:
        _log.warn(f"trainer.stop_grace_s ({cfg.trainer.stop_grace_s} s) does not fit the container's stop timeout "
                  f"(stop_timeout_s: {cfg.stop_timeout_s:g} s): the trainer gets {grace} s to checkpoint; give the "
                  "container longer to stop (docker stop -t, compose stop_grace_period) and set stop_timeout_s to it")
    lines = [f"{k}={v}" for k, v in sorted(cfg.as_env(shown=True).items())]  # a record: no remote's secret
    (cfg.run_path / "podkit.env").write_text("\n".join(lines) + "\n")
    _log.info(f"supervisord.conf {'parsed' if full_check else 'checked'}; {len(lines)} settings in {cfg.run_path / 'podkit.env'}")
    return env
