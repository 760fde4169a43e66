"""``--data npz:PATH`` / ``mnist:DIR`` tell a user model's input shape when the model declares none
(new-user trial 3: an npz of N x 1 x 8 x 8 images still stopped with "pass --input-shape")."""

from __future__ import annotations

import numpy as np
import pytest

from convcheck.cli.main import main
from convcheck.plan.data_files import npz_input_shape

MODELS = '''
import torch.nn as nn


def small_cnn():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 3))


def mlp():  # no Conv2d: no size can be tried
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 3))
'''


def _npz(path, shape, n=96, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, *shape)).astype(np.float32) + y.reshape(-1, *[1] * len(shape)) * 0.5
    np.savez(path, x=x, y=y)
    return path


@pytest.mark.parametrize("shape, expected", [((1, 8, 8), (1, 8, 8)), ((8, 8), (1, 8, 8)), ((3, 4, 4), (3, 4, 4)),
                                             ((6,), None), ((2, 3, 4, 5), None)])
def test_one_sample_shape_from_the_header(tmp_path, shape, expected):
    assert npz_input_shape(str(_npz(tmp_path / "d.npz", shape, n=4))) == expected


def test_no_shape_from_what_is_not_an_npz(tmp_path):
    (tmp_path / "t.npz").write_text("not a zip")
    assert npz_input_shape(str(tmp_path / "t.npz")) is None
    assert npz_input_shape(str(tmp_path / "missing.npz")) is None


@pytest.mark.parametrize("factory, shape", [("small_cnn", (1, 8, 8)), ("small_cnn", (8, 8)), ("mlp", (3, 4, 4))])
def test_compare_takes_the_input_shape_from_the_npz(tmp_path, capsys, factory, shape):
    (tmp_path / "models.py").write_text(MODELS)
    data = _npz(tmp_path / "mine.npz", shape)
    code = main(["compare", "--model", f"{tmp_path / 'models.py'}:{factory}", "--data", f"npz:{data}",
                 "--targets", "cpu,cpu:bf16", "--steps", "4", "--envelope", "1", "--no-save", "--threads", "1"])
    out = capsys.readouterr()
    assert "--input-shape" not in out.out + out.err
    assert code in (0, 1), out.err  # a verdict, not a usage error
    c, h, w = (1,) * (3 - len(shape)) + shape
    assert f"input {c}x{h}x{w}" in out.out


def test_an_explicit_input_shape_still_wins(tmp_path, capsys):
    (tmp_path / "models.py").write_text(MODELS)
    data = _npz(tmp_path / "mine.npz", (1, 8, 8))
    code = main(["compare", "--model", f"{tmp_path / 'models.py'}:small_cnn", "--data", f"npz:{data}",
                 "--input-shape", "1,6,6", "--targets", "cpu,cpu:bf16", "--steps", "2", "--no-save"])
    assert code == 2
    assert "rejects input shape 1x6x6" in capsys.readouterr().err  # --input-shape, not the data's 1x8x8


def test_a_channels_last_npz_says_so(tmp_path, capsys):
    """Review: an N x 32 x 32 x 3 x was taken as 32 channels ('expected 3 channels, but got 32')."""
    (tmp_path / "models.py").write_text(MODELS.replace("nn.Conv2d(1, 8, 3, padding=1)", "nn.Conv2d(3, 8, 3, padding=1)")
                                        .replace("8 * 8 * 8", "8 * 32 * 32"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "hwc.npz", x=rng.normal(size=(16, 32, 32, 3)).astype(np.float32), y=rng.integers(0, 3, 16))
    code = main(["compare", "--model", f"{tmp_path / 'models.py'}:small_cnn", "--data", f"npz:{tmp_path / 'hwc.npz'}",
                 "--targets", "cpu,cpu:bf16", "--steps", "2", "--no-save"])
    err = capsys.readouterr().err
    assert code == 2
    assert "x has shape (16, 32, 32, 3), expected (N, 3, 32, 32) (channels last: save x.transpose(0, 3, 1, 2))" in err
