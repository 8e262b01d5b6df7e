"""The checkpoint remote at the end of a run and under faults (issue 49 items 4, 5 and 7): the last checkpoint goes up
when the pod stops (its SIGTERM, a cost guard's stop) within a deadline, and what could not is named; two pods of one
run never upload into one generation (the run's lease on the remote); a restore cut by the endpoint's death leaves
no half checkpoint; a full remote is named as one; no credential reaches the bug-report bundle. A real S3 endpoint
(`rclone serve s3`, tests/s3server.py) on 127.0.0.1, and a remote that is really full (a tmpfs, or a file size limit)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import test_remote

import s3server
import stub_pod
from conftest import PODKIT, wait_for
from podkit import records
from podkit.boot import restore
from podkit.host import lease as lease_mod
from podkit.money import costguard
from podkit.programs.fake_trainer import FakeTrainer
from podkit.remote import mover, remote, uploader
from s3server import Server

pytestmark = pytest.mark.timeout(60)
pod = test_remote.pod  # the fixture, served by this module's own server and bucket
runpod_api, STOP, on_runpod = stub_pod.runpod_api, stub_pod.STOP, stub_pod.on_runpod  # RunPod's stub
BUCKETS = [f"faults-{i:02d}" for i in range(16)]  # one a test

server, bucket = s3server.fixtures(BUCKETS)  # one server for the module, a bucket a test


def train_to(cfg, step: int, pad: int = 0) -> FakeTrainer:
    """The fake trainer's checkpoint of `step` as it writes it; `pad` floats more in it (a bigger file)."""
    t = FakeTrainer(cfg)
    t.step = step
    t.checkpoint("test")
    if pad:
        t.codec.save({"step": step, "model": t.model.state_dict(), "optim": t.opt.state_dict(),
                      "pad": np.zeros(pad, np.float32)}, cfg.checkpoint_dir / f"step-{step:08d}.pt")
    return t


def gens(server: Server, bucket: str) -> dict[int, bool]:
    """{step: whether its manifest is there} on the server's own disk."""
    runs = server.root / bucket / "runs" / "podkit" / "run"
    return {int(p.name[4:]): (p / remote.MANIFEST).exists() for p in runs.glob("gen-*")} if runs.exists() else {}


# -- nothing lost at the end --------------------------------------------------------------------------------------
def test_the_last_checkpoint_goes_up_at_the_stop_and_is_recorded(pod, server, bucket):
    """The trainer's last checkpoint (step 9), saved after the uploader's last look: final() puts it up, says so and
    records it; a second final() (the pod's SIGTERM after a cost guard's stop) has nothing left to do."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    train_to(a, 4)
    assert up.once() == 4
    train_to(a, 9)
    words = up.final(20, "the pod is stopping")
    assert words.startswith("the last checkpoint, step 9, is on the remote") and gens(server, bucket)[9]
    final = records.REMOTE.read(a.state_dir)["final"]
    assert final["outcome"] == "uploaded" and final["step"] == 9 and final["where"].endswith("gen-00000009")
    t0 = time.monotonic()
    assert up.final(20, "the pod is stopping").startswith("the last checkpoint, step 9, is on the remote")
    assert time.monotonic() - t0 < 1, "nothing to upload: not even a listing"
    assert any("the pod is stopping: the last checkpoint, step 9" in line for line in said)


def test_what_could_not_be_uploaded_at_the_stop_is_named_with_its_step_and_why(pod, server, bucket):
    """A final upload that cannot be made (the credentials refused) names the step that is not on the remote, why,
    and the remote's newest of this run, in the log and in remote.json."""
    a = pod("a", RUNPOD_POD_ID="pod-a", AWS_SECRET_ACCESS_KEY="wrongsecret-0123456789abcdef")
    train_to(a, 6)
    said: list[str] = []
    words = uploader.Uploader(a, say=said.append).final(20, "the pod is stopping")
    assert "the last checkpoint, step 6, is NOT on the remote" in words and "refused the credentials" in words
    assert "newest whole generation of this lineage is not known (the remote could not be read)" in words
    final = records.REMOTE.read(a.state_dir)["final"]
    assert final["outcome"] == "failed" and final["step"] == 6 and "refused the credentials" in final["why"]
    assert any("NOT on the remote" in line for line in said)


def test_the_final_upload_is_cut_at_its_deadline_and_says_so(pod, server, bucket, monkeypatch):
    """A checkpoint too big for the time the stop leaves (4 MB at 256 KiB/s, 1 s given): final() returns by its
    deadline, leaves no manifest, and names the deadline that cut it."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    train_to(a, 3, pad=1 << 20)
    monkeypatch.setenv("RCLONE_BWLIMIT", "256k")
    up = uploader.Uploader(a, say=lambda _: None)
    t0 = time.monotonic()
    words = up.final(1.0, "the pod is stopping", "what the stop's deadline left after the trainer (stop_timeout_s)")
    assert time.monotonic() - t0 < 2.5
    assert "step 3, is NOT on the remote" in words and "deadline passed (1.0 s: what the stop's deadline left" in words
    assert not gens(server, bucket).get(3)


def test_an_older_upload_in_flight_is_given_up_for_the_last_checkpoint(pod, server, bucket, monkeypatch):
    """Step 2 (4 MB at 256 KiB/s: 16 s) is uploading when the trainer's stop writes step 5: final() cuts step 2's
    upload at once and puts step 5 up, the newest winning at the end too."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    train_to(a, 2, pad=1 << 20)
    monkeypatch.setenv("RCLONE_BWLIMIT", "256k")
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    import threading

    loop = threading.Thread(target=up.once, daemon=True)
    loop.start()
    wait_for(lambda: up.inflight == 2 and (server.root / bucket / "runs").exists(), 15, what="step 2 uploading")
    train_to(a, 5)
    t0 = time.monotonic()
    assert up.final(20, "the pod is stopping").startswith("the last checkpoint, step 5, is on the remote")
    assert time.monotonic() - t0 < 8
    loop.join(5)
    assert gens(server, bucket).get(5) and not gens(server, bucket).get(2)
    assert any(line.startswith("[podkit:remote] step 2 not uploaded: given up for step 5") for line in said)


def test_a_cost_guards_stop_uploads_the_last_checkpoint_before_it_asks_runpod(pod, server, bucket, monkeypatch):
    """A cost guard's stop (Stopper, every guard's one path) does the log listener's final upload first and waits
    for it: RunPod is asked to stop the pod only once the last checkpoint's manifest is on the remote, and the stop's
    reason (the pod-stop notification) says where it is."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    up = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 8)
    asked: list[tuple[str, dict]] = []
    monkeypatch.setattr(costguard, "stop_pod_notified", lambda reason, *_a, **_k: asked.append(
        (reason, gens(server, bucket))) or True)
    monkeypatch.setattr(costguard, "BEFORE_STOP", [lambda why: up.final(20, "the pod stops itself")])
    assert costguard.Stopper("training finished at step 8 (guard.stop_pod_when_finished: auto)", a.state_dir).run()
    (reason, seen), = asked
    assert seen.get(8) is True, "the pod was stopped before its last checkpoint was whole on the remote"
    assert "; the last checkpoint, step 8, is on the remote (s3://" in reason


def test_a_pods_sigterm_uploads_the_checkpoint_the_trainer_wrote_in_its_stop(stack_factory, server, bucket):
    """The smoke stack with a remote whose uploader never looks by itself (poll 1 h): the pod's SIGTERM stops the
    trainer with its checkpoint, then the log listener, last, uploads it within the stop's deadline, and the
    container still stops in time; the step is the trainer's last."""
    env = {**server.env(bucket), "PODKIT_CHECKPOINT_REMOTE_POLL_S": "3600", "PODKIT_TRAINER_CHECKPOINT_EVERY": "1000"}
    s = stack_factory("a", **env).start()
    s.wait_step(7, timeout=60)
    t0 = time.monotonic()
    assert s.stop() == 0
    assert time.monotonic() - t0 < 10, "past the stop timeout (stop_timeout_s: 10 s)"
    last = records.PROGRESS.read(s.workspace / ".podkit")["checkpoint_step"]
    assert gens(server, bucket) == {last: True}
    assert f"the pod is stopping: the last checkpoint, step {last}, is on the remote" in s.stdout()
    assert records.REMOTE.read(s.workspace / ".podkit")["final"]["outcome"] == "uploaded"


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_finished_run_on_runpod_uploads_its_last_checkpoint_before_its_pod_stops(stack_factory, server, bucket,
                                                                                   runpod_api):
    """The smoke stack on RunPod (the API stub) with a remote whose uploader never looks by itself: training finishes
    at step 12, and the cost guard's stop (guard.stop_pod_when_finished) has the log listener upload that last
    checkpoint before it asks RunPod: the stop's reason says where it is."""
    env = {**server.env(bucket), "PODKIT_CHECKPOINT_REMOTE_POLL_S": "3600", "PODKIT_TRAINER_MAX_STEPS": "12",
           **on_runpod(runpod_api.url)}
    s = stack_factory("a", **env).start()
    wait_for(lambda: STOP in runpod_api.calls(), 60, what="the pod's stop")
    assert gens(server, bucket) == {12: True}
    assert "stopping pod pod-abc123: training finished at step 12 (guard.stop_pod_when_finished: auto); the last " \
           "checkpoint, step 12, is on the remote (s3://" in s.stdout()
    assert s.stop() == 0


# -- two pods of one run ----------------------------------------------------------------------------------------
def test_two_pods_of_one_run_never_upload_into_one_generation(pod, server, bucket):
    """Pod a holds the run's lease on the remote: pod b's uploader, with a newer checkpoint on its own volume,
    uploads nothing, says who holds it, and records it; while a renews, b's watch never lapses it; once a is gone
    (no renewal for the lease's length) b takes it and uploads, and a, back, uploads nothing."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    up_a = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 3)
    assert up_a.once() == 3
    b = pod("b", RUNPOD_POD_ID="pod-b")
    said: list[str] = []
    up_b = uploader.Uploader(b, say=said.append)
    up_b.lease.lapse_s = 1.5
    train_to(b, 5)
    assert up_b.once() is None and 5 not in gens(server, bucket)
    assert "another pod holds this run's lease on the remote (pod pod-a" in said[-1]
    # the words say the lapse that applies: a renews every RENEW_S, so twice that and 5 s (issue 56: they said
    # guard.lease_s while the lease was taken 128 s on)
    assert f"unchanged for {2 * lease_mod.RENEW_S + 5:g} s" in said[-1], said[-1]
    lease = records.REMOTE.read(b.state_dir)["lease"]
    assert lease["outcome"] == "blocked" and "pod pod-a" in lease["why"]
    up_a.lease.renew_s = 0.0  # a renews at each look: b sees the lease change, so a is live
    for _ in range(4):
        time.sleep(0.6)
        up_a.renew()
        assert up_b.once() is None
    time.sleep(1.6)  # a is gone: its lease unchanged for b's whole lapse
    assert up_b.once() == 5 and gens(server, bucket)[5]
    assert "holds the run's lease on the remote now" in said[-2]
    train_to(a, 6)
    assert up_a.once() is None and 6 not in gens(server, bucket)
    assert "pod pod-b" in records.REMOTE.read(a.state_dir)["lease"]["why"]


def test_a_lease_taken_during_an_upload_leaves_that_generation_without_its_manifest(pod, server, bucket, monkeypatch):
    """The race the lease cannot close: pod b takes the lease while pod a's upload of step 4 is under way. a looks
    again just before the manifest: its files stay there without one (never taken, and not removed: b may be
    uploading the same step's), and it says who holds the lease."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    train_to(a, 4, pad=1 << 19)  # 2 MB at 1 MiB/s: 2 s
    monkeypatch.setenv("RCLONE_BWLIMIT", "1M")
    up_a = uploader.Uploader(a, say=lambda _: None)
    up_a.lease.renew_s = 0.0  # its lease says so: a reader's lapse is then its own alone
    import threading

    result: list = []
    t = threading.Thread(target=lambda: result.append(up_a.once()), daemon=True)
    t.start()
    wait_for(lambda: up_a.lease.token and up_a.inflight == 4 and (server.root / bucket / "runs").exists(), 15,
             what="step 4 uploading under a's lease")
    b = pod("b", RUNPOD_POD_ID="pod-b")
    up_b = uploader.Uploader(b, say=lambda _: None)
    up_b.lease.lapse_s = 0.0  # b judges a's lease lapsed (a partition: a's renewals unseen)
    assert up_b.lease.hold() == ""
    t.join(20)
    assert result == [None] and gens(server, bucket).get(4) is False
    assert "left without its manifest: another pod holds this run's lease on the remote (pod pod-b" in \
        records.REMOTE.read(a.state_dir)["last"]["why"]


def test_the_pods_stop_releases_its_lease_and_the_next_pod_uploads_at_once(pod, server, bucket):
    """The lease released at the stop (Uploader.release) is gone from the remote: a replacement pod uploads at its
    first look, without waiting for a lapse."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    up_a = uploader.Uploader(a, say=lambda _: None)
    train_to(a, 2)
    assert up_a.once() == 2
    up_a.release()
    b = pod("b", RUNPOD_POD_ID="pod-b")
    train_to(b, 3)
    assert uploader.Uploader(b, say=lambda _: None).once() == 3


# -- faults -------------------------------------------------------------------------------------------------------
def test_server_killed_and_restarted_mid_restore_leaves_no_half_checkpoint(pod, server, bucket, monkeypatch):
    """The endpoint dies while a pod on an empty volume downloads gen 6 (12 MB at 1 MiB/s: more than the kernel's
    socket buffers hold, so the death cuts the transfer): the restore fails, the boot goes on, the volume holds no
    checkpoint and no temp of it; the next boot, the endpoint back, restores it."""
    a = pod("a", RUNPOD_POD_ID="pod-a")
    train_to(a, 6, pad=3 << 20)
    assert uploader.Uploader(a, say=lambda _: None).once() == 6
    b = pod("b", RUNPOD_POD_ID="pod-b")
    monkeypatch.setenv("RCLONE_BWLIMIT", "1M")
    monkeypatch.setattr(mover, "RETRIES", ("--retries", "1", "--low-level-retries", "1"))
    killer = subprocess.Popen(["sh", "-c", f"sleep 2; kill -9 {server.proc.pid}"])  # ours, by pid
    try:
        assert restore.run(b) is None
    finally:
        killer.wait(10)
        server.proc.wait(10)
        monkeypatch.delenv("RCLONE_BWLIMIT")  # before the server inherits it
        server.start()
    assert not b.checkpoint_dir.exists() or not any(b.checkpoint_dir.iterdir())
    assert not [p for p in b.workspace_path.rglob("*") if ".restore-" in p.name]
    assert records.REMOTE.read(b.state_dir)["restore"]["outcome"] == "failed"
    assert restore.run(b) == 6
    resumed = FakeTrainer(b)
    resumed.resume()
    assert resumed.step == 6


class FullDisk:
    """A remote that fills up: rclone's local backend (a mounted volume as the remote, `disk:<dir>`) on a 1 MiB tmpfs
    when this process may mount one (root), with all but 128 KiB of it taken; else rclone run under a file size limit
    of 256 KiB (`ulimit -f`: rclone, in Go, ignores SIGXFSZ and gets EFBIG). A network server would not do: `rclone
    serve sftp` and `serve s3` answer a full disk as a closed pipe or a bare 500, the cause left in their own log."""

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root, self.monkeypatch = root, monkeypatch
        root.mkdir(parents=True)
        self.mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True, timeout=10).returncode == 0
        if self.mounted:
            free = os.statvfs(root)
            (root / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (128 << 10)))
        else:
            real = mover.binary()
            wrapper = root.parent / "rclone-limited"
            wrapper.write_text(f'#!/bin/sh\nulimit -f 256\nexec "{real}" "$@"\n')
            wrapper.chmod(0o755)
            monkeypatch.setattr(mover, "binary", lambda: str(wrapper))

    def env(self) -> dict[str, str]:
        return {"PODKIT_CHECKPOINT_REMOTE": f"disk:{self.root}/ckpts", "RCLONE_CONFIG_DISK_TYPE": "local"}

    def free(self) -> None:
        """Room made: the filler removed, or the limit lifted."""
        if self.mounted:
            (self.root / "filler").unlink()
        else:
            self.monkeypatch.undo()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.root)], capture_output=True, timeout=10)  # ours, mounted above


@pytest.fixture
def full(tmp_path, monkeypatch):
    s = FullDisk(tmp_path / "disk", monkeypatch)
    yield s
    s.close()


def test_a_full_remote_is_named_as_full_and_the_next_checkpoint_goes_up_once_it_fits(pod, full):
    """A remote with no room for the checkpoint (1 MB into 128 KiB): the upload fails as "full or over its quota",
    in remote.json and the log, with no manifest; once there is room, the next checkpoint goes up."""
    a = pod("a", **full.env())  # the S3 remote's variables beside it, unused
    said: list[str] = []
    up = uploader.Uploader(a, say=said.append)
    train_to(a, 3, pad=1 << 18)
    assert up.once() is None
    why = records.REMOTE.read(a.state_dir)["last"]["why"]
    assert "is full or over its quota" in why and f"disk:{full.root}/ckpts" in why, why
    assert any("step 3 not uploaded" in line and "full or over its quota" in line for line in said)
    assert not list(full.root.rglob(remote.MANIFEST))
    full.free()
    train_to(a, 4)
    assert up.once() == 4
    assert [p.parent.name for p in full.root.rglob(remote.MANIFEST)] == [remote.gen(4)]


@pytest.mark.parametrize("said", [
    "api error QuotaExceeded: The account quota has been exceeded",  # Wasabi, Ceph RGW
    "api error XMinioStorageFull: Storage backend has reached its minimum free drive threshold",  # MinIO
    "Cannot upload files, storage cap exceeded.",  # Backblaze B2
    "507 Insufficient Storage",  # WebDAV
    'sftp: "write /data/x.partial: no space left on device" (SSH_FX_FAILURE)',
    "write /mnt/vol/x: disk quota exceeded",
])
def test_each_providers_words_for_a_full_remote_are_named_as_full(said):
    """What object stores, WebDAV, SFTP and a mounted volume say when they are full, in podkit's one sentence."""
    assert mover.explain(f"2026/11/28 17:00:00 ERROR : x: Failed to copy: {said}", "s3://b/p").startswith(
        "s3://b/p is full or over its quota")


def test_no_credential_of_the_remote_reaches_the_bug_report_bundle(pod, server, bucket, tmp_path):
    """AWS_SECRET_ACCESS_KEY and an rclone remote's RCLONE_CONFIG_*_SECRET_ACCESS_KEY in the environment, a failed
    upload's words in remote.json, rclone's own lines with them in the listener's log: the bundle holds none of
    their bytes, anywhere."""
    wrong = "wrongsecret-Zq8Vv3Kc1Nn5Xx7Bb9"
    rclone_secret = "rclonesecret-Hh4Jj6Ll8Pp0Rr2Tt"
    a = pod("a", AWS_SECRET_ACCESS_KEY=wrong, RCLONE_CONFIG_MYS3_TYPE="s3",
            RCLONE_CONFIG_MYS3_ACCESS_KEY_ID="podkittestaccess01", RCLONE_CONFIG_MYS3_SECRET_ACCESS_KEY=rclone_secret)
    train_to(a, 2)
    assert uploader.Uploader(a, say=lambda _: None).once() is None  # refused: its words recorded
    (a.workspace_path / "logs").mkdir(exist_ok=True)
    (a.workspace_path / "logs" / "logs.log").write_text(
        f"podkit   | [podkit:remote] step 2 not uploaded: {records.REMOTE.read(a.state_dir)['last']['why']}\n"
        f"rclone config dump: secret_access_key = {rclone_secret}\n"
        f"env: AWS_SECRET_ACCESS_KEY={wrong}\n")
    env = {**os.environ, "PODKIT_WORKSPACE": str(a.workspace_path)}
    out = tmp_path / "report.tar.gz"
    r = subprocess.run([*PODKIT, "doctor", "--bundle", str(out)], capture_output=True, text=True, env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    with tarfile.open(out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert any(name.endswith("remote.json") for name in files)
    for name, data in files.items():
        for secret in (wrong, rclone_secret):
            assert secret.encode() not in data, (name, secret)
    assert json.dumps(sorted(files))  # the bundle was read whole
