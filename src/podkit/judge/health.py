"""Inference health as the outside sees it: a /health probe plus the start-up phase from its log.

The phases are SGLang's own log lines (the stand-in prints the same): until "fired up" nothing may
be wrong even though nothing listens; a run capturing CUDA graphs once cost hours (docs/failures.md).
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

# In order of appearance; the last one seen since the program's last start is the phase.
PHASES = [
    ("loading_weights", re.compile(r"Load weight begin")),
    ("weights_loaded", re.compile(r"Load weight end")),
    ("capturing_cuda_graphs", re.compile(r"Capture cuda graph begin")),
    ("cuda_graphs_captured", re.compile(r"Capture cuda graph end")),
    ("warming_up", re.compile(r"Uvicorn running on")),
    ("ready", re.compile(r"The server is fired up and ready to roll!")),
]
START_MARK = "[podkit:run] starting "
START_LINE = re.compile(re.escape(START_MARK.encode()))  # anywhere: a killed server may leave half a line


def probe(host: str, port: int, timeout: float = 2.0, path: str = "/health") -> bool:
    """/health: liveness (podkit runs SGLang with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0);
    /health_generate: a real one-token generation, answered within SGLang's own 20 s."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


# SGLang's model_runner.py, as whole log lines after its stamp ("[2026-11-25 14:37:48 TP0] "): a prompt that
# quotes one, logged mid-line, is not an update.
UPDATE_BEGIN = re.compile(rb"^\[[^\]\n]{0,64}\] Update engine weights online from disk begin", re.M)
UPDATE_END = re.compile(rb"^\[[^\]\n]{0,64}\] Update weights end\.", re.M)


def update_in_flight(path: Path) -> int | None:
    """None when no weight update is in flight; else where the last update that ended ended (its end line's
    offset in the log; -1 when none is in view), which tells one update in flight from the next. Only since
    inference's last start: an update cut short by a restart is not in flight."""
    base, data = _tail_bytes(path, 64 * 1024)
    begin, end, start = (_last(p, data) for p in (UPDATE_BEGIN, UPDATE_END, START_LINE))
    if begin < 0 or begin < max(end, start):  # no begin in view (a busy log, none yet): none in flight
        return None
    return base + end if end >= 0 else -1


def _last(pattern: re.Pattern, data: bytes) -> int:
    found = -1
    for m in pattern.finditer(data):
        found = m.start()
    return found


def updating(path: Path) -> bool:
    """A weight update is in flight: its begin line is the last of the two since the server's last start."""
    return update_in_flight(path) is not None


def tail(path: Path, max_bytes: int = 256 * 1024) -> list[str]:
    return _tail_bytes(path, max_bytes)[1].decode(errors="replace").splitlines()


def _tail_bytes(path: Path, max_bytes: int) -> tuple[int, bytes]:
    """(offset, the log's last max_bytes from it): a log is data, read bounded (records.read_end)."""
    from podkit.records import read_end

    start, _, data = read_end(path, max_bytes, follow=True)
    return start, data


def phase_from_log(path: Path) -> str:
    lines = tail(path)
    for i in range(len(lines) - 1, -1, -1):
        if START_MARK in lines[i]:
            lines = lines[i:]
            break
    phase = "starting" if lines else "unknown"
    for line in lines:
        for name, pattern in PHASES:
            if pattern.search(line):
                phase = name
    return phase


def inference_phase(host: str, port: int, log_path: Path, running: bool | None = None) -> str:
    if probe(host, port):
        return "ready"
    if running is False:
        return "down"
    phase = phase_from_log(log_path)
    # Past "fired up" but not answering: it died or hangs.
    return "unhealthy" if phase == "ready" else phase


def wait_for_inference(cfg, is_dead=None, interval: float = 1.0, stopping=None, logger=None) -> str | None:
    """Wait until SGLang answers /health. Returns why not, or None when ready. `is_dead` says what supervisord
    says of the server when it will not start it again by itself (FATAL, EXITED, STOPPED): a dead one is not
    waited for; one stopped on request (STOPPED: `podkit ctl stop sglang`) is, without a limit, said every few
    minutes (the user stopped it: the trainer waiting on it neither fails nor loops), and the start-up limit
    counts again from its start. `stopping()` True ends the wait ("stopping")."""
    from podkit import log
    from podkit.host import supervisord
    from podkit.judge import ending

    _log = logger or log.get("trainer")
    inf = cfg.inference
    host = inf.host if inf.host not in ("0.0.0.0", "::") else "127.0.0.1"
    t0 = time.monotonic()
    told = 0.0
    held = None  # since when inference is stopped on request
    while not probe(host, inf.port):
        if stopping is not None and stopping():
            return "stopping"
        waited = time.monotonic() - t0
        dead = is_dead() if is_dead else None
        if dead == supervisord.STOPPED:
            if held is None or time.monotonic() - held >= 300:
                asker = ending.asked_by(cfg.run_path, "sglang")
                _log.info(f"inference was stopped on request{' by ' + asker if asker else ''}: the trainer waits "
                          "for it without a limit (`podkit ctl start sglang`); this is not a failure")
                held = time.monotonic()
            t0, told = time.monotonic(), 0.0  # its start-up gets the full limit once it is started again
            time.sleep(interval)
            continue
        held = None
        if dead:
            return f"inference is {dead} in supervisord: not waiting for it (see logs/sglang.log)"
        if waited > inf.ready_timeout_s:
            return f"inference at {inf.host}:{inf.port} not ready after {inf.ready_timeout_s:.0f}s"
        if waited - told >= 30:
            _log.info(f"waiting for inference at {inf.host}:{inf.port} ({waited:.0f}s; loading weights and "
                      "capturing CUDA graphs takes minutes)")
            told = waited
        time.sleep(interval)
    return None


def sglang_state(cfg):
    """supervisord's word on the sglang program when it will not start it again by itself (STOPPED: on
    request; EXITED; FATAL), else None."""
    from podkit.host import supervisord

    def check():
        info = supervisord.process_info(cfg.socket_path, "sglang")
        return info["statename"] if info and info["statename"] in (supervisord.STOPPED, supervisord.FATAL) else None
    return check
