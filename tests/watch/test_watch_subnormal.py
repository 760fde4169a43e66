"""A float16 model whose gradients sink into float16's subnormal range shows, at step 0, one factor on every
gradient - as a loss multiplied by a constant would. The diff names the underflow (numerics, GradScaler) when the
gradients are that small, and keeps calling a loss scaled in the script a setup difference when they are not."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck
from convcheck.analysis.diff import diff_watched


def _regression(out, half: bool, loss_weight: float, steps: int = 6) -> None:
    """A user's regression: an auxiliary task whose loss is down-weighted by ``loss_weight``, SGD with the lr scaled
    up to match; ``half``: ``model.half()`` and half inputs, no GradScaler."""
    convcheck.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if half:
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 / loss_weight)
    g = torch.Generator().manual_seed(2)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(64, 8, generator=g)
            y = x[:, :1] * 0.5
            if half:
                x, y = x.half(), y.half()
            loss = loss_weight * nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_float16_gradients_in_the_subnormal_range_are_an_underflow(tmp_path):
    _regression(tmp_path / "fp32", half=False, loss_weight=1e-6)
    _regression(tmp_path / "fp16", half=True, loss_weight=1e-6)
    v = diff_watched(tmp_path / "fp32", tmp_path / "fp16").verdict
    assert v.category == "numerics", v.headline
    assert v.headline == "gradient underflow in B: its gradients at step 0 lie in float16's subnormal range"
    assert "GradScaler" in v.remedies[0]


def test_a_loss_multiplied_by_a_constant_stays_a_setup_difference(tmp_path):
    """The same float16 model with gradients in float16's normal range: one run's loss scaled by 4 is the recipe."""

    def scaled(out, factor):
        convcheck.seed_everything(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(2)
        with convcheck.watch(model, opt, out=out) as w:
            for _ in range(4):
                x = torch.randn(64, 8, generator=g).half()
                loss = nn.functional.mse_loss(model(x), x[:, :1] * 0.5)
                opt.zero_grad()
                (loss * factor).backward()
                opt.step()
                w.step(loss)

    scaled(tmp_path / "a", 1.0)
    scaled(tmp_path / "b", 4.0)
    v = diff_watched(tmp_path / "a", tmp_path / "b").verdict
    assert v.category == "setup" and "underflow" not in v.headline, v.headline
