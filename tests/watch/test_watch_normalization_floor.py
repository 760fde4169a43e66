"""A BatchNorm's statistics are sums over the whole batch: how exactly a kernel forms them is part of its float32
floor. The CPU's channels_last BatchNorm sums one element after another (100x the error of the contiguous kernel's
on a 16x32x64x64 input, still a float32 implementation), so a healthy model moved to channels_last is a healthy pair;
a normalization that loses its variance (E[x^2] - E[x]^2 on values far from their mean) is still named.

Written as a user writes it: an image classifier with BatchNorm trained twice, the second run with
``model.to(memory_format=torch.channels_last)`` and its inputs likewise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.measure.parity import floor
from convcheck.numerics import metrics
from convcheck.report.verdict_lines import unwrapped


class SquaresNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def _images(n: int = 384, s: int = 24):
    """Noisy images, each with a bright (class 1) or dark (class 2) square, or none (class 0)."""
    g = torch.Generator().manual_seed(7)
    x = 0.5 * torch.randn(n, 1, s, s, generator=g) + 1.0
    y = torch.randint(0, 3, (n,), generator=g)
    for i in range(n):
        if y[i]:
            r, c = torch.randint(0, s - 6, (2,), generator=g).tolist()
            x[i, 0, r:r + 6, c:c + 6] += 1.5 if y[i] == 1 else -1.5
    return x, y


def _train(out, channels_last: bool, steps: int = 12) -> None:
    torch.manual_seed(0)
    model = SquaresNet()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_all, y_all = _images()
    with convcheck.watch(model, opt, out=out) as w:
        for k in range(steps):
            x, y = x_all[32 * k:32 * (k + 1)], y_all[32 * k:32 * (k + 1)]
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_a_batchnorm_model_in_channels_last_against_itself_contiguous_is_ok(tmp_path, capsys):
    _train(tmp_path / "contiguous", channels_last=False)
    _train(tmp_path / "channels_last", channels_last=True)
    code = main(["diff", str(tmp_path / "contiguous"), str(tmp_path / "channels_last"), "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: ok: "), out
    assert "computes beyond its floor" not in out
    assert code == 0


def test_the_same_pair_over_too_few_steps_to_judge_the_outcome_is_inconclusive(tmp_path, capsys):
    """Six steps: the runs part in bn1 by the kernels' rounding, the judge finds every layer within its floor, and
    there are too few steps to see how they end. Which kernel a run used is judged by the outcome: without one the
    verdict says so (exit 5) and how to get one - not a ``numerics`` finding (exit 1), not an ``ok``."""
    _train(tmp_path / "contiguous", channels_last=False, steps=6)
    _train(tmp_path / "channels_last", channels_last=True, steps=6)
    code = main(["diff", str(tmp_path / "contiguous"), str(tmp_path / "channels_last"), "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict == ("verdict: inconclusive: the runs part at step 0 in bn1, as their precisions can explain, but "
                       "too few steps were recorded to judge whether it changes how they end"), out
    assert "float64 judge on B: every replayed layer within its floor" in out
    assert "remedy: record at least 10 steps in each run" in out
    assert code == 5


def test_the_floor_of_a_normalization_grows_with_its_reduction_and_its_inputs_offset():
    """The term a flagged normalization row's floor takes: u * sqrt(K) * sqrt(E[x^2] / (var + eps)), K its
    reduction (a BatchNorm's batch and positions in training, 1 in eval: no sum); none for other elementwise ops."""
    from convcheck.measure.parity.floor import normalization_spread
    from convcheck.numerics.metrics import reduction_length

    g = torch.Generator().manual_seed(0)
    centred, offset = torch.randn(16, 8, 32, 32, generator=g), torch.randn(16, 8, 32, 32, generator=g) + 10.0
    bn = nn.BatchNorm2d(8)
    assert floor.normalization_spread(bn, centred.double()) == pytest.approx(1.0, rel=1e-2)
    assert floor.normalization_spread(bn, offset.double()) == pytest.approx(101 ** 0.5, rel=1e-2)
    assert metrics.reduction_length(bn, (centred,), centred) == 16 * 32 * 32
    assert metrics.reduction_length(bn.eval(), (centred,), centred) == 1
    ln = nn.LayerNorm(64)
    assert metrics.reduction_length(ln, (torch.randn(4, 64),), None) == 64
    inorm = nn.InstanceNorm2d(8)
    assert metrics.reduction_length(inorm, (centred,), centred) == 32 * 32
    assert floor.normalization_spread(nn.RMSNorm(64), torch.randn(4, 64).double() + 100) == 1.0
