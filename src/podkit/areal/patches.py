"""What podkit changes in AReaL 1.0.4 at run time, each change pinned to the AReaL code it relies on.

apply() runs in every rank before PPOTrainer is built (it patches classes and module names, so later
engines are covered; a second call is a no-op). It refuses any other AReaL version: each patch below
names file:line of areal 1.0.4's wheel, and `check()` pins the signature and source hash of everything
wrapped (tests/trainer/test_rehearsal.py runs it in the AReaL environment), so an upgrade fails loudly here,
not silently in training.

- packed_mask: with attn_impl sdpa or eager, AReaL packs each micro-batch into one row and passes
  attention_mask={"full_attention": None, ...} plus cu_seq_lens, which only flash-attention reads; so
  every packed sequence attended to the ones before it and the trainer's log-probs were wrong
  (0.15 nats on average at step 1 of the rehearsal, 4.7 at worst). Setting the mask to None lets
  transformers build the block-diagonal causal mask from position_ids, as AReaL itself does for
  qwen3_moe/qwen3_vl/qwen3_5 (fsdp_engine.py:1890-1896). Checked on every micro-batch.
- versioned weight updates: each disk update tells SGLang its version (UpdateWeightFromDiskReqInput
  has weight_version), so /model_info says which weights are served.
- API key: RemoteSGLangEngine sends no Authorization header; SGLang with --api-key answers every route
  but /health and /metrics with 401. The header is added to every request AReaL sends to SGLang.
- ride out restarts: AReaL retries a request request_retries times 1 s apart (http.py:164-217), so a
  restarting SGLang failed the step within seconds; requests that failed to connect are retried for
  up to inference.ready_timeout_s.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time

from podkit.judge.failure import CONNECTION_ERRORS

AREAL_VERSION = "1.0.4"
PACKED_MASK_IMPLS = ("sdpa", "eager")
EXPECTED_MASK = {"full_attention": None, "sliding_attention": None}

# What the patches wrap, with the sha256 (first 16 hex) of its source in areal 1.0.4.
PINNED = {
    "areal.engine.fsdp_engine:FSDPEngine._prepare_mb_list": "7f16c43e78b0be9a",
    "areal.engine.sglang_remote:SGLangBackend.build_disk_weight_update_requests": "f98e82180b7f3c6b",
    "areal.infra.utils.http:arequest_with_retry": "c539b75abc8e38ba",  # its "Last error: {e!r}" message
    "areal.trainer.rl_trainer:PPOTrainer.train": "87c2844be42f4362",  # the step loop and its stop check
    "areal.trainer.rl_trainer:PPOTrainer._save_recover_checkpoint": "cc24f2261c3e3904",
    "areal.trainer.rl_trainer:PPOTrainer._export_and_commit_stats": "7e4e8cad3f836983",
    # freq_ctl.check called by keyword, last_step_info set after the save (force_recover_checkpoint)
    "areal.utils.recover:RecoverHandler.dump": "501e4695bd6b985f",
    # the disk update waits for SGLang's answer (fut.result()) before the step goes on: what hooks.py's
    # check of the served version at commit time relies on
    "areal.engine.fsdp_engine:FSDPEngine._update_weights_from_disk": "42638912b2b392fa",
    # hooks.py: a config AReaL refuses is a config error; SPMD mode refuses what needs proxy workers
    "areal.api.cli_args:load_expr_config": "ace860e7e20c7390",
    # hooks.py's construction hook: the config is __init__'s first argument, and the recover checkpoint is
    # loaded and W&B opened inside it (StatsLogger.init names the W&B run by wandb.id_suffix)
    "areal.trainer.rl_trainer:PPOTrainer.__init__": "c0a4330e9fc317af",
    "areal.utils.stats_logger:StatsLogger.init": "55de3e9adb7c16ea",
    # reattach.py: set after each push (and recover's), read as "the trainer pushed weights"
    "areal.infra.remote_inf_engine:RemoteInfEngine.set_version": "75f804f3024d07e4",
    # reattach.py: AReaL's disk update writes weight_update_v<N> and (clear_checkpoint_after_load) removes
    # it after the load; hooks.py keeps the latest for a re-push
    "areal.infra.remote_inf_engine:RemoteInfEngine.update_weights_from_disk": "b885280bc9cc9240",
    "areal.trainer.rl_trainer:PPOTrainer._requires_proxy_workflow": "c9a08061c679c941",
    # episodes.py: the task's workflow.arun_episode and should_accept_fn are its calls into the user's code;
    # a failure anywhere in it is caught and logged there, the episode dropped (the function returns None)
    "areal.infra.workflow_executor:WorkflowExecutor._create_workflow_task": "1a68c1e1c7312a1b",
    # episodes.py: the main thread's wait for rollouts raises what a background thread set here
    "areal.infra.workflow_executor:BatchTaskDispatcher._set_thread_exception": "b533eb4a0eaf4b2f",
    "areal.infra.workflow_executor:BatchTaskDispatcher._check_thread_exception": "cda38c5f843f062e",
}


class PatchError(RuntimeError):
    """AReaL is not what these patches were written against."""


def _resolve(target: str):
    import importlib

    mod, _, attr = target.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


def source_hash(target: str) -> str:
    return hashlib.sha256(inspect.getsource(_resolve(target)).encode()).hexdigest()[:16]


def check() -> dict[str, str]:
    """Each pinned target's current source hash (the test compares them with PINNED's)."""
    return {t: source_hash(t) for t in PINNED}


def areal_version() -> str:
    from importlib.metadata import version

    return version("areal")


def patch_once(owner, name: str, wrap, mark: str = "_podkit"):
    """owner.<name> = wrap(original), the wrapper marked with `mark` and its __wrapped__ the original
    (check() and the tests read it); nothing when the name already holds a wrapper so marked, so a second
    install in the same process does not wrap podkit's wrapper again. Returns the wrapper it installed,
    or None. Two patches of one name nest only with different marks."""
    original = getattr(owner, name)
    if getattr(original, mark, False):
        return None
    wrapper = wrap(original)
    setattr(wrapper, mark, True)
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)
    return wrapper


_applied: list[tuple[str, float]] = []


def apply(api_key: str = "", ride_out_s: float = 0.0) -> None:
    if _applied:  # the request wrappers nest: a second call would double the ride-out window
        if _applied[0] != (api_key, ride_out_s):
            raise PatchError("AReaL was already patched with other settings")
        return
    _applied.append((api_key, ride_out_s))
    have = areal_version()
    if have != AREAL_VERSION:
        raise PatchError(f"podkit's AReaL patches are for areal {AREAL_VERSION}, this is {have}: read "
                         "src/podkit/areal/patches.py against the new version before training")
    packed_mask()
    version_weight_updates()
    watch_episodes()
    if ride_out_s > 0:
        track_versions()
        keep_weight_updates()
        ride_out_restarts(ride_out_s)
    if api_key:
        send_api_key(api_key)  # outermost: every retry carries the header


# --- packed micro-batches -------------------------------------------------------------------------


class PackedMaskError(PatchError):
    """AReaL's packed micro-batch no longer looks like what the packed-mask patch relies on."""


def unmask(mb: dict) -> None:
    """One padded micro-batch (fsdp_engine.py:1877-1901): check it is one packed row whose position_ids
    restart at every cu_seqlens boundary, then drop the mask so transformers builds it per sequence."""
    import torch

    mask = mb.get("attention_mask", "missing")
    if mask is None:
        return
    if mask != EXPECTED_MASK:
        raise PackedMaskError(f"attention_mask is {mask!r}, expected {EXPECTED_MASK!r}")
    ids, pos, cu = mb.get("input_ids"), mb.get("position_ids"), mb.get("cu_seqlens")
    if not (torch.is_tensor(ids) and ids.ndim == 2 and ids.shape[0] == 1):
        raise PackedMaskError(f"input_ids must be [1, T], got {getattr(ids, 'shape', ids)}")
    t = ids.shape[1]
    if not (torch.is_tensor(pos) and tuple(pos.shape) == (1, t)):
        raise PackedMaskError(f"position_ids must be [1, {t}], got {getattr(pos, 'shape', pos)}")
    if not (torch.is_tensor(cu) and cu.ndim == 1 and cu.numel() >= 2):
        raise PackedMaskError(f"cu_seqlens must be 1-D, got {getattr(cu, 'shape', cu)}")
    cu = cu.to(device=pos.device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != t or bool((lens < 0).any()):
        raise PackedMaskError(f"cu_seqlens must run from 0 to T={t}, got {cu.tolist()}")
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=t)
    if not torch.equal(pos[0].to(torch.long), torch.arange(t, device=pos.device) - starts):
        raise PackedMaskError("position_ids do not restart at 0 at each cu_seqlens boundary")
    mb["attention_mask"] = None


def packed_mask() -> None:
    from areal.engine.fsdp_engine import FSDPEngine

    def wrap(original):
        def _prepare_mb_list(self, input_):
            mb_list = original(self, input_)
            if self.config.attn_impl not in PACKED_MASK_IMPLS:
                return mb_list  # flash-attention reads cu_seq_lens itself
            if self.enable_tree_training or self.parallel_helper.sp_size > 1 or self.is_vision_model:
                raise PackedMaskError(f"attn_impl {self.config.attn_impl!r} with packed micro-batches is patched "
                                      "only for text models without tree training or Ulysses SP")
            for mb in mb_list.padded_mbs:
                unmask(mb)
            return mb_list

        return _prepare_mb_list

    patch_once(FSDPEngine, "_prepare_mb_list", wrap)


# --- weight updates carry their version -----------------------------------------------------------


def version_weight_updates() -> None:
    from areal.engine.sglang_remote import SGLangBackend

    def wrap(build):
        def with_version(self, meta):
            requests = build(self, meta)
            if meta.version is not None and not meta.use_lora:
                for req in requests.requests:
                    if req.endpoint == "/update_weights_from_disk":
                        req.payload["weight_version"] = str(meta.version)
            return requests

        return with_version

    patch_once(SGLangBackend, "build_disk_weight_update_requests", wrap)


# --- the user's episodes --------------------------------------------------------------------------


def watch_episodes() -> None:
    """Each rollout task's workflow counted (episodes.py): episodes failing in a row stop the trainer."""
    from areal.infra.workflow_executor import WorkflowExecutor

    from podkit.areal import episodes

    patch_once(WorkflowExecutor, "_create_workflow_task", episodes.watch)


# --- requests to SGLang ---------------------------------------------------------------------------


class _AuthSession:
    """The methods arequest_with_retry calls on its aiohttp session (http.py:168-177), with the header."""

    def __init__(self, session, headers: dict) -> None:
        self._session, self._headers = session, headers

    def _call(self, method: str, url, **kw):
        kw["headers"] = {**self._headers, **(kw.get("headers") or {})}
        return getattr(self._session, method)(url, **kw)

    def get(self, url, **kw):
        return self._call("get", url, **kw)

    def post(self, url, **kw):
        return self._call("post", url, **kw)

    def put(self, url, **kw):
        return self._call("put", url, **kw)

    def delete(self, url, **kw):
        return self._call("delete", url, **kw)


def send_api_key(api_key: str) -> None:
    """Every request RemoteSGLangEngine sends to SGLang goes through the name arequest_with_retry in
    areal.infra.remote_inf_engine (imported at :47, called at :866, :1312, :1403) with a session;
    AReaL's readiness check is /health, which SGLang leaves open."""
    import areal.infra.remote_inf_engine as rie

    headers = {"Authorization": f"Bearer {api_key}"}

    def wrap(original):
        async def arequest_with_retry(addr, endpoint, payload=None, session=None, **kw):
            if session is None:
                import aiohttp

                async with aiohttp.ClientSession(connector=rie.get_default_connector()) as own:
                    return await original(addr, endpoint, payload, session=_AuthSession(own, headers), **kw)
            return await original(addr, endpoint, payload, session=_AuthSession(session, headers), **kw)

        return arequest_with_retry

    patch_once(rie, "arequest_with_retry", wrap, mark="_podkit_api_key")


RIDE_OUT_POLL_S = 0.25  # a refused connection costs nothing: a server back is seen within a quarter second


def ride_out_restarts(window_s: float, interval_s: float = RIDE_OUT_POLL_S) -> None:
    """Retry what failed to connect (SGLang down or restarting) for up to window_s; HTTP errors and
    timeouts fail as before. AReaL names the last exception in its RuntimeError ("... Last error:
    {last_exception!r}", http.py:219-223): that format is pinned by check().

    Generation (/generate) also waits for the trainer's weights (reattach.py): once this trainer pushed a
    version, a request is sent again only when inference serves one it pushed, and an answer from the base
    weights is dropped and sent again, until rank 0 re-attaches or falls back."""
    import areal.infra.remote_inf_engine as rie

    from podkit.areal.reattach import GENERATION as gen
    from podkit.areal.reattach import answered_from_base

    def wrap(original):
        async def arequest_with_retry(*args, **kw):
            endpoint = kw.get("endpoint", args[1] if len(args) > 1 else "")
            addr = kw.get("addr", args[0] if args else "")
            generating = endpoint == "/generate"
            # From the first failure: rank 0 decides within window_s whether it re-attaches (or falls back); the
            # requests, the trainer's own push among them, wait a little longer, so that a server back just after
            # the fallback lets the step end with its checkpoint instead of failing it. A later failure (a second
            # restart) gives a new window.
            deadline, told, dropped = None, False, False
            while True:
                try:
                    result = await original(*args, **kw)
                except RuntimeError as e:
                    last = str(e).rpartition("Last error: ")[2]
                    if not last.startswith(CONNECTION_ERRORS):
                        raise
                    if deadline is None:
                        deadline = time.monotonic() + window_s + 30.0
                        # AReaL's own retries wait retry_delay (1 s) between tries: while riding out, they poll
                        # as often as this loop does (the pinned http.py takes retry_delay as a keyword)
                        kw["retry_delay"] = min(kw.get("retry_delay", 1.0), interval_s)
                    elif time.monotonic() >= deadline:
                        raise
                    if not told:
                        print(f"[podkit] inference unreachable ({last[:80]}); retrying for up to {window_s:.0f}s "
                              "(a restarting server)", flush=True)
                        told = True
                    if generating and gen.pushed and not gen.released():
                        await gen.wait_served(addr, deadline)
                    else:
                        await asyncio.sleep(interval_s)
                    continue
                if not (generating and gen.pushed and answered_from_base(result)) or gen.released():
                    return result
                if not dropped:  # the first drop opens the window (a connection error may have opened one)
                    deadline = time.monotonic() + window_s + 30.0
                    print(f"[podkit] inference answered from the base weights (it restarted) after this trainer "
                          f"pushed version {gen.version}: the answer is dropped and the request sent again once "
                          "the trainer's weights are served", flush=True)
                    dropped = True
                if not await gen.wait_served(addr, deadline):
                    raise RuntimeError(f"inference served the base weights for {window_s:.0f}s after this trainer "
                                       f"pushed version {gen.version}, and was not re-attached")

        return arequest_with_retry

    patch_once(rie, "arequest_with_retry", wrap, mark="_podkit_ride_out")


def track_versions() -> None:
    """The highest version set on this process's inference engines (RemoteInfEngine.set_version, which the
    step loop calls after each push and recover after its own): >= 1 once the trainer pushed weights."""
    from areal.infra.remote_inf_engine import RemoteInfEngine

    from podkit.areal.reattach import GENERATION as gen

    def wrap(original):
        def set_version(self, version):
            original(self, version)
            if isinstance(version, int) and version > gen.version:
                gen.version = version

        return set_version

    patch_once(RemoteInfEngine, "set_version", wrap)


def keep_weight_updates() -> None:
    """AReaL removes each weight_update_v<N> right after inference loaded it (clear_checkpoint_after_load,
    in update_weights_from_disk's callback): while re-attaching is on, the latest stays for a re-push to a
    restarted server, and rank 0 removes the older ones once the next version is served
    (reattach.keep_latest)."""
    import copy

    from areal.infra.remote_inf_engine import RemoteInfEngine

    from podkit.areal.reattach import GENERATION as gen

    def wrap(original):
        def update_weights_from_disk(self, meta):
            if gen.active and getattr(meta, "clear_checkpoint_after_load", False):
                meta = copy.copy(meta)
                meta.clear_checkpoint_after_load = False
            return original(self, meta)

        return update_weights_from_disk

    patch_once(RemoteInfEngine, "update_weights_from_disk", wrap)


# --- the training loop (rl_trainer.py:552-860) ----------------------------------------------------


def stop_after_step(trainer, global_step: int) -> None:
    """train() checks `total_train_steps is not None and global_step >= total_train_steps` at the top
    of each iteration (rl_trainer.py:590-594), so it returns normally and `with PPOTrainer` exits
    without the "Training failed" of a SystemExit. Every rank must call it for the same step."""
    trainer.config.total_train_steps = global_step + 1


def recover_checkpoint_written(trainer, global_step: int) -> bool:
    """RecoverHandler.dump sets last_step_info only after the freq check passed and every engine's save
    returned (recover.py:238-255); the same answer on every rank."""
    info = getattr(trainer.recover_handler, "last_step_info", None)
    return info is not None and info.global_step == global_step


def force_recover_checkpoint(trainer, save, epoch: int, epoch_step: int, global_step: int) -> bool:
    """A recover checkpoint for this step whatever recover.freq_* say; a collective (all ranks)."""
    freq = trainer.recover_handler.freq_ctl
    check_, freq.check = freq.check, (lambda **_: True)
    try:
        save(epoch=epoch, epoch_step=epoch_step, global_step=global_step)
    finally:
        freq.check = check_
    return recover_checkpoint_written(trainer, global_step)
