"""Stacks for a hang dump, and the user's frame read from one.

On SIGUSR2 a trainer process writes every thread's stack (faulthandler, from C: it works while Python is
blocked in C) and then every pending asyncio task's await chain to <workspace>/logs/stacks-<pid>.txt. The
tasks matter: a workflow whose `arun_episode` awaits for ever is on no thread's stack (the rollout thread's
event loop shows only its select), only on its task's. The watchdog reads the dump (py-spy's, these) for the
frame in the user's checkout nearest to where it waits: "hung in your workflow at my_workflow.py:42 in
arun_episode".

No podkit imports: the trainer's ranks and the watchdog both use it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal

TASKS_BEGIN = "# asyncio tasks"
TASKS_END = "# end of asyncio tasks"
MAX_TASKS = 200
MAX_DEPTH = 64


def on_sigusr2(path: str) -> None:
    """SIGUSR2 dumps this process's threads (at once, from C) and then its asyncio tasks (from Python, when the
    main thread next runs Python code) into `path`."""
    f = open(path, "a")  # noqa: SIM115 - open for the process's lifetime
    signal.signal(signal.SIGUSR2, lambda *_: dump_tasks(f))
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=True)  # then the handler above


def _all_tasks() -> list:
    import asyncio

    tasks = getattr(asyncio.tasks, "_all_tasks", None)  # 3.11: every loop's tasks, in any thread
    if tasks is None:  # 3.12 on
        tasks = set(getattr(asyncio.tasks, "_scheduled_tasks", ())) | set(getattr(asyncio.tasks, "_eager_tasks", ()))
    for _ in range(5):  # another thread's loop changes the set under us
        try:
            return list(tasks)
        except RuntimeError:
            continue
    return []


def await_chain(coro) -> list[tuple[str, int, str]]:
    """(file, line, function) of each coroutine `coro` awaits, outermost first."""
    out = []
    while coro is not None and len(out) < MAX_DEPTH:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return out


def dump_tasks(f) -> None:
    """Every pending task's await chain, most recent call first (faulthandler's shape). Never raises: it runs in
    a signal handler, inside whatever the main thread was doing."""
    try:
        lines = [f"{TASKS_BEGIN} of pid {os.getpid()} (their await chains, most recent call first)"]
        for task in _all_tasks()[:MAX_TASKS]:
            try:
                if task.done():
                    continue
                lines.append(f"Task {task.get_name()!r} (pending):")
                lines += [f'  File "{fn}", line {ln} in {name}' for fn, ln, name in reversed(await_chain(task.get_coro()))]
            except Exception:  # noqa: BLE001 - a task torn down meanwhile
                continue
        lines.append(TASKS_END)
        f.write("\n".join(lines) + "\n")
        f.flush()
    except Exception:  # noqa: BLE001
        pass


# -- reading a dump ----------------------------------------------------------------------------------------------
HEAD = re.compile(r"^(?:Current thread|Thread|Task)\b")
FAULTHANDLER = re.compile(r'^\s*File "(.+)", line (\d+) in (.+?)\s*$')
PY_SPY = re.compile(r"^\s+(\S.*?) \((.+):(\d+)\)\s*$")


def stacks_in(text: str) -> list[tuple[bool, list[tuple[str, int, str]]]]:
    """The stacks of a dump: (a task's, [(file, line, function), most recent first])."""
    out: list[tuple[bool, list]] = []
    current = None
    for line in text.splitlines():
        if HEAD.match(line):
            current = (line.startswith("Task"), [])
            out.append(current)
            continue
        if current is None:
            continue
        m = FAULTHANDLER.match(line)
        if m:
            current[1].append((m.group(1), int(m.group(2)), m.group(3)))
            continue
        m = PY_SPY.match(line)
        if m:
            current[1].append((m.group(2), int(m.group(3)), m.group(1)))
    return [s for s in out if s[1]]


def _under(path: str, roots: list[str]) -> str | None:
    real = os.path.realpath(path)
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return root
    return None


def user_frame(text: str, roots: list[str]) -> dict | None:
    """The frame in `roots` (the user's checkout) nearest to where some stack waits: {where, function, shown,
    task}; `shown` is the path relative to its root. A task's frame wins a tie (a workflow's await)."""
    roots = [os.path.realpath(r) for r in roots if r]
    best = None
    for task, frames in stacks_in(text):
        for above, (path, line, name) in enumerate(frames):
            root = _under(path, roots)
            if root is None:
                continue
            key = (above, 0 if task else 1)
            if best is None or key < best[0]:
                top = frames[0]
                best = (key, {"where": f"{path}:{line}", "function": name, "task": task, "above": above,
                              "shown": f"{os.path.relpath(os.path.realpath(path), root)}:{line}",
                              "top": f"{os.path.basename(top[0])}:{top[1]} in {top[2]}"})
            break  # this stack's nearest user frame
    return best[1] if best else None


def top_frame(text: str) -> dict | None:
    """The main thread's innermost frame outside Python's own library (a lock's wait says less than who waits),
    when no frame of the user's is on any stack (faulthandler: the current thread; py-spy: the first)."""
    import sysconfig

    stacks = [s for s in stacks_in(text) if not s[0]]
    if not stacks:
        return None
    lib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    frames = stacks[0][1]
    path, line, name = next((f for f in frames if _under(f[0], [lib]) is None), frames[0])
    return {"where": f"{path}:{line}", "function": name, "task": False, "shown": f"{os.path.basename(path)}:{line}"}


NEAR = 3  # frames between the user's and where it waits: an await, a lock, a sleep; more is a library's own wait


def describe(frame: dict | None, mine: bool) -> str:
    if frame is None:
        return "no Python frame could be read"
    if not mine:
        return f"no frame of your code on any stack; waiting at {frame['shown']} in {frame['function']}"
    if frame.get("above", 0) > NEAR:  # deep in a library (AReaL, torch) below the user's call
        return (f"waiting at {frame['top']}, {frame['above']} frames below your code at {frame['shown']} in "
                f"{frame['function']}")
    return f"hung in your {'workflow' if frame['task'] else 'code'} at {frame['shown']} in {frame['function']}"
