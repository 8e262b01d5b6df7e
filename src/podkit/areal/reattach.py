"""reattach: an inference restart costs the AReaL trainer no restart (trainer.on_inference_restart reattach).

A restarted SGLang serves the base weights (weight_version "default", in /model_info and in every answer's
meta_info). The trainer's process goes on:

- every rank (patches.ride_out_restarts): a generation request that failed to connect, or whose answer says
  "default" after this trainer pushed weights (set_version >= 1), is not used; it is sent again once
  inference serves a version the trainer pushed. An answer from the base weights is dropped, so none
  reaches training, and AReaL's own staleness rule (max_head_offpolicyness) judges the rest;
- rank 0 (Attacher, a thread): sees the restart (a dropped answer wakes it; /model_info is asked every
  trainer.stale_weights_check_s), waits for inference to answer (inference.ready_timeout_s, the window the
  requests ride out), and pushes the latest version's weights from disk (AReaL's weight_update_v<N>, which
  hooks.py keeps on disk until the next version is served) with its version. One push at a time: the
  trainer's own update_weights takes the same lock;
- the fallback, when it cannot (inference does not answer in time, the weights are not on disk, the push
  fails): progress.json's reattach says why, the generation requests go on as before, and the trainer stops
  after the step with its recover checkpoint (exit 75) and restarts, as it did before re-attaching existed.

A cluster (AReaL's Ray launcher runs its servers, which come back elsewhere) and a weight update that is not
from disk (xccl) take the fallback. Imports neither AReaL nor torch.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from podkit import log, records

_log = log.get("trainer")
BASE = "default"  # SGLang's weight_version before any update (ServerArgs.weight_version)
REATTACHED, FELL_BACK = "re-attached", "fell back"
VERSION_DIR = re.compile(r"weight_update_v(\d+)")  # AReaL's WeightUpdateMeta.with_version
POLL_S = 0.25  # how often a waiting rank or the re-attacher asks /model_info (one GET, shared by the waiting requests)


def served_version(addr: str, api_key: str, timeout: float = 10) -> str | None:
    """What inference says it serves; None when it does not answer."""
    req = urllib.request.Request(f"http://{addr}/model_info",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            version = json.loads(r.read()).get("weight_version")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):  # a server killed mid-answer too
        return None
    return None if version is None else str(version)


def answered_from_base(result) -> bool:
    """A /generate answer whose meta_info says the base weights served it."""
    meta = result.get("meta_info") if isinstance(result, dict) else None
    return isinstance(meta, dict) and meta.get("weight_version") == BASE


def fell_back_since(state_dir: Path, since: float) -> bool:
    """Rank 0 gave up re-attaching after `since` (every rank reads it: they are separate processes)."""
    last = (records.PROGRESS.read(state_dir).get("reattach") or {}).get("last") or {}
    t = last.get("time")
    return last.get("outcome") == FELL_BACK and isinstance(t, (int, float)) and t >= since


class Generation:
    """What one rank's generation requests need to know (set by hooks.install and the engine's set_version)."""

    def __init__(self) -> None:
        self.active = False  # trainer.on_inference_restart reattach, one node (hooks.install)
        self.version = 0  # the highest version set on this process's engines: >= 1 once the trainer pushed
        self.api_key = ""
        self.state_dir: Path | None = None
        self.started = time.time()
        self.wake = threading.Event()  # rank 0's Attacher, when this process runs it
        self.fell_back = threading.Event()  # rank 0's own fallback (the others read it from progress.json)
        self._served: dict[str, tuple[float, str | None]] = {}  # addr -> (when, version): one look per POLL_S
        self._looking: set[str] = set()
        self._released = (0.0, False)

    @property
    def pushed(self) -> bool:
        """Generation must come from weights the trainer pushed (the base weights are not its own)."""
        return self.active and self.version >= 1

    def released(self) -> bool:
        """Rank 0 fell back: answers from the base weights are taken as before (the step's end stops).
        Read from progress.json at most once a second (every waiting request asks)."""
        if self.fell_back.is_set():
            return True
        at, was = self._released
        if time.monotonic() - at < 1.0 or self.state_dir is None:
            return was
        now = fell_back_since(self.state_dir, self.started)
        self._released = (time.monotonic(), now)
        return now

    async def served(self, addr: str, interval_s: float = POLL_S) -> str | None:
        """/model_info's weight_version at `addr`, asked at most once per interval by this process's
        waiting requests together (hundreds may wait on a server that is starting)."""
        at, version = self._served.get(addr, (-1e9, None))
        if time.monotonic() - at < interval_s:
            return version
        if addr in self._looking:  # another request is asking: wait for its answer
            await asyncio.sleep(interval_s / 2)
            return self._served.get(addr, (0.0, None))[1]
        self._looking.add(addr)
        try:
            version = await asyncio.get_running_loop().run_in_executor(None, served_version, addr, self.api_key, 5.0)
            self._served[addr] = (time.monotonic(), version)
        finally:
            self._looking.discard(addr)
        return version

    async def wait_served(self, addr: str, deadline: float, interval_s: float = POLL_S) -> bool:
        """Until inference at `addr` serves a version this trainer pushed (True), rank 0 fell back (True), or
        the deadline (False)."""
        self.wake.set()
        while time.monotonic() < deadline:
            served = await self.served(addr, interval_s)
            if served not in (None, BASE) or self.released():
                return True
            if served == BASE:
                self.wake.set()  # up again: rank 0 pushes now, not at its next look
            await asyncio.sleep(interval_s)
        return False


GENERATION = Generation()


def keep_latest(folder: Path, version: int) -> None:
    """Remove AReaL's weight_update_v<N> directories older than `version` (the served one stays on disk for
    a re-push; AReaL would have removed each right after its load). Only those names, only real
    directories: a link or anything else there is left alone."""
    import shutil

    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for d in entries:
        m = VERSION_DIR.fullmatch(d.name)
        if m and int(m.group(1)) < version and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


class Attacher:
    """Rank 0: pushes the trainer's latest weights to a restarted inference server, or falls back."""

    def __init__(self, cfg, progress, addr: str, api_key: str, folder: Path | None, pushed: int | None,
                 stale: threading.Event, stopping: threading.Event | None = None, identity=lambda: None) -> None:
        self.cfg, self.progress, self.addr, self.api_key, self.folder = cfg, progress, addr, api_key, folder
        self.pushed = pushed  # the version the trainer's last landed push served (None: base weights)
        self.stale = stale  # the fallback's flag: stop after this step (hooks.supervise)
        self.lock = threading.Lock()  # one push at a time: the trainer's update_weights takes it too
        self.window_s = cfg.inference.ready_timeout_s
        self.wake = GENERATION.wake
        self.done = threading.Event()
        # SIGTERM: the pod is stopping (supervisord stops inference too): the step's end stops, nothing to wait for
        self.stopping = stopping or threading.Event()
        # which server process serves (supervisord's pid and start; None outside supervisord): one record per
        # restart, whether rank 0's push or the trainer's own next push re-attached it
        self.identity = identity
        self.noted = identity()

    def pushing(self, update_weights):
        """The trainer's own push (actor.update_weights on rank 0) under the lock, its version noted."""
        def locked(meta):
            with self.lock:
                result = update_weights(meta)
                if meta.version is not None:
                    self.pushed = int(meta.version)
                    if self.folder is not None:  # served: the one before is no longer needed on disk
                        keep_latest(self.folder, self.pushed)
                return result

        return locked

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - a dead re-attacher would leave every request waiting
            self.fall_back(self.pushed or 0, f"the re-attacher failed: {type(e).__name__}: {e}", time.monotonic())

    def _ended(self) -> bool:
        return self.done.is_set() or self.stale.is_set() or self.stopping.is_set()

    def _run(self) -> None:
        while not self._ended():
            self.wake.wait(self.cfg.trainer.stale_weights_check_s)
            self.wake.clear()
            if self._ended():
                return
            if self.pushed is None:
                continue
            served = served_version(self.addr, self.api_key)
            if served == BASE:
                self.attach("inference serves the base weights (it restarted)")
            elif served is None:  # down or restarting: wait for it (inference.ready_timeout_s), or fall back
                self.attach("inference does not answer (down or restarting)")

    def attach(self, why: str) -> bool:
        """Make inference serve self.pushed again; False (and the fallback) when it cannot."""
        t0 = time.monotonic()
        if not self.lock.acquire(timeout=1.0):
            # The trainer's own push is under way (it holds the lock) and rides out a restart itself, a little
            # longer than this window (patches.ride_out_restarts): only the fallback is decided here.
            served = self._answering(t0 + self.window_s)
            if served is None and not self._ended():
                return self.fall_back(self.pushed or 0, f"inference did not answer within "
                                                        f"inference.ready_timeout_s ({self.window_s:.0f} s) after it "
                                                        "went down during the trainer's push", t0)
            return True
        try:
            version = self.pushed
            if version is None:
                return True  # the trainer holds the base weights: a restarted server serves them
            want = str(version)
            served = self._answering(t0 + self.window_s)
            if self._ended():
                return False  # the trainer stops after this step anyway (a pod stop, the fallback taken)
            if served is None:
                return self.fall_back(version, f"inference did not answer within inference.ready_timeout_s "
                                               f"({self.window_s:.0f} s) after it restarted", t0)
            if served == want:  # the trainer's own push landed meanwhile
                self._note(version, time.monotonic() - t0, f"{why}; the trainer's own push served version {served}")
                return True
            # the base weights (or a version that is not the latest): push the latest
            path = self.folder / f"weight_update_v{version}" if self.folder else None
            if path is None or not (path / "config.json").is_file():
                return self.fall_back(version, f"the weights of version {version} are not on disk "
                                               f"({path or 'weight updates are not from disk'})", t0)
            failed = self._push(path, want)
            if failed:
                return self.fall_back(version, failed, t0)
        finally:
            self.lock.release()
        took = time.monotonic() - t0
        _log.info(f"{why}: re-attached, pushed version {version} from {path} in {took:.1f}s; the trainer goes on")
        self._note(version, took, why)
        return True

    def _note(self, version: int, took: float, why: str) -> None:
        """One re-attach record per restarted server (by supervisord's word, when it runs the server)."""
        now = self.identity()
        if now is not None and now == self.noted:
            return
        self.noted = now
        if "own push" in why:
            _log.info(f"{why}: re-attached; the trainer goes on")
        self._record(REATTACHED, version, took, why)

    def _answering(self, deadline: float) -> str | None:
        while True:
            served = served_version(self.addr, self.api_key, timeout=5)
            if served is not None or time.monotonic() >= deadline or self.done.is_set() or self.stopping.is_set():
                return served
            time.sleep(POLL_S)

    def _push(self, path: Path, version: str) -> str | None:
        """SGLang's /update_weights_from_disk (UpdateWeightFromDiskReqInput: model_path, weight_version,
        abort_all_requests);
        None when inference then serves `version`, else why not."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        # abort_all_requests: SGLang's update waits for every request in flight (its writer lock), and those on
        # the base weights are dropped anyway (their answers say "default"): end them now
        body = json.dumps({"model_path": str(path), "weight_version": version, "abort_all_requests": True}).encode()
        req = urllib.request.Request(f"http://{self.addr}/update_weights_from_disk", data=body, headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=max(self.cfg.trainer.weight_update_timeout_s, 120)) as r:
                answer = json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                said = json.loads(e.read(4096) or b"{}").get("message")
            except (OSError, ValueError, AttributeError, http.client.HTTPException):
                said = None
            return f"the push of version {version} failed: HTTP {e.code}" + (f": {str(said)[:300]}" if said else "")
        except (OSError, ValueError, http.client.HTTPException) as e:
            return f"the push of version {version} failed: {type(e).__name__}: {e}"
        if isinstance(answer, dict) and answer.get("success") is False:
            return f"inference refused the push of version {version}: {str(answer.get('message'))[:300]}"
        served = served_version(self.addr, self.api_key)
        if served != version:
            return f"after the push of version {version} inference serves {served!r}"
        return None

    def fall_back(self, version: int, why: str, t0: float) -> bool:
        _log.warn(f"cannot re-attach to the restarted inference: {why}. Falling back: the trainer stops after this "
                  "step with its recover checkpoint, restarts, and pushes its weights again")
        GENERATION.fell_back.set()  # this process's requests go on at once
        self._record(FELL_BACK, version, time.monotonic() - t0, why)
        self.stale.set()
        return False

    def _record(self, outcome: str, version: int, took: float, why: str) -> None:
        with self.progress.lock:  # read, count, write: the step hook writes the same record
            self._count(outcome, version, took, why)

    def _count(self, outcome: str, version: int, took: float, why: str) -> None:
        before = self.progress.data.get("reattach") or {}
        count = before.get("count") if isinstance(before.get("count"), int) else 0
        fell = before.get("fell_back") if isinstance(before.get("fell_back"), int) else 0
        self.progress.update(reattach={
            "count": count + (outcome == REATTACHED), "fell_back": fell + (outcome == FELL_BACK),
            "last": {"time": time.time(), "outcome": outcome, "version": version, "took_s": round(took, 3),
                     "why": why[:500]}})
