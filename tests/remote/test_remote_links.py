"""A checkpoint whose newest step is a link (a user's layout: the step file or AReaL's recover checkpoint kept
elsewhere, linked in): uploaded as what it points to, restored whole on a new pod (issue 56: the generation went up
with its manifest and no file, recorded as uploaded, and every restore refused it). The real rclone against
`rclone serve s3` (tests/s3server.py) on 127.0.0.1."""

from __future__ import annotations

import os

import pytest
import test_remote
from test_remote_snapshot import gens

import s3server
from podkit.boot import restore
from podkit.remote import uploader

pytestmark = pytest.mark.timeout(120)
pod = test_remote.pod
server, bucket = s3server.fixtures([f"links-{i:02d}" for i in range(3)])


def test_a_newest_step_that_is_a_link_goes_up_as_its_file_and_a_new_pod_restores_it(pod, server, bucket, tmp_path):
    a = pod("a")
    test_remote.train_to(a, 4)
    step = a.checkpoint_dir / "step-00000004.pt"
    elsewhere = tmp_path / "kept-elsewhere.pt"
    os.replace(step, elsewhere)
    os.symlink(elsewhere, step)
    assert uploader.Uploader(a, say=lambda _: None).once() == 4
    assert gens(server, bucket) == {4: True}
    assert restore.run(pod("b")) == 4
    assert (pod("b").checkpoint_dir / "step-00000004.pt").read_bytes() == elsewhere.read_bytes()


def test_a_newest_step_whose_link_dangles_is_not_recorded_as_uploaded(pod, server, bucket, tmp_path):
    a = pod("a")
    test_remote.train_to(a, 4)
    step = a.checkpoint_dir / "step-00000004.pt"
    step.unlink()
    os.symlink(tmp_path / "gone.pt", step)
    said: list[str] = []
    assert uploader.Uploader(a, say=said.append).once() is None
    assert gens(server, bucket) == {}, "no generation with a manifest and no file"


def test_an_areal_shard_that_is_a_link_goes_up_and_comes_back_whole(pod, server, bucket, tmp_path):
    """The adversarial pass: one shard of AReaL's recover checkpoint linked in from elsewhere on the volume was left out
    of the file list without a word, and the restore brought back the others only."""
    from test_remote import areal_checkpoint

    from podkit.remote import remote

    a = pod("a", PODKIT_TRAINER_KIND="areal")
    root = areal_checkpoint(a, 6, remote.mine(a))
    shard = root / "default" / "recover_checkpoint" / "__0_0.distcp"
    kept = tmp_path / "a" / "shards" / "__0_0.distcp"
    kept.parent.mkdir(parents=True)
    os.replace(shard, kept)
    os.symlink(kept, shard)
    assert "default/recover_checkpoint/__0_0.distcp" in remote.local(a).files
    remote.Remote(a.checkpoint.remote, "podkit/run").upload(remote.local(a))
    b = pod("b", PODKIT_TRAINER_KIND="areal")
    assert restore.run(b) == 7
    from podkit.areal import identity

    back = identity.save_root(identity.fileroot(b), "podkit", "run") / "default" / "recover_checkpoint" / "__0_0.distcp"
    assert back.read_bytes() == kept.read_bytes()
