"""podkit's verbs, one table. Stage names are verbs too: `podkit preflight`, `podkit reap`, `podkit sync`,
`podkit setup`, `podkit render` run the stage exactly as `podkit boot` does.

Every verb is a small function of (cfg, args). `--config` picks the pod config and `--workspace`
overrides its workspace, for every verb that takes them. Errors follow click: `podkit: error: ...` on
stderr, exit 2 for usage and config errors, 1 for runtime failures, and no traceback for a person's
mistake unless PODKIT_DEBUG is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from podkit import config, log
from podkit.errors import ConfigError, PodkitError


class Verb:
    def __init__(self, name, fn, help, options, *, workspace: bool, load: bool, tolerant: bool) -> None:
        self.name, self.fn, self.help, self.options = name, fn, help, options
        self.workspace, self.load, self.tolerant = workspace, load, tolerant


VERBS: dict[str, Verb] = {}


def opt(*flags: str, override: str | None = None, **kw):
    """An option of a verb; `override` names the setting it sets (`section.key`)."""
    return flags, override, kw


def verb(name: str, help: str, *options, workspace: bool = False, load: bool = True, tolerant: bool = False):
    """`tolerant`: a verb that reads a workspace (status, doctor...) still works under a broken config:
    the config error is what it must then show, not what stops it."""
    def add(fn):
        VERBS[name] = Verb(name, fn, help, options, workspace=workspace, load=load, tolerant=tolerant)
        return fn
    return add


def load(args, **overrides) -> config.Config:
    """The config this verb works on: --config (or $PODKIT_CONFIG), the verb's overrides, --workspace."""
    v = VERBS[args.verb]
    ov = {o[1]: getattr(args, _dest(o)) for o in v.options if o[1]}
    if v.workspace:
        ov["workspace"] = getattr(args, "workspace", None)
    ov.update(overrides)
    cfg = config.load(args.config, overrides={k: x for k, x in ov.items() if x is not None})
    log.set_level(cfg.log_level)
    return cfg


def load_tolerant(args) -> config.Config:
    """The config, or, when it does not load, the defaults with only the workspace from --workspace or
    PODKIT_WORKSPACE: a pod waiting in safe mode over a bad config must still be looked at."""
    try:
        return load(args)
    except ConfigError as e:
        print(f"podkit: warning: {e.message}; reading the workspace with the default settings", file=sys.stderr)
        ws = getattr(args, "workspace", None) or os.environ.get("PODKIT_WORKSPACE") or "/workspace"
        fallback = config.load(None, environ={}, overrides={"workspace": ws})
        fallback.load_error = (str(e), args.config or os.environ.get("PODKIT_CONFIG"))  # for doctor --bundle
        return fallback


def _dest(option) -> str:
    flags, _, kw = option
    return kw.get("dest") or flags[0].lstrip("-").replace("-", "_")


# Each verb imports its modules when it runs: `podkit boot`, the container's entrypoint, loads the boot
# path and nothing else (pinned by tests/boot/test_boot_imports.py).

# -- the boot sequence and local runs ----------------------------------------------------------------------
@verb("boot", "the container entrypoint: preflight, reap, sync, setup, render, exec supervisord", load=False)
def _boot(_cfg, args) -> int:
    from podkit.boot import boot

    return boot.main(args.config)  # total: supervisord or safe mode, whatever happens


@verb("up", "run the boot pipeline and supervisord in the foreground (local runs)",
      opt("--smoke", action="store_true", help="use the built-in no-GPU smoke config"),
      opt("--steps", type=int, help="stop everything cleanly once the trainer reaches this step"),
      workspace=True, load=False)
def _up(_cfg, args) -> int:
    from podkit.boot import boot

    if args.smoke:
        args.config = str(config.packaged("configs/smoke.yaml"))
    return boot.up(load(args), steps=args.steps)


# -- the stages --------------------------------------------------------------------------------------------
@verb("preflight", "check the workspace, the run dir and that the config can train", workspace=True)
def _preflight(cfg, args) -> int:
    from podkit.boot import preflight

    preflight.run(cfg)
    return 0


@verb("reap", "stop every process holding the GPU device files (what boot does; always, when asked)",
      opt("--devices", override="devices", help="glob of device files (default: $PODKIT_DEVICES, /dev/nvidia*)"),
      opt("--grace", type=float, override="reap.grace_s", help="SIGTERM to SIGKILL grace, seconds"),
      opt("--dry-run", action="store_true", help="find and report holders, kill nothing"),
      opt("--json", action="store_true"), load=False)
def _reap(_cfg, args) -> int:
    from podkit.boot import reap

    # A person asking for the stage is an explicit request: `auto` would skip it off the entrypoint.
    cfg = load(args, **({} if os.environ.get("PODKIT_REAP_ENABLED") == "never" else {"reap.enabled": "always"}))
    try:
        report = reap.run(cfg, dry_run=args.dry_run)
    except reap.ReapFailed as e:
        if args.json:
            print(e.report.to_json())
        raise
    if args.json:
        print(report.to_json())
    return 1 if report.survivors else 0


@verb("sync", "bring the training repo to a ref, keeping local work (what boot does)",
      opt("--repo", override="repo.url", help="repository URL (default: $PODKIT_REPO_URL)"),
      opt("--ref", override="repo.ref", help="branch, tag or commit"),
      opt("--dest", override="repo.dest", help="checkout directory"),
      opt("--json", action="store_true"), workspace=True)
def _sync(cfg, args) -> int:
    if not cfg.repo.url:
        raise ConfigError("command line", "repo.url", "no repository given",
                          hint="pass --repo URL or set PODKIT_REPO_URL")
    from podkit.boot import sync

    result = sync.run(cfg)
    if args.json:
        print(result.to_json())
    return 0


@verb("setup", "install the training repo's requirements (repo.setup) into its environment on the volume "
      "(what boot does)", opt("--json", action="store_true"), workspace=True)
def _setup(cfg, args) -> int:
    from podkit.boot import setup

    rec = setup.run(cfg)
    if args.json:
        print(json.dumps(rec))
    elif rec is None:
        print("repo.setup is empty: the trainer runs the image's Python")
    return 0


@verb("render", "check supervisord.conf with the config (supervisor's own parser) and print its settings",
      workspace=True)
def _render(cfg, args) -> int:
    from podkit.boot import preflight, render

    preflight.private_dir(cfg.run_path)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    render.run(cfg, full_check=True)
    print((cfg.run_path / "podkit.env").read_text(), end="")
    return 0


# -- while running -----------------------------------------------------------------------------------------
@verb("status", "programs, trainer progress, inference phase",
      opt("--json", action="store_true"),
      opt("--health", action="store_true", help="exit 0 when healthy, 1 with the reason (healthchecks)"),
      workspace=True, tolerant=True)
def _status(cfg, args) -> int:
    from podkit.views import status

    return status.main(cfg.workspace_path, args.json, args.health, cfg.health.progress_timeout_s, cfg.multi_node,
                       cfg=cfg)


@verb("doctor", "name the cause of a failure, with evidence and the fix (exit 1 if any)",
      opt("--json", action="store_true"),
      opt("--bundle", metavar="FILE.tar.gz",
          help="instead, gather a bug report: versions, config, records, logs, stacks, GPU facts; secrets redacted"),
      workspace=True, tolerant=True)
def _doctor(cfg, args) -> int:
    if args.bundle:
        from podkit.views import bundle

        return bundle.main(cfg, Path(args.bundle))
    from podkit.views import doctor

    return doctor.main(cfg, cfg.workspace_path, args.json)


@verb("resume", "start training again: in safe mode, forgive past boots and boot again; on a running pod whose "
      "trainer stopped for good, sync the repo (the fix you pushed), set it up and start the trainer",
      workspace=True, tolerant=True)
def _resume(cfg, args) -> int:
    from podkit.boot import boot, guard

    if not getattr(cfg, "load_error", None) and boot.live_supervisord(cfg):
        return boot.resume_trainer(cfg)
    print(guard.resume(cfg.state_dir))
    return 0


@verb("start-over", "move this run's AReaL checkpoints aside (kept, never deleted), so that its trainer starts "
      "from step 0 (e.g. it found another run's checkpoint under its names); then start the trainer",
      opt("--dry-run", action="store_true"), workspace=True)
def _start_over(cfg, args) -> int:
    from podkit.areal import identity
    from podkit.remote import remote

    return identity.start_over(cfg, args.dry_run, then=lambda: remote.new_lineage(cfg, "start-over"))


@verb("adopt", "resume the checkpoint under this run's names as this run's own, where the trainer stopped saying "
      "another run wrote it and you know it is this run (a script renamed, the repo or the model moved); then "
      "start the trainer", opt("--dry-run", action="store_true"), workspace=True)
def _adopt(cfg, args) -> int:
    from podkit.areal import identity
    from podkit.remote import remote

    return identity.adopt(cfg, args.dry_run, then=lambda: remote.new_lineage(cfg, "adopt"))


@verb("restore", "the restore stage again, on a pod whose trainer is stopped: the newest whole checkpoint of the "
      "run's lineage from checkpoint.remote onto the volume, when it is newer than the volume's (what boot does)",
      workspace=True)
def _restore(cfg, args) -> int:
    from podkit.areal import identity
    from podkit.boot import restore

    identity.own_run(cfg, "restore")  # refused while the trainer runs: its checkpoints are in use
    if not cfg.checkpoint.remote:
        print("checkpoint.remote is not set: there is nothing to restore from")
        return 0
    step = restore.run(cfg)
    print(f"restored step {step}: start the trainer (`podkit ctl start trainer`)" if step is not None else
          "nothing restored (the log lines above say why)")
    return 0


@verb("weights", "put inference.model's weights on the volume before the GPU pod needs them: from the hub "
      "into the volume's HF cache, or --from DIR copied under <workspace>/models",
      opt("--from", dest="source", help="a local model directory to copy onto the volume"), workspace=True)
def _weights(cfg, args) -> int:
    from podkit.boot import weights

    return weights.main(cfg, args.source)


@verb("guard", "the cost guards of a running pod, changed without a restart (RunPod restarts a pod whose env is "
      "edited): show | set KEY=VALUE... | clear [KEY...]; keys {guards}",
      opt("action", nargs="?", choices=["show", "set", "clear"], default="show"),
      opt("settings", nargs="*", metavar="KEY=VALUE", help="set: KEY=VALUE pairs; clear: keys (none: all)"),
      opt("--json", action="store_true"), workspace=True, tolerant=True)
def _guard(cfg, args) -> int:
    from podkit.money import guardfile

    return guardfile.main(cfg, args.action, args.settings, args.json)


@verb("ctl", "supervisorctl for this pod: podkit ctl status | restart sglang | ...",
      opt("args", nargs="REMAINDER"), workspace=True, tolerant=True)
def _ctl(cfg, args) -> int:
    from podkit import records
    from podkit.boot import preflight

    current = records.CURRENT.read(cfg.state_dir)
    if not current.get("run_dir"):
        raise PodkitError(f"no podkit has booted on {cfg.workspace_path}", "start it with podkit boot or podkit up")
    exe = str(Path(preflight.supervisord_path() or "supervisord").with_name("supervisorctl"))
    argv = [exe, "-c", str(Path(current["run_dir"]) / "supervisorctl.conf"), *args.args]
    words = [a for a in args.args if not a.startswith("-")]
    if words and words[0] in ("stop", "restart") and words[1:]:
        from podkit.judge import ending

        # Who asks: the program stopped says "stopped by you", and its stop is never counted as a failure.
        names = [w.split(":")[0] for w in words[1:]]  # "trainer", "trainer:*": each program is its own group
        ending.ask(Path(current["run_dir"]), names, f"you (podkit ctl {' '.join(words)})")
    os.execv(argv[0], argv)
    return 127  # not reached


@verb("run", "what supervisord runs: sglang | trainer | watchdog | logs | metrics | ray", opt("program"))
def _run(cfg, args) -> int:
    from podkit import programs

    return programs.run(args.program, cfg)


# -- outside the pod ---------------------------------------------------------------------------------------
@verb("deploy", "RunPod (REST API v2): create/update the template and start a pod on A40s; status [POD] | stop | "
      "start | terminate POD; logs POD [--follow] [--system]; watch POD: relaunch it on its network volume (or, with "
      "a checkpoint.remote, in any data center) when it is lost; cluster: an Instant Cluster (--nodes x --gpus-per-node --gpu-type, on --network-volume); "
      "cluster-status | cluster-delete CLUSTER",
      opt("action", nargs="?", choices=["create", "status", "stop", "start", "terminate", "logs", "watch", "cluster",
                                        "cluster-status", "cluster-delete"]),
      opt("pod", nargs="?", help="pod id (status, stop, start, terminate, logs, watch); cluster id (cluster-status, "
          "cluster-delete)"),
      opt("--template", help="template YAML (default: runpod/template.yaml)"),
      opt("--image", help="image to deploy (overrides the template's imageName)"),
      opt("--gpus", type=int, default=4, help="number of A40s (default 4)"),
      opt("--cloud", default="SECURE", help="SECURE | COMMUNITY (default SECURE)"),
      opt("--name", help="pod name (default <template>-<N>xa40)"),
      opt("--dry-run", action="store_true", help="print exactly what would be sent; send nothing"),
      opt("--capacity-timeout", type=float, default=600, help="retry 'no capacity' for this long (s)"),
      opt("--wait-timeout", type=float, default=900, help="wait this long for the pod to run (s)"),
      opt("--network-volume", help="RunPod network volume id mounted at /workspace: what a replacement pod "
          "resumes from (create; watch needs it unless the template's env sets PODKIT_CHECKPOINT_REMOTE)"),
      opt("--max-runtime", help="the pod stops itself after this long, the trainer first with its checkpoint: "
          "90m, 12h, 2d or seconds (create)"),
      opt("--nodes", type=int, default=2, help="cluster: nodes, 2 or more (default 2)"),
      opt("--gpus-per-node", type=int, default=8, help="cluster: GPUs on each node (default 8)"),
      opt("--gpu-type", help='cluster: RunPod GPU type id, e.g. "NVIDIA H100 80GB HBM3" (required)'),
      opt("--lost-after", type=float, default=900, help="watch: a pod not running this long is lost (s)"),
      opt("--poll", type=float, default=30, help="watch: ask RunPod about the pod this often (s)"),
      opt("--max-relaunches", type=int, default=3, help="watch: give up after this many replacements"),
      opt("--backoff", type=float, default=60, help="watch: wait before a second replacement, doubling (s)"),
      opt("--follow", action="store_true", help="logs: keep following, resuming after a dropped connection"),
      opt("--system", action="store_true", help="logs: RunPod's system log (image pull, start) instead of the "
          "container's"),
      opt("--tail", type=int, help="logs: this many earlier lines first (RunPod's default 100; 0..5000)"),
      opt("--json", action="store_true"), load=False)
def _deploy(_cfg, args) -> int:
    from podkit.deploy import verbs

    return verbs.main(args)


@verb("config", "print the resolved config (or --defaults, the documented default)",
      opt("--defaults", action="store_true"), workspace=True, load=False)
def _config(_cfg, args) -> int:
    if args.defaults:
        print(config.render_default_yaml(), end="")
        return 0
    import yaml

    print(yaml.safe_dump(load(args).as_dict(), sort_keys=False), end="")
    return 0


def guards_help() -> str:
    from podkit.money import guards

    return guards.HELP


def parser():
    import argparse  # not on the entrypoint's fast path

    p = argparse.ArgumentParser(prog="podkit", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="pod config YAML (default: $PODKIT_CONFIG, else built-in defaults)")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for v in VERBS.values():
        # the guards' keys from their table (guards.HELP), read here: the boot path does not load it
        sp = sub.add_parser(v.name, help=v.help.replace("{guards}", guards_help()) if "{guards}" in v.help else v.help)
        for flags, _, kw in v.options:
            kw = dict(kw)
            if kw.get("nargs") == "REMAINDER":
                kw["nargs"] = argparse.REMAINDER
            sp.add_argument(*flags, **kw)
        if v.workspace:
            sp.add_argument("--workspace", help="the pod's workspace (default: the config's)")
    return p


def _boot_total(args) -> int:
    """boot.main is total; this is the last line for what could fail before it runs (a broken install)."""
    try:
        return dispatch(args)
    except Exception as e:  # noqa: BLE001 - PID 1 must not exit: under restart: always that is a loop
        import time
        import traceback

        traceback.print_exc()
        print(f"podkit: SAFE MODE: podkit itself cannot run ({type(e).__name__}: {e}); the container stays up "
              "so you can look: reinstall the image", flush=True)
        import signal

        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        while not stop:
            time.sleep(1)
        return 0


class _Args:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def dispatch(args) -> int:
    if getattr(args, "json", False):
        log.to_stderr()
    v = VERBS[args.verb]
    if not v.load:
        return v.fn(None, args)
    return v.fn(load_tolerant(args) if v.tolerant else load(args), args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The entrypoint's exact call skips argparse: it is on every container start's critical path.
    args = _Args(verb="boot", config=None) if argv == ["boot"] else parser().parse_args(argv)
    if args.verb == "boot":
        return _boot_total(args)
    try:
        return dispatch(args)
    except PodkitError as e:
        if os.environ.get("PODKIT_DEBUG"):
            raise
        print(f"podkit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
