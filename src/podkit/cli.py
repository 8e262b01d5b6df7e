"""podkit's verbs. Stage names are verbs too: `podkit reap`, `podkit sync`, `podkit render`.

Errors follow click: `podkit: error: ...` on stderr, exit 2 for usage and config errors, 1 for
runtime failures, and no traceback for a person's mistake unless PODKIT_DEBUG is set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from podkit import config, log
from podkit.errors import ConfigError, PodkitError


def _parser():
    import argparse  # not on the entrypoint's fast path

    p = argparse.ArgumentParser(prog="podkit", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="pod config YAML (default: $PODKIT_CONFIG, else built-in defaults)")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    sub.add_parser("boot", help="the container entrypoint: preflight, reap, sync, render, exec supervisord")
    up = sub.add_parser("up", help="run the boot pipeline and supervisord in the foreground (local runs)")
    up.add_argument("--smoke", action="store_true", help="use the built-in no-GPU smoke config")
    up.add_argument("--workspace", help="workspace directory (default: the config's)")
    up.add_argument("--steps", type=int, help="stop everything cleanly once the trainer reaches this step")

    st = sub.add_parser("status", help="programs, trainer progress, inference phase")
    st.add_argument("--json", action="store_true")
    st.add_argument("--workspace")
    st.add_argument("--health", action="store_true", help="exit 0 when healthy, 1 with the reason (healthchecks)")

    dr = sub.add_parser("doctor", help="name the cause of a failure, with evidence and the fix (exit 1 if any)")
    dr.add_argument("--json", action="store_true")
    dr.add_argument("--workspace")

    rs = sub.add_parser("resume", help="leave safe mode: forgive past boots and boot again")
    rs.add_argument("--workspace")

    run = sub.add_parser("run", help="what supervisord runs: sglang | trainer | watchdog | logs")
    run.add_argument("program", choices=["sglang", "trainer", "watchdog", "logs"])

    rp = sub.add_parser("reap", help="stop every process holding the GPU device files")
    rp.add_argument("--devices", help="glob of device files (default: $PODKIT_DEVICES, /dev/nvidia*)")
    rp.add_argument("--grace", type=float, help="SIGTERM to SIGKILL grace, seconds")
    rp.add_argument("--dry-run", action="store_true", help="find and report holders, kill nothing")
    rp.add_argument("--json", action="store_true")

    sy = sub.add_parser("sync", help="bring the training repo to a ref, keeping local work")
    sy.add_argument("--repo", help="repository URL (default: $PODKIT_REPO_URL)")
    sy.add_argument("--ref", help="branch, tag or commit")
    sy.add_argument("--dest", help="checkout directory")
    sy.add_argument("--json", action="store_true")

    ctl = sub.add_parser("ctl", help="supervisorctl for this pod: podkit ctl status | restart sglang | ...")
    ctl.add_argument("--workspace")
    ctl.add_argument("args", nargs=argparse.REMAINDER)

    dp = sub.add_parser("deploy", help="RunPod: create/update the template and start a pod on A40s; "
                        "or stop | terminate | status POD")
    dp.add_argument("action", nargs="?", choices=["create", "stop", "terminate", "status"])
    dp.add_argument("pod", nargs="?", help="pod id (stop, terminate, status)")
    dp.add_argument("--template", help="template YAML (default: runpod/template.yaml)")
    dp.add_argument("--image", help="image to deploy (overrides the template's imageName)")
    dp.add_argument("--gpus", type=int, default=4, help="number of A40s (default 4)")
    dp.add_argument("--cloud", default="SECURE", help="SECURE | COMMUNITY | ALL (default SECURE)")
    dp.add_argument("--name", help="pod name (default <template>-<N>xa40)")
    dp.add_argument("--dry-run", action="store_true", help="print exactly what would be sent; send nothing")
    dp.add_argument("--capacity-timeout", type=float, default=600, help="retry 'no capacity' for this long (s)")
    dp.add_argument("--wait-timeout", type=float, default=900, help="wait this long for the pod to run (s)")
    dp.add_argument("--json", action="store_true")

    sub.add_parser("render", help="check supervisord.conf with the config and print supervisord's settings")
    cf = sub.add_parser("config", help="print the resolved config (or --defaults, the documented default)")
    cf.add_argument("--defaults", action="store_true")
    return p


def _load(args, **overrides):
    path = args.config
    if getattr(args, "smoke", False):
        path = str(config.packaged("configs/smoke.yaml"))
    ov = {k: v for k, v in overrides.items() if v is not None}
    cfg = config.load(path, overrides=ov)
    log.set_level(cfg.log_level)
    return cfg


def dispatch(args) -> int:
    verb = args.verb
    if getattr(args, "json", False):
        log.to_stderr()
    if verb == "boot":
        from podkit import boot

        try:
            cfg = _load(args)
        except ConfigError as e:
            # PID 1 never exits on a bad config: that is a restart loop.
            from podkit import safemode

            ws = Path(os.environ.get("PODKIT_WORKSPACE", "/workspace")) / ".podkit"
            return safemode.wait(ws if ws.parent.is_dir() else None, "config", e.message, e.hint)
        return boot.boot(cfg)
    if verb == "up":
        from podkit import boot

        cfg = _load(args, workspace=args.workspace)
        return boot.up(cfg, steps=args.steps)
    if verb == "status":
        from podkit import status

        cfg = _load(args)
        ws = args.workspace or cfg.workspace
        return status.main(Path(ws).absolute(), args.json, args.health, cfg.health.progress_timeout_s)
    if verb == "doctor":
        from podkit import doctor

        cfg = _load(args)
        return doctor.main(cfg, Path(args.workspace or cfg.workspace).absolute(), args.json)
    if verb == "resume":
        from podkit import guard

        ws = Path(args.workspace or _load(args).workspace).absolute()
        print(guard.resume(ws / ".podkit"))
        return 0
    if verb == "run":
        from podkit import programs

        return programs.run(args.program, _load(args))
    if verb == "reap":
        from podkit import reap

        cfg = _load(args)
        report = reap.run(args.devices or cfg.devices, cfg.reap.grace_s if args.grace is None else args.grace,
                          cfg.reap.kill_wait_s, dry_run=args.dry_run, gpu_timeout_s=cfg.reap.gpu_free_timeout_s)
        if args.json:
            print(report.to_json())
        return 1 if report.survivors else 0
    if verb == "sync":
        from podkit import sync

        cfg = _load(args, **{"repo.url": args.repo, "repo.ref": args.ref, "repo.dest": args.dest})
        r = cfg.repo
        if not r.url:
            raise ConfigError("command line", "repo.url", "no repository given",
                              hint="pass --repo URL or set PODKIT_REPO_URL")
        result = sync.update(r.url, r.ref, r.dest, depth=r.depth, timeout_s=r.timeout_s, retries=r.retries,
                             lock_timeout_s=r.lock_timeout_s)
        if args.json:
            print(result.to_json())
        return 0
    if verb == "ctl":
        from podkit import preflight
        from podkit.state import read_json

        ws = Path(args.workspace or _load(args).workspace).absolute()
        current = read_json(ws / ".podkit" / "current.json", {}) or {}
        if not current.get("run_dir"):
            raise PodkitError(f"no podkit has booted on {ws}", "start it with podkit boot or podkit up")
        exe = str(Path(preflight.supervisord_path() or "supervisord").with_name("supervisorctl"))
        argv = [exe, "-c", str(Path(current["run_dir"]) / "supervisorctl.conf"), *args.args]
        os.execv(argv[0], argv)
    if verb == "deploy":
        from podkit import deploy

        return deploy.main(args)
    if verb == "render":
        from podkit import render

        cfg = _load(args)
        cfg.run_path.mkdir(parents=True, exist_ok=True, mode=0o700)
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        render.write(cfg, full_check=True)
        print((cfg.run_path / "podkit.env").read_text(), end="")
        return 0
    if verb == "config":
        if args.defaults:
            print(config.render_default_yaml(), end="")
            return 0
        import yaml

        print(yaml.safe_dump(_load(args).as_dict(), sort_keys=False), end="")
        return 0
    raise AssertionError(verb)


class _Args:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The entrypoint's exact call skips argparse: it is on every container start's critical path.
    args = _Args(verb="boot", config=None) if argv == ["boot"] else _parser().parse_args(argv)
    try:
        return dispatch(args)
    except PodkitError as e:
        if os.environ.get("PODKIT_DEBUG"):
            raise
        print(f"podkit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
