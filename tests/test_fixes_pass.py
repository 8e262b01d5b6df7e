"""An adversarial pass over issue 34's and 37's fixes (setup, weights --from, the start-up timeline, the
weight-update deadline, trainer.entry links, the lease, the stop budget, a worker outside its cluster):
hostile or unlucky inputs a real volume, machine or user produces, each kept as the scenario it broke."""

from __future__ import annotations

import pytest

from conftest import ROOT
from podkit import config, records

pytestmark = pytest.mark.timeout(120)


def _cfg(tmp_path, **env):
    return config.load(ROOT / "configs" / "a40-1gpu.yaml", environ={"PODKIT_WORKSPACE": str(tmp_path), **env})


def test_a_busy_server_whose_log_has_no_weight_update_in_view_is_not_updating_nor_restarted(tmp_path, monkeypatch):
    """A log whose last 64 KiB hold no update line (a server answering requests between two steps, or one
    that never updated) read as 'an update in flight': the generation check stayed off and, past
    weight_update_deadline_s, the healthy server was restarted. A missing log is no update either."""
    from podkit import health, watchdog

    cfg = _cfg(tmp_path, PODKIT_WATCHDOG_WEIGHT_UPDATE_DEADLINE_S="10", PODKIT_WATCHDOG_GENERATION_PROBE_S="0")
    log = cfg.log_dir / "sglang.log"
    log.parent.mkdir(parents=True)
    assert not health.updating(log), "a missing log"
    w = watchdog.Watchdog(cfg)
    restarts = []
    monkeypatch.setattr(w, "restart", restarts.append)
    with open(log, "w") as f:
        f.write(f"[2026-11-25 14:00:00] {health.START_MARK}sglang\n")
        f.write("[2026-11-25 14:00:01] Update engine weights online from disk begin. path=/ckpt/1\n")
        f.write("[2026-11-25 14:00:02] Update weights end.\n")
        f.writelines(f"[2026-11-25 14:00:03] Prefill batch. #new-seq: 1, #new-token: {i}\n" for i in range(3000))
    assert not health.updating(log)
    assert all(w.check_generation(1000.0 + t) for t in (0, 11, 30)) and restarts == []
    assert records.WATCHDOG.read(cfg.state_dir) == []
