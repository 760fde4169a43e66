"""FP8 emulated on the CPU (``runners/fp8.py``): the worked example of a target kind that is one file.

The kind registers itself (listed by ``convcheck targets`` and ``compare --help``), rounds the
operands of every matmul/conv to E4M3/E5M2 forward and backward, its parity rows are held against
floors in its own format, and an overflow of its range is named by the overflow rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.numerics.formats import FLOAT32, FP8_E4M3, FP8_E5M2
from convcheck.pipeline import compare
from convcheck.targets.runners.fp8 import EmulatedFP8Runner
from convcheck.targets.runners.precision import round_to
from convcheck.targets.spec import Target

SPECS = {"cpu:emulate-fp8-e4m3": FP8_E4M3, "cpu:emulate-fp8-e5m2": FP8_E5M2}
MNIST_SHAPE = dict(input_shape=(1, 28, 28), num_classes=10)


@pytest.mark.parametrize("spec, fmt", SPECS.items())
def test_the_spec_parses_to_its_runner_and_format(spec, fmt):
    t = Target.parse(spec)
    assert type(t.runner) is EmulatedFP8Runner and str(t) == spec and t.runner.format is fmt
    p = t.runner.precision
    assert p.matmul.operand is fmt and p.conv.operand is fmt and p.matmul.accumulate is FLOAT32
    assert p.elementwise.operand is FLOAT32 and p.working is fmt and p.narrowest is fmt
    assert t.unit_roundoff == fmt.unit_roundoff and t.param_dtype == t.compute_dtype == torch.float32
    assert not t.runner.tf32_like and not t.runner.half_compute


def test_fp8_is_for_the_cpu_only():
    with pytest.raises(UsageError, match="is for the cpu"):
        Target.parse("cuda:emulate-fp8-e4m3")


@pytest.mark.parametrize("spec, fmt", SPECS.items())
def test_matmul_and_conv_operands_are_rounded_forward_and_backward(spec, fmt):
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 32, generator=gen), torch.randn(16, 32, generator=gen)
    img, k = torch.randn(2, 3, 8, 8, generator=gen), torch.randn(4, 3, 3, 3, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, w, img, k)]
    with Target.parse(spec).applied():
        lin, conv = F.linear(leaves[0], leaves[1]), F.conv2d(leaves[2], leaves[3])
        (lin.sum() + conv.sum()).backward()
    r = [round_to(t, fmt) for t in (x, w, img, k)]
    assert torch.equal(lin, F.linear(r[0], r[1])) and torch.equal(conv, F.conv2d(r[2], r[3]))
    assert torch.equal(leaves[1].grad, round_to(torch.ones(8, 16), fmt).T @ r[0])  # dW = dY^T X on rounded operands
    assert not torch.equal(lin, F.linear(x, w))
    plain = x.clone()
    with Target.parse(spec).applied():
        assert torch.equal(plain + 1, x + 1)  # element-wise ops keep float32


def test_the_targets_command_and_compare_help_list_them(capsys):
    assert main(["targets"]) == 0
    listing = capsys.readouterr().out
    for spec in SPECS:
        line = next(ln for ln in listing.splitlines() if ln.startswith(spec + " "))
        assert " here " in line and "FP8" in line
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert all(spec in text for spec in SPECS)


def test_lenet_on_e4m3_is_judged_against_e4m3_floors():
    r = compare("lenet", "cpu,cpu:emulate-fp8-e4m3", steps=3, envelope=0, env_findings=[])
    assert r.verdict.category == "ok", r.verdict.headline
    rows = r.parity.layers[r.parity.layers["target"] == "cpu:emulate-fp8-e4m3"]
    convs = rows[(rows["kind"] == "forward") & rows["module"].isin(["Conv2d", "Linear"])]
    assert len(convs) == 5 and (convs["u"] == FP8_E4M3.unit_roundoff).all()
    assert ((convs["floor"] > 1e-3) & (convs["floor"] < 0.1)).all()  # FP8's own floor, not float32's
    assert not rows["flagged"].any()


class Gain(nn.Module):
    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def gain_net(gain: float) -> nn.Module:
    """Values scaled by ``gain`` in float32 (element-wise) right before a Linear reads them in FP8."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), Gain(gain), nn.Linear(32, 10))


def test_values_beyond_448_are_an_e4m3_overflow_though_e4m3_saturates():
    r = compare(lambda: gain_net(3e3), "cpu,cpu:emulate-fp8-e4m3", steps=3, envelope=0, env_findings=[],
                **MNIST_SHAPE)
    v = r.verdict
    assert v.category == "numerics" and v.target == "cpu:emulate-fp8-e4m3" and v.layer == "2", v.headline
    assert v.headline.startswith("float8_e4m3fn overflow in '2' on cpu:emulate-fp8-e4m3: the matmul/conv reading "
                                 "its values saturates them at 448"), v.headline
    assert any("below 448" in rem for rem in v.remedies), v.remedies
    assert not r.parity.layers[["nan", "inf"]].to_numpy().any()  # saturated: no NaN/Inf anywhere


def test_values_beyond_57344_are_an_e5m2_overflow_to_inf():
    r = compare(lambda: gain_net(1e6), "cpu,cpu:emulate-fp8-e5m2", steps=3, envelope=0, env_findings=[],
                **MNIST_SHAPE)
    v = r.verdict
    assert v.category == "numerics" and v.target == "cpu:emulate-fp8-e5m2", v.headline
    assert v.headline.startswith("float8_e5m2 overflow in '3' on cpu:emulate-fp8-e5m2: it produces the first Inf"), \
        v.headline
    assert "> 57344" in v.headline


def test_the_same_gain_is_no_overflow_in_float32_range():
    r = compare(lambda: gain_net(3e3), "cpu,cpu:emulate-fp8-e5m2", steps=3, envelope=0, env_findings=[],
                **MNIST_SHAPE)
    assert "overflow" not in r.verdict.headline, r.verdict.headline
