"""podkit's supervision around AReaL 1.0.4's PPOTrainer, installed at class level before the training
script runs (bootstrap.py), so that a user's script runs unchanged under it:

- config errors: `load_expr_config` raising (hydra, omegaconf, AReaL's own checks) stops the trainer
  once, `stopped.by: config-error` with AReaL's words in progress.json (doctor shows them), never a
  restart loop. So does an agent workflow or online mode at `train()`: SPMD mode has no proxy workers;
- progress: rank 0 writes <workspace>/.podkit/progress.json after each step (status, health, watchdog):
  step, weight_version, checkpoint_step, reward, loss, the trainer-vs-inference log-prob gap (and, from
  a fresh run's first step, where every rollout came from the weights the trainer holds, the gap that
  must be float error: on_policy_logp_gap), resumed_from/resumed_at, and the code that trains;
- an inference restart: a restarted SGLang serves the base weights ("default"). With
  trainer.on_inference_restart reattach (single node, disk weight updates) the trainer goes on: rank 0
  pushes its latest weights to the new server and generation waits for them (reattach.py). Otherwise, or
  when that fails (the fallback), rank 0 flags stale weights (it asks /model_info every
  trainer.stale_weights_check_s); after the step in flight (its recover checkpoint written) every rank
  stops, and the launcher exits 75 so supervisord restarts the trainer, which resumes from that
  checkpoint and pushes its weights;
- SIGTERM: the step in flight finishes, with a recover checkpoint if it had none, and train() returns.
  `train()` takes SIGTERM back from a handler the script installed, which would cut that step;
- SIGUSR2: every thread's stack, to logs/stacks-<pid>.txt (the watchdog's dump).

Every stop happens between steps and on all ranks at once (an all-reduce of the flags), through
AReaL's own step limit, so no checkpoint is cut and AReaL logs no failure. Each wrapped method is
pinned by hash in patches.PINNED.

Imports AReaL and torch: this runs only in the AReaL environment, never on podkit's boot path.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from pathlib import Path

from podkit import config, log, records
from podkit.areal import episodes, reattach
from podkit.areal.checks import API_KEY_ENV
from podkit.areal.reattach import served_version
from podkit.host import lease
from podkit.judge import ending

_log = log.get("trainer")


class Refused(SystemExit):
    """The script's setup cannot train (recorded as a config error); exits the rank with 2."""

    def __init__(self) -> None:
        super().__init__(2)


class Progress(records.Progress):
    """Rank 0's record for podkit (the same contract as the fake trainer's)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.state_dir, "areal")
        before = records.PROGRESS.read(cfg.state_dir)
        self.data["checkpoint_step"] = before.get("checkpoint_step")
        if before.get("reattach"):  # inference restarts counted across trainer restarts (reattach.py)
            self.data["reattach"] = before["reattach"]

    def write(self, **fields) -> None:
        self.update(**fields, time=time.time())


class State:
    """One rank's supervision: set by install(), read by the hooks."""

    def __init__(self, cfg, code: dict | None) -> None:
        self.cfg, self.code = cfg, code
        self.rank = int(os.environ.get("RANK", "0"))
        self.pid = os.getpid()  # the rank itself, not a process it forks
        self.api_key = os.environ.get(API_KEY_ENV, "")
        self.addr = os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",")[0]
        self.sigterm, self.stale = threading.Event(), threading.Event()
        self.stopped_by: str | None = None  # an ending kind: SIGTERM, STALE, LEASE_LOST
        self.training = False  # train() was entered: an error from here on is a training failure
        self.returned = False  # train() returned: the run's own end (finished, a stop) is recorded
        self.handling = False  # the bootstrap records the script's exception: a SIGTERM must not cut that short
        self.started = time.time()
        self.config = None  # the config AReaL loaded (a missing file's key is looked up in it)
        self.run: tuple | None = None  # (save root, record): the run that owns its checkpoints (check_run)
        self.resuming = False  # check_run found this run's own checkpoint under its names
        self.attacher = None  # rank 0's reattach.Attacher while train() runs (trainer.on_inference_restart)
        self.entry_file = ""  # the file that defines the entry (bootstrap): the run's identity resolves it

    def on_sigterm(self, sig=signal.SIGTERM, *_) -> None:
        """During training: the step in flight ends with a recover checkpoint, then train() returns. Before it:
        nothing is in flight, and the script's own code (loading data, a model) stops at once."""
        if os.getpid() != self.pid:  # a worker the rank forked (a Pool's): its own stop, as if it had no handler
            _real_signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        self.note_signal(sig)
        self.sigterm.set()
        if not self.training and not self.handling:
            raise ending.Stop()

    def note_signal(self, sig) -> None:
        """The stop signal this rank got, for the judge: handed on by the trainer program, or someone's kill. Not
        in a process the rank forked (a Pool's worker inherits the handler, and its pool stops it with SIGTERM)."""
        if os.getpid() == self.pid:
            ending.rank_signalled(self.cfg.run_path, self.rank, sig, self.started)

    def refuse(self, what: str, message: str, hint: str) -> Refused:
        """Record a setup that cannot train (rank 0) and say so; the caller raises what this returns."""
        _log.error(f"{what}: {message.splitlines()[0] if message else ''} (hint: {hint})")
        if self.rank == 0:
            ending.write(self.cfg.state_dir, ending.CONFIG_ERROR, f"{what}: {message}", hint, step=None)
        return Refused()


_state: State | None = None


def state() -> State | None:
    return _state


def install(cfg, code: dict | None = None) -> State:
    """Before the script runs, in every rank: signals, AReaL's patches, and the class-level hooks."""
    global _state
    from podkit.areal import patches
    from podkit.programs import stacks_on_sigusr2

    _state = st = State(cfg, code)
    stacks_on_sigusr2(cfg)
    take_signals(st)
    if cfg.multi_node:  # a rank placed by AReaL's Ray launcher: rank 0's launcher watches it, and asks it to stop
        from podkit.areal import heartbeat

        heartbeat.start_heartbeat(cfg, st.sigterm.set)
    gen = reattach.GENERATION
    gen.active = cfg.trainer.on_inference_restart == "reattach" and not cfg.multi_node
    gen.api_key, gen.state_dir = st.api_key, cfg.state_dir
    ep = episodes.EPISODES
    ep.limit, ep.window_s, ep.cfg = cfg.trainer.max_episode_failures, cfg.trainer.episode_failure_window_s, cfg
    # A cluster's server comes back elsewhere (AReaL's recover run starts it on a new port): fail fast into it.
    patches.apply(api_key=st.api_key, ride_out_s=0.0 if cfg.multi_node else cfg.inference.ready_timeout_s)
    hook_config_loader(st)
    hook_construction(st)
    hook_trainer(st)
    return st


def take_signals(st: State) -> None:
    """The stop signals, noted for the judge: SIGTERM's handler, Python's own SIGINT handler (a KeyboardInterrupt)
    after a note, and the script's own handlers under a note (noting)."""
    signal.signal(signal.SIGTERM, st.on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Python's own (not ignored at start)
        signal.signal(signal.SIGINT, _interrupted)
    signal.signal, signal.getsignal = noting(signal.signal, signal.getsignal)


# --- the config ------------------------------------------------------------------------------------


def hook_config_loader(st: State) -> None:
    """areal.api.cli_args.load_expr_config, and every module that imported the name before this ran."""
    import sys

    from areal.api import cli_args

    from podkit.areal.patches import patch_once

    def wrap(original):
        def load_expr_config(argv, config_cls):
            st = _state  # installed once per process: the current install's state, not the first's
            try:
                loaded = original(argv, config_cls)
            except Exception as e:  # noqa: BLE001 - hydra, omegaconf and AReaL's own checks raise their own types
                from podkit.judge import failure

                if failure.volume_of(e) or failure.oom_of(e) or failure.transient(e):
                    raise  # not the config: a full volume while AReaL saves it, memory, the network (judged so)
                # The same on every restart: a restart loop re-importing torch every 20 s fixes nothing.
                raise st.refuse("AReaL rejected its config", f"{type(e).__name__}: {e}".strip(),
                                unknown_key(e, argv) + "fix trainer.areal_config or trainer.overrides: "
                                + ending.fix_setting(st.cfg)) from e
            st.config = loaded[0] if isinstance(loaded, tuple) else loaded
            check_names(st, st.config)  # the identity waits for the config the trainer gets (the script may change it)
            return loaded

        return load_expr_config

    hooked = patch_once(cli_args, "load_expr_config", wrap)
    if hooked is None:
        return
    for mod in list(sys.modules.values()):
        if mod is not None and mod.__name__.startswith("areal") and \
                getattr(mod, "load_expr_config", None) is hooked.__wrapped__:
            mod.load_expr_config = hooked


def unknown_key(e: BaseException, argv) -> str:
    """For a key AReaL's config class does not have (omegaconf's ConfigKeyError: key, full_key, object_type):
    where the YAML sets it and the field it may have meant; "" otherwise."""
    import dataclasses
    import difflib

    key, full, cls = (getattr(e, a, None) for a in ("key", "full_key", "object_type"))
    if type(e).__name__ != "ConfigKeyError" or not isinstance(key, str) or not dataclasses.is_dataclass(cls):
        return ""
    near = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1)
    where = ""
    args = list(argv or [])
    path = args[args.index("--config") + 1] if "--config" in args[:-1] else None
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines() if path else []
    except (OSError, ValueError):
        lines = []
    at = yaml_line(lines, (full or key).split("."))
    if at:
        where = f"{path}:{at} sets {full or key}"
    return (f"{where or (full or key)}: {cls.__name__} has no {key!r}"
            + (f"; did you mean {near[0]!r}?" if near else "") + "; ")


def yaml_line(lines: list[str], path: list[str]) -> int | None:
    """The line (1-based) of a block-style YAML mapping key at `path` (["rollout", "max_concurent_rollouts"]):
    each part looked for among the direct keys of the block of the one before, by indentation."""
    import re

    key_line = re.compile(r"(\s*)([^\s#:\-][^:]*?)\s*:(\s|$)")
    start, parent = 0, -1
    for depth, part in enumerate(path):
        child, found = None, None
        for i in range(start, len(lines)):
            m = key_line.match(lines[i])
            if not m:
                continue  # a blank line, a comment, a list item, a value's continuation
            ind = len(m.group(1))
            if ind <= parent:
                break  # the block ended
            child = ind if child is None else child
            if ind == child and m.group(2).strip("'\"") == part:
                found = i
                break
        if found is None:
            return None
        if depth == len(path) - 1:
            return found + 1
        parent, start = child, found + 1
    return None


def check_names(st: State, config_) -> tuple[str, str] | None:
    """The run's names, as AReaL's recovery reads them (recover.experiment_name/trial_name; the YAMLs
    interpolate the top level's), are each one plain path component; None for a config without them."""
    recover = getattr(config_, "recover", None)
    if recover is None or not hasattr(config_, "experiment_name"):
        return None  # not an experiment config with a recover section: nothing of AReaL's to resume
    named = {f"{part}{key}": getattr(obj, key, None) for part, obj in (("", config_), ("recover.", recover))
             for key in ("experiment_name", "trial_name")}
    for key, name in named.items():
        try:
            if not isinstance(name, str):
                raise config.ConfigError("", key, f"is {name!r}, not a string")
            config.check_name(name, "AReaL's loaded config", key)
        except config.ConfigError as e:
            raise st.refuse("the run's names are not names", f"{key} {e.problem}",
                            f"{key} names the run's directories: set a plain name (e.g. myrepo-v2; quote one that "
                            "YAML would read as a boolean or a number) in the AReaL YAML or trainer.overrides") from None
    return named["recover.experiment_name"], named["recover.trial_name"]


def check_run(st: State, config_) -> None:
    """At PPOTrainer's construction, before it loads a recover checkpoint: the checkpoint under the run's
    names is this run's own (identity.differences). Another run's is not resumed: the trainer stops once,
    saying which checkpoint, how it differs, and the ways on."""
    from podkit.areal import identity

    names = check_names(st, config_)
    if names is None:
        return
    recover, actor = config_.recover, getattr(config_, "actor", None)
    entry = st.cfg.trainer.entry or "podkit:gsm8k_grpo"
    repo = st.cfg.repo.url if st.cfg.trainer.entry else ""
    root = identity.save_root(recover.fileroot, *names)
    data = getattr(getattr(config_, "train_dataset", None), "path", "") or ""
    st.run = (root, identity.record_for(names, entry, getattr(actor, "path", "") or "", repo,
                                        (st.code or {}).get("commit", ""),
                                        identity.entry_file(st.entry_file, st.cfg.repo.dest if st.cfg.trainer.entry
                                                            else None),
                                        data if isinstance(data, str) else ""))
    st.resuming = False
    if getattr(recover, "mode", "disabled") in ("disabled", "off"):
        st.run = None  # writes no recover checkpoint: owns none, and must not claim another run's
        return
    if not identity.has_checkpoint(root):
        return
    theirs = identity.read_record(root)
    if theirs is not None and theirs.get("adopt"):  # `podkit adopt`: the user says it is this run's
        _log.info(f"resuming the recover checkpoint in {root} as this run's own (podkit adopt); its record "
                  "becomes this run's when training starts")
        st.resuming = True
        return
    why = identity.differences(st.run[1], theirs, root)
    st.resuming = not why
    if why:
        raise st.refuse(f"the recover checkpoint in {root} belongs to another run", "; ".join(why),
                        f"if it is this run (the same script renamed, the repo or the model moved), run `podkit adopt` "
                        f"to resume it as this run's; else give this run its own trial name (trial_name in the AReaL "
                        f"YAML, or trainer.trial): it starts "
                        f"from step 0 beside the other; or run `podkit start-over` (with this run's --config and "
                        f"--workspace {st.cfg.workspace_path}; on a pod, as it is) to move {root} aside (kept, not "
                        "deleted) and train this run from step 0 under the same names")


def hook_construction(st: State) -> None:
    """PPOTrainer.__init__, before AReaL builds anything: the config it gets is the one AReaL runs, after
    every loader (load_expr_config, or parse_cli_args + to_structured_cfg), every override in any Hydra
    syntax and whatever the script changed. podkit's required settings and the run's identity are checked
    there (no training script can pass around it), and the W&B run chosen, before the recover checkpoint
    is loaded and W&B opened (rl_trainer.py:393-407)."""
    from areal.trainer.rl_trainer import PPOTrainer

    from podkit.areal.patches import patch_once

    def wrap(original):
        def __init__(self, config, *args, **kwargs):
            st = _state
            if st is not None:
                check_required(st, config)
                check_run(st, config)
                choose_wandb_run(st, config)
            result = original(self, config, *args, **kwargs)
            if st is not None and st.resuming and self.recover_info is None:
                raise st.refuse(
                    f"AReaL could not load the recover checkpoint in {st.run[0]}",
                    "it logged \"Resume info not found\" and would train from step 0, writing over the checkpoint "
                    "(its log above says why: the trainer's rank count changed since it was written, or a file of "
                    "it is missing)",
                    "to resume, run it as it was written (the same trainer.gpus or trainer.cpu_ranks); or run "
                    "`podkit start-over` to move it aside (kept, not deleted) and train from step 0")
            return result

        return __init__

    patch_once(PPOTrainer, "__init__", wrap)


def check_required(st: State, config_) -> None:
    """What podkit depends on (checks.required: recovery on, weight updates from disk, the pod's backends), read
    on the config AReaL will run. podkit set each on AReaL's command line; a value that differs now was set after
    it, on purpose: the trainer stops once, saying which and where it can come from."""
    from podkit.areal import checks, identity

    root = identity.fileroot(st.cfg)
    on_volume = ("recover.fileroot", root, lambda v: os.path.normpath(str(v)) == os.path.normpath(root),
                 "the recover checkpoints live on the volume, where the next pod (and podkit start-over) finds them",
                 "")  # lost when an override replaces the whole section (recover={...})
    wrong = []
    for key, value, fits, why, pod_key in [*checks.required(st.cfg, {}), on_volume]:
        node = config_
        for part in key.split("."):
            node = getattr(node, part, None)
        if node is not None and not fits(node):
            wrong.append((key, node, value, why, pod_key))
    if not wrong:
        return
    what = "; ".join(f"{key} is {v!r}, but podkit needs {value}: {why}" for key, v, value, why, _ in wrong)
    keys = ", ".join(k for k, *_ in wrong)
    pods = [p for *_, p in wrong if p]
    raise st.refuse("AReaL's final config turns off what podkit needs", what,
                    f"podkit set {keys} on AReaL's command line, and something after it changed "
                    f"{'them' if len(wrong) > 1 else 'it'}: trainer.overrides in any Hydra syntax (~key, "
                    "section={key:value}, ++key=value) or the training script itself. Remove that (podkit sets "
                    "what it needs)" + (f", or change {', '.join(pods)} to match" if pods else "")
                    + ": " + ending.fix_setting(st.cfg))


def choose_wandb_run(st: State, config_) -> None:
    """A run from step 0 is a new W&B run (identity.wandb_id): AReaL names it <experiment>_<trial>_<id_suffix>
    with resume="allow", so a start-over would write into the run it set aside, where W&B drops every step
    below the last one logged. Sets stats_logger.wandb.id_suffix before AReaL opens W&B; the id goes on the
    run's record and progress.json (status names it). W&B off, or id_suffix "timestamp" (a new run at every
    start, AReaL's own): nothing chosen."""
    from podkit.areal import identity

    logger = getattr(config_, "stats_logger", None)
    w = getattr(logger, "wandb", None)
    if st.run is None or w is None:
        return
    if getattr(w, "mode", "disabled") == "disabled" or w.id_suffix == "timestamp":
        st.run[1]["wandb"] = None
        return
    from areal.utils.stats_logger import StatsLogger

    prefix = f"{logger.experiment_name}_{logger.trial_name}_"
    base = f"{prefix}{w.id_suffix}"
    chosen = identity.wandb_id(st.run[0], base, st.resuming, identity.wandb_logged(StatsLogger.get_log_path(logger)))
    if chosen != base:
        if not chosen.startswith(prefix):  # a run recorded under other names cannot be resumed here
            chosen = base
        w.id_suffix = chosen[len(prefix):]
        _log.info(f"W&B: resuming the W&B run this run logged into, {chosen}" if st.resuming else
                  f"W&B: this run starts from step 0 under names that logged before, so it logs into a new W&B "
                  f"run, {chosen} (not {base}, whose steps W&B would keep over this run's)")
    st.run[1]["wandb"] = chosen


# --- the trainer -----------------------------------------------------------------------------------


_real_signal = signal.signal  # before the script's is wrapped (noting)
SEEN = "_podkit_error"  # an exception's attribute: the rank's record of it, made where podkit saw it first


def seen(e: BaseException) -> dict | None:
    """The rank's record of `e` made where podkit saw it first, or None. Read from the instance's own dict: an
    exception class may answer any attribute (a proxy's __getattr__), or raise on every one, in the handler of
    the script's own failure."""
    try:
        found = vars(e).get(SEEN)
    except Exception:  # noqa: BLE001 - no __dict__ (__slots__), or a class that guards it: no mark either
        return None
    return found if isinstance(found, dict) else None
_STOPS = (signal.SIGTERM, signal.SIGINT)


def noting(real, getsignal):
    """`signal.signal` (and `signal.getsignal`) for the script: a handler it installs for a stop signal (the usual
    SIGTERM -> sys.exit(0)) runs as it wrote it, after the signal is noted (State.note_signal): the judge must know
    a stop came, whatever the script makes of it. The script gets its own handlers back, never podkit's wrapper.
    SIG_DFL and SIG_IGN are the script's to choose, not noted (a rank killed by the default is a signal's end)."""
    if getattr(real, "__wrapped__", None) is not None:
        return real, getsignal  # installed already (a second install in one process)

    def own(handler):
        return getattr(handler, "__wrapped__", handler) if getattr(handler, "_podkit_noting", False) else handler

    def install(sig, handler):
        handler = own(handler)
        if sig in _STOPS and callable(handler) and not isinstance(getattr(handler, "__self__", None), State):
            user = handler

            def handler(signum, frame):
                if _state is not None:
                    _state.note_signal(signum)
                    if signum == signal.SIGTERM and _state.training:  # train() in a worker thread could not take
                        _state.sigterm.set()  # SIGTERM back: its step in flight still ends with a checkpoint
                return user(signum, frame)

            handler.__wrapped__, handler._podkit_noting = user, True
        return own(real(sig, handler))

    def get(sig):
        return own(getsignal(sig))

    install.__wrapped__, get.__wrapped__ = real, getsignal
    return install, get


def _interrupted(signum, frame):
    """Python's own SIGINT handler (a KeyboardInterrupt), after the signal is noted: the judge tells someone's
    Ctrl-C or `kill -INT` of a rank (a stop, restarted to resume) from a KeyboardInterrupt the script raised itself
    (its own failure, counted: uncounted, it would restart for ever)."""
    if _state is not None:
        _state.note_signal(signum)
    return signal.default_int_handler(signum, frame)


_interrupted.__wrapped__, _interrupted._podkit_noting = signal.default_int_handler, True


def record_through_train(st: State, e: BaseException) -> None:
    """An exception that leaves PPOTrainer.train, recorded as it passes: the script may catch it and exit 0."""
    from podkit.judge import failure

    if isinstance(e, (SystemExit, ending.Stop)) or seen(e):
        return
    try:
        roots = list(episodes.EPISODES.roots or [])
        err = failure.clean(failure.describe(e, roots, str(st.cfg.workspace_path), place=ending.place(st.cfg)),
                            st.cfg)
        failure.classify(e, err, place=ending.place(st.cfg))
        down = episodes.EPISODES.server_down()
        if down:
            err["unreachable"] = down
        err["through"] = "train"
        failure.write(st.cfg.run_path, st.rank, err)
        setattr(e, SEEN, err)
    except Exception:  # noqa: BLE001 - the user's exception goes on whatever podkit's record of it does
        pass


def hook_trainer(st: State) -> None:
    from areal.trainer.rl_trainer import PPOTrainer

    from podkit.areal.patches import patch_once

    def wrap(original):
        signature = inspect.signature(original)

        def train(self, *args, **kwargs):
            st = _state  # installed once per process: the current install's state, not the first's
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            caller = inspect.currentframe().f_back  # the user's line that calls train(workflow=...)
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "the training script"
            del caller
            refuse_what_spmd_cannot_run(st, self, bound.arguments, where)
            if threading.current_thread() is threading.main_thread():  # only it may (a worker's train(): its
                signal.signal(signal.SIGTERM, st.on_sigterm)  # stop is the main thread's handler's, flagged)
            st.training = True
            ending.rank_alive(st.cfg.run_path, st.rank, training=True)
            if st.rank == 0 and st.run is not None:  # this run owns its checkpoints from here on
                from podkit.areal import identity

                identity.write_record(*st.run)
            progress = supervise(st, self)
            try:
                result = original(*bound.args, **bound.kwargs)
            except BaseException as e:
                record_through_train(st, e)
                raise
            finally:
                if st.attacher is not None:
                    st.attacher.done.set()
            st.returned = True
            if progress is not None and st.stopped_by != ending.LEASE_LOST:  # a lost lease: the record is theirs
                ending.note_oom_kills(st.cfg.run_path, progress.data.get("step"))  # a kill after it: a failure
                ending.write(st.cfg.state_dir, st.stopped_by or ending.DONE, progress=progress)
            return result

        return train

    patch_once(PPOTrainer, "train", wrap)


def _import_error(target: str) -> tuple[str, str] | None:
    """(why, hint) when `target` (module.attr) does not import: its own path wrong, or a module it
    imports missing (a dependency to install, not a path to fix)."""
    from areal.utils.dynamic_import import import_from_string

    try:
        import_from_string(target)
    except Exception as e:  # noqa: BLE001 - whatever importing the user's module raises
        why = f"{target!r} cannot be imported: {type(e).__name__}: {e}"
        cause = e  # AReaL wraps the import's own error in an ImportError of its own
        for _ in range(10):  # a bounded walk: a chain may loop
            if cause is None or isinstance(cause, ModuleNotFoundError):
                break
            cause = cause.__cause__ or cause.__context__
        missing = getattr(cause, "name", None)
        module = target.rpartition(".")[0] if "." in target else target
        if missing and not (module == missing or module.startswith(missing + ".")):
            return why, (f"{target} imports {missing}, which is not installed: add it to the repo's requirements "
                         "(repo.setup installs them)")
        return why, "fix the import path in the training script"
    return None


def refuse_what_spmd_cannot_run(st: State, trainer, arguments: dict, where: str = "the training script") -> None:
    """AReaL checks only `workflow` when train() starts; an agent eval_workflow would fail at the first
    evaluation, an epoch in. A reward or workflow string that does not import fails at the first step.
    Each refusal names `where`, the user's line that calls train()."""
    hint_agent = ("podkit runs AReaL in SPMD mode, which has no proxy workers for agent workflows or online mode: "
                  "pass a RolloutWorkflow (e.g. areal.workflow.rlvr.RLVRWorkflow or a subclass)")
    for name in ("workflow", "eval_workflow"):
        workflow = arguments.get(name)
        if workflow is None:
            if name == "workflow":
                raise st.refuse(f"the script's train() at {where} has no workflow",
                                "online mode (rollout.agent.mode online)", hint_agent)
            continue
        if isinstance(workflow, str):
            failed = _import_error(workflow)
            if failed:
                raise st.refuse(f"train({name}=...) at {where}", *failed)
        if trainer._requires_proxy_workflow(workflow):
            raise st.refuse(f"train({name}=...) at {where}", f"{workflow!r} is an agent workflow, not a "
                            "RolloutWorkflow", hint_agent)
        kwargs = arguments.get(f"{name}_kwargs") or {}
        reward = kwargs.get("reward_fn")
        if isinstance(reward, str):
            failed = _import_error(reward)
            if failed:
                raise st.refuse(f"train({name}_kwargs reward_fn) at {where}", *failed)


def stat(stats, *suffixes: str):
    """The first of `suffixes` (in that order of preference) that some stats key ends with."""
    items = stats if isinstance(stats, list) else [stats]
    for suffix in suffixes:
        for item in items:
            for key, value in item.items():
                if key.endswith(suffix):
                    try:
                        return float(value)
                    except (TypeError, ValueError):
                        pass
    return None


def logp_gap(stats) -> dict | None:
    """AReaL's kl_div_direct is old_logp - logprobs over the step's tokens: inference's (behaviour)
    log-probs against the trainer's recomputed ones. On-policy tokens (step 1 of a fresh run: every
    rollout from the weights the trainer holds) must agree to float error."""
    lo, hi, avg = (stat(stats, f"kl_div_direct/{k}") for k in ("min", "max", "avg"))
    if hi is None or lo is None:
        return None
    return {"max_abs": max(abs(lo), abs(hi)), "avg": avg}


def server_identity(cfg) -> tuple | None:
    """Which SGLang process serves, by supervisord's word (pid and start time); None outside supervisord.
    A different one at the end of a step than at its start means a restart in between: part of the
    step's rollouts came from the base weights, whatever the label says once this step's push landed."""
    from podkit.host import supervisord

    if cfg.multi_node:  # AReaL's Ray launcher runs SGLang, not supervisord; the served version still tells
        return None
    info = supervisord.process_info(cfg.socket_path, "sglang")
    if info is None:
        return None
    # STARTING with a pid is the same process as once RUNNING (it may answer before supervisord's startsecs)
    return (info["pid"], info["start"]) if info.get("statename") in supervisord.UP and info.get("pid") \
        else ("not running",)


def watch_served_weights(cfg, progress: Progress, addr: str, api_key: str, stale: threading.Event) -> None:
    """Rank 0, a daemon thread: flags base weights served after this trainer pushed a version."""
    while not stale.is_set():
        time.sleep(cfg.trainer.stale_weights_check_s)
        pushed = progress.data.get("weight_version")
        if pushed is None:
            continue
        if served_version(addr, api_key) == "default":
            _log.warn(f"inference serves the base weights but this trainer pushed version {pushed}: inference "
                      "restarted. Stopping after this step; supervisord restarts the trainer, which resumes "
                      "from its recover checkpoint and pushes those weights again.")
            stale.set()


def attach_on_restart(st: State, trainer, progress: Progress | None):
    """Rank 0's re-attacher (reattach.Attacher), when an inference restart is to cost no trainer restart:
    trainer.on_inference_restart reattach, one node, and weight updates from disk (the latest version's save
    is what a restarted server gets). None otherwise: the stale-weights stop."""
    meta = trainer.weight_update_meta
    lora, kind = getattr(meta, "use_lora", False), getattr(meta, "type", None)
    if reattach.GENERATION.active and (lora or kind != "disk" or not meta.path):
        # On every rank: the hold on generation waits for a version only a full-weights disk push serves.
        reattach.GENERATION.active = False
        if progress is not None:
            _log.info(f"weight updates are {'LoRA adapters' if lora else repr(kind)}, not full weights from disk: an "
                      "inference restart stops the trainer after its step (it resumes and pushes its weights)")
    if progress is None or not st.addr or not reattach.GENERATION.active:
        return None
    folder = Path(meta.path).parent
    info = trainer.recover_info
    pushed = info.last_step_info.global_step + 1 if info is not None else None  # recover pushed this version
    attacher = reattach.Attacher(st.cfg, progress, st.addr, st.api_key, folder, pushed, st.stale, st.sigterm,
                                 identity=lambda: server_identity(st.cfg))
    trainer.actor.update_weights = attacher.pushing(trainer.actor.update_weights)
    return attacher


def saving_marked(cfg, rank: int, save):
    """The recover checkpoint's save with a marker in the run dir while it writes (records.SAVING_PREFIX)."""
    def save_marked(*args, **kwargs):
        marker = cfg.run_path / f"{records.SAVING_PREFIX}{rank}"
        try:
            marker.write_text(str(os.getpid()))
        except OSError:
            marker = None
        try:
            return save(*args, **kwargs)
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)

    return save_marked


def supervise(st: State, trainer) -> Progress | None:
    """What train() runs under: the per-step commit hook on this trainer, and rank 0's progress record
    and stale-weights watcher. Returns rank 0's progress (None on other ranks)."""
    import torch
    import torch.distributed as dist

    from podkit.areal import patches

    cfg, config_ = st.cfg, trainer.config
    progress = Progress(cfg) if st.rank == 0 else None
    export = trainer._export_and_commit_stats
    save_recover = saving_marked(cfg, st.rank, trainer._save_recover_checkpoint)
    info_path = trainer.recover_handler.recover_info_path(
        config_.experiment_name, config_.trial_name, config_.recover.fileroot)
    serving = [server_identity(cfg) if progress is not None else None]
    attacher = st.attacher = attach_on_restart(st, trainer, progress)
    episodes.EPISODES.progress = progress  # rank 0: failed episodes go on its record

    def commit(epoch: int, epoch_step: int, global_step: int) -> None:
        stats, commit_ = {}, trainer.stats_logger.commit

        def keep(e, s, g, data):
            stats["data"] = data
            return commit_(e, s, g, data)

        trainer.stats_logger.commit = keep
        try:
            export(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
        finally:
            trainer.stats_logger.commit = commit_
        step = global_step + 1  # AReaL pushed these weights as version global_step + 1
        if progress is not None and st.stopped_by != ending.LEASE_LOST:  # the record is the new holder's now
            data = stats.get("data") or {}
            saved = patches.recover_checkpoint_written(trainer, global_step)
            progress.data.setdefault("first_step_time", time.time())  # a trained step: the start-up's end
            progress.write(step=step, weight_version=str(step),
                           checkpoint_step=step if saved else progress.data.get("checkpoint_step"),
                           loss=stat(data, "update/loss/avg", "loss/avg"),
                           reward=stat(data, "task_reward/avg", "reward/avg"),
                           logp_gap=logp_gap(data), weight_update_s=stat(data, "timeperf/update_weights"))
            records.HISTORY.append(cfg.state_dir, step, progress.data.get("reward"), progress.data.get("loss"))
            ending.note_oom_kills(cfg.run_path, step)  # an OOM kill counted by now, the run stepped past
            evaluated = stat(data, "eval-rollout/reward")  # only on the evaluator's steps
            if evaluated is not None:
                progress.write(eval_reward=evaluated, eval_step=step)
            if global_step == 0:  # every rollout came from the weights the trainer holds
                progress.write(on_policy_logp_gap=logp_gap(data))
            # No answer (supervisord shutting down at a pod stop) says nothing about a restart.
            now_serving = server_identity(cfg) or serving[0]
            restarted = serving[0] is not None and now_serving != serving[0]
            serving[0] = now_serving
            if attacher is not None:
                # Answers from the base weights were dropped (reattach.py): this step trained on none. The
                # push just made must be what is served before rollout resumes.
                if not st.sigterm.is_set() and (
                        restarted or served_version(st.addr, st.api_key) not in (str(step), None)):
                    attacher.attach(f"inference restarted during step {step}")
            else:
                if served_version(st.addr, st.api_key) not in (str(step), None):
                    st.stale.set()  # the push just made is not what is served
                if restarted:
                    _log.warn(f"inference was restarted during step {step}: its rollouts came partly from the base "
                              "weights. Stopping after this step; the trainer restarts and resumes.")
                    st.stale.set()
        # Every rank must stop at the same step, or the next collective hangs.
        flags = torch.tensor([st.sigterm.is_set(), st.stale.is_set()], dtype=torch.int64)
        dist.all_reduce(flags, group=trainer.actor.cpu_group)
        by_sigterm, by_stale = bool(flags[0]), bool(flags[1])
        if not (by_sigterm or by_stale) or st.stopped_by == ending.LEASE_LOST:
            return
        saved = patches.recover_checkpoint_written(trainer, global_step) or \
            patches.force_recover_checkpoint(trainer, save_recover, epoch, epoch_step, global_step)
        st.stopped_by = ending.SIGTERM if by_sigterm else ending.STALE
        if progress is not None and saved:
            progress.write(checkpoint_step=step)
        _log.info(f"{st.stopped_by}: stopping after step {step}, " + (
            "with its recover checkpoint" if saved else "WITHOUT a recover checkpoint (recover.mode disabled?)"))
        patches.stop_after_step(trainer, global_step)

    def save_if_ours(epoch: int, epoch_step: int, global_step: int):
        """No recover checkpoint once another pod holds the workspace (this one stalled past its lease):
        every rank skips the save alike (it is a collective), and the run stops after this step."""
        holder = lease.lost(cfg.state_dir) if st.rank == 0 else None
        flag = torch.tensor([1 if holder else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=trainer.actor.cpu_group)
        if not int(flag[0]):
            return save_recover(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
        st.stopped_by = ending.LEASE_LOST
        if holder:
            _log.error(f"this pod lost the workspace to {holder} (it stalled past guard.lease_s, and a pod took "
                       f"over): stopping after step {global_step + 1} without writing a checkpoint; the pod that "
                       "holds the workspace resumes from the last one. This pod can be stopped")
        patches.stop_after_step(trainer, global_step)
        return None

    trainer._export_and_commit_stats = commit
    # a cluster's ranks share rank 0's lease, on other nodes
    trainer._save_recover_checkpoint = save_recover if cfg.multi_node else save_if_ours
    if attacher is not None:
        threading.Thread(target=attacher.run, daemon=True, name="podkit-reattach").start()
    elif progress is not None and st.addr:
        threading.Thread(target=watch_served_weights, args=(cfg, progress, st.addr, st.api_key, st.stale),
                         daemon=True).start()
    if progress is not None:
        fresh = {"resumed_from": None, "resumed_at": None, "logp_gap": None,
                 "on_policy_logp_gap": None, "code": st.code,
                 "run": f"{config_.experiment_name}/{config_.trial_name}",  # the names AReaL uses
                 "wandb": st.run[1].get("wandb") if st.run is not None else None}
        if trainer.recover_info is not None:
            # AReaL pushed the recovered weights as version global_step + 1.
            resumed = trainer.recover_info.last_step_info.global_step + 1
            fresh.update(step=resumed, weight_version=str(resumed), checkpoint_step=resumed,
                         resumed_from=info_path, resumed_at=resumed)
            _log.info(f"resumed from the recover checkpoint of step {resumed} ({info_path})")
        progress.write(**fresh)
    return progress
