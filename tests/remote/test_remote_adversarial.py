"""An adversarial pass over issue 49's upload path (remote.Remote.upload's hashes beside the copy, mover's yielding
prefix, the remote lease's fresh hold, checkpoint.remote_every_s, standing.durable's "final" and "blocked"):
real rclone against `rclone serve s3` on 127.0.0.1, real files, real writers. The claim under attack: a generation
that gets its manifest holds, on the remote, exactly the content its manifest's sha256 names."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time

import pytest
import test_remote

import s3server
from podkit import records
from podkit.judge import standing
from podkit.remote import mover, remote, uploader
from s3server import Server

pytestmark = pytest.mark.timeout(60)
pod = test_remote.pod  # the fixture, served by this module's own server and bucket
train_to, gen_dir = test_remote.train_to, test_remote.gen_dir
BUCKETS = [f"adv-{i:02d}" for i in range(12)]

server, bucket = s3server.fixtures(BUCKETS)  # one server for the module, a bucket a test


def big(cfg, step: int, size: int = 2 << 20):
    """The fake trainer's checkpoint of `step` as one file of `size` random bytes (2 MB: 2 s at RCLONE_BWLIMIT=1M)."""
    train_to(cfg, step)
    path = cfg.checkpoint_dir / f"step-{step:08d}.pt"
    path.write_bytes(os.urandom(size))
    return path


def manifest_matches_remote(server: Server, bucket: str, step: int) -> bool:
    """The claim: no manifest, or every file on the remote hashes to what the manifest says."""
    where = gen_dir(server, bucket, step)
    if not (where / remote.MANIFEST).exists():
        return True
    files = json.loads((where / remote.MANIFEST).read_text())["files"]
    return all(hashlib.sha256((where / rel).read_bytes()).hexdigest() == f["sha256"] for rel, f in files.items())


def writer_once_copying(server, bucket, step: int, script: str) -> subprocess.Popen:
    """A shell that runs `script` 0.3 s after the generation's PUT began (its dir appeared on the server)."""
    started = gen_dir(server, bucket, step)
    return subprocess.Popen(["sh", "-c", f"for i in $(seq 200); do [ -d {started} ] && break; sleep 0.05; done; "
                                         f"sleep 0.3; {script}"])  # ours, waited by pid


def test_a_rewrite_that_puts_its_mtime_back_still_drops_the_generation(pod, server, bucket, monkeypatch):
    """A writer rewrites bytes of the file mid-copy (same size) and sets its mtime back with touch -d: the ctime,
    which no user can set, still moves, so the generation gets no manifest."""
    a = pod("a")
    path = big(a, 5)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    monkeypatch.setenv("RCLONE_BWLIMIT", "1M")
    w = writer_once_copying(server, bucket, 5, f"printf XXXX | dd of={path} bs=1 seek=100 conv=notrunc status=none; "
                                                f"touch -m -d '{stamp}' {path}")
    try:
        assert uploader.Uploader(a, say=lambda _: None).once() is None
    finally:
        w.wait(20)
    assert "changed while it was uploaded" in records.REMOTE.read(a.state_dir)["last"]["why"]
    assert not (gen_dir(server, bucket, 5) / remote.MANIFEST).exists()


def test_a_file_renamed_over_during_the_copy_drops_the_generation_unless_a_snapshot_froze_it(pod, server, bucket,
                                                                                              monkeypatch):
    """A save that writes a temp file of the same size and renames it over the one uploading: a new inode. The
    uploader's snapshot links the file it looked at (snapshot.py): those bytes go up whole, the rename's never. An
    upload of the volume's files as they are (AReaL's at the stop, or no room for a copy) drops the generation."""
    a = pod("a")
    path = big(a, 6)
    looked = path.read_bytes()
    other = path.with_name(".tmp-save")
    other.write_bytes(os.urandom(path.stat().st_size))
    monkeypatch.setenv("RCLONE_BWLIMIT", "1M")
    w = writer_once_copying(server, bucket, 6, f"mv {other} {path}")
    try:
        assert uploader.Uploader(a, say=lambda _: None).once() == 6
    finally:
        w.wait(20)
    assert path.read_bytes() != looked and (gen_dir(server, bucket, 6) / path.name).read_bytes() == looked
    assert manifest_matches_remote(server, bucket, 6)
    path = big(a, 7)
    other.write_bytes(os.urandom(path.stat().st_size))
    w = writer_once_copying(server, bucket, 7, f"mv {other} {path}")
    try:
        with pytest.raises(remote.RemoteError, match="changed while it was uploaded"):
            remote.Remote(a.checkpoint.remote, "podkit/run").upload(remote.local(a))
    finally:
        w.wait(20)
    assert manifest_matches_remote(server, bucket, 7)


def test_a_rewrite_within_the_clock_tick_of_the_look_is_not_taken_as_unchanged(pod, server, bucket, monkeypatch):
    """Before Linux 6.13 a file's times step with the kernel's clock tick (1-10 ms; here 50 ms, simulated by
    rounding the stamps down): a save just before the look and another of the same size right after it, within
    that tick, leave the stamps as they were, while the hash read the first bytes and rclone the second. The look
    waits out a change that recent (remote.SETTLE_S), so the second save moves the stamps: no manifest, or one
    that matches what went up."""
    tick = 50_000_000
    monkeypatch.setattr(remote, "SETTLE_S", 0.1)  # beyond the simulated tick, as 0.05 s is beyond a real one
    real_stamps, real_hashes = remote.stamps, remote.hashes
    a = pod("a")
    path = big(a, 7, 1 << 20)
    looks = []

    def stamps(root, files):
        if not looks:  # the save just before the look, at the start of a tick
            while time.time_ns() % tick > tick // 10:
                time.sleep(0.001)
            path.write_bytes(b"A" * (1 << 20))
        looks.append(1)
        return {k: (*v[:3], v[3] - v[3] % tick, v[4] - v[4] % tick) for k, v in real_stamps(root, files).items()}

    def hashes(root, files, check=lambda: None):
        out = real_hashes(root, files, check)
        with open(path, "r+b") as f:  # the second save, same size, within the tick, before rclone reads it
            f.write(b"B" * (1 << 20))
        return out

    monkeypatch.setattr(remote, "stamps", stamps)
    monkeypatch.setattr(remote, "hashes", hashes)
    real_binary = mover.binary()
    monkeypatch.setattr(remote.mover, "binary", lambda: (time.sleep(0.1), real_binary)[1])  # rclone reads late
    up = uploader.Uploader(a, say=lambda _: None)
    up.once()
    assert manifest_matches_remote(server, bucket, 7)


def test_a_hash_that_raises_an_unexpected_error_fails_the_upload_in_words(pod, server, bucket, monkeypatch):
    """The hash thread raising what is neither an OSError nor a RemoteError: the upload fails as a RemoteError
    (recorded, no manifest), never a KeyError out of the stop's final upload."""
    a = pod("a")
    train_to(a, 3)
    monkeypatch.setattr(remote, "sha256", lambda *_: (_ for _ in ()).throw(ValueError("boom")))
    up = uploader.Uploader(a, say=lambda _: None)
    words = up.final(30, "the pod's stop")
    assert "NOT on the remote" in words and "could not be hashed" in words
    assert records.REMOTE.read(a.state_dir)["final"]["outcome"] == "failed"
    assert not (gen_dir(server, bucket, 3) / remote.MANIFEST).exists()


def test_a_copy_that_fails_stops_a_long_hash_at_once(pod, server, bucket, monkeypatch):
    """The copy fails (a wrong secret) while a slow hash (40 s of chunks) runs: the hash stops at its next chunk
    and the upload says why within seconds."""
    a = pod("a", AWS_SECRET_ACCESS_KEY="wrong-secret-000")
    big(a, 4, 40 << 20)
    real = hashlib.sha256

    class Slow:
        def __init__(self):
            self.h = real()

        def update(self, b):
            time.sleep(1.0)
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(remote.hashlib, "sha256", Slow)
    r = remote.Remote(a.checkpoint.remote, remote.run_id(a), 20)
    t0 = time.monotonic()
    with pytest.raises(remote.RemoteError):  # refused (rclone serve s3 words it its own way)
        r.upload(remote.local(a))
    assert time.monotonic() - t0 < 15
    assert not any(t.name == "podkit-remote-hash" for t in threading.enumerate())


def test_yielding_without_chrt_keeps_nice_and_ionice_and_the_upload_goes_up(pod, server, bucket, tmp_path,
                                                                           monkeypatch):
    """A container that refuses SCHED_BATCH (a chrt that exits 1): the prefix drops chrt alone, and a background
    upload still goes up."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "chrt").write_text("#!/bin/sh\nexit 1\n")
    (fake / "chrt").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setattr(mover, "_YIELDING", {})
    prefix = mover.yielding(mover.NICE)
    assert not any(p.endswith("chrt") for p in prefix) and any(p.endswith("nice") for p in prefix), prefix
    a = pod("a")
    train_to(a, 2)
    assert uploader.Uploader(a, say=lambda _: None).once() == 2
    assert manifest_matches_remote(server, bucket, 2)


def test_the_stops_upload_right_after_a_background_one_does_not_wait_for_remote_every_s(pod, server, bucket):
    """checkpoint.remote_every_s an hour: the loop's upload of step 1 went a moment ago, step 2 is saved, and the
    stop's final upload puts it up at once."""
    a = pod("a", PODKIT_CHECKPOINT_REMOTE_EVERY_S="3600", PODKIT_CHECKPOINT_REMOTE_POLL_S="0.1")
    up = uploader.Uploader(a, say=lambda _: None).start()
    try:
        train_to(a, 1)
        test_remote.wait_for(lambda: records.REMOTE.read(a.state_dir).get("uploaded", {}).get("step") == 1, 20,
                             what="step 1 up")
        train_to(a, 2)
        t0 = time.monotonic()
        assert "step 2, is on the remote" in up.final(20, "the pod's stop", for_good=True)
        assert time.monotonic() - t0 < 15
    finally:
        up.stopped.set()
    assert manifest_matches_remote(server, bucket, 2)


def test_the_fresh_lease_is_read_again_before_the_manifest(pod, server, bucket, monkeypatch):
    """A lease held moments ago is not read before the copy (uploader.FRESH_S), but another pod's lease written
    meanwhile is seen before the manifest: the generation is left without one."""
    a = pod("a")
    train_to(a, 1)
    up = uploader.Uploader(a, say=lambda _: None)
    assert up.once() == 1
    train_to(a, 2)
    real = up.remote.rclone

    def rclone(*args, **kw):
        if args[0] == "copy":  # another pod takes the lease as this copy runs
            up.lease._write({"pod": "other", "boot": "b", "token": "t" * 16, "beat": 1, "renew_s": 10,
                             "since": time.time(), "renewed": time.time()})
        return real(*args, **kw)
    monkeypatch.setattr(up.remote, "rclone", rclone)
    assert up.once() is None
    assert not (gen_dir(server, bucket, 2) / remote.MANIFEST).exists()


@pytest.mark.parametrize("hostile", [
    {"final": {"outcome": "failed", "step": True, "why": ["x"] * 5, "time": "soon"}},
    {"final": {"outcome": ["failed"], "step": 10**30, "why": "y" * 10**6, "time": 1e300}},
    {"final": {"outcome": "uploading", "step": -3, "why": None, "time": float("nan")}},
    {"final": "failed", "lease": ["blocked"]},
    {"lease": {"outcome": "blocked", "why": {"a": 1}, "time": 4e10}, "uploaded": {"step": 2, "time": 1.7e9}},
    {"final": {"outcome": "failed", "step": 9}, "uploaded": {"step": "9", "time": None}},
])
def test_hostile_final_and_lease_entries_are_judged_without_raising(hostile):
    """remote.json's "final" and "lease" of any shape: standing.durable and its words never raise, never carry a
    huge string, and a step that is not a step is shown as none."""
    now = time.time()
    d = standing.durable({"run": "podkit/run", **hostile}, 12, None, now, True, "podkit/run")
    words = standing.durable_words(d, now)
    assert len(words) < 4000
    if d["final"]:
        assert d["final"]["step"] is None or isinstance(d["final"]["step"], int) and d["final"]["step"] >= 0
