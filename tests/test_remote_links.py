"""A checkpoint whose newest step is a link (a user's layout: the step file or AReaL's recover checkpoint kept
elsewhere, linked in): uploaded as what it points to, restored whole on a new pod (issue 56: the generation went up
with its manifest and no file, recorded as uploaded, and every restore refused it). The real rclone against
`rclone serve s3` (tests/s3server.py) on 127.0.0.1."""

from __future__ import annotations

import os

import pytest

import s3server
import test_remote
from podkit import restore, uploader
from test_remote_snapshot import gens

pytestmark = pytest.mark.timeout(120)
pod = test_remote.pod
server, bucket = s3server.fixtures([f"links-{i:02d}" for i in range(2)])


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
