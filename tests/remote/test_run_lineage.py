"""The run is one thing, wherever it runs (issue 58 items 1-5): its lineage (`podkit start-over`, `podkit adopt`)
is kept in the run's record on the remote, so no pod restores or extends a lineage the run left; the stop claims only
a step it verified on the remote; another run under the same names and prefix is another run, blocking nothing; the
names AReaL resolved are the ones uploaded under. A real S3 endpoint (`rclone serve s3`, tests/s3server.py) on
127.0.0.1, real fake-trainer checkpoints and AReaL's recover checkpoint as it lays it out. The restore's faults (an
endpoint down, hung, pruning under a download) are in tests/remote/test_restore_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import test_remote

import s3server
from conftest import PODKIT
from podkit import records
from podkit.areal import identity
from podkit.boot import restore
from podkit.remote import mover, remote, runrecord, uploader
from s3server import Server

pytestmark = pytest.mark.timeout(90)
pod = test_remote.pod  # the fixture, served by this module's own server and bucket
train_to = test_remote.train_to
BUCKETS = [f"lineage-{i:02d}" for i in range(16)]

server, bucket = s3server.fixtures(BUCKETS)  # one server for the module, a bucket a test


def areal_ckpt(cfg, global_step: int, record: dict | None = None, shards: int = 1, size: int = 4096,
               names: tuple[str, str] = ("podkit", "run")) -> Path:
    """AReaL's recover checkpoint of `global_step` (step global_step + 1, as progress counts) under `names`, laid
    out as RecoverInfo.dump and DCP's save lay it out, `shards` files of `size` random bytes; progress.json says it
    is whole (checkpoint_step), as the trainer writes it."""
    progress = records.PROGRESS.read(cfg.state_dir)
    records.PROGRESS.write(cfg.state_dir, {**progress, "kind": "areal", "run": "/".join(names)})  # the names first
    root = identity.save_root(identity.fileroot(cfg), *names)
    (root / "recover_info").mkdir(parents=True, exist_ok=True)
    (root / "recover_info" / "step_info.json").write_text(json.dumps(
        {"epoch": 0, "epoch_step": global_step, "global_step": global_step, "steps_per_epoch": 100}))
    (root / "recover_info" / "dataloader_info.pkl").write_bytes(os.urandom(256))
    shard_dir = root / "default" / "recover_checkpoint"
    shard_dir.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        (shard_dir / f"__{i}_0.distcp").write_bytes(os.urandom(size) + bytes([global_step % 256]))
    (shard_dir / ".metadata").write_bytes(os.urandom(512))
    identity.write_record(root, record if record is not None else remote.mine(cfg))
    records.PROGRESS.write(cfg.state_dir, {**records.PROGRESS.read(cfg.state_dir), "checkpoint_step": global_step + 1})
    return root


def top(server: Server, bucket: str) -> Path:
    """The names' prefix on the server's own disk: the first lineage's generations, run/, lineages/."""
    return server.root / bucket / "runs" / "podkit" / "run"


def whole(where: Path) -> list[int]:
    """The steps of the generations with a manifest under `where` on the server's disk, newest first."""
    return sorted((int(p.parent.name[4:]) for p in where.glob("gen-*/manifest.json")), reverse=True)


def status(cfg) -> str:
    """`podkit status` of the pod's workspace, as the user runs it."""
    r = subprocess.run([*PODKIT, "status", "--workspace", str(cfg.workspace_path)], capture_output=True, text=True,
                       env={**os.environ, "PODKIT_WORKSPACE": str(cfg.workspace_path)}, timeout=60)
    return r.stdout + r.stderr


def as_pod(monkeypatch, name: str) -> None:
    """The process is pod `name` from now on (RunPod's pod id: what the lease and the run's record name it by)."""
    monkeypatch.setenv("RUNPOD_POD_ID", f"pod-{name}")


def start_over(cfg, said: list[str]) -> int:
    """`podkit start-over` as the CLI runs it (cli._start_over): the volume's part, then the run's new lineage."""
    return identity.start_over(cfg, say=said.append, then=lambda: remote.new_lineage(cfg, "start-over",
                                                                                       say=said.append))


# -- 1. start-over is not undone by the remote ---------------------------------------------------------------------
def test_start_over_is_not_undone_by_the_remote(pod, server, bucket, monkeypatch):
    """After start-over a pod on an empty volume trains from 0, the abandoned lineage's generations stay on the remote,
    the uploader already running moves to the new lineage at its next look (step 2 goes up, not skipped as older than
    the abandoned 4), a new uploader uploads into it too, and remote.json counts two lineages."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    for gs in (2, 3):
        areal_ckpt(a, gs)
        assert up.once() == gs + 1
    assert whole(top(server, bucket)) == [4, 3]
    assert start_over(a, said) == 0
    assert remote.local(a).step is None
    note = records.REMOTE.read(a.state_dir)
    lineage = note["lineage"]
    assert lineage["id"] and lineage["why"] == "start-over" and lineage["count"] == 2, note
    assert "uploaded" not in note, "the abandoned lineage's step 4 is not this lineage's durable step"
    shown = status(a)
    assert f"lineage {lineage['id']} of 2" in shown and "step 4 is off the pod" not in shown, shown
    assert any("begin a new lineage" in line for line in said), said

    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) is None
    assert remote.local(b).step is None and not identity.has_checkpoint(remote.local(b).root)
    seen = records.REMOTE.read(b.state_dir)["lineage"]
    assert seen["id"] == lineage["id"] and seen["count"] == 2, seen

    as_pod(monkeypatch, "a")
    areal_ckpt(a, 1)  # the run trained from 0 again: step 2
    assert up.once() == 2, up.why
    new = top(server, bucket) / "lineages" / lineage["id"]
    assert whole(new) == [2] and whole(top(server, bucket)) == [4, 3], "the abandoned lineage kept, untouched"
    assert any("began a new lineage" in line for line in said), said
    up.release()
    areal_ckpt(a, 2)
    fresh = uploader.Uploader(a, say=said.append)
    assert fresh.once() == 3, fresh.why
    assert whole(new) == [3, 2]
    assert records.REMOTE.read(a.state_dir)["lineage"]["count"] == 2
    assert "step 3, is on the remote" in fresh.final(20, "the pod is stopping")
    fresh.release()

    c = pod("c", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-c")
    assert restore.run(c) == 3, "the new lineage's newest, never the abandoned 4"


def test_a_replacement_with_the_same_pod_name_on_an_empty_volume_sees_the_start_over(pod, server, bucket, monkeypatch):
    """A pod with the same name (a local box's hostname, a RunPod pod restarted onto an empty volume) reads the run's
    record whole: the start-over it wrote itself is the run's, so it restores nothing of the abandoned lineage."""
    monkeypatch.delenv("RUNPOD_POD_ID", raising=False)
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 3)
    assert up.once() == 4
    assert start_over(a, []) == 0
    b = pod("b", PODKIT_TRAINER_KIND="areal")
    assert restore.run(b) is None, "the abandoned lineage's step 4 restored"
    assert remote.local(b).step is None


def test_adopt_begins_a_new_lineage_too(pod, server, bucket, monkeypatch):
    """`podkit adopt` through the CLI (the checkpoint under the run's names is this run's) begins a new lineage: a pod on
    an empty volume restores nothing of the lineage the run left, and the adopted checkpoint goes up into the new one."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 5)
    assert up.once() == 6
    other = identity.record_for(("podkit", "run"), "old_name.py", "Qwen/X", "https://example.invalid/old/r")
    areal_ckpt(a, 1, record=other)  # step 2, recorded as another run's: the user knows it is this run's
    r = subprocess.run([*PODKIT, "adopt", "--workspace", str(a.workspace_path)], capture_output=True, text=True,
                       env={**os.environ, "PODKIT_WORKSPACE": str(a.workspace_path)}, timeout=60)  # as the user runs it
    assert r.returncode == 0 and "begin a new lineage" in r.stdout, r.stdout + r.stderr
    lineage = records.REMOTE.read(a.state_dir)["lineage"]
    assert lineage["why"] == "adopt" and lineage["id"]
    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) is None, "the lineage the run left (step 6) restored"
    as_pod(monkeypatch, "a")
    areal_ckpt(a, 2)  # the trainer resumed the adopted checkpoint, wrote its own record, saved step 3
    assert up.once() == 3, up.why
    assert whole(top(server, bucket) / "lineages" / lineage["id"]) == [3]
    assert whole(top(server, bucket)) == [6], "the lineage the run left is kept as it was"


def test_an_adopted_checkpoint_goes_up_into_the_new_lineage_before_the_trainer_saves_again(pod, server, bucket,
                                                                                             monkeypatch):
    """The pod stops right after `podkit adopt`, before the trainer has written its own record: the stop uploads the
    adopted checkpoint into the run's new lineage (it is this run's, the user said so), and a fresh uploader does
    not take it for another run's."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 5)
    assert up.once() == 6
    other = identity.record_for(("podkit", "run"), "old_name.py", "Qwen/X", "https://example.invalid/old/r")
    areal_ckpt(a, 1, record=other)
    assert identity.adopt(a, say=lambda _: None, then=lambda: remote.new_lineage(a, "adopt", say=lambda _: None)) == 0
    lineage = records.REMOTE.read(a.state_dir)["lineage"]["id"]
    said: list[str] = []
    fresh = uploader.Uploader(a, say=said.append)
    fresh.once()
    assert not any("another run (" in line for line in said), said
    words = up.final(20, "the pod is stopping")
    assert "step 2, is on the remote" in words and lineage in words, words


# -- 2. start-over while the remote is down ------------------------------------------------------------------------
def test_start_over_while_the_remote_is_down_is_said_and_pushed_once_it_is_back(pod, server, bucket, monkeypatch):
    """The endpoint down at start-over: said ("NOT yet on the remote"); the listener's running uploader puts the entry
    up at its next look once the endpoint is back (and uploader.PUSH_S has passed), and a pod on an empty volume then
    restores nothing of the abandoned lineage."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 3)
    assert up.once() == 4
    monkeypatch.setattr(mover, "RETRIES", ("--retries", "1", "--low-level-retries", "1"))  # dead: said at once
    server.kill()
    said: list[str] = []
    try:
        t0 = time.monotonic()
        assert start_over(a, said) == 0
        assert time.monotonic() - t0 < 40
    finally:
        server.start()
    assert any("NOT yet on the remote" in line for line in said), said
    monkeypatch.setattr(uploader, "PUSH_S", 0.5, raising=False)  # how often missed entries are tried again (30 s)
    time.sleep(0.6)
    up.once()  # the listener's next look, the endpoint back (nothing to upload: the trainer has not saved)
    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) is None, "the abandoned lineage's step 4 restored"


def test_start_over_while_the_remote_is_down_is_pushed_by_a_new_listener(pod, server, bucket, monkeypatch):
    """The same, the pod restarted meanwhile: the listener's first look pushes the entry written while the endpoint
    was down."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    areal_ckpt(a, 3)
    assert uploader.Uploader(a, say=lambda _: None).once() == 4
    monkeypatch.setattr(mover, "RETRIES", ("--retries", "1", "--low-level-retries", "1"))
    server.kill()
    said: list[str] = []
    try:
        assert start_over(a, said) == 0
    finally:
        server.start()
    assert any("NOT yet on the remote" in line for line in said), said
    uploader.Uploader(a, say=lambda _: None).once()
    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) is None, "the abandoned lineage's step 4 restored"


# -- 4. the stop claims only what it verified ----------------------------------------------------------------------
def test_the_stop_claims_only_a_step_it_verified_on_the_remote(pod, server, bucket, monkeypatch):
    """The remote holds 145, 180 and 200 of the lineage (another pod's, its lease released); this pod's volume has
    77: the stop says step 77 is NOT on the remote and names 200 as the lineage's newest."""
    c = pod("c", RUNPOD_POD_ID="pod-c")
    up_c = uploader.Uploader(c, say=lambda _: None)
    for step in (145, 180, 200):
        train_to(c, step)
        assert up_c.once() == step
    up_c.release()
    as_pod(monkeypatch, "a")
    a = pod("a", RUNPOD_POD_ID="pod-a")
    train_to(a, 77)
    said: list[str] = []
    words = uploader.Uploader(a, say=said.append).final(20, "the pod is stopping")
    assert "step 77, is NOT on the remote" in words and "step 200" in words, words
    assert "gen-00000077" not in words and "is on the remote (" not in " ".join(said), said
    final = records.REMOTE.read(a.state_dir)["final"]
    assert final["outcome"] == "failed" and final["step"] == 77 and not final.get("where"), final
    assert not (top(server, bucket) / remote.gen(77)).exists()


# -- 8. two runs under the same names and prefix -------------------------------------------------------------------
def test_two_runs_under_the_same_names_and_prefix_neither_blocks_the_other(pod, server, bucket, monkeypatch):
    """Two runs with other models under podkit's default names and one prefix, both looking before either uploads:
    the second is told once that another run (its model named) uses the prefix, neither is ever blocked by the other's
    lease, and a pod of each on an empty volume restores only its own run's newest."""
    x = pod("x", RUNPOD_POD_ID="pod-x", PODKIT_INFERENCE_MODEL="someone/model-x")
    said_x: list[str] = []
    up_x = uploader.Uploader(x, say=said_x.append)
    assert up_x.once() is None  # bound: nothing saved yet
    y = pod("y", RUNPOD_POD_ID="pod-y", PODKIT_INFERENCE_MODEL="someone/model-y")
    said_y: list[str] = []
    up_y = uploader.Uploader(y, say=said_y.append)
    assert up_y.once() is None
    train_to(x, 3)
    assert up_x.once() == 3
    train_to(y, 5)
    for _ in range(3):  # the first look parts from x's run, the next upload
        if up_y.once() == 5:
            break
    assert list(top(server, bucket).rglob(f"{remote.gen(5)}/{remote.MANIFEST}")), (up_y.why, said_y)
    train_to(x, 6)
    assert up_x.once() == 6
    train_to(y, 7)
    assert up_y.once() == 7
    for said in (said_x, said_y):
        assert not any("another pod holds this run's lease" in line or "stop that pod" in line for line in said), said
    told = [line for line in said_y if "another run (model someone/model-x" in line]
    assert len(told) == 1 and "uses this" in told[0] and "prefix" in told[0], said_y
    assert not any("another run (" in line for line in said_x), said_x
    assert up_x.remote.lineage == "" and whole(top(server, bucket)) == [6, 3]
    assert whole(top(server, bucket) / "lineages" / up_y.remote.lineage) == [7, 5]
    up_x.release()
    up_y.release()

    x2 = pod("x2", RUNPOD_POD_ID="pod-x2", PODKIT_INFERENCE_MODEL="someone/model-x")
    assert restore.run(x2) == 6
    y2 = pod("y2", RUNPOD_POD_ID="pod-y2", PODKIT_INFERENCE_MODEL="someone/model-y")
    assert restore.run(y2) == 7


def test_a_second_run_under_the_same_names_after_the_first_uploaded_takes_a_lineage_of_its_own(pod, server, bucket,
                                                                                               monkeypatch):
    """The first run uploaded before the second ever looked: the second's first look tells it once that another run
    uses its names and prefix, uploads into a lineage of its own, and neither run's restore takes the other's."""
    x = pod("x", RUNPOD_POD_ID="pod-x", PODKIT_INFERENCE_MODEL="someone/model-x")
    up_x = uploader.Uploader(x, say=lambda _: None)
    train_to(x, 4)
    assert up_x.once() == 4
    y = pod("y", RUNPOD_POD_ID="pod-y", PODKIT_INFERENCE_MODEL="someone/model-y")
    said_y: list[str] = []
    up_y = uploader.Uploader(y, say=said_y.append)
    train_to(y, 2)
    assert up_y.once() == 2, up_y.why
    train_to(y, 3)
    assert up_y.once() == 3
    as_pod(monkeypatch, "x")
    train_to(x, 5)
    assert up_x.once() == 5
    assert len([line for line in said_y if "another run (model someone/model-x" in line]) == 1, said_y
    assert whole(top(server, bucket)) == [5, 4]
    up_x.release()
    up_y.release()
    assert restore.run(pod("x2", RUNPOD_POD_ID="pod-x2", PODKIT_INFERENCE_MODEL="someone/model-x")) == 5
    assert restore.run(pod("y2", RUNPOD_POD_ID="pod-y2", PODKIT_INFERENCE_MODEL="someone/model-y")) == 3


# -- 9. names only AReaL can tell ----------------------------------------------------------------------------------
def areal_names_pod(pod, tmp_path, name: str, **env):
    """A pod whose AReaL YAML names the trial by an interpolation only AReaL's loader resolves."""
    yaml = tmp_path / "areal.yaml"
    yaml.write_text("experiment_name: podkit\ntrial_name: ${oc.env:TRIAL,run}\n")
    cfg = pod(name, PODKIT_TRAINER_KIND="areal", PODKIT_TRAINER_AREAL_CONFIG=str(yaml), **env)
    assert not identity.names(cfg).known
    return cfg


def test_names_only_areal_can_tell_are_uploaded_under_once_the_trainer_says_them(pod, server, bucket, tmp_path):
    """`trial_name: ${oc.env:TRIAL,run}`: nothing goes up while the names are unknown; once the trainer's progress
    names the run (podkit/run), the uploader uploads under those names and the stop uploads the last checkpoint."""
    a = areal_names_pod(pod, tmp_path, "a", RUNPOD_POD_ID="pod-a")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    assert up.once() is None and "names are not known yet" in up.why, up.why
    areal_ckpt(a, 3)  # the trainer started: progress.json's run is podkit/run
    assert records.PROGRESS.read(a.state_dir)["run"] == "podkit/run"
    assert up.once() == 4, up.why
    assert whole(top(server, bucket)) == [4]
    areal_ckpt(a, 6)
    words = up.final(20, "the pod is stopping")
    assert "the last checkpoint, step 7, is on the remote" in words and "gen-00000007" in words, words
    assert whole(top(server, bucket)) == [7, 4] or whole(top(server, bucket))[0] == 7


def test_names_only_areal_can_tell_are_not_counted_durable_without_a_volume(pod, server, bucket, tmp_path, capsys):
    """Preflight on RunPod without a network volume: with names only AReaL can tell, the remote is not counted as
    durable (a pod without this volume cannot find the run there); with the names set it is."""
    from podkit.boot import preflight

    a = areal_names_pod(pod, tmp_path, "a")
    preflight.pod_facts(a, {"RUNPOD_POD_ID": "pod-a"})
    said = capsys.readouterr().out
    assert "does not count as durable" in said and "a remote counts as durable" not in said, said
    named = pod("b", PODKIT_TRAINER_KIND="areal", PODKIT_TRAINER_TRIAL="run",
                PODKIT_TRAINER_AREAL_CONFIG=a.trainer.areal_config)
    preflight.pod_facts(named, {"RUNPOD_POD_ID": "pod-b"})
    assert "a remote counts as durable" in capsys.readouterr().out


# -- 10. the run's record is data, not truth -------------------------------------------------------------------------
def plant(cfg, objects: dict[str, bytes]) -> None:
    """Objects written into the run's record on the remote (run/<name>), through the server (its directory cache)."""
    here = cfg.state_dir / "planted"
    for name, data in objects.items():
        (here / name).parent.mkdir(parents=True, exist_ok=True)
        (here / name).write_bytes(data)
    rem = remote.Remote(cfg.checkpoint.remote, "podkit/run", 20)
    rem.rclone("copy", str(here), f"{rem.root}/run/")


def test_planted_garbage_huge_future_and_foreign_lineage_entries_change_nothing(pod, server, bucket, monkeypatch):
    """The run's record holds objects podkit never wrote (not JSON, not an object, too big, nested past any parser,
    dated in the future, named in the future to crowd out the real ones, another run's lineage, malformed ones of this
    run): a new pod's restore and uploader keep the run's current lineage, remote.json stays readable, nothing
    crashes."""
    a = pod("a", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    areal_ckpt(a, 3)
    assert up.once() == 4
    assert start_over(a, []) == 0
    lineage = records.REMOTE.read(a.state_dir)["lineage"]["id"]
    areal_ckpt(a, 1)
    assert up.once() == 2
    up.release()

    ours = remote.mine(a)
    other = {**ours, "model": {**ours["model"], "path": "someone/else-7b", "id": "someone/else-7b"}}
    now, ns = time.time(), time.time_ns()

    def entry(**fields) -> bytes:
        return json.dumps({"kind": "lineage", "id": runrecord.new_id(), "why": "start-over", "identity": ours,
                           "time": now, "pod": "evil", "run": "", "names": ["podkit", "run"], **fields}).encode()
    objects = {
        f"lineage/{ns}-garbage.json": b"not json {",
        f"lineage/{ns + 1}-list.json": b"[1, 2, 3]",
        f"lineage/{ns + 2}-nested.json": b"[" * 30000 + b"]" * 30000,
        f"lineage/{ns + 3}-huge.json": entry(pad="x" * (100 << 10)),
        f"lineage/{ns + 4}-future.json": entry(time=now + 30 * 86400),
        f"lineage/{ns + 5}-other.json": entry(identity=other),
        f"lineage/{ns + 6}-badid.json": entry(id="../../x"),
        f"lineage/{ns + 7}-nowhy.json": entry(why=None) .replace(b'"why": null, ', b""),
        f"lineage/{ns + 8}-oddwhy.json": entry(why=5),
        f"lineage/{ns + 9}-nan.json": entry(time=float("nan")),
        f"lineage/{ns + 10}-booltime.json": entry(time=True),
        f"lineage/{ns + 11}-noidentity.json": entry(identity={"names": "podkit/run"}),
        f"lineage/{ns + 12}-utf.json": b"\xff\xfe\x00garbage",
        **{f"lineage/99999999999999999999-flood{i:03d}.json": b"{}" for i in range(300)},
    }
    plant(a, objects)

    b = pod("b", PODKIT_TRAINER_KIND="areal", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) == 2, "the run's current lineage's newest, never the abandoned 4, nor another lineage"
    note = records.REMOTE.read(b.state_dir)
    assert note.get("lineage", {}).get("id") == lineage, note  # readable, and the lineage kept
    up_b = uploader.Uploader(b, say=lambda _: None)
    areal_ckpt(b, 2)
    assert up_b.once() == 3 and up_b.remote.lineage == lineage, up_b.why
    as_pod(monkeypatch, "a")
    assert runrecord.current(runrecord.RunRecord(a.state_dir, ("podkit", "run")).entries("lineage"), ours,
                             Path("/nonexistent"))["id"] == lineage



def test_start_over_of_the_fake_trainer_sets_its_checkpoints_aside_and_nothing_of_them_goes_up_again(pod, server,
                                                                                                      bucket):
    """The smoke stack's trainer keeps its checkpoints in checkpoint_dir: start-over moves that aside (kept), so the
    uploader's next look does not put the abandoned step into the new lineage, and a replacement restores nothing."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 4)
    assert up.once() == 4
    said: list[str] = []
    assert start_over(a, said) == 0
    aside = [p for p in a.checkpoint_dir.parent.iterdir() if p.name.startswith(f"{a.checkpoint_dir.name}.set-aside-")]
    assert len(aside) == 1 and (aside[0] / "step-00000004.pt").is_file(), said
    assert up.once() is None and not list((top(server, bucket) / "lineages").glob("*/gen-*"))
    assert whole(top(server, bucket)) == [4]  # the lineage it left, kept
    b = pod("b", RUNPOD_POD_ID="pod-b")
    assert restore.run(b) is None
