"""Issue 58's adversarial pass, kept: the breaks it found in the run's lineages and the restore's words (a pod back
with its old volume after a start-over elsewhere, a restore alarm that outlived its cause, the "remote ahead" advice,
an upload ending after a start-over, a clock stepped back between two start-overs, a start-over the remote did not
hear of, a skewed clock blamed on the credentials) and the rules its mutants showed no test needed. A real S3 endpoint
(`rclone serve s3`) on 127.0.0.1, fake-trainer and AReaL-shaped checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import test_remote
from test_restore_faults import FAST, uploaded
from test_run_lineage import areal_ckpt, start_over, status, top, whole

import s3server
from podkit import records
from podkit.areal import identity
from podkit.boot import restore
from podkit.remote import mover, remote, runrecord, uploader

pytestmark = pytest.mark.timeout(90)
pod = test_remote.pod
train_to = test_remote.train_to
server, bucket = s3server.fixtures([f"adv58-{i:02d}" for i in range(12)])


def test_a_pod_back_with_its_old_volume_after_a_start_over_elsewhere_sets_the_abandoned_checkpoint_aside(pod, server,
                                                                                                        bucket):
    """Pod a uploaded step 4 and was lost; replacement b restored it, started over and uploaded the new lineage's
    step 2; a comes back with its volume: its boot moves the abandoned step 4 aside (kept) and restores step 2, so
    the start-over is not undone and nothing of the abandoned line goes into the new lineage."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 3)
    assert up.once() == 4
    up.release()
    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) == 4
    assert start_over(b, []) == 0
    up_b = uploader.Uploader(b, say=lambda _: None)
    areal_ckpt(b, 1)
    assert up_b.once() == 2
    up_b.release()
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    assert restore.run(a) == 2
    aside = [p for p in remote.local(a).root.parent.iterdir() if ".set-aside-" in p.name]
    assert len(aside) == 1 and identity.has_checkpoint(aside[0]), "the abandoned step 4 kept beside"
    assert remote.lineage_of(remote.local(a)) == records.REMOTE.read(a.state_dir)["lineage"]["id"]


def test_a_restore_that_gave_up_is_not_shown_once_the_remote_answers_with_nothing_newer(pod, server, bucket,
                                                                                       monkeypatch):
    """The boot's restore gave up (the endpoint down) while the pod held the remote's newest already: once the
    uploader reads the remote, the alarm (status, doctor's restore_failed) is resolved, not shown for ever."""
    a = pod("a", RUNPOD_POD_ID="pod-a", PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="2")
    uploaded(a, 6)
    monkeypatch.setattr(mover, "RETRIES", FAST)
    server.kill()
    try:
        assert restore.run(a) is None
    finally:
        server.start()
    assert records.REMOTE.read(a.state_dir)["restore"]["outcome"] == "failed"
    said: list[str] = []
    assert uploader.Uploader(a, say=said.append).once() is None  # nothing newer to upload, nothing ahead
    assert records.REMOTE.read(a.state_dir)["restore"]["outcome"] == "resolved"
    assert any("the boot's restore lost nothing" in line for line in said), said
    assert "restore gave up" not in status(a)


def test_the_remote_ahead_advice_adopt_makes_this_pods_line_the_runs(pod, server, bucket, monkeypatch):
    """The remote is ahead of this pod (step 6 against its 3): the way on the words give to keep this pod's line,
    `podkit adopt`, begins a new lineage from this pod's checkpoint: it goes up, the remote is no longer ahead, and a
    pod on an empty volume restores it."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 6)
    b = pod("b", RUNPOD_POD_ID="pod-b")
    train_to(b, 3)
    said: list[str] = []
    up = uploader.Uploader(b, say=said.append)
    assert up.once() is None and records.REMOTE.read(b.state_dir)["ahead"]["step"] == 6
    assert any("`podkit adopt`" in line for line in said), said
    assert identity.adopt(b, say=said.append, then=lambda: remote.new_lineage(b, "adopt", say=said.append)) == 0
    assert up.once() == 3, up.why
    assert not records.REMOTE.read(b.state_dir).get("ahead")
    c = pod("c", RUNPOD_POD_ID="pod-c")
    assert restore.run(c) == 3


def test_an_upload_of_the_lineage_left_ending_after_a_start_over_is_not_the_new_lineages_durable_step(tmp_path,
                                                                                                   monkeypatch):
    """remote.json: an upload's outcome stamped with the lineage it went into is dropped when the run is in another
    lineage since (a start-over while that upload ran), so status never says its step is off the pod."""
    import types

    monkeypatch.setattr(remote, "run_id", lambda cfg: "podkit/run")
    cfg = types.SimpleNamespace(state_dir=tmp_path)
    remote.note(cfg, lineage={"id": "", "why": "first", "since": None, "count": 1})
    remote.note(cfg, lineage={"id": "20261129-000000-abcdef", "why": "start-over", "since": None, "count": 2})
    late = {"outcome": "uploaded", "step": 4, "time": time.time(), "lineage": ""}
    remote.note(cfg, last=late, uploaded=late)
    rec = records.REMOTE.read(tmp_path)
    assert "uploaded" not in rec and "last" not in rec, rec
    mine = {**late, "lineage": "20261129-000000-abcdef", "step": 1}
    remote.note(cfg, last=mine, uploaded=mine)
    assert records.REMOTE.read(tmp_path)["uploaded"]["step"] == 1


def test_a_clock_stepped_back_between_two_start_overs_keeps_the_newer_lineage(tmp_path):
    """The second start-over's entry names the lineage it replaced: it is the run's current one although its clock
    stamped it before the first's."""
    mine = identity.record_for(("podkit", "run"), "train.py", "Qwen/X", "")
    book = runrecord.RunRecord(tmp_path, ("podkit", "run"), pod="pod-a")
    first = runrecord.begin(book, mine, "start-over", push_s=0)
    entries = book.entries("lineage")
    assert runrecord.current(entries, mine, tmp_path)["id"] == first["id"]
    second = runrecord.begin(book, mine, "start-over", push_s=0)
    name = next(p for p in (book.dir / "lineage").iterdir() if json.loads(p.read_text())["id"] == second["id"])
    data = json.loads(name.read_text())
    name.write_text(json.dumps({**data, "time": first["time"] - 3600}))  # its clock an hour behind
    assert second["parent"] == first["id"]
    assert runrecord.current(book.entries("lineage"), mine, tmp_path)["id"] == second["id"]


def test_a_skewed_clock_is_said_as_the_clock_not_the_credentials():
    """S3's RequestTimeTooSkewed (a 403) names the pod's clock, not the keys, and a restore tries it again."""
    words = mover.explain("ERROR : operation error S3: ListObjectsV2, https response error StatusCode: 403, "
                          "api error RequestTimeTooSkewed: The difference between the request time and the current "
                          "time is too large.", "s3://b/p")
    assert "clock" in words and "credentials are not at fault" in words
    assert not mover.lasting(words, "s3://b/p")


def test_a_start_over_before_the_remote_was_set_reaches_it_once_it_is(pod, server, bucket, monkeypatch):
    """A start-over on a pod without checkpoint.remote, the remote set later: the lineage entry goes up at the
    first sync, and a pod without the volume restores nothing of the lineage the run left."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 1)
    assert up.once() == 2
    up.release()
    bare = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a", PODKIT_CHECKPOINT_REMOTE="")
    assert start_over(bare, []) == 0
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    areal_ckpt(a, 0)
    assert uploader.Uploader(a, say=lambda _: None).once() == 1
    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) == 1, "the new lineage's, not the abandoned step 2"


def test_nothing_goes_into_a_lineage_the_remote_does_not_know_yet(pod, server, bucket, monkeypatch):
    """A start-over while the endpoint is down, the trainer's next save before it is back: nothing is uploaded into
    the new lineage (no pod without this volume could find it) and the stop claims nothing; once the entry is up,
    the save goes up."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 4)
    assert up.once() == 4
    monkeypatch.setattr(mover, "RETRIES", FAST)
    monkeypatch.setattr(uploader, "PUSH_S", 0.0)
    server.kill()
    try:
        assert start_over(a, []) == 0
        train_to(a, 2)
        assert up.once() is None and "not on the remote yet" in up.why, up.why
        assert "NOT on the remote" in up.final(5, "the pod is stopping")
    finally:
        server.start()
    up.stopped.clear()
    assert up.once() == 2, up.why
    assert restore.run(pod("b", RUNPOD_POD_ID="pod-b")) == 2


def test_refused_credentials_end_the_restore_at_once(pod, server, bucket):
    """A refusal no retry mends (the credentials) is not tried again for checkpoint.restore_timeout_s."""
    uploaded(pod("a", RUNPOD_POD_ID="pod-a"), 3)
    b = pod("b", RUNPOD_POD_ID="pod-b", AWS_SECRET_ACCESS_KEY="wrongsecret-0123456789abcdef",
            PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="60")
    t0 = time.monotonic()
    assert restore.run(b) is None
    assert time.monotonic() - t0 < 20
    assert "refused the credentials" in records.REMOTE.read(b.state_dir)["restore"]["why"]


def test_a_manifest_of_another_lineage_at_the_top_is_not_a_checkpoint_of_the_first(pod, server, bucket):
    """A generation at the names' prefix whose manifest names another lineage (copied there by hand) is not the
    first lineage's checkpoint: skipped, the one before it restored."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    uploaded(a, 3, 5)
    rem = remote.Remote(a.checkpoint.remote, "podkit/run", 20)
    manifest = json.loads((top(server, bucket) / remote.gen(5) / remote.MANIFEST).read_text())
    planted = Path(a.state_dir) / "planted.json"
    planted.write_text(json.dumps({**manifest, "lineage": "20261129-000000-abcdef"}))
    rem.rclone("copyto", str(planted), f"{rem.base}/{remote.gen(5)}/{remote.MANIFEST}")
    assert restore.run(pod("b", RUNPOD_POD_ID="pod-b")) == 3


def test_a_restarted_listener_does_not_upload_again_what_the_lineage_holds_and_a_pruned_step_is_not_claimed(
        pod, server, bucket):
    """What the lineage holds is read at a new uploader's first look: the step there is not uploaded again (its
    manifest untouched); a step pruned since is no longer verified, so the stop does not claim it."""
    a = pod("a", RUNPOD_POD_ID="pod-a", PODKIT_CHECKPOINT_REMOTE_KEEP="1")
    up = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 3)
    assert up.once() == 3
    written = (top(server, bucket) / remote.gen(3) / remote.MANIFEST).stat().st_mtime_ns
    up.release()
    fresh = uploader.Uploader(a, say=lambda _: None)
    assert fresh.once() is None and 3 in fresh.verified
    assert (top(server, bucket) / remote.gen(3) / remote.MANIFEST).stat().st_mtime_ns == written
    train_to(a, 4)
    assert fresh.once() == 4 and fresh.verified == {4}, fresh.verified  # keep 1: step 3 pruned
    assert whole(top(server, bucket)) == [4]


def test_a_full_volume_under_the_records_mirror_is_said_as_the_volume_not_the_remote(pod, server, bucket,
                                                                                    monkeypatch):
    """rclone's "no space left on device" while it mirrors the run's record is this pod's volume: said as such,
    never "the remote is full"."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    uploaded(a, 2)
    book = remote.book(pod("b", RUNPOD_POD_ID="pod-b"))
    monkeypatch.setattr(runrecord, "_full", lambda path: True)
    monkeypatch.setattr(book.remote, "rclone", lambda *a, **k: (_ for _ in ()).throw(
        mover.RemoteError(mover.explain("Failed to copy: write /x: no space left on device", book.remote.url))))
    assert not book.pull()
    assert "this pod's volume is full" in book.problem and "full or over its quota" not in book.problem
