"""The fake trainer's numpy net and its checkpoints: its step is torch's Linear-Tanh-Linear under Adam (torch is
the reference it stands in for), a checkpoint round-trips exactly, and a file that loads but is not this net's
checkpoint (torch's zip, another shape, a step that is no count, a flipped byte) is passed over for an older one."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import ROOT
from podkit import config
from podkit.programs.fake_trainer import Adam, Codec, FakeTrainer, TinyNet, _rng, train
from podkit.remote.checkpoint import NPZ, CheckpointDir

pytestmark = pytest.mark.timeout(60)


def test_forty_steps_of_the_numpy_net_are_torchs_adam_steps_to_float32_precision():
    torch = pytest.importorskip("torch")
    net = TinyNet(3)
    opt = Adam(net.params, 0.01)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for layer, w, b in ((ref[0], "w1", "b1"), (ref[2], "w2", "b2")):
            layer.weight.copy_(torch.from_numpy(net.params[w].copy()))
            layer.bias.copy_(torch.from_numpy(net.params[b].copy()))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    true_w = _rng(4).standard_normal((16, 1)).astype(np.float32)
    losses = []
    for step in range(40):
        g = _rng(step)
        x = g.standard_normal((64, 16)).astype(np.float32)
        y = x @ true_w
        loss, grads = net.loss_and_grads(x, y)
        losses.append(loss)
        opt.step(net.params, grads)
        ref_loss = torch.nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y))
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-6), step
    assert np.allclose(net.params["w1"], ref[0].weight.detach().numpy(), atol=1e-5)
    assert losses[-1] < losses[0] / 2, losses


def checkpoint(step: int, seed: int = 0) -> dict:
    net = TinyNet(seed)
    return {"step": step, "model": net.state_dict(), "optim": Adam(net.params, 0.01).state_dict()}


def savez_to(path, savez, **arrays) -> None:
    with open(path, "wb") as f:  # a name would get .npz appended
        savez(f, **arrays)


def test_a_file_that_loads_but_is_not_this_nets_checkpoint_is_passed_over_for_an_older_one(tmp_path):
    torch = pytest.importorskip("torch")
    d = CheckpointDir(tmp_path)
    d.save(Codec, 1, checkpoint(1))
    wrong = {
        2: lambda p: torch.save(checkpoint(2), p),                                   # torch's zip of the same state
        3: lambda p: NPZ.save({**checkpoint(3), "model": {"w1": np.zeros((8, 8), np.float32)}}, p),  # another net
        4: lambda p: NPZ.save({**checkpoint(4), "step": -4}, p),                      # a step that is no count
        5: lambda p: NPZ.save({**checkpoint(5), "step": 2.5}, p),
        6: lambda p: NPZ.save({"step": 6, "model": checkpoint(6)["model"]}, p),       # no optimizer state
        8: lambda p: NPZ.save({**checkpoint(8), "model": {k: np.ones(np.shape(v), np.int32)  # ints of the shape
                                                          for k, v in checkpoint(8)["model"].items()}}, p),
        9: lambda p: NPZ.save({**checkpoint(9), "optim": {**checkpoint(9)["optim"], "t": -1}}, p),
        10: lambda p: savez_to(p, np.savez_compressed, step=np.asarray(10)),              # deflated: not written by podkit
        11: lambda p: savez_to(p, np.savez, step=np.asarray(11), model=np.array([{"w1": 1}], dtype=object)),  # a pickle
    }
    for step, write in wrong.items():
        write(tmp_path / f"step-{step:08d}.pt")
    good = tmp_path / "step-00000007.pt"
    d.save(Codec, 7, checkpoint(7))
    d.save(Codec, 12, checkpoint(12))
    (tmp_path / "step-00000012.pt").write_bytes((tmp_path / "step-00000012.pt").read_bytes()[:-30])  # torn
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # inside an array's bytes: its member's CRC no longer matches
    good.write_bytes(bytes(raw))
    path, state = d.load_latest(Codec)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == [f"step-{s:08d}.pt" for s in range(1, 13)], \
        "nothing is deleted"
    assert [p.name for p in d.unreadable] == [f"step-{s:08d}.pt" for s in range(12, 1, -1)]


ARRAYS = hnp.arrays(st.sampled_from([np.float32, np.float64, np.int64]), hnp.array_shapes(min_dims=0, max_dims=3,
                                                                                          max_side=4))
KEYS = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=8)
TREES = st.recursive(ARRAYS, lambda kids: st.dictionaries(KEYS, kids, min_size=1, max_size=4), max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(KEYS, TREES, min_size=1, max_size=4))
def test_any_nested_dict_of_arrays_round_trips_through_npz_exactly(state):
    buf = io.BytesIO()
    NPZ.save(state, buf)
    buf.seek(0)
    back = NPZ.load(buf)

    def same(a, b):
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        a = np.asarray(a)
        if a.ndim == 0:  # a number comes back as Python's own (a step is an int)
            return not isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        return np.array_equal(a, b, equal_nan=a.dtype.kind == "f") and a.dtype == b.dtype

    assert same(state, back)


def test_a_key_holding_a_slash_is_refused_at_save_not_read_back_as_another_tree():
    with pytest.raises(ValueError, match="holds '/'"):
        NPZ.save({"model": {"a/b": np.zeros(1)}}, io.BytesIO())


def test_torchs_zip_is_not_read_as_an_npz_whose_members_are_bytes(tmp_path):
    """torch.save writes a zip too: np.load opens it and hands its pickle back as bytes, not an error."""
    torch = pytest.importorskip("torch")
    torch.save({"step": 1}, tmp_path / "t.pt")
    with pytest.raises(ValueError, match="a torch checkpoint, not NPZ"):
        NPZ.load(tmp_path / "t.pt")


def test_a_checkpoint_of_float64_arrays_resumes_as_float32():
    state = checkpoint(3)
    state["model"] = {k: v.astype(np.float64) for k, v in state["model"].items()}
    net = TinyNet(0)
    net.load_state_dict(state["model"])
    assert {v.dtype for v in net.params.values()} == {np.dtype(np.float32)}


def test_a_diverging_step_reports_inf_then_nan_with_no_warning():
    net = TinyNet(0)
    opt = Adam(net.params, 1e30)
    x = _rng(1).standard_normal((64, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [train(net, opt, x, x[:, :1]) for _ in range(4)]
    assert np.isfinite(losses[0]) and not np.isfinite(losses[-1]), losses


@pytest.mark.parametrize("keys", [("a", "a/b"), ("a/b", "a")])
def test_a_key_that_is_both_a_value_and_a_tree_is_refused(tmp_path, keys):
    savez_to(tmp_path / "c.npz", np.savez, **{k: np.zeros(1) for k in keys})
    with pytest.raises(ValueError, match="is under a value|is a value and a tree"):
        NPZ.load(tmp_path / "c.npz")


def test_an_older_podkits_torch_checkpoints_are_set_aside_so_the_runs_own_are_kept(tmp_path, monkeypatch):
    """A smoke workspace an older podkit trained (torch's files, steps 80-100, keep 3): their step numbers would
    outrank every new checkpoint, and retention would delete the run's own the moment each is written."""
    torch = pytest.importorskip("torch")
    for k in [k for k in os.environ if k.startswith("PODKIT_")]:
        monkeypatch.delenv(k)
    cfg = config.load(environ={"PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"),
                               "PODKIT_WORKSPACE": str(tmp_path), "PODKIT_TRAINER_KEEP_CHECKPOINTS": "3"})
    cfg.checkpoint_dir.mkdir(parents=True)
    for step in (80, 90, 100):
        torch.save({"step": step}, cfg.checkpoint_dir / f"step-{step:08d}.pt")
    t = FakeTrainer(cfg)
    t.resume()
    assert t.step == 0
    kept = sorted(p.name for p in (cfg.checkpoint_dir / "unreadable").iterdir())
    assert kept == ["step-00000080.pt", "step-00000090.pt", "step-00000100.pt"]
    t.step = 10
    written = t.checkpoint("test")
    assert written.exists() and CheckpointDir(cfg.checkpoint_dir).latest_path() == written
    again = FakeTrainer(cfg)
    again.resume()
    assert again.step == 10


def test_an_object_array_is_refused_before_its_pickle_is_read(tmp_path):
    """A pickle in a checkpoint would run code on load: numpy is told never to read one."""
    savez_to(tmp_path / "p.npz", np.savez, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        NPZ.load(tmp_path / "p.npz")


def test_a_deflated_member_is_refused_unread_so_a_small_file_cannot_inflate_to_gigabytes(tmp_path):
    savez_to(tmp_path / "z.npz", np.savez_compressed, x=np.zeros(1 << 20, np.float32))  # 4 MiB in about 4 KiB
    assert (tmp_path / "z.npz").stat().st_size < 1 << 16
    with pytest.raises(ValueError, match="a compressed member"):
        NPZ.load(tmp_path / "z.npz")


def smoke_cfg(tmp_path, monkeypatch, **env):
    for k in [k for k in os.environ if k.startswith("PODKIT_")]:
        monkeypatch.delenv(k)
    cfg = config.load(environ={"PODKIT_CONFIG": str(ROOT / "configs" / "smoke.yaml"), "PODKIT_WORKSPACE": str(tmp_path),
                               **env})
    cfg.checkpoint_dir.mkdir(parents=True)
    return cfg


def test_a_name_set_aside_twice_keeps_both_files(tmp_path):
    """A restore can bring the same unreadable file back: the second move never overwrites the first."""
    d = CheckpointDir(tmp_path)
    for body in (b"first", b"second"):
        (tmp_path / "step-00000009.pt").write_bytes(body)
        d.set_aside(tmp_path / "step-00000009.pt")
    kept = {p.name: p.read_bytes() for p in (tmp_path / "unreadable").iterdir()}
    assert kept == {"step-00000009.pt": b"first", "step-00000009.pt.1": b"second"}


@pytest.mark.parametrize("planted", ["file", "link"])
def test_an_unreadable_checkpoint_that_cannot_be_moved_aside_is_left_and_the_trainer_trains(tmp_path, monkeypatch,
                                                                                          planted):
    cfg = smoke_cfg(tmp_path, monkeypatch)
    NPZ.save({"step": 4, "model": {"w": np.zeros(2, np.float32)}}, cfg.checkpoint_dir / "step-00000004.pt")  # not ours
    Codec.save(checkpoint(2), cfg.checkpoint_dir / "step-00000002.pt")
    target = cfg.checkpoint_dir / "unreadable"
    if planted == "file":
        target.write_text("a user's notes\n")
    else:
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    t = FakeTrainer(cfg)
    t.resume()
    assert t.step == 2 and (cfg.checkpoint_dir / "step-00000004.pt").exists()
    assert not list((tmp_path / "elsewhere").iterdir()) if planted == "link" else target.read_text() == "a user's notes\n"


def test_a_checkpoint_whose_read_failed_is_not_set_aside(tmp_path, monkeypatch):
    """An I/O error says nothing of a file's bytes (EIO, a file gone under the listing): it stays where it is."""
    d = CheckpointDir(tmp_path)
    d.save(Codec, 3, checkpoint(3))
    d.save(Codec, 5, checkpoint(5))

    def load(path):
        if path.name == "step-00000005.pt":
            raise OSError(5, "Input/output error")
        return Codec.load(path)

    path, state = d.load_latest(type("Flaky", (), {"load": staticmethod(load)}))
    assert state["step"] == 3 and d.unreadable == []
