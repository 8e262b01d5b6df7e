"""The user's exception in its own words: what a failed rank raised, the frame in the user's code, and a
hint that fits the kind. torchrun's ChildFailedError says only that a rank failed; each rank writes its
own record (`trainer-error-<rank>.json` in the run dir) and the launcher keeps the first one.

No torch or AReaL here: the launcher, the fake trainer, status and doctor read these records too.
"""

from __future__ import annotations

import itertools
import linecache
import os
import re
import time
import traceback
from pathlib import Path

from podkit import records

MAX_MESSAGE = 1000
MAX_FIELDS = 20


def error_record(rank: int) -> records.Record:
    return records.Record(f"trainer-error-{rank}.json", records.ERROR)


def _in(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _row_fields(exc: KeyError, frames: list, roots: list[str]) -> str:
    """A KeyError on a dataset row: the fields the row does have, from the locals of the frame that raised
    (the user's frames first: a library's own `self` is the row's wrapper, not what the user named)."""
    key = exc.args[0] if exc.args else None
    mine = [f for f in frames if _in(f.f_code.co_filename, roots)]
    for frame in [*reversed(mine), *reversed(frames)][:8]:
        if frame.f_code.co_name == "<module>":
            continue  # a module's globals are not the row
        for name, value in list(frame.f_locals.items())[:200]:
            try:
                keys = getattr(value, "keys", None)
                if name.startswith("__") or not callable(keys) or isinstance(value, type):
                    continue
                fields = [safe_str(k, 80) for k in itertools.islice(keys(), MAX_FIELDS + 1)]
                if key in value:
                    continue
            except Exception:  # noqa: BLE001 - a user's object: anything may raise
                continue
            if fields:
                more = ", ..." if len(fields) > MAX_FIELDS else ""
                return (f"`{name}` has no field {key!r}; its fields are {', '.join(fields[:MAX_FIELDS])}{more}: "
                        "rename the field in the data or the key in the code")
    return ""


HUB_ERRORS = ("ConnectionError", "ConnectTimeout", "ReadTimeout", "MaxRetryError", "NameResolutionError",
              "LocalEntryNotFoundError", "OfflineModeIsEnabled", "HfHubHTTPError", "DatasetNotFoundError")


def _dataset(frames: list) -> str:
    for frame in frames:
        if frame.f_code.co_name == "load_dataset":
            path = frame.f_locals.get("path")
            if isinstance(path, str):
                return path
    return ""


def _reward_returned_none(exc: BaseException) -> str:
    """AReaL's RLVR workflow records each reward as float(reward): a reward function that returns None for some
    answers fails there, in AReaL's code, with no frame of the user's. Name the function instead."""
    e, seen = exc, 0
    while e is not None and seen < 8:
        if isinstance(e, TypeError) and "NoneType" in safe_str(e):
            for tb in _frames(e):
                f = tb.tb_frame
                if f.f_code.co_name == "_collect_samples" and "reward" in f.f_locals and f.f_locals["reward"] is None:
                    fn = getattr(f.f_locals.get("self"), "reward_fn", None)
                    fn = getattr(fn, "__wrapped__", fn)
                    code = getattr(fn, "__code__", None)
                    at = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
                    return (f"the reward function {getattr(fn, '__qualname__', None) or safe_str(fn, 200)}{at} "
                            "returned None: return a number for every completion (0.0 for one that is wrong)")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return ""


def chain(exc: BaseException, context: bool = True, limit: int = 8) -> list[BaseException]:
    """`exc` and the exceptions under it, nearest first, each once: what it was raised from (__cause__) and, unless
    `context` is False, what was being handled when it was raised (__context__)."""
    out, todo = [], [exc]
    while todo and len(out) < limit:
        e = todo.pop(0)
        if e is not None and all(e is not c for c in out):
            out.append(e)
            todo += [e.__cause__, e.__context__] if context else [e.__cause__]
    return out


# AReaL's request helper (areal/infra/utils/http.py arequest_with_retry, pinned in areal/patches.py) raises
# "Failed after N retries each. Payload: ... Addr: A. Endpoint: E. Last error: ClientConnectorError(...)". The
# payload comes first and may be megabytes (a prompt's token ids, an image): the address is read from the end.
CONNECTION_ERRORS = ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ConnectionRefusedError",
                     "ConnectionResetError")
_REQUEST = re.compile(r"\. Addr: (\S+)\. Endpoint: (\S+)\. Last error: (\w+)")
_REQUEST_TAIL = 16 * 1024  # what follows "Addr:": the address, the endpoint and the last error's repr


def unreachable_at(exc: BaseException) -> dict | None:
    """{addr, endpoint, error} when `exc`, or the exception it was raised from, is AReaL's request that never got
    through (nothing listening at the address, or the connection dropped on every retry); None otherwise (an
    HTTP error or a timeout is an answer). Only __cause__ is followed: an exception the user's code raised while
    handling one (__context__) is the user's own."""
    for e in chain(exc, context=False):
        text = safe_str(e, 1 << 30)[-_REQUEST_TAIL:]
        found = list(_REQUEST.finditer(text))  # the last: a payload may quote anything before it
        if found and found[-1].group(3) in CONNECTION_ERRORS:
            m = found[-1]
            return {"addr": m.group(1), "endpoint": m.group(2), "error": m.group(3)}
    return None


def unreachable(at: dict) -> str:
    return f"inference unreachable at {at['addr']} ({at['endpoint']}: {at['error']})"


# Network errors that may pass by themselves: a refused or reset connection, a timeout, a name that did not
# resolve for now, a service's 5xx or 429. Matched by class name too (requests, urllib3, httpx, aiohttp,
# huggingface_hub: none imported here).
TRANSIENT_NAMES = {"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "NewConnectionError",
                   "ProtocolError", "ReadTimeoutError", "ConnectTimeoutError", "ConnectError", "RemoteProtocolError",
                   "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "TimeoutException",
                   "ChunkedEncodingError", "IncompleteRead", "RemoteDisconnected", "ServerTimeoutError",
                   # aiohttp: a body cut mid-way (a data download, fsspec's http), the server gone mid-answer
                   "ClientPayloadError", "ClientConnectionResetError", "ContentLengthError", "TransferEncodingError"}
# What cannot heal by itself however often it is tried: the hub told offline with nothing cached, a repo or file
# that is not there or is gated, a name that does not exist.
PERMANENT = ("OfflineModeIsEnabled", "GatedRepoError", "RepositoryNotFoundError", "RevisionNotFoundError",
             "EntryNotFoundError", "DatasetNotFoundError", "Name or service not known", "nodename nor servname",
             "SSLCertVerificationError", "CERTIFICATE_VERIFY_FAILED")
_PERMANENT = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in PERMANENT) + r")\b")
_URL = re.compile(r"(?:https?|wss?)://([A-Za-z0-9.\-\[\]:]+)")
_HOST = re.compile(r"host='([^']+)'(?:, port=(\d+))?")
_REACH = re.compile(r"Couldn't reach '([^']+)'")


def _status(e: BaseException) -> int | None:
    """An HTTP error's status: requests' and huggingface_hub's `response.status_code`, urllib's `code`,
    aiohttp's `status`. Not aiohttp's HttpProcessingError's `code`: its own parser's (400 for a body cut short),
    no server's answer."""
    if "HttpProcessingError" in {c.__name__ for c in type(e).__mro__}:
        return None
    for value in (getattr(getattr(e, "response", None), "status_code", None), getattr(e, "code", None),
                  getattr(e, "status", None)):
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    return None


def transient(exc: BaseException, frames: list = (), offline: bool = False) -> str:
    """What a network error that may pass by itself could not reach ("could not reach huggingface.co (dataset
    'openai/gsm8k')"); "" when `exc` is no such error: a KeyError, a missing file, a 404, the hub offline with
    nothing cached cannot heal by itself, and is stopped once instead of retried.

    By cause, not by type: only `exc` and what it was raised from (__cause__) are read, never what was being
    handled when it was raised (an error the script raised in its `except` is its own, whatever it handled).
    A broken pipe (the script's own subprocess), a certificate that does not verify, a name that does not
    exist, and the hub where the trainer cannot reach it (`offline`: a rehearsal; HF_*_OFFLINE) never heal."""
    import socket

    found, texts = False, []
    for e in chain(exc, context=False):
        text = safe_str(e, 4000)
        texts.append(text)
        names = {c.__name__ for c in type(e).__mro__}
        if names & set(PERMANENT) or _PERMANENT.search(text) or isinstance(e, BrokenPipeError) and e is exc:
            return ""
        status = _status(e)
        if status is not None and status >= 400:
            if status < 500 and status != 429:
                return ""  # the service answered: not there, not allowed
            found = True
        elif isinstance(e, BrokenPipeError):
            continue  # a pipe (the script's own subprocess), not the network
        elif isinstance(e, (ConnectionError, TimeoutError)) or names & TRANSIENT_NAMES or \
                isinstance(e, socket.gaierror) and e.errno == socket.EAI_AGAIN:
            found = True
        elif type(e).__name__ == "URLError" and isinstance(getattr(e, "reason", None), (ConnectionError, TimeoutError)):
            found = True
    if not found:
        return ""
    frames = frames or [tb.tb_frame for e in chain(exc, context=False) for tb in _frames(e)]
    hub = _dataset(frames) or any(_REACH.search(t) or "huggingface" in t.lower() for t in texts)
    if hub and (offline or any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))):
        return ""  # the hub, where it cannot be reached: it fetches nothing, however often it is tried
    return "could not reach " + _reached(texts, frames)


def _reached(texts: list[str], frames: list) -> str:
    dataset = _dataset(frames)
    host = ""
    for text in texts:
        m = _HOST.search(text) or _URL.search(text)
        if m:
            host = m.group(1) + (f":{m.group(2)}" if m.re is _HOST and m.group(2) else "")
            break
    if not host:
        for frame in reversed(frames):
            for name in ("url", "full_url", "req", "request", "endpoint", "address"):
                value = frame.f_locals.get(name)
                value = getattr(value, "full_url", value)
                m = _URL.search(value) if isinstance(value, str) else None
                if m:
                    host = m.group(1)
                    break
            if host:
                break
    reach = next((m.group(1) for t in texts if (m := _REACH.search(t))), "")
    if dataset or reach:
        return f"{host or 'the hub'} (dataset {dataset or reach!r})"
    return host or "a service the script connects to"


def oom_of(exc: BaseException) -> str:
    """"GPU" for CUDA's out of memory, "host" for Python's MemoryError, "" otherwise: by the exception's type, in
    `exc` or what it was raised from, never by what a message says (a validation message, or AReaL quoting
    SGLang's answer, may say "CUDA out of memory" of another process), nor by a name alone (a script's own class
    named OutOfMemoryError, a budget it keeps, is its own)."""
    for e in under(exc, context=False):
        if any(c.__name__ == "OutOfMemoryError" and str(getattr(c, "__module__", "")).split(".")[0] == "torch"
               for c in type(e).__mro__):  # torch's own (torch.OutOfMemoryError, torch.cuda's), or a subclass
            return "GPU"
        if isinstance(e, MemoryError):
            return "host"
    return ""


def alloc_bytes(exc: BaseException) -> int | None:
    """What a MemoryError asked for, where it says: numpy's `_ArrayMemoryError` keeps the array's size."""
    for e in chain(exc, context=False):
        n = getattr(e, "_total_size", None) if isinstance(e, MemoryError) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def host_memory() -> int | None:
    """This machine's memory (its cgroup's limit when lower), in bytes."""
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit() and (total is None or int(limit) < total):
            total = int(limit)
    except OSError:
        pass
    return total


def under(exc: BaseException, context: bool = True) -> list[BaseException]:
    """`exc`'s chain (chain()), and what each rank's part of a torch distributed checkpoint raised: torch keeps
    those in CheckpointException.failures ({rank: (exception, frames)}), not in the chain."""
    out = chain(exc, context)
    for e in list(out):
        fails = getattr(e, "failures", None) if "CheckpointException" in {c.__name__ for c in type(e).__mro__} \
            else None
        if isinstance(fails, dict):
            for value in list(fails.values())[:8]:
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    out += [x for x in chain(inner, context) if all(x is not y for y in out)]
    return out


VOLUME_ERRNOS = ("ENOSPC", "EDQUOT", "EIO", "ESTALE", "EROFS")


def volume_of(exc: BaseException) -> str:
    """The errno's name ("ENOSPC") when `exc`, or anything under it, is the volume failing: full, over quota,
    an I/O error, a stale network handle, read-only. Under it includes what was being handled: a full disk is a
    fact of the machine, whatever the script raised about it."""
    import errno

    for e in under(exc):
        code = getattr(e, "errno", None) if isinstance(e, OSError) else None
        name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
        if name in VOLUME_ERRNOS:
            return name
    return ""


def checkpoint_of(exc: BaseException) -> bool:
    """torch's distributed checkpoint could not be loaded: a `CheckpointException` (a BaseException) raised through
    its loader (torch/distributed/checkpoint/state_dict_loader.py). One raised by a save is not a checkpoint that
    cannot be loaded (what the save hit is: the volume, memory, the script)."""
    for e in chain(exc):
        if "CheckpointException" in {c.__name__ for c in type(e).__mro__}:
            if any(os.path.basename(tb.tb_frame.f_code.co_filename) == "state_dict_loader.py" for tb in _frames(e)):
                return True
    return False


def classify(exc: BaseException, err: dict, frames: list = (), place: str = "pod") -> dict:
    """`err` (describe's record of `exc`) with the facts the end's judge reads (verdict.decide): the volume
    failing, out of memory (and what a MemoryError asked for, against the machine's memory), a checkpoint that
    cannot be read (not what its load ran into: the volume, memory), a network error that may pass, and a
    BaseException's type."""
    try:
        if not isinstance(exc, Exception):
            err["base"] = type(exc).__name__
        if (vol := volume_of(exc)):
            err["volume"] = vol
        elif (oom := oom_of(exc)):  # before the checkpoint: a load that ran out of memory is memory's, not damage
            err["oom"] = oom
            if oom == "host" and (n := alloc_bytes(exc)) and (total := host_memory()):
                err["alloc_bytes"], err["memory_bytes"] = n, total
        elif checkpoint_of(exc):
            err["checkpoint"] = True
        elif (reach := transient(exc, frames, offline=place == "rehearse")):
            err["transient"] = reach
    except Exception:  # noqa: BLE001 - never lose the record for want of a class
        pass
    return err


def hint_for(exc: BaseException, frames: list, workspace: str = "/workspace", roots: list[str] = (),
             place: str = "pod") -> str:
    """What to do about this kind of failure; "" when nothing more specific than "fix it" fits. `place` is where
    the trainer runs (ending.place): a rehearsal is offline, and its fix is an override, not the volume."""
    if none := _reward_returned_none(exc):
        return none
    if at := unreachable_at(exc):
        return (f"nothing answered at {at['addr']} ({at['endpoint']}: {at['error']}): if that is inference, the "
                "server was down (logs/sglang.log says why; on one pod supervisord starts it again, on a cluster "
                "AReaL's recover run starts a new one), not your code; if it is a server your code calls (a "
                "judge), that server")
    kinds = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, KeyError):
        return _row_fields(exc, frames, list(roots))
    if kinds & set(HUB_ERRORS) or isinstance(exc, ConnectionError):
        dataset = _dataset(frames)
        if dataset and place == "rehearse":
            return (f"the rehearsal is offline: dataset {dataset!r} cannot come from the hub here; point the YAML's "
                    "dataset at a local copy with OVERRIDES='train_dataset.path=<dir or file> "
                    "valid_dataset.path=<dir or file>' (rehearse/assets.py makes a GSM8K-shaped one in "
                    "<workspace>/rehearsal/gsm8k)")
        if dataset:
            return (f"the trainer could not fetch dataset {dataset!r} from the hub: fill its cache on the volume "
                    f"before the GPU pod (HF_HOME={workspace}/hf python -c \"import datasets; "
                    f"datasets.load_dataset('{dataset}')\" on any machine with the volume), or put the data in the "
                    "repo; a pod that cannot reach the hub cannot train on it")
        return "a connection failed before training: check the address or the token the script uses"
    if isinstance(exc, ImportError):
        return hint_for_import()
    return ""


def _frames(exc: BaseException) -> list:
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def own(exc: BaseException, roots: list[str]) -> BaseException:
    """The exception to name: `exc`, or the one it wraps (AReaL re-raises a background thread's exception as
    RuntimeError("Background thread failed") from it) when only that one went through the user's code."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        if any(_in(tb.tb_frame.f_code.co_filename, roots) for tb in _frames(e)):
            return e
        e = e.__cause__ or e.__context__
    return exc


TEXT_FRAME = re.compile(r'^\s*(?:\[rank\d+\]:\s*)?File "([^"]+)", line (\d+)')
TEXT_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): ?(.*)$")


def from_text(text: str, roots: list[str]) -> dict | None:
    """A traceback that reached this process as text: torch's DataLoader workers re-raise a worker's
    exception with its traceback in the message ("Original Traceback ..."). The user's frame and the
    exception from it, when the text has them."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Original Traceback" in ln), -1)
    frames = [(i, m) for i, ln in enumerate(lines) if i > start and (m := TEXT_FRAME.match(ln))]
    mine = [(i, m) for i, m in frames if _in(m.group(1), roots)]
    if not mine:
        return None
    i, m = mine[-1]
    error = next((e for ln in reversed(lines) if (e := TEXT_ERROR.match(ln.strip()))), None)
    path, lineno = m.group(1), int(m.group(2))
    return {"type": error.group(1).rsplit(".", 1)[-1] if error else "Error",
            "message": (error.group(2) if error else lines[-1])[:MAX_MESSAGE], "where": f"{path}:{lineno}",
            "code": (linecache.getline(path, lineno) or "").strip()[:300],
            "traceback": "\n".join(ln for ln in lines[i:] if ln.strip())[-4000:]}


def safe_str(value, limit: int = MAX_MESSAGE) -> str:
    """str() of a user's object, which may raise or be huge, as text any stream takes (utf8)."""
    try:
        text = str(value)
    except Exception:  # noqa: BLE001
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001
            text = f"<{type(value).__name__} that cannot be printed>"
    return utf8(text[:limit])


def utf8(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate: a file name's undecodable byte, a broken pair in a
    data row) written as its escape: a record that holds one would fail every print of it (the launcher's log of
    the end, status), after the rank had died."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(exc: BaseException, roots: list[str], workspace: str = "/workspace", call=None, place: str = "pod") -> dict:
    """The record of `exc`: type, message, where (the deepest frame under `roots`, the user's code), that
    line of code, the traceback's frames from the user's first one on, and a hint. `call` is the user's
    function that podkit called, for a TypeError from the call itself (a wrong signature). Never raises: it
    runs in the handler of the user's exception, which it must not hide."""
    try:
        return {k: utf8(v) if isinstance(v, str) else v for k, v in _describe(exc, roots, workspace, call, place).items()}
    except Exception as e:  # noqa: BLE001
        return {"type": type(exc).__name__, "message": safe_str(exc), "where": "?", "code": "", "traceback": "",
                "hint": "", "time": time.time(), "note": f"podkit could not read the traceback ({type(e).__name__})"}


def _describe(exc: BaseException, roots: list[str], workspace: str, call, place: str = "pod") -> dict:
    linecache.checkcache()  # the file as it is now, not as an earlier read of it cached it
    exc = own(exc, roots) if roots else exc
    tbs = _frames(exc)
    frames = [tb.tb_frame for tb in tbs]
    summary = [traceback.FrameSummary(tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name)
               for tb in tbs]
    mine = [i for i, f in enumerate(summary) if _in(f.filename, roots)]
    if isinstance(exc, SyntaxError) and exc.filename:
        where, code = f"{exc.filename}:{exc.lineno}", (exc.text or "").strip()
    elif mine:
        f = summary[mine[-1]]
        where, code = f"{f.filename}:{f.lineno}", (linecache.getline(f.filename, f.lineno) or "").strip()
    elif summary:
        f = summary[-1]
        where, code = f"{f.filename}:{f.lineno}", (linecache.getline(f.filename, f.lineno) or "").strip()
    else:
        where, code = "?", ""
    hint = hint_for(exc, frames, workspace, roots, place)
    if call is not None and isinstance(exc, TypeError) and len(summary) <= 1:
        # Raised by the call itself: the function does not take what podkit passes (argv, a list).
        fn = getattr(call, "__wrapped__", call)
        c = getattr(fn, "__code__", None)
        if c is not None:
            where, code = f"{c.co_filename}:{c.co_firstlineno}", (linecache.getline(c.co_filename, c.co_firstlineno)
                                                                 or "").strip()
        hint = (f"podkit calls {getattr(fn, '__name__', 'the function')}(argv) with the command-line arguments as "
                "a list (as AReaL's own mains take them): give it one parameter, e.g. `def main(argv=None)`")
    # Down the chain: AReaL wraps a rollout's exception (RuntimeError "Background thread failed" from it), and
    # a reward function run in AReaL's process pool raises with the worker's traceback as text under it.
    for e in chain(exc) if roots else ():
        text = safe_str(e, 64 * 1024)
        told = from_text(text, roots) if "Traceback" in text else None
        if told:  # a worker process's exception, raised here as text: its frame is the deeper one
            return {**told, "hint": hint_for(e, frames, workspace, roots, place), "time": time.time()}
    start = mine[0] if mine else max(0, len(summary) - 8)
    lines = [ln.rstrip() for ln in traceback.format_list(summary[start:])[-12:]]
    return {"type": type(exc).__name__, "message": safe_str(exc), "where": where, "code": code[:300],
            "traceback": "\n".join(lines)[-4000:], "hint": hint, "time": time.time()}


def clean(err: dict, cfg) -> dict:
    """`err` with the pod's secrets taken out: a user's exception may quote a URL with its token, and the
    record goes to status, doctor, the bundle and the webhook."""
    from podkit.redact import Redactor

    try:
        r = Redactor.for_pod(cfg, os.environ)
        return {k: r(v) if isinstance(v, str) else v for k, v in err.items()}
    except Exception:  # noqa: BLE001 - never lose the record for want of redaction
        return err


def hint_for_import() -> str:
    return "a missing package goes in the repo's requirements (repo.setup installs them), else a typo in a name"


def summary(err: dict) -> str:
    """One line: `KeyError: 'question' at train.py:42`."""
    first = (err.get("message") or "").strip().splitlines()
    return f"{err.get('type', 'error')}: {first[0] if first else ''}".rstrip(": ") + \
        (f" at {err['where']}" if err.get("where") else "")


def write(run_dir: Path, rank: int, err: dict) -> None:
    """Rank `rank`'s record of its exception, naming the trainer program it ran under (ending.program: the ranks
    inherit its pid), so that a record another run left (or one planted) is not read as this run's."""
    from podkit.judge import ending

    program = ending.program()
    try:
        error_record(rank).write(run_dir, {**err, "rank": rank, **({"program": program} if program else {})},
                                 mode=0o600)
    except OSError:
        pass  # the log has the traceback too


def first_since(run_dir: Path, since: float) -> dict | None:
    """The earliest rank record written since `since`: the rank that failed first (the others often fail
    because it did, in a collective)."""
    found = all_since(run_dir, since)
    return found[0] if found else None


def all_since(run_dir: Path, since: float, program_pid: int | None = None) -> list[dict]:
    """Every rank's record written since `since`, the earliest first: not one stamped more than ending.FUTURE_S
    ahead of this clock (planted, or another run's from a clock that was ahead: it would be every later run's
    exception until the clock caught up), nor, when both name one, one of another trainer program than
    `program_pid`. The same freshness rule as the end records' (ending.of)."""
    from podkit.judge import ending

    found, now = [], time.time()
    for path in Path(run_dir).glob("trainer-error-*.json"):
        rank = path.name.removeprefix("trainer-error-").removesuffix(".json")
        if rank.isdigit():
            err = error_record(int(rank)).read_owned(run_dir)
            t, named = err.get("time"), err.get("program")
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not since <= t <= now + ending.FUTURE_S:
                continue
            if program_pid is not None and isinstance(named, int) and not isinstance(named, bool) \
                    and named != program_pid:
                continue
            found.append(err)
    return sorted(found, key=lambda e: e["time"])
