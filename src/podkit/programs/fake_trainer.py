"""The fake-data trainer: a real training loop (numpy: a 16-32-1 tanh net under Adam, its gradients by hand) of a
tiny model on seeded random data (CPU). numpy, not torch: torch's import alone cost 1.5 CPU-s at every start, and
what podkit supervises here is the loop, not the library.

It behaves as the real trainer does where podkit depends on it: waits for inference to be ready,
asks it for a rollout each step (and stalls, as AReaL does, while inference is down), writes a
checkpoint atomically every K steps, pushes it with /update_weights_from_disk, re-pushes when a
restarted server serves stale weights (detected from /get_model_info's weight_version), records
progress for `podkit status`, resumes from the latest good checkpoint, and on SIGTERM saves a final
checkpoint and exits 0.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from podkit import log, records
from podkit.host import lease
from podkit.judge import ending, health
from podkit.programs import hold_devices, stacks_on_sigusr2
from podkit.remote.checkpoint import NPZ, CheckpointDir

_log = log.get("trainer")


class Stop(Exception):
    pass


class Inference:
    def __init__(self, host: str, port: int) -> None:
        self.base = f"http://{host}:{port}"

    def call(self, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def ready(self) -> bool:
        try:
            self.call("/health", timeout=2.0)
            return True
        except (OSError, urllib.error.URLError, ValueError):
            return False


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)  # trainer.seed is 0..2^32-1 (settings)


class TinyNet:
    """x (n, 16) -> tanh(x W1ᵀ + b1) (n, 32) -> h W2ᵀ + b2 (n, 1), initialised as torch's Linear is."""

    SHAPES = {"w1": (32, 16), "b1": (32,), "w2": (1, 32), "b2": (1,)}

    def __init__(self, seed: int) -> None:
        rng = _rng(seed)
        fan_in = {"w1": 16, "b1": 16, "w2": 32, "b2": 32}
        self.params = {k: rng.uniform(-fan_in[k] ** -0.5, fan_in[k] ** -0.5, shape).astype(np.float32)
                       for k, shape in self.SHAPES.items()}

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
        """Mean squared error and its gradient for each parameter."""
        p = self.params
        h = np.tanh(x @ p["w1"].T + p["b1"])
        out = h @ p["w2"].T + p["b2"]
        d_out = 2.0 * (out - y) / out.size
        dz = (d_out @ p["w2"]) * (1.0 - h * h)
        grads = {"w2": d_out.T @ h, "b2": d_out.sum(0), "w1": dz.T @ x, "b1": dz.sum(0)}
        return float(np.mean((out - y) ** 2)), grads

    def state_dict(self) -> dict:
        return dict(self.params)

    def load_state_dict(self, state: dict) -> None:
        self.params = _checked(state, self.SHAPES, "model")


class Adam:
    """torch.optim.Adam's update (betas 0.9, 0.999; eps 1e-8), its moments in the checkpoint."""

    def __init__(self, params: dict, lr: float) -> None:
        self.lr, self.t = lr, 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, params: dict, grads: dict) -> None:
        self.t += 1
        c1, c2 = 1 - 0.9 ** self.t, 1 - 0.999 ** self.t
        for k, g in grads.items():
            self.m[k] = 0.9 * self.m[k] + 0.1 * g
            self.v[k] = 0.999 * self.v[k] + 0.001 * g * g
            params[k] = (params[k] - self.lr * (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + 1e-8)).astype(np.float32)

    def state_dict(self) -> dict:
        return {"t": self.t, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: dict) -> None:
        shapes = {k: np.shape(v) for k, v in self.m.items()}
        if not isinstance(state, dict) or not isinstance(state.get("t"), int) or state["t"] < 0:
            raise ValueError("optim: no step count")
        self.m, self.v = _checked(state.get("m"), shapes, "optim.m"), _checked(state.get("v"), shapes, "optim.v")
        self.t = state["t"]


def _checked(state, shapes: dict, what: str) -> dict:
    """The arrays of `state` when they are exactly `shapes` (float32); else ValueError naming what differs."""
    if not isinstance(state, dict) or set(state) != set(shapes):
        raise ValueError(f"{what}: keys {sorted(state) if isinstance(state, dict) else type(state).__name__}, "
                         f"want {sorted(shapes)}")
    out = {}
    for k, shape in shapes.items():
        a = np.asarray(state[k])
        if a.shape != tuple(shape) or a.dtype.kind != "f":
            raise ValueError(f"{what}.{k}: {a.dtype}{list(a.shape)}, want float{list(shape)}")
        out[k] = a.astype(np.float32)
    return out


def train(net: TinyNet, opt: Adam, x: np.ndarray, y: np.ndarray) -> float:
    """One step; its loss before the update."""
    with np.errstate(all="ignore"):  # a diverging run's inf and NaN are its loss to report, not warnings
        loss, grads = net.loss_and_grads(x, y)
        opt.step(net.params, grads)
    return loss


class Codec:
    """NPZ whose load also checks the state's shape: a file that loads but is not this net's checkpoint (a
    renamed key, another model's arrays, a step that is not a count) is unreadable, and an older one is tried."""

    save = staticmethod(NPZ.save)

    @staticmethod
    def load(path) -> dict:
        state = NPZ.load(path)
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step {step!r} is not a count of steps")
        TinyNet(0).load_state_dict(state.get("model"))
        net = TinyNet(0)
        Adam(net.params, 0.0).load_state_dict(state.get("optim"))
        return state


class FakeTrainer:
    def __init__(self, cfg) -> None:
        self.codec = Codec
        self.cfg = cfg
        t = cfg.trainer
        self.every, self.interval, self.max_steps = t.checkpoint_every, t.step_interval_s, t.max_steps
        self.ckpts = CheckpointDir(cfg.checkpoint_dir, keep=t.keep_checkpoints)
        self.progress = records.Progress(cfg.state_dir, "fake")
        self.inference = Inference(cfg.inference.host, cfg.inference.port)
        self.ready_timeout = cfg.inference.ready_timeout_s
        self.update_timeout = t.weight_update_timeout_s
        self.stopping = False
        self.model = TinyNet(t.seed)
        self.opt = Adam(self.model.params, t.lr)
        self.true_w = _rng(t.seed + 1).standard_normal((16, 1)).astype(np.float32)
        self.seed = t.seed
        self.step = 0
        self.pushed: str | None = None
        self.resumed_from: str | None = None
        self.last_ckpt_step = 0

    # -- lifecycle --------------------------------------------------------------------------------------
    def on_sigterm(self, *_):
        self.stopping = True

    def resume(self) -> None:
        found = self.ckpts.load_latest(self.codec)
        for p in self.ckpts.unreadable:  # newer than what loads (or than nothing): they would outrank this run's own
            try:
                kept = self.ckpts.set_aside(p).relative_to(self.ckpts.path)
            except OSError as e:  # a read-only volume, a planted `unreadable`: train on, as checkpoint() does
                _log.warn(f"checkpoint {p.name} does not load and could not be moved aside ({e}): it stays, and "
                          "retention may delete this run's older-numbered checkpoints; move it out of checkpoints/")
                continue
            _log.warn(f"checkpoint {p.name} does not load: moved to checkpoints/{kept}, kept for you; this run's "
                      "own checkpoints go on beside it")
        if found is None:
            _log.info("no checkpoint found: starting at step 0")
            return
        path, state = found
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.step = self.last_ckpt_step = int(state["step"])
        self.resumed_from = path.name
        _log.info(f"resumed from checkpoint {path.name} (step {self.step})")

    def wait_for_inference(self) -> bool:
        """False when inference did not come (recorded as the end: ending.INFERENCE). Inference stopped on
        request is waited for without a limit (health.wait_for_inference)."""
        why = health.wait_for_inference(self.cfg, health.sglang_state(self.cfg), interval=0.25,
                                        stopping=lambda: self.stopping, logger=_log)
        if why == "stopping":
            raise Stop
        if why:
            _log.error(why)
            ending.write(self.cfg.state_dir, ending.INFERENCE, why, "logs/sglang.log says why inference did not start",
                         progress=self.progress)
            return False
        return True

    # -- one step ---------------------------------------------------------------------------------------
    def rollout(self) -> bool:
        """Ask inference for a generation; stall while it is down, as a real trainer waits for rollouts.
        Returns True when inference had been unreachable (it may have restarted)."""
        t0 = time.monotonic()
        warned = False
        while True:
            if self.stopping:
                raise Stop
            try:
                self.inference.call("/generate", {"text": f"step {self.step}", "sampling_params":
                                                  {"max_new_tokens": 4}}, timeout=5.0)
                if warned:
                    _log.info(f"inference is back after {time.monotonic() - t0:.1f}s")
                return warned
            except (OSError, urllib.error.URLError, ValueError) as e:
                if not warned:
                    _log.warn(f"waiting for rollouts: inference unreachable ({e})")
                    warned = True
                time.sleep(0.25)

    def train_step(self) -> float:
        g = _rng(self.seed * 1_000_003 + self.step)
        x = g.standard_normal((64, 16)).astype(np.float32)
        y = x @ self.true_w + np.float32(0.01) * g.standard_normal((64, 1)).astype(np.float32)
        return train(self.model, self.opt, x, y)

    def checkpoint(self, why: str) -> Path | None:
        if not self.cfg.multi_node and (holder := lease.lost(self.cfg.state_dir)):
            raise LeaseLost(holder)
        try:
            path = self.ckpts.save(self.codec, self.step, {"step": self.step, "model": self.model.state_dict(),
                                                           "optim": self.opt.state_dict()})
        except OSError as e:
            # A full or read-only volume: keep training, keep the last good checkpoint, try again later.
            _log.error(f"checkpoint of step {self.step} not written ({e.strerror}); the latest good one stays "
                       f"step {self.last_ckpt_step}. `podkit doctor` checks the workspace")
            return None
        self.last_ckpt_step = self.step
        self.progress.update(checkpoint_step=self.step)
        _log.info(f"checkpoint {path.name} written ({why})")
        return path

    def loads(self, path: Path) -> int | None:
        """The step of the checkpoint at `path` if it loads, else None: a file that does not load is
        never pushed to inference (it would fail there, or serve something else than its version)."""
        try:
            return int(self.codec.load(path)["step"])
        except Exception as e:  # noqa: BLE001 - any unreadable file means: do not push it
            _log.warn(f"checkpoint {path.name} does not load ({type(e).__name__}); not pushing it")
            return None

    def push_weights(self, path: Path) -> None:
        """Push a checkpoint that loads, tagged with the step it holds."""
        step = self.loads(path)
        if step is None:
            found = self.ckpts.load_latest(self.codec)
            if found is None:
                return
            path, step = found[0], int(found[1]["step"])
        version = str(step)
        t0 = time.monotonic()
        try:
            r = self.inference.call("/update_weights_from_disk", {"model_path": str(path), "weight_version": version},
                                    timeout=self.update_timeout)
        except (OSError, urllib.error.URLError, ValueError) as e:
            if "timed out" in str(e):
                _log.warn(f"weight update to step {step} timed out after {self.update_timeout:.0f}s "
                          "(weight_update_timeout_s); will retry")
            else:
                _log.warn(f"weight update to step {step} failed ({e}); will retry")
            return
        took = time.monotonic() - t0
        if took > self.update_timeout / 2:
            _log.warn(f"weight update to step {step} took {took:.1f}s of its {self.update_timeout:.0f}s limit")
        if r.get("success"):
            self.pushed = version
            self.progress.update(weight_update_s=round(took, 4))
            _log.info(f"inference now serves weights of step {step}")
        else:
            _log.warn(f"weight update rejected: {r.get('message')}")

    def ensure_served_weights(self) -> None:
        """A restarted server serves base weights: push the latest checkpoint again, never train on stale."""
        try:
            served = str(self.inference.call("/get_model_info", timeout=5.0).get("weight_version"))
        except (OSError, urllib.error.URLError, ValueError):
            return
        latest = self.ckpts.latest_path()
        if latest is None:
            return
        want = str(self.last_ckpt_step)
        if served != want:
            _log.warn(f"inference serves weight_version {served!r}, trainer's latest is {want!r} "
                      "(inference restarted?): pushing again")
            self.push_weights(latest)

    def record(self, loss: float) -> None:
        # progress.json is the workspace's: once another pod holds it, that pod's record is not this one's.
        if not self.cfg.multi_node and (holder := lease.lost(self.cfg.state_dir)):
            raise LeaseLost(holder)
        self.progress.trained(step=self.step, loss=loss, checkpoint_step=self.last_ckpt_step,
                             weight_version=self.pushed, resumed_from=self.resumed_from)
        records.HISTORY.append(self.cfg.state_dir, self.step, None, loss)  # the page's pictures (no reward here)

    def injected_failure(self) -> tuple[int, Path | None]:
        """Fault injection for the loop bound's tests: FAKE_TRAINER_FAIL_AT_STEP=N raises at step N on every
        run (a script's bug), N:once on the first run only (a failure after progress); `new` raises right after
        each run's first new step (progress every time: never stopped, but named)."""
        raw = os.environ.get(FAIL_AT_STEP, "")
        if raw == "new":
            return self.step + 2, None
        at, _, once = raw.partition(":")
        n = int(at) if at.isdigit() else 0
        return n, (self.cfg.state_dir / f"fake-failed-at-{n}" if once == "once" else None)

    def prepare(self) -> None:
        """Fault injection for the watchdog tests (PREPARE_S): a long, CPU-bound preparation before the first step
        (a dataset's tokenisation), printing nothing: busy, not hung."""
        try:
            until = time.monotonic() + float(os.environ.get(PREPARE_S) or 0)
        except ValueError:
            return
        n = 0
        while time.monotonic() < until and not self.stopping:
            n = sum(i * i for i in range(20000)) + n % 7

    def run(self) -> int:
        if not self.cfg.multi_node and (holder := lease.lost(self.cfg.state_dir)):
            return lease_lost(self.step, self.last_ckpt_step, holder)
        self.resume()
        fetch = os.environ.get(FETCH)  # fault injection: a data mirror fetched first (its own network errors)
        if fetch:
            urllib.request.urlopen(fetch, timeout=10).read()
        try:
            if not self.wait_for_inference():
                return 1
            self.ensure_served_weights()
            self.prepare()
            if self.max_steps and self.step >= self.max_steps:  # resumed at its end: nothing left to train
                self.progress.update(step=self.step, checkpoint_step=self.last_ckpt_step)
                ending.write(self.cfg.state_dir, ending.MAX_STEPS, progress=self.progress)
                _log.info(f"already at step {self.step} of max_steps {self.max_steps}: done")
                return 0
            fail_at, once = self.injected_failure()
            while not self.stopping:
                t0 = time.monotonic()
                if fail_at and self.step + 1 == fail_at and not (once and once.exists()):
                    if once:
                        once.touch()
                    raise RuntimeError(f"injected failure at step {fail_at} ({FAIL_AT_STEP})")
                if self.rollout():
                    self.ensure_served_weights()
                loss = self.train_step()
                self.step += 1
                if not math.isfinite(loss):
                    _log.error(f"step {self.step}: loss is {loss}")
                self.record(loss)
                if self.step % 10 == 0 or self.step == 1:
                    _log.info(f"step {self.step} loss {loss:.5f}")
                if self.step % self.every == 0 or self.step - self.last_ckpt_step > self.every:
                    path = self.checkpoint(f"every {self.every} steps")
                    if path:
                        self.push_weights(path)
                if self.step % 5 == 0:
                    self.ensure_served_weights()  # cheap; catches a restart between two rollouts
                if self.max_steps and self.step >= self.max_steps:
                    if self.last_ckpt_step != self.step:
                        self.checkpoint("final step")
                    ending.write(self.cfg.state_dir, ending.MAX_STEPS, progress=self.progress)
                    _log.info(f"reached max_steps {self.max_steps}: done")
                    return 0
                time.sleep(max(0.0, self.interval - (time.monotonic() - t0)))
        except Stop:
            pass
        except LeaseLost as e:
            return lease_lost(self.step, self.last_ckpt_step, str(e))
        try:
            if self.step != self.last_ckpt_step or not self.ckpts.latest_path():
                self.checkpoint("SIGTERM")
        except LeaseLost as e:
            return lease_lost(self.step, self.last_ckpt_step, str(e))
        return stopped_by_sigterm(self.cfg, self.progress, self.step)


STARTED = time.monotonic()
START_SECS = 4  # supervisord.conf's startsecs for the trainer (3), and a second


class LeaseLost(Exception):
    """Another pod holds the workspace now (its holder): this trainer writes nothing more."""


def lease_lost(step: int, checkpoint_step: int, holder: str) -> int:
    """Stop at once, writing nothing on the volume (not even its progress record, which is the holder's
    now): the pod that holds the workspace resumes from the last checkpoint this one wrote. Exit 0
    (supervisord leaves it stopped: a restart would lose it again), never counted as finished."""
    _log.error(f"this pod lost the workspace to {holder} (it stalled past guard.lease_s, and a pod took over): "
               f"stopping at step {step} without writing a checkpoint; the latest is step {checkpoint_step}, which "
               "the pod that holds the workspace resumes from. This pod can be stopped")
    # An exit within supervisord's startsecs counts as a failed start, which it retries: outlive it.
    time.sleep(max(0.0, START_SECS - (time.monotonic() - STARTED)))
    return 0


def stopped_by_sigterm(cfg, progress, step) -> int:
    """Stopped with a checkpoint; who asked, and so whether it stays stopped or restarts to resume, is the
    judge's to say (verdict.judge)."""
    ending.write(cfg.state_dir, ending.SIGTERM, f"stopped at step {step} with a checkpoint", progress=progress)
    _log.info(f"stopped cleanly at step {step}")
    return 0


HANG_AFTER_DONE = "FAKE_TRAINER_HANG_AFTER_DONE"  # not PODKIT_: not a setting
FAIL_AT_STEP = "FAKE_TRAINER_FAIL_AT_STEP"  # likewise: the loop bound's tests
FETCH = "FAKE_TRAINER_FETCH"  # likewise: a network error before training
PREPARE_S = "FAKE_TRAINER_PREPARE_S"  # likewise: a busy start-up (the watchdog's tests)


def _injected_hang(*_) -> None:
    """Fault injection for the watchdog tests (SIGUSR1): block forever, as a trainer stuck in a
    collective or on a dead rollout socket does. Only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()


def main(cfg) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = cfg.trainer.gpus
    stacks_on_sigusr2(cfg)
    held = hold_devices(cfg)  # noqa: F841 - held for the process's lifetime, as a CUDA trainer holds its GPU
    trainer = FakeTrainer(cfg)
    if ending.SIGNALS.cfg is not None:  # the trainer program: its stop signal, noted there, comes here
        ending.SIGNALS.forward = trainer.on_sigterm
        if ending.SIGNALS.at is not None:
            trainer.on_sigterm()
    else:
        signal.signal(signal.SIGTERM, trainer.on_sigterm)
        signal.signal(signal.SIGINT, trainer.on_sigterm)
    signal.signal(signal.SIGUSR1, _injected_hang)
    if os.environ.get(HANG_AFTER_DONE) == ending.NEVER_TRAINED:
        # Fault injection: a script that never trains (its end says so, final) and whose non-daemon thread keeps
        # it alive: the watchdog stops it, never restarts it as a hang
        ending.write(cfg.state_dir, ending.NEVER_TRAINED, "the script ended without training",
                     ending.kind(ending.NEVER_TRAINED).fix)
        threading.Thread(target=threading.Event().wait, name="left-running").start()
        return 0
    code = trainer.run()
    if os.environ.get(HANG_AFTER_DONE) == "1" and \
            (trainer.progress.data.get("stopped") or {}).get("by") in ending.FINISHED_KINDS:
        # Fault injection for the watchdog tests: a script that finished and left a non-daemon thread running
        # never exits (its SIGTERM handler only sets a flag).
        threading.Thread(target=threading.Event().wait, name="left-running").start()
    return code
