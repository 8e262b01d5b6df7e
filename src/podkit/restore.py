"""The restore stage: a volume without this run's checkpoint, or with an older one than the remote's newest whole
generation (remote.py), gets that generation before the trainer starts.

The generation is downloaded to a temp directory beside the checkpoint, checked file by file against its
manifest (size and sha256), then renamed into place: a restore cut at any point leaves no half checkpoint.
Another run's generation (its identity differs: identity.differences) is never restored. A restore that fails
(the remote unreachable, refused, corrupt) never stops the boot: the trainer starts from what the volume has,
and the log says why. Only a `checkpoint.remote` that is not a remote at all is a config error.
"""

from __future__ import annotations

from podkit import log
from podkit.errors import ConfigError

_log = log.get("restore")


def run(cfg) -> int | None:
    """The stage: the step restored, or None (nothing to restore, or a failure said in the log)."""
    if not cfg.checkpoint.remote:
        return None
    # rclone, hashing and temp dirs: only for a pod with a remote (the boot path's imports are pinned)
    from podkit import remote

    try:
        remote.parse(cfg.checkpoint.remote)
    except ValueError as e:
        raise ConfigError(cfg.origin("checkpoint.remote"), "checkpoint.remote", str(e),
                          hint="s3://bucket/prefix, or an rclone remote name:path configured by "
                               "RCLONE_CONFIG_<NAME>_* env vars; empty: no remote") from None
    if cfg.multi_node and cfg.cluster.rank != 0:
        _log.info(f"node rank {cfg.cluster.rank}: rank 0's boot restores the run's checkpoint")
        return None
    run_id = remote.run_id(cfg)
    if not run_id:
        _log.warn("the run's names are AReaL's to tell (a Hydra default or an interpolation): nothing restored; set "
                  "trainer.experiment and trainer.trial to restore from checkpoint.remote")
        return None
    try:
        step = remote.restore(cfg, remote.Remote(cfg.checkpoint.remote, run_id, cfg.checkpoint.remote_timeout_s))
    except (remote.RemoteError, OSError) as e:
        _log.warn(f"no checkpoint restored from {cfg.checkpoint.remote}: {e}. The trainer starts from what the "
                  "volume has")
        remote.restored(cfg, "failed", None, str(e))
        return None
    return step
