"""The container's boot, stage by stage (preflight, reap, sync, setup, restore, render, then supervisord), each stage
idempotent, with the crash-loop guard and the safe mode where a boot that cannot train waits and explains itself."""
