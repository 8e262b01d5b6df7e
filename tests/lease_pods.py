"""Processes that hold or contend for the workspace lease as other pods would: on another host (a hostname and
a kernel boot id of their own) and with a clock of their own (lease.SKEW_ENV). The lease's tests
(tests/host/test_lease_clocks.py) and the adversarial pass over its fixes (tests/boot/test_fixes_pass.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from podkit.host import lease


def can_unshare(*flags: str) -> bool:
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


def on_another_host(tmp_path: Path, argv: list[str]) -> list[str]:
    """`argv` as if on another host: its own hostname and kernel boot id (bind-mounted over /proc's)."""
    boot_id = tmp_path / "other-boot-id"
    boot_id.write_text("0f0f0f0f-1111-2222-3333-444455556666\n")
    return ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
            'hostname pod-on-another-host && mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"',
            str(boot_id), *argv]


def spawn(procs, argv, skew_s: float) -> subprocess.Popen:
    env = {**os.environ, lease.SKEW_ENV: str(skew_s)}
    return procs.spawn(argv, env=env, stdout=subprocess.PIPE, text=True)
