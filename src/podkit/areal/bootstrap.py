"""The trainer's entry point: torchrun runs this file in each rank (and AReaL's Ray launcher loads it
by path and calls `main(argv)` on every node), and it runs the training script under podkit's hooks.

    torchrun ... bootstrap.py --config <areal yaml> key=value ...

The script is trainer.entry in the synced checkout (`train.py`, or `package.module:function`), or
podkit's GSM8K example (example/gsm8k_grpo.py) when none is named. It runs unchanged, as `__main__`,
with `sys.argv` = [script, *argv], cwd = the checkout and `sys.path` = [its directory, the checkout,
...]. Before it runs:

- AReaL is imported and patched (hooks.install): a checkout that is an AReaL tree or vendors `areal/`
  would otherwise shadow the installed, patched AReaL; its copy is ignored, with a warning;
- this file's own directory is taken off `sys.path` first, so none of podkit's modules (launch.py,
  cluster.py, ...) shadows a module of the script's.

Any exception the script raises before training starts (an import, a data field named differently, a
`main` that takes no argument, a data file that is not there) is the script's own: the trainer stops
once, naming the exception, the file and line in the user's code and a hint, and does not restart into
the same error. What may pass goes to the loop bound instead, named as what it is: a network error (a
refused or reset connection, a timeout, a hub's 5xx or 429: ending.NETWORK, retried with its back-off), out
of memory, the distributed or CUDA runtime's start-up failures (a port taken). Every rank's exception, before
or during training, is recorded in its own words (failure.py) for status, doctor and the notification, and
each rank notes that it lives (ending.rank_alive): one that ends without a word was killed.

A SIGTERM before train() ends the rank at once (ending.Stop): the script has no step in flight to finish.
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == _HERE:
    del sys.path[0]

import errno  # noqa: E402 - after the path is cleared
import re  # noqa: E402
import runpy  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

EXAMPLE = os.path.join(_HERE, "example", "gsm8k_grpo.py")
# Raised before training, these may pass on a restart: the runtime's, not the script's (matched by name:
# torch.distributed's DistError family, CUDA's OutOfMemoryError; NCCL and c10d say so in the message).
RUNTIME_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "OutOfMemoryError",
                  "MemoryError", "AcceleratorError")
RUNTIME_MESSAGES = ("NCCL", "CUDA out of memory", "CUDA error", "CUDA-capable device", "Address already in use",
                    "c10d", "Gloo", "gloo")
# A volume that hiccups (a network volume's I/O error, a stale handle, a full disk): not the script's code.
RUNTIME_ERRNOS = (errno.EIO, errno.ESTALE, errno.ENOSPC, errno.EDQUOT)


def runtime_error(exc: BaseException, message: str) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & set(RUNTIME_ERRORS)) or any(m in message for m in RUNTIME_MESSAGES) or \
        isinstance(exc, OSError) and exc.errno in RUNTIME_ERRNOS


def entry_of(cfg) -> tuple[str, str | None, str | None]:
    """(script path or module, function or None, checkout or None) for trainer.entry."""
    entry = cfg.trainer.entry
    if not entry:
        return EXAMPLE, None, None
    checkout = cfg.repo.dest
    if ":" in entry and not entry.endswith(".py"):
        module, _, function = entry.partition(":")
        return module, function, checkout
    return os.path.join(checkout, entry), None, checkout


def code_of(cfg) -> dict:
    """What trains: the entry, and the checkout's commit and whether its tree differs from it."""
    from podkit import records

    out = {"entry": cfg.trainer.entry or "podkit:gsm8k_grpo"}
    if not cfg.trainer.entry:
        return out
    commit = records.SYNC.read(cfg.state_dir).get("new")
    try:
        head = subprocess.run(["git", "-C", cfg.repo.dest, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", cfg.repo.dest, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
        out["commit"] = head or commit or ""
        out["dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        out["commit"] = commit or ""
    return out


def shadowed_areal(paths: list[str]) -> list[str]:
    import areal

    installed = os.path.realpath(os.path.dirname(areal.__file__))
    found = [p for d in dict.fromkeys(paths) if d and os.path.isdir(p := os.path.join(d, "areal"))]
    return [p for p in found if os.path.realpath(p) != installed]


def main(argv: list[str]) -> int:
    from podkit import config
    from podkit.judge import ending

    cfg = config.load()
    rank = int(os.environ.get("RANK", "0"))
    ending.rank_alive(cfg.run_path, rank)
    try:
        return run(cfg, argv)
    finally:
        ending.rank_exited(cfg.run_path, rank)  # through Python's exit: not killed


def run(cfg, argv: list[str]) -> int:
    from podkit import log
    from podkit.areal import episodes, hooks
    from podkit.judge import ending

    _log = log.get("trainer")
    script, function, checkout = entry_of(cfg)
    st = hooks.install(cfg, code_of(cfg) if int(os.environ.get("RANK", "0")) == 0 else None)
    script_dir = checkout if function else os.path.dirname(script)
    roots = [os.path.realpath(p) for p in (script_dir, checkout) if p]
    episodes.EPISODES.roots = roots  # a failed episode is named in the user's code, as an exception here is
    for p in shadowed_areal([script_dir, checkout]):
        _log.warn(f"{p} is not used: the script imports the installed AReaL that podkit patches and pins "
                  f"(areal {hooks_version()})")
    if st.rank == 0:
        _log.info(f"running {script}{':' + function if function else ''} under podkit's hooks; progress is recorded "
                  "from AReaL's PPOTrainer.train (a script that trains otherwise records no steps)")
    if checkout:
        os.chdir(checkout)
    sys.path[:0] = list(dict.fromkeys(p for p in (script_dir, checkout) if p))
    target = None
    st.entry_file = script if not function else ""
    try:
        if function:
            import importlib
            import inspect

            target = getattr(importlib.import_module(script), function)
            try:  # the file that defines it, for the run's identity (grpo.train:main is grpo/train.py's main)
                st.entry_file = inspect.getsourcefile(inspect.unwrap(target)) or ""
            except (TypeError, ValueError):
                pass
            target(argv)
        else:
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
    except ending.Stop:  # a SIGTERM while the script was still in its own code: nothing in flight
        if not ending.forwarded(cfg.run_path, st.started):
            # Not the trainer program's: torchrun's (another rank failed, and its record says how), or someone's kill
            # of this rank (its note says so): the judge tells them apart by what came first.
            _log.info("a SIGTERM before train() that the trainer program did not hand on (torchrun's, after another "
                      "rank ended, or a kill of this rank): stopping")
            return 1
        if st.rank == 0:
            ending.write(cfg.state_dir, ending.SIGTERM, "stopped before training started (no step in flight)",
                         step=None)
        _log.info("SIGTERM before train(): the script stops at once, with nothing in flight")
        return 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code and not isinstance(e, hooks.Refused) and not hooks.seen(e):
            record_error(cfg, st, e, roots, target)  # sys.exit(3), sys.exit("message"): the script's own way out
        elif not code and st.training and not st.returned:
            # sys.exit(0) (or sys.exit()) while train() ran: the run did not finish, and nothing else says so (an
            # exit 0 with no record left the trainer stopped, the pod billing, nothing named). One raised while an
            # exception was handled is that failure, caught and hidden; else it is the script's own early end.
            caught = e.__context__
            if isinstance(caught, Exception) and not isinstance(caught, SystemExit):
                record_error(cfg, st, caught, roots, target)
            elif st.rank == 0:
                at = _line_of(e.__traceback__, roots)
                ending.write(cfg.state_dir, ending.ENDED_EARLY, f"your script ended training with exit 0 inside "
                             f"PPOTrainer.train{' at ' + at if at else ''}, before its last step",
                             ending.kind(ending.ENDED_EARLY).fix)
        elif not code and not st.training and isinstance(e.__context__, Exception):
            # sys.exit(0) while an exception was handled, before training: that exception, caught and hidden (a
            # missing file the script printed and left on), named with its type, file and line, judged as if raised.
            caught = e.__context__
            err = hooks.seen(caught) or record_error(cfg, st, caught, roots, target)
            if runtime_error(caught, err["message"]) or any(err.get(k) for k in CAUSES):
                return 1  # what may pass (the network, memory, the volume): the loop bound's, by its kind
            at = _line_of(e.__traceback__, roots)
            st.refuse(f"the training script failed before training started, at {err['where']} (it caught the "
                      f"exception and exited 0{' at ' + at if at else ''})",
                      f"{err['type']}: {err['message']}" + (f"\n{err['code']}" if err["code"] else ""),
                      (err["hint"] + "; " if err["hint"] else "") + ending.fix_code(cfg))
            return 2
        if code or st.training or isinstance(e, hooks.Refused):
            return code
        # sys.exit(0) (or sys.exit(main())) without training: as a script that ended, below.
    except BaseException as e:  # noqa: BLE001 - every way out of the script is recorded (CheckpointException,
        # KeyboardInterrupt: BaseExceptions), then judged by its kind (verdict.decide)
        st.handling = True  # a SIGTERM now (torchrun's, as this rank exits) must not cut its record short
        err = hooks.seen(e) or left_train(cfg, st, e) or record_error(cfg, st, e, roots, target)
        if isinstance(e, KeyboardInterrupt) or not isinstance(e, Exception):
            raise
        if st.training or runtime_error(e, err["message"]) or any(err.get(k) for k in CAUSES):
            raise  # the loop bound counts it, by its kind (verdict.judge); the record above names it
        st.refuse(f"the training script failed before training started, at {err['where']}",
                  f"{err['type']}: {err['message']}" + (f"\n{err['code']}" if err["code"] else ""),
                  (err["hint"] + "; " if err["hint"] else "") + ending.fix_code(cfg))
        return 2
    if not st.training:
        name = Path(script).name + (f":{function}" if function else "")
        msg = (f"{name} ended without calling PPOTrainer.train: nothing trained (a script that trains otherwise "
               "records no steps, and a `main` that is defined but never called does nothing)")
        _log.error(msg)
        if st.rank == 0:
            ending.write(cfg.state_dir, ending.NEVER_TRAINED, msg, "call PPOTrainer(...).train(...) from the script "
                         "(as AReaL's examples do under `if __name__ == \"__main__\"`); " + ending.fix_code(cfg),
                         step=None)
    return 0


def left_train(cfg, st, e: BaseException) -> dict | None:
    """The record of the exception that left PPOTrainer.train when `e` was raised while handling it (a cleanup in
    the script's `finally` or `except` that failed too): that one is the cause (an OOM stays an OOM), and `e` is
    named beside it. None when `e` came from no such exception."""
    from podkit.areal import hooks
    from podkit.judge import failure

    for x in failure.chain(e)[1:]:
        rec = hooks.seen(x)
        if rec and rec.get("through") == "train":
            first, _, rest = str(rec.get("message") or "").partition("\n")
            then = f"{type(e).__name__}: {failure.safe_str(e, 300).splitlines()[0] if failure.safe_str(e) else ''}"
            rec = {**rec, "message": f"{first} (then, in the cleanup after it: {then.rstrip(': ')})"
                                     + (f"\n{rest}" if rest else "")}
            failure.write(cfg.run_path, st.rank, rec)
            return rec
    return None


def _line_of(tb, roots: list[str]) -> str:
    """file:line of the last frame of `tb` in the user's code (under `roots`), else its last frame's."""
    import traceback

    frames = traceback.extract_tb(tb) if tb is not None else []
    mine = [f for f in frames if any(str(f.filename).startswith(r) for r in roots)] or frames
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else ""


# An exception with one of these facts is not the script's code: the judge names it (the volume, a checkpoint,
# memory, the network, inference), the loop bound counts it.
CAUSES = ("transient", "oom", "volume", "checkpoint", "unreachable")


def record_error(cfg, st, e: BaseException, roots: list[str], target=None) -> dict:
    """The rank's record of `e`, in the user's words, with the facts the judge reads (failure.classify). Never
    raises: the user's exception matters more than podkit's record of it."""
    from podkit.judge import failure

    try:
        return _record_error(cfg, st, e, roots, target)
    except Exception as why:  # noqa: BLE001
        err = {"type": type(e).__name__, "message": failure.safe_str(e), "where": "?", "code": "", "traceback": "",
               "hint": "", "note": f"podkit could not read it ({type(why).__name__})"}
        failure.write(cfg.run_path, st.rank, {**err, "time": __import__("time").time()})
        return err


def _record_error(cfg, st, e: BaseException, roots: list[str], target=None) -> dict:
    from podkit.areal import episodes
    from podkit.judge import ending, failure

    err = failure.clean(failure.describe(e, roots, str(cfg.workspace_path), call=target, place=ending.place(cfg)), cfg)
    failure.classify(e, err, place=ending.place(cfg))
    down = episodes.EPISODES.server_down()
    if down:
        err["unreachable"] = down
    if err.get("checkpoint") and st.run is not None:
        err["hint"] = (f"the recover checkpoint in {st.run[0]} cannot be loaded (cut in the middle of its save, or "
                       "damaged): `podkit start-over` moves it aside (kept, never deleted) and trains from step 0; "
                       "or put a whole copy of it back")
    missing = missing_file_key(e, st.config)
    if missing:
        err["hint"] = missing + ("; " + err["hint"] if err.get("hint") else "")
    failure.write(cfg.run_path, st.rank, err)
    return err


def missing_file_key(exc: BaseException, loaded) -> str:
    """For a file that is not there: the config key that names it (`train_dataset.path is '...'`), looked up in
    the config AReaL loaded; "" when no key does."""
    import dataclasses

    from podkit.judge import failure

    wanted = set()
    for e in failure.chain(exc):
        if isinstance(e, FileNotFoundError) or "Unable to find" in failure.safe_str(e, 2000):
            if isinstance(getattr(e, "filename", None), str):
                wanted.add(e.filename)
            wanted.update(re.findall(r"'([^']{1,4096})'", failure.safe_str(e, 8000)))
    if not wanted or loaded is None:
        return ""
    real = {os.path.realpath(w) for w in wanted}
    found = []

    def walk(obj, prefix: str, depth: int) -> None:
        if depth > 4 or len(found) >= 3 or not dataclasses.is_dataclass(obj):
            return
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name, None)
            if isinstance(value, str) and value and (value in wanted or os.path.realpath(value) in real):
                found.append(f"{prefix}{f.name}")
            else:
                walk(value, f"{prefix}{f.name}.", depth + 1)

    walk(loaded, "", 0)
    return "; ".join(f"{key} names a file that is not there: set it to the data's path (in the AReaL YAML or "
                     "trainer.overrides)" for key in found)


def hooks_version() -> str:
    from podkit.areal import patches

    return patches.AREAL_VERSION


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
