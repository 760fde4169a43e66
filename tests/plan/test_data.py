"""Tests for convcheck.plan.seeded_data: seeded batches, MNIST IDX and .npz readers, hashes."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from convcheck.plan import seeded_data as data
from convcheck.plan.seeded_data import Batches, hash_state_dict, load_batches
from convcheck.errors import UsageError


def synth(**kw):
    args = dict(input_shape=(1, 28, 28), num_classes=10, batch_size=8, num_batches=3, seed=0)
    args.update(kw)
    return load_batches(args.pop("source", None), **args)


# ---------------------------------------------------------------- synthetic


def test_synthetic_shapes_dtypes_and_hashes():
    b = synth(input_shape=(3, 32, 32), batch_size=5, num_batches=4)
    assert isinstance(b, Batches) and b.source == "synthetic" and b.note is None
    assert len(b) == len(b.batches) == len(b.hashes) == 4
    for (x, y), h in zip(b, b.hashes):
        assert x.shape == (5, 3, 32, 32) and x.dtype == torch.float64 and x.device.type == "cpu"
        assert y.shape == (5,) and y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        expected = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
        assert h == expected == data.batch_hash(x, y)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.note = "changed"


def test_synthetic_is_deterministic_per_seed():
    a, b, c = synth(seed=3), synth(seed=3), synth(seed=4)
    assert a.hashes == b.hashes
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert set(a.hashes).isdisjoint(c.hashes)
    assert len(set(a.hashes)) == len(a.hashes)  # batches differ from each other
    assert synth(source="synthetic", seed=3).hashes == a.hashes


def test_synthetic_is_normalised_and_uses_all_classes():
    s = synth(batch_size=64, num_batches=4).stats()
    assert abs(s["x_mean"]) < 0.05 and 0.9 < s["x_std"] < 1.1
    assert s["samples"] == 256
    assert s["y_min"] == 0 and s["y_max"] == 9 and s["y_distinct"] == 10


def test_synthetic_data_is_learnable():
    b = synth(batch_size=32, num_batches=30, seed=1)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 12 * 12, 10)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for x, y in b:
        loss = nn.functional.cross_entropy(net(x.float()), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


def test_prototypes_are_lazy_and_few(monkeypatch):
    made = []
    real = data._prototype
    monkeypatch.setattr(data, "_prototype", lambda *a: made.append(a[-1]) or real(*a))
    b = synth(input_shape=(3, 224, 224), num_classes=1000, batch_size=2, num_batches=2)
    x, y = b[0]
    assert x.shape == (2, 3, 224, 224)
    labels = torch.cat([y for _, y in b]).tolist()
    assert sorted(made) == sorted(set(labels))  # one prototype per class that occurs
    assert b.note and "10 of the 1000 classes" in b.note
    assert all(0 <= label < 1000 for label in labels)


def test_many_classes_use_a_seeded_subset():
    s = synth(num_classes=100, batch_size=64, num_batches=4).stats()
    assert s["y_distinct"] == data.SYNTHETIC_MAX_CLASSES
    assert synth(num_classes=100).note == synth(num_classes=100).note


def test_samples_of_a_class_share_a_smooth_pattern():
    b = synth(batch_size=256, num_batches=1)
    x, y = b[0]
    means = torch.stack([x[y == c].mean(0) for c in range(2)])
    # averaging removes the noise; what is left is the class prototype, which
    # differs between classes and varies slowly from pixel to pixel
    assert (means[0] - means[1]).abs().mean() > 0.3
    step = (means[0, 0, :, 1:] - means[0, 0, :, :-1]).abs().mean()
    assert step < 0.5 * means[0].abs().mean()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(source="imagenet:/x"), "unknown data source"),
        (dict(source="synthetic:3"), "unknown data source"),
        (dict(source="npz:"), "needs a path"),
        (dict(batch_size=0), "batch_size"),
        (dict(num_batches=0), "num_batches"),
        (dict(num_classes=0), "num_classes"),
        (dict(input_shape=(28, 28)), "input shape"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(UsageError, match=match):
        synth(**kw)


# ---------------------------------------------------------------- MNIST


def idx_bytes(array: np.ndarray, magic: int | None = None, dims=None) -> bytes:
    array = np.asarray(array, dtype=np.uint8)
    magic = (2048 + array.ndim) if magic is None else magic
    dims = array.shape if dims is None else dims
    return struct.pack(">I", magic) + struct.pack(f">{len(dims)}I", *dims) + array.tobytes()


def write_mnist(directory, n=12, *, kind="train", sep="-", gz=False, images=None, labels=None):
    directory.mkdir(parents=True, exist_ok=True)
    y = np.arange(n) % 10
    # image i holds the value 20 * label everywhere (so pairs stay checkable), pixel 0 is 255
    x = np.repeat((20 * y).astype(np.uint8), 28 * 28).reshape(n, 28, 28)
    x[:, 0, 0] = 255
    images = idx_bytes(x) if images is None else images
    labels = idx_bytes(y) if labels is None else labels
    opener = gzip.open if gz else open
    ext = ".gz" if gz else ""
    paths = []
    for what, dims, payload in (("images", "idx3", images), ("labels", "idx1", labels)):
        path = directory / f"{kind}-{what}{sep}{dims}-ubyte{ext}"
        with opener(path, "wb") as f:
            f.write(payload)
        paths.append(path)
    return paths


def mnist(directory, **kw):
    args = dict(input_shape=(1, 28, 28), num_classes=10, batch_size=4, num_batches=3, seed=0)
    args.update(kw)
    return load_batches(f"mnist:{directory}", **args)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("kind, sep", [("train", "-"), ("train", "."), ("t10k", "-")])
def test_mnist_reads_and_normalises(tmp_path, gz, kind, sep):
    write_mnist(tmp_path, kind=kind, sep=sep, gz=gz)
    b = mnist(tmp_path)
    assert b.source == f"mnist:{tmp_path}" and b.note is None
    xs = torch.cat([x for x, _ in b])
    ys = torch.cat([y for _, y in b])
    assert xs.shape == (12, 1, 28, 28) and xs.dtype == torch.float64 and ys.dtype == torch.int64
    assert sorted(ys.tolist()) == sorted((np.arange(12) % 10).tolist())  # each sample once
    raw = (xs * data.MNIST_STD + data.MNIST_MEAN) * 255  # undo the normalisation
    assert torch.allclose(raw[:, 0, 0, 0], torch.full((12,), 255.0, dtype=torch.float64))
    assert torch.allclose(raw[:, 0, 5, 5], 20.0 * ys.double())  # images still match labels
    assert torch.isclose(xs.max(), torch.tensor((1 - 0.1307) / 0.3081, dtype=torch.float64))
    assert ys.tolist() != list(np.arange(12) % 10)  # shuffled (seeded)


def test_mnist_order_is_seeded(tmp_path):
    write_mnist(tmp_path, n=40)
    assert mnist(tmp_path, seed=1).hashes == mnist(tmp_path, seed=1).hashes
    assert mnist(tmp_path, seed=1).hashes != mnist(tmp_path, seed=2).hashes


def test_mnist_prefers_train_over_t10k(tmp_path):
    write_mnist(tmp_path, n=12, kind="train")
    write_mnist(tmp_path, n=20, kind="t10k")
    assert mnist(tmp_path, batch_size=20, num_batches=1).note  # only 12: cycled


def test_mnist_cycles_when_short(tmp_path):
    write_mnist(tmp_path, n=5)
    b = mnist(tmp_path, batch_size=4, num_batches=3)
    assert "only 5 samples" in b.note and "12" in b.note
    ys = torch.cat([y for _, y in b]).tolist()
    assert ys[:5] == ys[5:10] and sorted(ys[:5]) == [0, 1, 2, 3, 4]


def test_mnist_needs_28x28_single_channel(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(UsageError, match="1x28x28 but the model expects 3x32x32"):
        mnist(tmp_path, input_shape=(3, 32, 32))


def test_mnist_labels_beyond_the_model(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(UsageError, match=r"labels span 0\.\.9, outside 0\.\.4"):
        mnist(tmp_path, num_classes=5)


def good_images(n=12):
    return idx_bytes(np.zeros((n, 28, 28), np.uint8))


def good_labels(n=12):
    return idx_bytes(np.arange(n) % 10)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    "images, labels, match",
    [
        (idx_bytes(np.zeros((12, 28, 28)), magic=2049), None, r"images-idx3-ubyte.*bad magic number 2049, expected 2051"),
        (None, idx_bytes(np.arange(12) % 10, magic=2051), r"labels-idx1-ubyte.*bad magic number 2051, expected 2049"),
        (good_images()[:-100], None, r"images-idx3-ubyte.*truncated, 9324 bytes but its header \(12x28x28\) needs 9424"),
        (None, good_labels()[:5], r"labels-idx1-ubyte.*truncated, only 5 bytes"),
        (good_images() + b"\0", None, "1 bytes beyond what its header"),
        (good_images(11), None, "holds 11 images but .* holds 12 labels"),
        (idx_bytes(np.zeros((12, 32, 32))), None, "images are 32x32, MNIST needs 28x28"),
    ],
)
def test_mnist_bad_files(tmp_path, gz, images, labels, match):
    write_mnist(tmp_path, gz=gz, images=images, labels=labels)
    with pytest.raises(UsageError, match=match) as err:
        mnist(tmp_path)
    assert "\n" not in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_mnist_missing_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        mnist(tmp_path / "nope")
    with pytest.raises(UsageError, match="no MNIST files in .*train-images-idx3-ubyte"):
        mnist(tmp_path)
    images, labels = write_mnist(tmp_path)
    labels.unlink()
    with pytest.raises(UsageError, match="train-images-idx3-ubyte has no labels file"):
        mnist(tmp_path)


def test_mnist_corrupt_gzip(tmp_path):
    images, _ = write_mnist(tmp_path, gz=True)
    images.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(UsageError, match="cannot read"):
        mnist(tmp_path)


# ---------------------------------------------------------------- npz


def npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def from_npz(path, **kw):
    args = dict(input_shape=(1, 4, 4), num_classes=3, batch_size=2, num_batches=2, seed=0)
    args.update(kw)
    return load_batches(f"npz:{path}", **args)


def test_npz_good(tmp_path):
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 4, 4)  # N,H,W: single channel
    y = np.array([0, 1, 2, 1], dtype=np.uint8)
    b = from_npz(npz(tmp_path, x=x, y=y))
    assert b.source == f"npz:{tmp_path / 'd.npz'}" and b.note is None
    xs = torch.cat([x for x, _ in b])
    ys = torch.cat([y for _, y in b])
    assert xs.shape == (4, 1, 4, 4) and xs.dtype == torch.float64 and ys.dtype == torch.int64
    for xi, yi in zip(xs, ys):  # values used as given, pairs kept
        i = int(xi[0, 0, 0]) // 16
        assert torch.equal(xi[0], torch.from_numpy(x[i]).double()) and yi == y[i]
    s = b.stats()
    assert s["x_min"] == 0 and s["x_max"] == 63 and s["y_distinct"] == 3


def test_npz_with_channels_and_cycling(tmp_path):
    x = np.random.default_rng(0).normal(size=(3, 3, 4, 4))
    path = npz(tmp_path, x=x, y=np.array([0, 1, 2]))
    b = from_npz(path, input_shape=(3, 4, 4))
    assert b[0][0].shape == (2, 3, 4, 4) and "only 3 samples" in b.note


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(x=np.zeros((4, 4, 4))), r"no array 'y' \(found: x\)"),
        (dict(y=np.zeros(4, int)), r"no array 'x'"),
        (dict(x=np.zeros((4, 1, 5, 5)), y=np.zeros(4, int)), r"x has shape \(4, 1, 5, 5\), expected \(N, 1, 4, 4\)"),
        (dict(x=np.zeros((4, 16)), y=np.zeros(4, int)), "x has shape"),
        (dict(x=np.zeros((4, 4, 4)), y=np.zeros(3, int)), r"y has shape \(3,\), expected \(4,\)"),
        (dict(x=np.zeros((4, 4, 4)), y=np.zeros(4)), "y has dtype float64, expected integer"),
        (dict(x=np.zeros((4, 4, 4)), y=np.array([0, 1, 3, 0])), r"labels span 0\.\.3, outside 0\.\.2"),
        (dict(x=np.zeros((4, 4, 4)), y=np.array([0, -1, 2, 0])), "labels span -1..2"),
        (dict(x=np.full((4, 4, 4), np.nan), y=np.zeros(4, int)), "NaN"),
        (dict(x=np.zeros((0, 4, 4)), y=np.zeros(0, int)), "no samples"),
        (dict(x=np.array([["a"] * 4] * 4), y=np.zeros(4, int)), "expected numbers"),
    ],
)
def test_npz_bad(tmp_path, arrays, match):
    path = npz(tmp_path, **arrays)
    with pytest.raises(UsageError, match=match) as err:
        from_npz(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_npz_unreadable(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        from_npz(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(UsageError, match="cannot read as .npz") as err:
        from_npz(junk)
    # numpy's own message invites allow_pickle=True (running code from the file): never relayed
    assert "allow_pickle" not in str(err.value) and "never loads" in str(err.value)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(UsageError, match="not an .npz archive"):
        from_npz(single)
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([None] * 4, dtype=object), y=np.zeros(4, int))
    with pytest.raises(UsageError, match="cannot read arrays"):
        from_npz(objects)


# ---------------------------------------------------------------- hash_state_dict


def test_hash_state_dict():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    h = hash_state_dict(net)
    assert len(h) == 64 and h == hash_state_dict(net.state_dict())
    reordered = OrderedDict(reversed(list(net.state_dict().items())))
    assert hash_state_dict(reordered) == h  # key order does not matter
    assert hash_state_dict(net.double()) == h  # float32 values are exact in float64
    with torch.no_grad():
        net[0].weight[0, 0, 0, 0] += 1e-6
    assert hash_state_dict(net) != h
    # the same numbers under another name or shape hash differently
    t = torch.arange(6.0)
    assert hash_state_dict({"a": t}) != hash_state_dict({"b": t})
    assert hash_state_dict({"a": t}) != hash_state_dict({"a": t.reshape(2, 3)})


def test_npz_that_would_expand_past_the_limit_is_refused_before_loading(tmp_path, monkeypatch):
    import zipfile

    import convcheck.plan.data_files as readers

    path = tmp_path / "big.npz"
    np.savez_compressed(path, x=np.zeros((64, 1, 28, 28)), y=np.zeros(64, dtype=np.int64))
    with zipfile.ZipFile(path) as z:
        total = sum(i.file_size for i in z.infolist())
    monkeypatch.setattr(readers, "MAX_IDX_BYTES", total - 1)  # the same check, with a small limit
    with pytest.raises(UsageError, match="would expand to .* GiB, more than"):
        load_batches(f"npz:{path}", input_shape=(1, 28, 28), num_classes=10, batch_size=4, num_batches=1, seed=0)
