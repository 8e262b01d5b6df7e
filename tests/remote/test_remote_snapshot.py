"""A run that saves faster than an upload takes (issue 58): the uploader freezes the checkpoint first (snapshot.py:
hard links of the fake trainer's step file, a whole copy of AReaL's recover checkpoint, which its next save rewrites
in place) and uploads that, so a generation goes up whole however soon the next save comes. Where it cannot (saves
spoil every copy, no room for one) it says so once, in words, and fills nothing. The real rclone against a real S3
endpoint (`rclone serve s3`, tests/s3server.py) on 127.0.0.1, and the real fake trainer's checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest
import test_remote

import s3server
from podkit import records
from podkit.areal import identity
from podkit.boot import restore
from podkit.host import proc
from podkit.programs.fake_trainer import FakeTrainer
from podkit.remote import remote, snapshot, uploader
from s3server import Server

pytestmark = pytest.mark.timeout(120)  # a saver thread beside each upload: slow on a busy machine
pod = test_remote.pod  # the fixture, served by this module's own server and bucket
BUCKETS = [f"snap-{i:02d}" for i in range(8)]  # one a test

server, bucket = s3server.fixtures(BUCKETS)  # one server for the module, a bucket a test
FASTER = "the run saves checkpoints faster than they can be uploaded"


def gens(server: Server, bucket: str) -> dict[int, bool]:
    """{step: whether its manifest is there} on the server's own disk."""
    runs = server.root / bucket / "runs" / "podkit" / "run"
    return {int(p.name[4:]): (p / remote.MANIFEST).exists() for p in runs.glob("gen-*")} if runs.exists() else {}


def manifest(server: Server, bucket: str, step: int) -> dict:
    return json.loads((test_remote.gen_dir(server, bucket, step) / remote.MANIFEST).read_text())


def staged(cfg) -> list[Path]:
    """What the uploader has staged now (nothing once an upload is over)."""
    base = cfg.state_dir / snapshot.HERE
    return sorted(base.iterdir()) if base.is_dir() else []


class Trainer(threading.Thread):
    """The fake trainer saving as fast as it can: its own checkpoint() (a new file each step, the oldest pruned past
    trainer.keep_checkpoints, progress.json's checkpoint_step)."""

    def __init__(self, cfg) -> None:
        super().__init__(daemon=True)
        self.t, self.halt = FakeTrainer(cfg), threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.t.step += 1
            self.t.checkpoint("test")

    def __enter__(self) -> Trainer:
        self.start()
        return self

    def __exit__(self, *_) -> None:
        self.halt.set()
        self.join(10)


# -- AReaL's recover checkpoint, rewritten in place ------------------------------------------------------------------
FILES = {"recover_info/dataloader_info.pkl": 256, "default/recover_checkpoint/__0_0.distcp": 1 << 20,
         "default/recover_checkpoint/.metadata": 512}


def content(rel: str, global_step: int) -> bytes:
    """The bytes of `rel` as the save of `global_step` writes them: each save's own."""
    return (hashlib.sha256(f"{rel}:{global_step}".encode()).digest() * (FILES[rel] // 32 + 1))[:FILES[rel]]


class Saver(threading.Thread):
    """AReaL's recover saves one after another, `pause_s` apart, as its trainer and podkit's hook make them: a marker
    in the run dir while the save writes (areal/hooks.py), every file rewritten IN PLACE (the same inodes, as DCP and
    RecoverInfo.dump write them), the step info last, then progress.json's checkpoint_step."""

    def __init__(self, cfg, global_step: int = 1, pause_s: float = 0.03) -> None:
        super().__init__(daemon=True)
        self.cfg, self.g, self.pause_s, self.halt = cfg, global_step, pause_s, threading.Event()
        self.root = identity.save_root(identity.fileroot(cfg), "podkit", "run")
        self.marker = cfg.run_path / f"{records.SAVING_PREFIX}0"
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.save()
        identity.write_record(self.root, remote.mine(cfg))

    def save(self) -> None:
        self.marker.write_text(str(os.getpid()))
        try:
            for rel in FILES:
                (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                with open(self.root / rel, "wb") as f:  # truncated and written again: the same inode
                    f.write(content(rel, self.g))
            (self.root / "recover_info" / "step_info.json").write_text(json.dumps(
                {"epoch": 0, "epoch_step": self.g, "global_step": self.g, "steps_per_epoch": 10 ** 6}))
        finally:
            self.marker.unlink(missing_ok=True)
        records.PROGRESS.write(self.cfg.state_dir, {"kind": "areal", "checkpoint_step": self.g + 1})

    def run(self) -> None:
        while not self.halt.wait(self.pause_s):
            self.g += 1
            self.save()

    def __enter__(self) -> Saver:
        self.start()
        return self

    def __exit__(self, *_) -> None:
        self.halt.set()
        self.join(10)


def one_save(m: dict) -> None:
    """The generation's files are all the bytes of one save, the one its step names (never a mix of two)."""
    g = m["step"] - 1
    for rel in FILES:
        assert m["files"][rel]["sha256"] == hashlib.sha256(content(rel, g)).hexdigest(), (rel, g)
    assert m["files"]["recover_info/step_info.json"]["sha256"] == hashlib.sha256(json.dumps(
        {"epoch": 0, "epoch_step": g, "global_step": g, "steps_per_epoch": 10 ** 6}).encode()).hexdigest()


def upload_within(up: uploader.Uploader, seconds: float) -> int | None:
    """The uploader's looks, one after another, until one uploads (its step) or `seconds` pass (None)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if (step := up.once()) is not None:
            return step
        time.sleep(0.05)
    return None


# -- the tests -------------------------------------------------------------------------------------------------------
def test_a_trainer_saving_every_few_ms_still_gets_a_whole_generation_up_and_restored(pod, server, bucket):
    """The fake trainer saves as fast as it can, keeping 2 (bench/remote.py's restore part): the step the uploader
    looked at is pruned long before rclone reads it. Linked first, it goes up whole, and a new pod on an empty volume
    restores it and resumes at its step. Nothing is left staged."""
    a = pod("a", PODKIT_TRAINER_KEEP_CHECKPOINTS="2")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    with Trainer(a) as trainer:
        test_remote.wait_for(lambda: trainer.t.last_ckpt_step >= 3, 20, what="the trainer's first checkpoints")
        step = up.once()
        assert step is not None, (up.why, said)
        newer = trainer.t.last_ckpt_step
    assert newer > step + 2, "the trainer saved on meanwhile: the step uploaded was pruned from the volume"
    assert not (a.checkpoint_dir / f"step-{step:08d}.pt").exists()
    assert gens(server, bucket) == {step: True} and staged(a) == []
    b = pod("b")
    assert restore.run(b) == step  # its files verified against the manifest
    resumed = FakeTrainer(b)
    resumed.resume()
    assert resumed.step == step


def test_an_areal_checkpoint_rewritten_in_place_during_its_upload_goes_up_as_one_whole_save(pod, server, bucket):
    """AReaL's recover checkpoint rewritten in place every ~30 ms (faster than an upload takes): the uploader copies
    it between two saves and uploads the copy, so the generation is one save's bytes, every file of the same step,
    never a mix; a new pod on an empty volume restores it (the manifest's hashes are what the restore verifies)."""
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    up = uploader.Uploader(a, say=lambda _: None)
    with Saver(a) as saver:
        step = upload_within(up, 20)
        saved = saver.g
    assert step is not None, up.why
    assert saved > step, "saves went on during the upload"
    m = manifest(server, bucket, step)
    one_save(m)
    assert staged(a) == []
    b = pod("b", PODKIT_TRAINER_KIND="areal")
    assert restore.run(b) == step
    root = identity.save_root(identity.fileroot(b), "podkit", "run")
    for rel in FILES:
        assert (root / rel).read_bytes() == content(rel, step - 1)


def test_a_killed_uploaders_staging_is_removed_at_the_next_start_and_a_live_ones_is_not(pod):
    """Staging dirs named by their owner's pid and start time: a dead pid's (a kill mid-upload), and one whose pid
    now names another process (recycled), are removed when the next uploader starts; a live process's is kept. The
    checkpoint a removed staging linked stays whole."""
    a = pod("a")
    test_remote.train_to(a, 3)
    ckpt = a.checkpoint_dir / "step-00000003.pt"
    before = ckpt.read_bytes()
    base = a.state_dir / snapshot.HERE
    gone = subprocess.Popen(["true"])  # ours; its pid is free once it is reaped
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])  # ours, killed below by its pid
    try:
        me = os.getpid()
        dead, recycled = base / f"{gone.pid}-1-0", base / f"{me}-{proc.starttime(me) + 1}-0"
        kept = base / f"{live.pid}-{proc.starttime(live.pid)}-0"
        for d in (dead, recycled, kept):
            d.mkdir(parents=True)
            os.link(ckpt, d / ckpt.name)
        up = uploader.Uploader(a, say=lambda _: None).start()
        up.stopped.set()
        assert not dead.exists() and not recycled.exists()
        assert kept.is_dir() and (kept / ckpt.name).is_file()
        assert ckpt.read_bytes() == before and remote.local(a).step == 3
    finally:
        live.kill()
        live.wait(10)


def test_no_room_for_a_copy_is_said_once_and_fills_nothing(pod, server, bucket, monkeypatch):
    """The volume too full for a copy of AReaL's checkpoint (a copy must leave the trainer's margin): no copy is made
    (nothing staged, the volume not filled), it is said once in words however many looks, and the checkpoint goes up
    from the volume as it is only when no save comes during its upload: while saves come faster, nothing goes up."""
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    full = types.SimpleNamespace(total=100 << 30, used=(100 << 30) - (2 << 30), free=2 << 30)  # 2 of 100 GiB free
    monkeypatch.setattr(shutil, "disk_usage", lambda _: full)
    copied: list[Path] = []
    monkeypatch.setattr(snapshot, "copy_file", lambda src, *_a, **_k: copied.append(src))
    with Saver(a, pause_s=0.01):
        tried, until = set(), time.monotonic() + 40
        while len(tried) < 2 and time.monotonic() < until:  # looks that got past a save in flight, to an upload
            assert up.once() is None
            tried.add(records.REMOTE.read(a.state_dir).get("last", {}).get("time"))
            tried.discard(None)
    assert len(tried) == 2, said
    assert not copied and staged(a) == []
    assert not any(gens(server, bucket).values())
    room = [line for line in said if "no room on the volume for a copy" in line]
    assert len(room) == 1, said
    assert "GB free" in room[0] and "Free space on the volume" in room[0]
    step = up.once()  # the saves over: it goes up whole from the volume's files
    assert step is not None and gens(server, bucket)[step]
    one_save(manifest(server, bucket, step))
    assert len([line for line in said if "no room" in line]) == 1


def test_saves_faster_than_a_copy_are_said_once_and_recorded_each_time(pod, server, bucket, monkeypatch):
    """Each copy for the upload takes longer than the run's saves are apart (a slow copy: a save begins during every
    try): nothing is uploaded, the words that the run saves faster than it can upload are said once however many looks,
    with what to change, and each look's failure is recorded in remote.json with them."""
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    real = snapshot.copy_file

    def slow(src, dst, check=lambda: None):
        time.sleep(0.1)  # several saves apart
        real(src, dst, check)

    monkeypatch.setattr(snapshot, "copy_file", slow)
    failed = 0
    with Saver(a, pause_s=0.02):
        until = time.monotonic() + 30
        while failed < 3 and time.monotonic() < until:
            assert up.once() is None
            failed += FASTER in up.why
    assert failed == 3, up.why
    assert not gens(server, bucket) and staged(a) == []
    words = [line for line in said if FASTER in line]
    assert len(words) == 1, said
    assert "nothing of it goes off the pod" in words[0] and "recover.freq_steps" in words[0]
    last = records.REMOTE.read(a.state_dir)["last"]
    assert last["outcome"] == "failed" and FASTER in last["why"]
    monkeypatch.setattr(snapshot, "copy_file", real)  # copies fast again: it goes up, and a new row is said anew
    assert upload_within(up, 20) is not None
    assert len([line for line in said if FASTER in line]) == 1


def test_where_hard_links_are_refused_the_step_is_copied_for_its_upload(pod, server, bucket, monkeypatch):
    """A filesystem without hard links (link() refused: EPERM, as a FUSE mount or protected_hardlinks says it): the
    fake trainer's step is copied into the staging instead, uploaded whole, and the staging removed."""
    a = pod("a")
    test_remote.train_to(a, 4)

    def refused(*_a, **_k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(snapshot.os, "link", refused)
    copied: list[Path] = []
    real = snapshot.copy_file
    monkeypatch.setattr(snapshot, "copy_file", lambda src, *rest: copied.append(src) or real(src, *rest))
    assert uploader.Uploader(a, say=lambda _: None).once() == 4
    assert [p.name for p in copied] == ["step-00000004.pt"] and staged(a) == []
    assert gens(server, bucket) == {4: True}
