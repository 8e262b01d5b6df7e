"""The restore stage under faults (issue 58 item 3): a restore that does not give up at the first fault, does not hang,
and says what it does. An endpoint down at the boot, hung (SIGSTOP), a download that stalls, the old pod pruning the
generation a replacement downloads, one stalled manifest read, manifests that are not checkpoints, half downloads of
killed boots, a volume with no room. A real S3 endpoint (`rclone serve s3`, tests/s3server.py) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import test_remote
import test_run_lineage
from test_run_lineage import status

import s3server
from conftest import PODKIT, wait_for
from podkit import records
from podkit.areal import identity
from podkit.boot import restore
from podkit.programs.fake_trainer import FakeTrainer
from podkit.remote import mover, remote, uploader

pytestmark = pytest.mark.timeout(90)
pod = test_remote.pod  # the fixture, served by this module's own server and bucket
areal_ckpt, top, whole = test_run_lineage.areal_ckpt, test_run_lineage.top, test_run_lineage.whole
BUCKETS = [f"restore-{i:02d}" for i in range(16)]
FAST = ("--retries", "1", "--low-level-retries", "1")  # an endpoint that is down: said at once, not in 20 s

server, bucket = s3server.fixtures(BUCKETS)  # one server for the module, a bucket a test


def train_to(cfg, step: int, pad: int = 0) -> FakeTrainer:
    """The fake trainer's checkpoint of `step` as it writes it; `pad` floats more in it (a bigger file)."""
    t = test_remote.train_to(cfg, step)
    if pad:
        t.codec.save({"step": step, "model": t.model.state_dict(), "optim": t.opt.state_dict(),
                      "pad": np.zeros(pad, np.float32)}, cfg.checkpoint_dir / f"step-{step:08d}.pt")
    return t


def uploaded(cfg, *steps: int, pad: int = 0) -> None:
    """Pod `cfg` trains to each of `steps` and uploads it, then releases the run's lease (the pod is gone)."""
    up = uploader.Uploader(cfg, say=lambda _: None)
    for step in steps:
        train_to(cfg, step, pad)
        assert up.once() == step, up.why
    up.release()


def empty(cfg) -> bool:
    """The volume holds no checkpoint and no half download of one."""
    ws = cfg.workspace_path
    return remote.local(cfg).step is None and not [p for p in ws.rglob("*") if ".restore-" in p.name]


def later(seconds: float, then) -> threading.Thread:
    t = threading.Timer(seconds, then)
    t.daemon = True
    t.start()
    return t


# -- 3. an endpoint down at the boot -------------------------------------------------------------------------------
def test_an_endpoint_down_for_seconds_at_the_boot_is_tried_again_and_the_newest_restored(pod, server, bucket,
                                                                                       monkeypatch, capsys):
    """The endpoint down for 5 s when a replacement boots, the remote holding step 6: the restore tries again with
    back-off and restores step 6, not "starting at step 0"."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 3, 6)
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="40")
    monkeypatch.setattr(mover, "RETRIES", FAST)
    server.kill()
    back = later(5, server.start)
    t0 = time.monotonic()
    try:
        assert restore.run(b) == 6
    finally:
        back.join(30)
    assert time.monotonic() - t0 >= 4
    said = capsys.readouterr().out
    assert "trying again in" in said and "starting at step 0" not in said and "starts from step 0" not in said, said
    assert records.REMOTE.read(b.state_dir)["restore"]["outcome"] == "restored"


def test_a_restore_that_gives_up_says_so_and_the_remote_ahead_is_shown_and_never_claimed(pod, server, bucket,
                                                                                          monkeypatch, capsys):
    """The endpoint down longer than checkpoint.restore_timeout_s: the restore gives up, says the trainer starts
    WITHOUT the remote's newest and records "failed"; once the endpoint is back the uploader's look records that the
    remote is ahead (step 6), and the stop does not claim the pod's step 2 is on the remote."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6)
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="3")
    monkeypatch.setattr(mover, "RETRIES", FAST)
    server.kill()
    try:
        t0 = time.monotonic()
        assert restore.run(b) is None
        assert time.monotonic() - t0 < 15
    finally:
        server.start()
    said = capsys.readouterr().out
    assert "WITHOUT the remote's newest" in said and "restore_timeout_s" in said, said
    note = records.REMOTE.read(b.state_dir)["restore"]
    assert note["outcome"] == "failed" and note["why"], note
    assert empty(b)

    train_to(b, 2)  # the trainer started from 0 and saved step 2
    lines: list[str] = []
    up = uploader.Uploader(b, say=lines.append)
    assert up.once() is None
    ahead = records.REMOTE.read(b.state_dir).get("ahead")
    assert ahead and ahead["step"] == 6 and ahead["from"] == 2, records.REMOTE.read(b.state_dir)
    assert any("newer checkpoint of this lineage (step 6" in line for line in lines), lines
    shown = status(b)
    assert "the remote holds a newer checkpoint of this lineage, step 6" in shown, shown
    words = up.final(20, "the pod is stopping")
    assert "step 2, is NOT on the remote" in words and "step 6" in words, words
    assert not (top(server, bucket) / remote.gen(2)).exists()

    # The way on that the uploader names: `podkit restore` (the trainer stopped), then the trainer resumes from 6.
    r = subprocess.run([*PODKIT, "restore", "--workspace", str(b.workspace_path)], capture_output=True, text=True,
                       env={**os.environ, "PODKIT_WORKSPACE": str(b.workspace_path)}, timeout=60)
    assert r.returncode == 0 and "restored step 6" in r.stdout, r.stdout + r.stderr
    assert remote.local(b).step == 6
    assert "the last checkpoint, step 6, is on the remote" in uploader.Uploader(b, say=lambda _: None).final(
        20, "the pod is stopping")


# -- 5. a hung endpoint ---------------------------------------------------------------------------------------------
def test_a_hung_endpoint_at_the_boot_holds_it_for_restore_timeout_s_not_remote_timeout_s(pod, server, bucket,
                                                                                          monkeypatch, capsys):
    """The endpoint hangs (SIGSTOP: it accepts, never answers): the restore ends within checkpoint.restore_timeout_s
    and one bounded call, not checkpoint.remote_timeout_s (60 s here), says so, and status shows it trying meanwhile."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6)
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="6",
            PODKIT_CHECKPOINT_REMOTE_TIMEOUT_S="60")
    monkeypatch.setattr(restore, "CALL_S", 2.0, raising=False)
    result: list = []
    os.kill(server.proc.pid, signal.SIGSTOP)  # ours, by its pid
    try:
        t0 = time.monotonic()
        run = threading.Thread(target=lambda: result.append(restore.run(b)), daemon=True)
        run.start()
        wait_for(lambda: records.REMOTE.read(b.state_dir).get("restore", {}).get("outcome") == "retrying", 10,
                 what="status to show the restore trying again")
        shown = status(b)
        run.join(30)
        took = time.monotonic() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert result == [None] and took < 6 + 2 + 3, took
    assert "restoring: the remote could not be read" in shown, shown
    said = capsys.readouterr().out
    assert "WITHOUT the remote's newest" in said, said
    assert "checkpoint.remote_timeout_s" not in records.REMOTE.read(b.state_dir)["restore"]["why"], \
        "the call was bounded by the restore's budget, not by remote_timeout_s"
    assert records.REMOTE.read(b.state_dir)["restore"]["outcome"] == "failed"
    assert restore.run(b) == 6  # the endpoint answers again: the next boot restores it


def test_a_download_that_stalls_is_cut_and_tried_again(pod, server, bucket, monkeypatch, tmp_path, capsys):
    """The endpoint hangs as the download begins (SIGSTOP just before rclone's copy of the generation starts, SIGCONT
    5 s later): the download that moves no byte for STALL_S is cut, tried again, and the generation restored whole."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6, pad=1 << 18)
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="60",
            PODKIT_CHECKPOINT_REMOTE_TIMEOUT_S="60")
    monkeypatch.setattr(restore, "STALL_S", 2.0, raising=False)
    monkeypatch.setattr(restore, "CALL_S", 3.0, raising=False)
    pid, real, marker = server.proc.pid, mover.binary(), tmp_path / "stopped-once"
    wrapper = tmp_path / "rclone-hangs"  # the server's own pid, stopped once: ours
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = copy ] && [ ! -e {marker} ]; then case "$*" in *{remote.gen(6)}*) '
                       f'touch {marker}; kill -STOP {pid};; esac; fi\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(mover, "binary", lambda: str(wrapper))
    result: list = []
    run = threading.Thread(target=lambda: result.append(restore.run(b)), daemon=True)
    run.start()
    try:
        wait_for(marker.exists, 20, what="the download to begin")
        time.sleep(5)
    finally:
        os.kill(pid, signal.SIGCONT)
    run.join(40)
    said = capsys.readouterr().out
    assert result == [6], said
    assert "stalled" in said and "trying again" in said, said
    assert records.REMOTE.read(b.state_dir)["restore"]["outcome"] == "restored"
    assert sorted(p.name for p in b.checkpoint_dir.iterdir() if p.name != remote.LINEAGE_MARK) == ["latest", "step-00000006.pt"]


# -- 6. pruning while a replacement restores -----------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_a_generation_pruned_under_a_download_sends_the_restore_to_the_newest_whole_one(pod, server, bucket,
                                                                                        monkeypatch, capsys):
    """The old pod keeps uploading with remote_keep 1 while a replacement downloads its step 6 (8 shards, 4 MB at 256
    KiB/s): step 8's upload prunes 6 under the download, and the restore lists again and restores step 8, never
    "directory not found ... starts from what the volume has"."""
    a = pod("a", RUNPOD_POD_ID="pod-a", PODKIT_TRAINER_KIND="areal", PODKIT_CHECKPOINT_REMOTE_KEEP="1")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 5, shards=8, size=512 << 10)
    assert up.once() == 6
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_TRAINER_KIND="areal", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="60",
            RCLONE_BWLIMIT="256k")  # 16 s: step 8's upload and prune (unlimited) come well within it
    result: list = []
    run = threading.Thread(target=lambda: result.append(restore.run(b)), daemon=True)
    run.start()
    wait_for(lambda: (records.REMOTE.read(b.state_dir).get("restore") or {}).get("outcome") == "restoring", 20,
             what="the replacement downloading step 6")
    time.sleep(0.5)
    areal_ckpt(a, 7, shards=8, size=512 << 10)
    assert up.once() == 8  # keep 1: step 6 pruned under the download
    assert whole(top(server, bucket)) == [8]
    assert (records.REMOTE.read(b.state_dir).get("restore") or {}).get("step") == 6, "the download of 6 had ended"
    run.join(80)
    said = capsys.readouterr().out
    assert result == [8], said
    assert "starts from what the volume has" not in said and "WITHOUT" not in said, said
    assert remote.local(b).step == 8 and not [p for p in b.workspace_path.rglob("*") if ".restore-" in p.name]


# -- 7. one stalled manifest read ------------------------------------------------------------------------------------
def test_one_stalled_manifest_read_is_tried_again_and_the_newest_restored(pod, server, bucket, monkeypatch, tmp_path,
                                                                         capsys):
    """The first read of the newest manifest (step 6) stalls: it is cut at its bound and tried again, and step 6 is
    restored, not the older step 3 ("not a checkpoint, skipped")."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 3, 6)
    real, marker = mover.binary(), tmp_path / "stalled-once"
    wrapper = tmp_path / "rclone-stalls"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = cat ] && [ ! -e {marker} ]; then case "$2" in '
                       f'*/gen-00000006/manifest.json) touch {marker}; exec sleep 30;; esac; fi\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(mover, "binary", lambda: str(wrapper))
    monkeypatch.setattr(restore, "CALL_S", 2.0, raising=False)
    b = pod("b", RUNPOD_POD_ID="pod-b", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="30")
    t0 = time.monotonic()
    assert restore.run(b) == 6
    assert marker.exists() and time.monotonic() - t0 < 20
    said = capsys.readouterr().out
    assert "not a checkpoint, skipped" not in said and "trying again" in said, said


# -- 11. what is not a checkpoint, half downloads, no room ---------------------------------------------------------
@pytest.mark.parametrize("files", ["empty", "absolute", "dotdot"])
def test_a_manifest_naming_no_file_or_one_outside_its_generation_is_not_a_checkpoint(pod, server, bucket, files,
                                                                                     capsys):
    """A newest manifest with `files: {}`, an absolute path or a `..`: skipped as not a checkpoint, the boot goes on
    (never an exception: safe mode) and the older whole generation is restored; nothing outside the checkpoint's
    directory is written."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    uploaded(a, 4)
    b = pod("b", RUNPOD_POD_ID="pod-b")
    outside = b.workspace_path / "outside.pt"  # a file a restore must never take, or place, as the checkpoint
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_bytes(os.urandom(1000))
    entry = {"size": 1000, "sha256": remote.sha256(outside)}
    named = {"empty": {}, "absolute": {str(outside): entry}, "dotdot": {"../outside.pt": entry}}[files]
    manifest = {"step": 9, "kind": "fake", "run": "podkit/run", "lineage": "", "time": time.time(),
                "identity": remote.mine(b), "files": named}
    rem = remote.Remote(b.checkpoint.remote, "podkit/run", 20)
    planted = b.workspace_path / "planted.json"
    planted.write_text(json.dumps(manifest))
    rem.rclone("copyto", str(outside), f"{rem.base}/{remote.gen(9)}/outside.pt")  # through the server: its cache
    rem.rclone("copyto", str(planted), f"{rem.base}/{remote.gen(9)}/{remote.MANIFEST}")
    before = outside.stat()
    assert restore.run(b) == 4
    assert "gen-00000009 has a manifest podkit cannot read: not a checkpoint, skipped" in capsys.readouterr().out
    assert sorted(p.name for p in b.checkpoint_dir.iterdir() if p.name != remote.LINEAGE_MARK) == ["latest", "step-00000004.pt"]
    assert (b.checkpoint_dir / "latest").read_text().strip() == "step-00000004.pt"
    assert outside.stat().st_ino == before.st_ino and outside.stat().st_mtime_ns == before.st_mtime_ns


def dead_pid() -> int:
    p = subprocess.Popen(["true"])  # ours: a pid that was a process and is gone
    p.wait(10)
    return p.pid


def test_a_boot_killed_twice_mid_restore_leaves_no_half_download_after_the_next(pod, server, bucket):
    """Two earlier boots killed mid-restore left their temp dirs (`.<name>.restore-gen-…-<pid>`, pids dead): the next
    boot removes them and restores; a live process's temp, and anything not named so, is kept."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6, pad=1 << 18)
    b = pod("b", RUNPOD_POD_ID="pod-b")
    ws = b.workspace_path
    halves = [ws / f".checkpoints.restore-{remote.gen(6)}-{dead_pid()}" for _ in range(2)]
    for h in halves:
        h.mkdir(parents=True)
        (h / "step-00000006.pt").write_bytes(os.urandom(300_000))  # half of it
    live = ws / f".checkpoints.restore-{remote.gen(6)}-1"  # pid 1: alive, never ours to remove
    live.mkdir()
    kept = ws / ".checkpoints.restore-notes"
    kept.mkdir()
    assert restore.run(b) == 6
    assert not any(h.exists() for h in halves)
    assert live.is_dir() and kept.is_dir()
    assert sorted(p.name for p in b.checkpoint_dir.iterdir() if p.name != remote.LINEAGE_MARK) == ["latest", "step-00000006.pt"]


@pytest.fixture
def small_volume(tmp_path):
    """A 2 MiB tmpfs as pod b's whole workspace (root may mount one; else the test is skipped)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                                           capture_output=True, timeout=10).returncode != 0:
        pytest.skip("a small volume needs a tmpfs mount (root)")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True, timeout=10)  # ours, mounted above


def test_a_volume_too_small_for_the_restore_is_said_as_the_volumes(pod, server, bucket, small_volume, capsys):
    """A 4 MB checkpoint onto a 2 MiB volume: the restore says the volume has no room (not that the remote is full),
    does not try again for minutes, leaves no half download, and the boot goes on."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6, pad=1 << 20)
    b = pod("small", RUNPOD_POD_ID="pod-b")
    assert b.workspace_path == small_volume
    t0 = time.monotonic()
    assert restore.run(b) is None
    assert time.monotonic() - t0 < 5
    said = capsys.readouterr().out
    assert "no room" in said and "full or over its quota" not in said, said
    note = records.REMOTE.read(b.state_dir)["restore"]
    assert note["outcome"] == "failed" and "no room" in note["why"], note
    assert empty(b)


def test_a_volume_that_fills_during_the_restore_is_said_as_the_volumes(pod, server, bucket, small_volume, capsys):
    """Room for the checkpoint (8 shards of 128 KiB) when the restore begins, none soon after (another writer fills
    the volume): said as the volume's, not the remote's, and no half download is left."""
    a = pod("a", RUNPOD_POD_ID="pod-a", PODKIT_TRAINER_KIND="areal")
    areal_ckpt(a, 5, shards=8, size=128 << 10)
    assert uploader.Uploader(a, say=lambda _: None).once() == 6
    b = pod("small", RUNPOD_POD_ID="pod-b", PODKIT_TRAINER_KIND="areal", RCLONE_BWLIMIT="256k")
    filler = small_volume / "filler"
    result: list = []
    run = threading.Thread(target=lambda: result.append(restore.run(b)), daemon=True)
    run.start()
    wait_for(lambda: (records.REMOTE.read(b.state_dir).get("restore") or {}).get("outcome") == "restoring", 20,
             what="the download to begin")
    free = os.statvfs(small_volume)
    filler.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (16 << 10)))
    run.join(40)
    said = capsys.readouterr().out
    assert result == [None], said
    assert "no room" in said or "filled" in said, said
    assert "full or over its quota" not in said, said
    filler.unlink()
    assert not identity.has_checkpoint(remote.local(b).root)
    assert not [p for p in b.workspace_path.rglob("*") if ".restore-" in p.name]


def test_status_names_a_restore_in_progress(pod, server, bucket, monkeypatch):
    """While a restore downloads, remote.json says which step, from where, and how many bytes of how many."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6, pad=1 << 19)
    b = pod("b", RUNPOD_POD_ID="pod-b", RCLONE_BWLIMIT="512k")
    monkeypatch.setattr(restore, "PROGRESS_S", 0.3, raising=False)
    result: list = []
    run = threading.Thread(target=lambda: result.append(restore.run(b)), daemon=True)
    run.start()
    wait_for(lambda: (records.REMOTE.read(b.state_dir).get("restore") or {}).get("got"), 20,
             what="the restore's progress in remote.json")
    note = records.REMOTE.read(b.state_dir)["restore"]
    assert note["outcome"] == "restoring" and note["step"] == 6 and note["where"].endswith(remote.gen(6)), note
    assert 0 < note["got"] < note["total"], note
    shown = status(b)
    assert f"restoring step 6 from {note['where']} (" in shown and " of 2 MB)" in shown, shown
    run.join(30)
    assert result == [6]


