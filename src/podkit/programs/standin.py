"""STAND-IN for SGLang's HTTP server, for the no-GPU smoke stack. It is not SGLang.

It speaks the subset of SGLang's API that podkit and the trainers use (/health, /health_generate,
/get_model_info, /v1/models, /generate, /update_weights_from_disk) and behaves like SGLang where
podkit depends on it: nothing listens until start-up is over (connection refused), the start-up
phases print SGLang's own log lines, and a restarted server serves the base weights
(`weight_version` "default") until a trainer pushes again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from podkit.boot.weights import WEIGHT_FILES
from podkit.programs import hold_devices

BANNER = "[stand-in] podkit's SGLang stand-in (not SGLang): no GPU, no model, same HTTP API subset"


def say(msg: str) -> None:
    # SGLang's log format, so the phase detection that reads real logs reads these too.
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)


class State:
    def __init__(self, model: str) -> None:
        self.model = model
        self.weight_version = "default"  # what SGLang reports before any update
        self.weights_path = model
        self.frozen = threading.Event()  # fault injection: accept connections, never answer
        self.lock = threading.Lock()
        self.updated = threading.Event()  # clear while a weight update is in flight
        self.updated.set()
        self.probes = 0  # generation probes queued or running


# SGLang's own default: /health is /health_generate (a real generation) unless this is "0".
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default


class Handler(BaseHTTPRequestHandler):
    """What both stand-ins answer alike (this one and standin_lm's generating one): SGLang's JSON bodies,
    its 404 and its missing-weights 400, its model descriptions, and no request log."""

    protocol_version = "HTTP/1.1"
    server_version = "sglang-standin"

    def log_message(self, fmt, *args):  # requests are not logged, like SGLang at info level
        pass

    def _send(self, code: int, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (AReaL cancels rollouts in flight when it stops)

    def _body(self) -> dict:
        """The request's JSON ({} without a body); json.JSONDecodeError when it is not JSON."""
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else {}

    def _not_found(self) -> None:
        self._send(404, {"detail": "Not Found"})

    def _weights_missing(self, path) -> bool:
        """SGLang's answer to /update_weights_from_disk for a path that is not there."""
        if path and os.path.isdir(path) and not any(p.name.endswith(WEIGHT_FILES) for p in Path(path).iterdir()):
            self._send(400, {"success": False, "message": f"Failed to update weights: Cannot find any model weights "
                             f"with `{path}`", "num_paused_requests": 0})  # SGLang's DefaultModelLoader
            return True
        if path and os.path.exists(path):
            return False
        self._send(400, {"success": False, "message": f"Failed to get weights iterator: {path!r} does not exist",
                         "num_paused_requests": 0})
        return True

    def _model_info(self, model_path: str, weight_version: str, **more) -> None:
        self._send(200, {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": weight_version, **more})

    def _models(self, model_path: str, max_model_len: int) -> None:
        self._send(200, {"object": "list", "data": [{"id": model_path, "object": "model", "created": int(time.time()),
                                                     "owned_by": "sglang", "root": model_path,
                                                     "max_model_len": max_model_len}]})


def start(banner: str, host: str, port: int, model: str) -> threading.Event:
    """A stand-in's first lines (its banner: a stand-in, not SGLang; then SGLang's own server_args line)
    and the event SIGTERM and SIGINT set to stop it."""
    print(banner, flush=True)
    say(f"server_args=ServerArgs(model_path='{model}', host='{host}', port={port}, stand_in=True)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def make_handler(state: State, update_delay_s: float = 0.0, probe_s: float = 0.1):
    generation_on_health = os.environ.get(HEALTH_GENERATION_ENV, "1").strip().lower() not in ("0", "false", "no")

    class SmokeHandler(Handler):
        def _maybe_freeze(self) -> None:
            while state.frozen.is_set():
                time.sleep(0.5)

        def _generation_probe(self) -> None:
            """As SGLang: a one-token generation is queued (behind a weight update in flight) and answered
            200 once it has run, or 503 after HEALTH_CHECK_TIMEOUT_S, when it stays queued all the same."""
            with state.lock:
                state.probes += 1
                n = state.probes
            say(f"health check: a one-token generation queued ({n} in flight)")
            done = threading.Event()

            def generate():
                state.updated.wait()
                time.sleep(probe_s)
                with state.lock:
                    state.probes -= 1
                done.set()

            threading.Thread(target=generate, daemon=True).start()
            self._send(200 if done.wait(HEALTH_CHECK_TIMEOUT_S) else 503, b"")

        def do_GET(self) -> None:
            self._maybe_freeze()
            if self.path == "/health" and not generation_on_health:
                self._send(200, b"")
            elif self.path in ("/health", "/health_generate"):
                self._generation_probe()
            elif self.path in ("/get_model_info", "/model_info"):  # SGLang serves both
                with state.lock:
                    self._model_info(state.model, state.weight_version)
            elif self.path == "/v1/models":
                self._models(state.model, 4096)
            else:
                self._not_found()

        def do_POST(self) -> None:
            self._maybe_freeze()
            try:
                body = self._body()
            except json.JSONDecodeError:
                body = {}
            if self.path == "/generate":
                text = body.get("text") or ""
                n = int((body.get("sampling_params") or {}).get("max_new_tokens", 8))
                with state.lock:
                    version = state.weight_version
                self._send(200, {"text": " 42" * max(1, min(n, 16)), "meta_info": {
                    "id": os.urandom(8).hex(), "prompt_tokens": len(str(text).split()),
                    "completion_tokens": n, "finish_reason": {"type": "length", "length": n},
                    "weight_version": version}})
            elif self.path == "/update_weights_from_disk":
                path = body.get("model_path")
                if self._weights_missing(path):
                    return
                say(f"Update engine weights online from disk begin. path={path}")  # SGLang's model_runner lines
                state.updated.clear()
                try:
                    # really read them, as SGLang would: one file, or a checkpoint directory's files
                    files = sorted(p for p in Path(path).iterdir() if p.is_file()) if os.path.isdir(path) else [path]
                    for name in files:
                        with open(name, "rb") as f:
                            while f.read(1 << 20):
                                pass
                    time.sleep(update_delay_s)
                    with state.lock:
                        state.weights_path = path
                        state.weight_version = str(body.get("weight_version") or state.weight_version)
                        version = state.weight_version
                finally:
                    state.updated.set()
                    say("Update weights end.")
                say(f"Update weights from disk: {path} (weight_version={version})")
                self._send(200, {"success": True, "message": "Succeeded to update model weights.",
                                 "num_paused_requests": 0})
            else:
                self._not_found()

    return SmokeHandler


def serve(host: str, port: int, model: str, startup_delay_s: float, update_delay_s: float = 0.0,
          probe_s: float = 0.1) -> int:
    stop = start(BANNER, host, port, model)
    # Start-up phases: nothing listens yet, exactly like SGLang before its HTTP server starts.
    step = startup_delay_s / 2
    say("Load weight begin. avail mem=0.00 GB")
    if stop.wait(step):
        return 0
    say(f"Load weight end. type=StandIn, dtype=float32, avail mem=0.00 GB, mem usage=0.00 GB, elapsed={step:.2f} s")
    say("Capture cuda graph begin. This can take up to several minutes. avail mem=0.00 GB")
    if stop.wait(step):
        return 0
    say(f"Capture cuda graph end. Time elapsed: {step:.2f} s. mem usage=0.00 GB. avail mem=0.00 GB.")
    state = State(model)
    # SIGUSR1 freezes the server (accepts, never answers), SIGUSR2 thaws it: the fault suite's hang.
    signal.signal(signal.SIGUSR1, lambda *_: state.frozen.set())
    signal.signal(signal.SIGUSR2, lambda *_: state.frozen.clear())
    return listen(ThreadingHTTPServer((host, port), make_handler(state, update_delay_s, probe_s)), host, port, stop)


def listen(httpd: ThreadingHTTPServer, host: str, port: int, stop: threading.Event) -> int:
    """Serve until `stop`, announcing it with SGLang's own lines (phase detection reads them)."""
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    say(f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)")
    say("The server is fired up and ready to roll!")
    # Python runs a signal's handler in the main thread only, when it wakes: a signal the kernel hands to a
    # request's thread (SIGTERM, or the fault suite's SIGUSR1) would wait for ever on an untimed wait.
    while not stop.wait(0.5):
        pass
    say("Shutting down (SIGTERM)")
    httpd.shutdown()
    httpd.server_close()
    return 0


def main(cfg) -> int:
    from podkit.programs import sglang

    env = sglang.environment(cfg)
    if os.environ.get(HEALTH_GENERATION_ENV) != env[HEALTH_GENERATION_ENV]:
        # Run under SGLang's own environment (as the real server is exec'd with it): the caches, and /health
        # as liveness only. Once: the exec'd process finds it already set.
        os.execve(sys.executable, [sys.executable, "-m", "podkit", "run", "sglang"], env)
    held = hold_devices(cfg)  # noqa: F841 - held for the process's lifetime, as a CUDA server holds its GPU
    inf = cfg.inference
    return serve(inf.host, inf.port, inf.model, inf.startup_delay_s, inf.standin_update_delay_s, inf.standin_probe_s)


if __name__ == "__main__":
    sys.exit(serve("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 30000, "stand-in", 0.0))
