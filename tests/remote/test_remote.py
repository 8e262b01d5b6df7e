"""The checkpoint remote (remote.py, restore.py) against a real S3 endpoint: `rclone serve s3` on 127.0.0.1 over a
temp dir, one per module, driven by the real rclone podkit ships. A checkpoint goes off the pod whole or not at all,
and comes back onto an empty volume only whole, verified, and only into its own run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, wait_for
from podkit import config, records
from podkit.boot import restore
from podkit.programs.fake_trainer import FakeTrainer
from podkit.remote import mover, remote, uploader
from s3server import SECRET, Server

pytestmark = pytest.mark.timeout(60)

BUCKETS = 20  # one per test that asks for one (the `bucket` fixture)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("s3"), [f"bucket-{i:02d}" for i in range(BUCKETS)]).start()
    yield s
    s.kill()


_handed = iter(range(BUCKETS))


@pytest.fixture
def bucket(server) -> str:
    """A bucket of this test's own."""
    return f"bucket-{next(_handed):02d}"


def env_for(server: Server, workspace: Path, bucket: str, secret: str = SECRET, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODKIT_", "AWS_", "RCLONE_"))}
    env.update({"PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"), "PODKIT_WORKSPACE": str(workspace),
                **server.env(bucket, secret=secret),
                "PODKIT_CHECKPOINT_REMOTE_TIMEOUT_S": "20",  # a hang fails the test, not its timeout
                "PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S": "6", **extra})  # a restore gives up within the test's
    return env


@pytest.fixture
def pod(server, bucket, tmp_path, monkeypatch):
    """A pod of the smoke config with the remote on: pod(name, **env) -> its config (the env is the process's)."""
    def make(name: str, **extra: str):
        env = env_for(server, tmp_path / name, bucket, **extra)
        for k in [k for k in os.environ if k.startswith(("AWS_", "RCLONE_"))]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cfg = config.load(environ=env)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        return cfg
    return make


def train_to(cfg, step: int) -> FakeTrainer:
    """The fake trainer's own checkpoint of `step`, written as it writes it (progress.json's checkpoint_step)."""
    t = FakeTrainer(cfg)
    t.step = step
    t.checkpoint("test")
    return t


def gen_dir(server: Server, bucket: str, step: int) -> Path:
    return server.root / bucket / "runs" / "podkit" / "run" / remote.gen(step)


def test_upload_then_restore_onto_an_empty_workspace_resumes_at_that_step(pod, server, bucket, capsys):
    """A fake trainer's checkpoint of step 7 is uploaded by the uploader as one generation, manifest last; a new pod
    on an empty volume restores it at boot and the trainer resumes at step 7 with the same weights."""
    a = pod("a")
    trained = train_to(a, 7)
    up = uploader.Uploader(a, say=lambda _: None)
    assert up.once() == 7
    manifest = json.loads((gen_dir(server, bucket, 7) / remote.MANIFEST).read_text())
    assert manifest["step"] == 7 and list(manifest["files"]) == ["step-00000007.pt"]
    assert manifest["identity"]["names"] == ["podkit", "run"]
    assert records.REMOTE.read(a.state_dir)["uploaded"]["step"] == 7
    assert up.once() is None  # nothing new: nothing uploaded again

    b = pod("b")
    assert restore.run(b) == 7
    assert not [p for p in b.workspace_path.iterdir() if ".restore-" in p.name]  # the temp renamed away
    resumed = FakeTrainer(b)
    resumed.resume()
    assert resumed.step == 7
    for k, v in trained.model.state_dict().items():
        assert np.array_equal(resumed.model.state_dict()[k], v)
    assert restore.run(b) is None  # the volume has it now: nothing to restore


def test_a_generation_without_its_manifest_is_not_a_checkpoint(pod, server, bucket, capsys):
    """An upload cut before its manifest (gen 9's files, no manifest) is skipped: the restore takes gen 4."""
    a = pod("a")
    train_to(a, 4)
    assert uploader.Uploader(a).once() == 4
    train_to(a, 9)
    cut = remote.Remote(a.checkpoint.remote, "podkit/run")  # gen 9's files, as an upload cut before its manifest
    cut.rclone("copy", str(a.checkpoint_dir / "step-00000009.pt"), f"{cut.base}/{remote.gen(9)}")
    b = pod("b")
    assert restore.run(b) == 4
    said = capsys.readouterr().out
    assert "gen-00000009 has no manifest" in said
    assert not (b.checkpoint_dir / "step-00000009.pt").exists()


def test_a_corrupted_object_is_refused_by_its_checksum(pod, server, bucket, capsys):
    """Bytes flipped in a stored checkpoint (same size): the restore refuses it and leaves no file of it behind;
    the older whole generation is restored instead."""
    a = pod("a")
    train_to(a, 3)
    up = uploader.Uploader(a)
    assert up.once() == 3
    train_to(a, 6)
    assert up.once() == 6
    obj = gen_dir(server, bucket, 6) / "step-00000006.pt"
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    b = pod("b")
    assert restore.run(b) == 3
    said = capsys.readouterr().out
    assert "gen-00000006 refused" in said
    assert sorted(p.name for p in b.checkpoint_dir.iterdir() if p.name != remote.LINEAGE_MARK) == ["latest", "step-00000003.pt"]
    assert records.REMOTE.read(b.state_dir)["restore"]["step"] == 3


def test_wrong_credentials_are_named_and_the_boot_goes_on(pod, capsys):
    """A refused secret key: the uploader records it in words, the restore stage says it and returns (no raise:
    the boot goes on without a restore), and the secret is in neither."""
    a = pod("a", AWS_SECRET_ACCESS_KEY="wrongsecret-hunter2-0123456789")
    train_to(a, 2)
    assert uploader.Uploader(a, say=lambda _: None).once() is None
    why = records.REMOTE.read(a.state_dir)["last"]["why"]
    assert "refused the credentials" in why
    assert restore.run(pod("b", AWS_SECRET_ACCESS_KEY="wrongsecret-hunter2-0123456789")) is None
    said = capsys.readouterr().out
    assert "refused the credentials" in said
    assert "hunter2" not in said + why + records.REMOTE.path(a.state_dir).read_text()


def test_a_missing_bucket_is_named(server, tmp_path, monkeypatch, capsys):
    """checkpoint.remote naming a bucket the endpoint does not have: said as such, the boot goes on."""
    env = env_for(server, tmp_path / "a", "no-such-bucket")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = config.load(environ=env)
    assert restore.run(cfg) is None
    said = capsys.readouterr().out
    assert "does not exist" in said and "bucket" in said


def test_another_runs_generation_is_never_restored(pod, server, bucket, capsys):
    """Another run (another model) uploaded under this run's names and prefix: this run restores nothing of it,
    is told that another run (its model named) uses the prefix and how to part them, and keeps a lineage of its
    own; the volume stays empty."""
    a = pod("a", PODKIT_INFERENCE_MODEL="someone/else-7b")
    train_to(a, 5)
    assert uploader.Uploader(a).once() == 5
    b = pod("b")
    assert restore.run(b) is None
    said = capsys.readouterr().out
    assert "another run (model someone/else-7b" in said and "a lineage of their own" in said
    assert "trainer.trial" in said
    assert not b.checkpoint_dir.exists() or not any(b.checkpoint_dir.iterdir())
    assert records.REMOTE.read(b.state_dir)["lineage"]["id"] != ""


def test_a_planted_generation_of_another_run_in_this_runs_lineage_is_refused(pod, server, bucket, capsys):
    """A generation whose manifest names another run's identity, copied into this run's own lineage by hand, is
    refused by its identity, with the ways on."""
    a = pod("a", PODKIT_INFERENCE_MODEL="someone/else-7b")
    train_to(a, 5)
    assert uploader.Uploader(a).once() == 5
    b = pod("b")
    restore.run(b)  # b's own lineage (a holds the first)
    lineage = records.REMOTE.read(b.state_dir)["lineage"]["id"]
    top = remote.Remote(b.checkpoint.remote, "podkit/run", 20)
    mine = top.of_lineage(lineage)
    top.rclone("copy", f"{top.base}/{remote.gen(5)}", f"{mine.base}/{remote.gen(5)}")  # through the server: its cache
    manifest = json.loads((gen_dir(server, bucket, 5) / remote.MANIFEST).read_text())
    planted = b.state_dir / "planted.json"
    planted.write_text(json.dumps({**manifest, "lineage": lineage}))
    top.rclone("copyto", str(planted), f"{mine.base}/{remote.gen(5)}/{remote.MANIFEST}")
    capsys.readouterr()
    assert restore.run(b) is None
    said = capsys.readouterr().out
    assert "another run's checkpoint" in said and "its model is someone/else-7b" in said


def test_another_runs_generations_under_the_same_names_are_never_pruned_nor_skip_this_runs_uploads(pod, server,
                                                                                                    bucket):
    """Another run (another model) left generations 5 and 6 under this run's names: this run's uploads from step 1
    were skipped as "already there" until it passed step 6, and its pruning removed the other run's; now this run
    keeps a lineage of its own beside the other's, and neither touches the other's generations."""
    other = pod("other", PODKIT_INFERENCE_MODEL="someone/else-7b")
    up_other = uploader.Uploader(other, say=lambda _: None)
    for step in (5, 6):
        train_to(other, step)
        assert up_other.once() == step
    a = pod("a", PODKIT_CHECKPOINT_REMOTE_KEEP="2")
    up = uploader.Uploader(a, say=lambda _: None)
    for step in (1, 2, 3, 4):
        train_to(a, step)
        assert up.once() == step, step
    assert up.remote.lineage != "" and up.remote.whole() == [4, 3], "keep 2 of this run's, in its own lineage"
    assert up.remote.of_lineage("").whole() == [6, 5], "the other run's kept, in the first lineage"


def test_a_malformed_remote_is_a_config_error(tmp_path):
    """checkpoint.remote that is no remote at all: a config error naming the key (safe mode at boot)."""
    from podkit.errors import ConfigError

    cfg = config.load(environ={"PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"),
                               "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_CHECKPOINT_REMOTE": "/just/a/path"})
    with pytest.raises(ConfigError) as e:
        restore.run(cfg)
    assert "checkpoint.remote" in str(e.value) and e.value.hint


def test_server_killed_mid_upload_leaves_the_previous_generation_the_newest(pod, server, bucket, monkeypatch):
    """The endpoint dies while gen 8 is uploading (its bandwidth held low): the upload fails without a manifest, and
    once the endpoint is back a restore takes gen 2, the newest whole one."""
    a = pod("a")
    train_to(a, 2)
    assert uploader.Uploader(a).once() == 2
    t = train_to(a, 8)
    big = a.checkpoint_dir / "step-00000008.pt"
    t.codec.save({"step": 8, "model": t.model.state_dict(), "optim": t.opt.state_dict(),
                  "pad": np.zeros(1 << 20, np.float32)}, big)  # 4 MB at 256 KiB/s: 16 s to upload
    monkeypatch.setenv("RCLONE_BWLIMIT", "256k")
    monkeypatch.setattr(mover, "RETRIES", ("--retries", "1", "--low-level-retries", "1"))  # dead: said at once
    up = uploader.Uploader(a, say=lambda _: None)
    killer = subprocess.Popen(["sh", "-c", f"sleep 2; kill -9 {server.proc.pid}"])  # ours, by pid
    try:
        t0 = time.monotonic()
        assert up.once() is None
        assert time.monotonic() - t0 < 40
    finally:
        killer.wait(10)
        monkeypatch.delenv("RCLONE_BWLIMIT")
        server.proc.wait(10)
        server.start()
    assert not (gen_dir(server, bucket, 8) / remote.MANIFEST).exists()
    last = records.REMOTE.read(a.state_dir)["last"]
    assert last["outcome"] == "failed" and ("does not answer" in last["why"] or "broke" in last["why"])
    assert restore.run(pod("b")) == 2


def test_a_save_over_a_file_during_its_upload_drops_that_generation(pod, server, bucket, monkeypatch):
    """AReaL writes its recover checkpoint in place: a file rewritten while it uploads makes the generation's
    manifest (hashed before) wrong, so no manifest is written and the generation is dropped, never taken."""
    a = pod("a")
    t = train_to(a, 5)
    path = a.checkpoint_dir / "step-00000005.pt"
    t.codec.save({"step": 5, "model": t.model.state_dict(), "optim": t.opt.state_dict(),
                  "pad": np.zeros(1 << 19, np.float32)}, path)  # 2 MB at 1 MiB/s: 2 s to upload
    monkeypatch.setenv("RCLONE_BWLIMIT", "1M")
    up = uploader.Uploader(a, say=lambda _: None)
    started = gen_dir(server, bucket, 5)  # the PUT under way (the run's lease and the listing come first)
    writer = subprocess.Popen(["sh", "-c", f"for i in $(seq 200); do [ -d {started} ] && break; sleep 0.05; done; "
                                           f"sleep 0.3; printf X | dd of={path} bs=1 seek=100 conv=notrunc "
                                           "status=none"])  # ours
    try:
        assert up.once() is None
    finally:
        writer.wait(10)
    assert "changed while it was uploaded" in records.REMOTE.read(a.state_dir)["last"]["why"]
    assert not gen_dir(server, bucket, 5).exists() or not (gen_dir(server, bucket, 5) / remote.MANIFEST).exists()
    assert restore.run(pod("b")) is None


def test_older_generations_are_pruned_only_behind_enough_whole_ones(pod, server, bucket, monkeypatch):
    """keep 2: after gens 1, 2 nothing goes; gen 3 whole removes gen 1; a cut gen 4 (no manifest) removes nothing."""
    monkeypatch.setenv("PODKIT_CHECKPOINT_REMOTE_KEEP", "2")
    a = pod("a", PODKIT_CHECKPOINT_REMOTE_KEEP="2")
    up = uploader.Uploader(a, say=lambda _: None)
    for step in (1, 2):
        train_to(a, step)
        assert up.once() == step
    assert up.remote.whole() == [2, 1]
    train_to(a, 3)
    assert up.once() == 3
    assert up.remote.generations() == [3, 2]
    train_to(a, 4)
    up.remote.rclone("copy", str(a.checkpoint_dir / "step-00000004.pt"), f"{up.remote.base}/{remote.gen(4)}")
    assert up.remote.prune(2) == []
    assert up.remote.whole() == [3, 2]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_pod_on_an_empty_volume_resumes_where_the_lost_pod_left_off(stack_factory, server, bucket):
    """The smoke stack with a remote: the log listener uploads the fake trainer's checkpoints as it trains; a second
    pod on an empty workspace restores the newest at its boot (the restore stage) and resumes at that step."""
    env = {k: v for k, v in env_for(server, Path("unused"), bucket).items()
           if k.startswith(("AWS_", "PODKIT_CHECKPOINT"))}
    env["PODKIT_CHECKPOINT_REMOTE_POLL_S"] = "0.3"
    runs = server.root / bucket / "runs" / "podkit" / "run"
    a = stack_factory("a", **env).start()
    # the uploads run at nice 19: on a machine the suite keeps busy they take what is left
    wait_for(lambda: list(runs.glob("gen-*/manifest.json")), 90, what="a generation uploaded")
    assert a.stop() == 0
    newest = max(int(p.parent.name[4:]) for p in runs.glob("gen-*/manifest.json"))
    b = stack_factory("b", **env).start()
    wait_for(lambda: f"resumed from checkpoint step-{newest:08d}.pt" in b.log("trainer"), 60,
             what=f"the second pod to resume at step {newest}")
    assert f"restored the checkpoint of step {newest}" in b.stdout()
    assert b.stop() == 0


def areal_checkpoint(cfg, global_step: int, record: dict) -> Path:
    """AReaL's recover checkpoint as its RecoverInfo.dump and DCP save lay it out, with the run's record."""
    from podkit.areal import identity

    root = identity.save_root(identity.fileroot(cfg), "podkit", "run")
    (root / "recover_info").mkdir(parents=True, exist_ok=True)
    (root / "recover_info" / "step_info.json").write_text(json.dumps(
        {"epoch": 0, "epoch_step": global_step, "global_step": global_step, "steps_per_epoch": 100}))
    (root / "recover_info" / "dataloader_info.pkl").write_bytes(os.urandom(256))
    (root / "default" / "recover_checkpoint").mkdir(parents=True, exist_ok=True)
    (root / "default" / "recover_checkpoint" / "__0_0.distcp").write_bytes(os.urandom(4096) + bytes([global_step]))
    (root / "default" / "recover_checkpoint" / ".metadata").write_bytes(os.urandom(512))
    identity.write_record(root, record)
    return root


def test_an_areal_recover_checkpoint_replaces_an_older_one_which_is_kept_aside(pod, server, bucket):
    """AReaL's kind: recover_info/, default/recover_checkpoint/ and the run's record go up as one generation
    (step = global_step + 1, as progress counts); a volume holding an older checkpoint of the run gets it, the
    older one moved aside whole, nothing deleted."""
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    root = areal_checkpoint(a, 6, remote.mine(a))
    ckpt = remote.local(a)
    assert ckpt.step == 7 and "default/recover_checkpoint/__0_0.distcp" in ckpt.files
    remote.Remote(a.checkpoint.remote, "podkit/run").upload(ckpt)
    b = pod("b", PODKIT_TRAINER_KIND="areal")
    old = areal_checkpoint(b, 2, remote.mine(b))
    assert restore.run(b) == 7
    assert (old / "default" / "recover_checkpoint" / "__0_0.distcp").read_bytes() == \
        (root / "default" / "recover_checkpoint" / "__0_0.distcp").read_bytes()
    aside = list(old.parent.glob("run.before-restore-*"))
    assert len(aside) == 1 and json.loads((aside[0] / "recover_info" / "step_info.json").read_text())["global_step"] == 2
    assert not [p for p in old.parent.iterdir() if ".restore-" in p.name]


def test_an_areal_checkpoint_is_not_uploaded_while_a_rank_writes_it(pod, server, bucket):
    """AReaL writes its recover checkpoint in place: while a rank's save marker is in the run dir the uploader waits,
    and takes the checkpoint whole once the save is over."""
    a = pod("a", PODKIT_TRAINER_KIND="areal")
    areal_checkpoint(a, 6, remote.mine(a))
    records.PROGRESS.write(a.state_dir, {"kind": "areal", "checkpoint_step": 7})
    marker = a.run_path / f"{records.SAVING_PREFIX}0"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("")
    up = uploader.Uploader(a, say=lambda _: None)
    assert up.once() is None and not gen_dir(server, bucket, 7).exists()
    marker.unlink()
    assert up.once() == 7 and (gen_dir(server, bucket, 7) / remote.MANIFEST).exists()


def test_podkits_example_checkpoint_is_restored_as_its_trainer_recorded_it(pod, server, bucket):
    """Without trainer.entry the trainer records podkit's example as the entry, and no repo (areal/hooks.py): a new
    pod of that run restores it (the boot once told the run as entry "" with the repo, and refused it as another
    run's)."""
    from podkit.areal import identity

    a = pod("a", PODKIT_TRAINER_KIND="areal", PODKIT_REPO_URL="https://example.com/me/unused.git")
    example = str(ROOT / "src" / "podkit" / "areal" / "example" / "gsm8k_grpo.py")
    areal_checkpoint(a, 3, identity.record_for(("podkit", "run"), "podkit:gsm8k_grpo", a.inference.model, "", "",
                                               example))
    remote.Remote(a.checkpoint.remote, "podkit/run").upload(remote.local(a))
    assert restore.run(pod("b", PODKIT_TRAINER_KIND="areal", PODKIT_REPO_URL="https://example.com/me/unused.git")) == 4


def test_uploads_beside_training_yield_the_cpu_and_the_stops_final_upload_does_not(pod, tmp_path, monkeypatch):
    """The background uploads start rclone at nice 19, SCHED_BATCH and the lowest best-effort disk priority (the
    trainer's steps come first: bench/remote.py's step time); the stop's final upload, once the trainer has exited,
    at the listener's own priority (it has a deadline). A steady upload is four rclone starts: the copy, the lease
    read before the manifest, the manifest, the listing that prunes (each start is CPU taken beside the trainer)."""
    real, seen = mover.binary(), tmp_path / "priorities"
    wrapper = tmp_path / "rclone-watched"
    wrapper.write_text(f'#!/bin/sh\necho "$(cut -d" " -f19 /proc/$$/stat) $(chrt -p $$ | head -1 | sed "s/.*: //")'
                       f' $1" >> {seen}\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(mover, "binary", lambda: str(wrapper))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    a = pod("a")
    train_to(a, 3)
    up = uploader.Uploader(a, say=lambda _: None)
    assert up.once() == 3
    train_to(a, 5)
    first = len(seen.read_text().splitlines())
    assert up.once() == 5
    background = seen.read_text().splitlines()
    assert {ln.rsplit(" ", 1)[0] for ln in background} == {f"{min(19, base + 19)} SCHED_BATCH"}, background
    assert [ln.rsplit(" ", 1)[1] for ln in background[first:]] == ["copy", "cat", "copyto", "lsf"], background
    train_to(a, 6)
    assert "step 6, is on the remote" in up.final(30, "the pod's stop")
    final = seen.read_text().splitlines()[len(background):]
    assert final and {ln.rsplit(" ", 1)[0] for ln in final} == {f"{base} SCHED_OTHER"}, final


def test_background_uploads_start_at_most_once_every_remote_every_s_and_take_the_newest_then(pod, server, bucket):
    """checkpoint.remote_every_s (10 s here: more than an upload takes on a busy machine): the loop's first upload
    goes at once; the checkpoints saved within the next 10 s wait, and only the newest of them goes up (each
    upload's rclone starts are CPU beside the trainer)."""
    a = pod("a", PODKIT_CHECKPOINT_REMOTE_EVERY_S="10", PODKIT_CHECKPOINT_REMOTE_POLL_S="0.1")
    up = uploader.Uploader(a, say=lambda _: None).start()
    try:
        train_to(a, 1)
        wait_for(lambda: records.REMOTE.read(a.state_dir).get("uploaded", {}).get("step") == 1, 20, what="step 1 up")
        first = records.REMOTE.read(a.state_dir)["uploaded"]["time"]
        train_to(a, 2)
        time.sleep(0.5)
        train_to(a, 3)
        wait_for(lambda: records.REMOTE.read(a.state_dir).get("uploaded", {}).get("step") == 3, 40, what="step 3 up")
        assert records.REMOTE.read(a.state_dir)["uploaded"]["time"] - first >= 5.0
        assert not gen_dir(server, bucket, 2).exists()  # never started: the newest went when the time came
    finally:
        up.stopped.set()
