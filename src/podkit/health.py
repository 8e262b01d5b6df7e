"""Inference health as the outside sees it: a /health probe plus the start-up phase from its log.

The phases are SGLang's own log lines (the stand-in prints the same): until "fired up" nothing may
be wrong even though nothing listens; a run capturing CUDA graphs once cost hours (docs/failures.md).
"""

from __future__ import annotations

import os
import re
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


def probe(host: str, port: int, timeout: float = 2.0, path: str = "/health") -> bool:
    """/health: liveness (podkit runs SGLang with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0);
    /health_generate: a real one-token generation, answered within SGLang's own 20 s."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


UPDATE_BEGIN = re.compile(r"Update engine weights online from disk begin")  # SGLang's model_runner.py
UPDATE_END = re.compile(r"Update weights end\.")


def updating(path: Path) -> bool:
    """A weight update is in flight: its begin line is the last of the two in the server's log."""
    for line in reversed(tail(path, 64 * 1024)):
        if UPDATE_END.search(line):
            return False
        if UPDATE_BEGIN.search(line):
            return True
    return False


def tail(path: Path, max_bytes: int = 256 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


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
