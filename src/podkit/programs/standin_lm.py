"""STAND-IN for SGLang's HTTP server that really generates, on CPU: podkit's generating stand-in
(`inference.kind: standin-lm`, the CPU rehearsal). It is not SGLang.

A tiny causal LM (transformers, fp32, CPU) behind the subset of SGLang 0.5.10's HTTP API that AReaL
1.0.4's RemoteSGLangEngine (disk weight updates) and podkit use:

  GET  /health, /health_generate        200, empty body (never need the API key, as in SGLang)
  GET  /get_model_info, /model_info     model_path, weight_version ("default" before any update), ...
  POST /generate                        input_ids + sampling_params + return_logprob (non-streaming)
  POST /pause_generation                SGLang's default mode "abort": requests in flight end now with
                                        finish_reason {"type": "abort"} and their partial output; new
                                        requests wait until /continue_generation
  POST /continue_generation
  POST /update_weights_from_disk        loads the HF weights at model_path BEFORE answering (AReaL deletes
                                        the directory right after), then sets weight_version. As SGLang's
                                        model_update_lock (a writer lock): requests in flight finish on the
                                        old weights first, new ones wait for the update

With SGLANG_API_KEY set, every other route answers 401 without `Authorization: Bearer <key>`, as
SGLang's server does.

Sampling matches SGLang's sampler (sglang/srt/layers/sampler.py, standard path, no
SGLANG_RETURN_ORIGINAL_LOGPROB): probs = softmax(logits / temperature); the token is drawn from probs
after top-k / top-p filtering; the returned log-prob is log(probs[token]): temperature-scaled, not
renormalised by top-k/top-p. temperature 0 is greedy with log_softmax(logits). The stop token is part of
the output. frequency_penalty subtracts penalty * count(token in output) from the logits.

All requests in flight are decoded together: each step is one forward over the right-padded batch
(no KV cache: sequences here are short, and a causal mask makes right padding harmless).

SIGUSR1: serve the base weights again with weight_version "default", as a restarted SGLang would, but
without the downtime (`supervisorctl restart sglang` is the real restart).
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

import torch

from podkit.areal.checks import API_KEY_ENV
from podkit.programs import hold_devices
from podkit.programs.standin import Handler, listen, say, start

BANNER = "[stand-in] podkit's generating SGLang stand-in (not SGLang): a tiny causal LM on CPU, SGLang's HTTP API subset"


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


class Request:
    def __init__(self, body: dict, eos_ids: set[int]) -> None:
        sp = body.get("sampling_params") or {}
        self.rid = str(body.get("rid") or uuid.uuid4().hex)
        self.input_ids = [int(x) for x in body["input_ids"]]
        self.max_new_tokens = int(sp.get("max_new_tokens") if sp.get("max_new_tokens") is not None else 128)
        self.temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
        self.top_p = float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0)
        top_k = sp.get("top_k", -1)
        self.top_k = int(top_k) if top_k is not None else -1
        self.freq_penalty = float(sp.get("frequency_penalty") or 0.0)
        self.ignore_eos = bool(sp.get("ignore_eos", False))
        self.skip_special_tokens = bool(sp.get("skip_special_tokens", True))
        self.stop_ids = set(int(x) for x in (sp.get("stop_token_ids") or []))
        if not self.ignore_eos:
            self.stop_ids |= eos_ids
        self.stop_strs = sp.get("stop") or []
        if isinstance(self.stop_strs, str):
            self.stop_strs = [self.stop_strs]
        self.return_logprob = bool(body.get("return_logprob", False))
        self.out_ids: list[int] = []
        self.out_lps: list[float] = []
        self.finish: dict | None = None
        self.weight_version: str | None = None  # set when it finishes
        self.done = threading.Event()
        self.t0 = time.time()


class Engine:
    """One decoding thread; HTTP handler threads hand requests over and wait for them."""

    def __init__(self, model_path: str, seed: int, context_length: int) -> None:
        from transformers import AutoTokenizer

        self.model_path = self.base_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = load_model(model_path)
        self.eos_ids = self._eos_ids(self.model)
        self.context_length = context_length
        self.weight_version = "default"
        self.gen = torch.Generator().manual_seed(seed)
        self.cv = threading.Condition()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused = False
        self.updating = 0  # weight updates under way: each waits for the running requests; new ones wait for them
        self.model_lock = threading.Lock()  # held for each decoding step and for a weight swap
        self.steps = 0
        threading.Thread(target=self._loop, daemon=True, name="decode").start()

    def _eos_ids(self, model) -> set[int]:
        ids = set()
        for src in (getattr(model, "generation_config", None), model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            ids |= set(e if isinstance(e, list) else ([e] if e is not None else []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests -------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self.cv:
            self.waiting.append(req)
            self.cv.notify_all()

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish = reason
        req.weight_version = self.weight_version  # the weights that generated it (SGLang's meta_info)
        req.done.set()

    def abort_all(self, message: str) -> int:
        """Requests in flight end now with their partial output (SGLang's abort_request(abort_all=True)).
        Waits for the decoding step in flight, so no token is appended after the answer."""
        with self.model_lock, self.cv:
            n = 0
            for req in self.running:
                self._finish(req, {"type": "abort", "message": message})
                n += 1
            self.running = []
            if not self.paused:  # queued ones too: SGLang aborts the waiting queue as well
                for req in self.waiting:
                    self._finish(req, {"type": "abort", "message": "Abort before prefill"})
                    n += 1
                self.waiting = []
            self.cv.notify_all()
            return n

    def pause(self) -> int:
        with self.cv:
            self.paused = True
        return self.abort_all("Abort in running batch (pause_generation)")

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def update_from_disk(self, path: str, version: str | None, abort: bool) -> tuple[bool, str]:
        if abort:
            self.abort_all("Abort in running batch (update_weights_from_disk)")
        t0 = time.time()
        with self.cv:  # SGLang's writer lock: the requests in flight finish on the weights they started on
            self.updating += 1
            while self.running:
                self.cv.wait()
        try:
            model = load_model(path)
        except Exception as e:  # noqa: BLE001 - SGLang answers 400 with the reason
            self._updated()
            return False, f"Failed to update weights: {type(e).__name__}: {e}"
        with self.model_lock:
            self.model = model
            self.model_path = path
            if version is not None:
                self.weight_version = str(version)
        self._updated()
        say(f"Update weights from disk: {path} (weight_version={self.weight_version}, {time.time() - t0:.2f}s)")
        return True, "Succeeded to update model weights." + (
            f" Weight version updated to {version}." if version is not None else "")

    def _updated(self) -> None:
        with self.cv:
            self.updating -= 1
            self.cv.notify_all()

    def reset_to_base(self) -> None:
        """Fault injection (SIGUSR1): what a restarted server serves - the base weights, version
        "default" - without the downtime of a real restart."""
        self.abort_all("Abort in running batch (stand-in reset)")
        model = load_model(self.base_path)
        with self.model_lock:
            self.model, self.model_path, self.weight_version = model, self.base_path, "default"
        say("stand-in reset: serving the base weights, weight_version=default (as after a restart)")

    # --- decoding -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while self.paused or not (self.running or (self.waiting and not self.updating)):
                    self.cv.wait()
                if not self.updating:  # during an update only the requests in flight go on
                    self.running += self.waiting
                    self.waiting = []
                batch = list(self.running)
            with self.model_lock:
                self._step(batch)
            with self.cv:
                self.running = [r for r in self.running if not r.done.is_set()]
                self.cv.notify_all()  # an update waits for the running requests to end

    @torch.no_grad()
    def _step(self, batch: list[Request]) -> None:
        live = [r for r in batch if not r.done.is_set()]
        if not live:
            return
        for r in live:  # nothing to generate (SGLang answers length with no tokens)
            if r.max_new_tokens <= 0:
                self._finish(r, {"type": "length", "length": 0})
        live = [r for r in live if not r.done.is_set()]
        if not live:
            return
        seqs = [r.input_ids + r.out_ids for r in live]
        n = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), n), dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        last = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        self.steps += 1
        for i, r in enumerate(live):
            row = last[i].clone()
            if r.freq_penalty and r.out_ids:
                counts = torch.bincount(torch.tensor(r.out_ids), minlength=row.numel())[: row.numel()]
                row -= r.freq_penalty * counts.float()
            if r.temperature <= 1e-6:  # greedy
                tok = int(torch.argmax(row))
                lp = float(torch.log_softmax(row, -1)[tok])
            else:
                probs = torch.softmax(row / r.temperature, -1)
                filt = probs.clone()
                if 0 < r.top_k < filt.numel():
                    kth = torch.topk(filt, r.top_k).values[-1]
                    filt[filt < kth] = 0
                if r.top_p < 1.0:
                    sp, si = torch.sort(filt, descending=True)
                    cum = torch.cumsum(sp, 0)
                    drop = (cum - sp) > r.top_p * cum[-1]
                    filt[si[drop]] = 0
                tok = int(torch.multinomial(filt / filt.sum(), 1, generator=self.gen))
                lp = float(torch.log(probs[tok]).clamp(min=torch.finfo(torch.float32).min))
            r.out_ids.append(tok)
            r.out_lps.append(lp)
            if tok in r.stop_ids:
                self._finish(r, {"type": "stop", "matched": tok})
            elif r.stop_strs and any(s in self.tokenizer.decode(r.out_ids) for s in r.stop_strs):
                matched = next(s for s in r.stop_strs if s in self.tokenizer.decode(r.out_ids))
                self._finish(r, {"type": "stop", "matched": matched})
            elif len(r.out_ids) >= r.max_new_tokens or len(r.input_ids) + len(r.out_ids) >= self.context_length:
                self._finish(r, {"type": "length", "length": len(r.out_ids)})

    def response(self, r: Request) -> dict:
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(r.out_ids), "cached_tokens": 0,
                "weight_version": r.weight_version or self.weight_version,
                "e2e_latency": time.time() - r.t0}
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.out_lps, r.out_ids, strict=True)]
        return {"text": self.tokenizer.decode(r.out_ids, skip_special_tokens=r.skip_special_tokens),
                "output_ids": list(r.out_ids), "meta_info": meta}


def make_handler(engine: Engine, api_key: str = ""):
    class GeneratingHandler(Handler):
        server_version = "sglang-gen-standin"

        def _refused(self, path: str) -> bool:
            """SGLang's API-key middleware (decide_request_auth): /health* and /metrics* are open."""
            if not api_key or path.startswith(("/health", "/metrics")):
                return False
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode()):
                return False
            self._send(401, {"error": "Unauthorized"})
            return True

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if self._refused(path):
                return
            if path in ("/health", "/health_generate"):
                self._send(200, b"")
            elif path in ("/get_model_info", "/model_info"):
                self._model_info(engine.model_path, engine.weight_version, has_image_understanding=False,
                                 has_audio_understanding=False,
                                 model_type=getattr(engine.model.config, "model_type", None),
                                 architectures=getattr(engine.model.config, "architectures", None))
            elif path == "/v1/models":
                self._models(engine.model_path, engine.context_length)
            else:
                self._not_found()

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            if self._refused(path):
                return
            try:
                body = self._body()
            except json.JSONDecodeError as e:
                self._send(400, {"error": {"message": f"invalid JSON: {e}"}})
                return
            if path == "/generate":
                if body.get("stream"):
                    self._send(400, {"error": {"message": "stand-in: streaming is not supported"}})
                    return
                if "input_ids" not in body:
                    self._send(400, {"error": {"message": "stand-in: only input_ids requests are supported"}})
                    return
                req = Request(body, engine.eos_ids)
                engine.submit(req)
                req.done.wait()
                self._send(200, engine.response(req))
            elif path == "/pause_generation":
                n = engine.pause()
                say(f"Pause generation (mode=abort): {n} request(s) aborted")
                self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation":
                engine.resume()
                self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif path == "/update_weights_from_disk":
                mp = body.get("model_path")
                if self._weights_missing(mp):
                    return
                ok, msg = engine.update_from_disk(mp, body.get("weight_version"),
                                                  bool(body.get("abort_all_requests", False)))
                self._send(200 if ok else 400, {"success": ok, "message": msg, "num_paused_requests": 0})
            elif path == "/flush_cache":
                self._send(200, b"Cache flushed.")
            else:
                self._not_found()

    return GeneratingHandler


def serve(host: str, port: int, model: str, seed: int = 1, threads: int = 1, context_length: int = 1024,
          api_key: str = "") -> int:
    torch.set_num_threads(threads)
    stop = start(BANNER, host, port, model)
    say("Load weight begin.")
    t0 = time.time()
    engine = Engine(model, seed, context_length)
    say(f"Load weight end. type={type(engine.model).__name__}, dtype=float32, elapsed={time.time() - t0:.2f} s")
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=engine.reset_to_base, daemon=True).start())
    return listen(ThreadingHTTPServer((host, port), make_handler(engine, api_key)), host, port, stop)


def main(cfg) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = cfg.inference.gpus
    held = hold_devices(cfg)  # noqa: F841 - held for the process's lifetime, as a CUDA server holds its GPU
    inf = cfg.inference
    return serve(inf.host, inf.port, inf.model, seed=cfg.trainer.seed + 1, context_length=inf.context_length or 1024,
                 api_key=os.environ.get(API_KEY_ENV, ""))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=BANNER)
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    a = ap.parse_args()
    sys.exit(serve(a.host, a.port, a.model, api_key=os.environ.get(API_KEY_ENV, "")))
