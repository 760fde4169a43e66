"""TF32 rounds like the hardware (issue 29): the rounding mode is part of the number format.

NVIDIA's tensor cores read float32 operands as TF32 rounded to nearest, ties away from zero
(``TF32``, ``cpu:emulate-tf32``: pytorch/pytorch#53635's ``[1024.5] @ [[1.0]]`` is 1025);
ROCm gfx942's xf32 truncates (``TF32_RZ``, ``cpu:emulate-tf32-rz``). The rounding is checked
bit pattern by bit pattern against an arithmetic reference (no bit tricks), at the ties and the
edges of the range; truncation's bias is measured; the floors round as the operands do.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.measure.parity import run_parity
from convcheck.numerics.formats import FLOAT32, RNA, RNE, RZ, TF32, TF32_RZ
from convcheck.pipeline import compare
from convcheck.targets.runners.emulation import EmulateTF32, round_to_tf32
from convcheck.targets.runners.precision import round_to
from convcheck.targets.runners.tf32_rz import TruncatedTF32Runner
from convcheck.targets.spec import Target

TF32_RNE = replace(TF32, rounding=RNE)
BY_MODE = {RNE: TF32_RNE, RNA: TF32, RZ: TF32_RZ}


# --- the published case ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, expected", [(TF32, 1025.0), (TF32_RNE, 1024.0), (TF32_RZ, 1024.0)], ids=str)
def test_pytorch_53635_1024_5_times_one(fmt, expected):
    """1024.5 lies halfway between the TF32 neighbours 1024 and 1025 (10 stored bits at 2^10)."""
    a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    with EmulateTF32(fmt):
        assert (a @ b).item() == expected
        assert F.linear(a, b).item() == expected
        assert F.conv2d(a.view(1, 1, 1, 1), b.view(1, 1, 1, 1)).item() == expected
    assert (a @ b).item() == 1024.5  # float32 outside the emulation


@pytest.mark.parametrize("spec, expected", [("cpu:emulate-tf32", 1025.0), ("cpu:emulate-tf32-rz", 1024.0),
                                            ("cpu", 1024.5)])
def test_the_targets_reproduce_the_hardware(spec, expected):
    a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    with Target.parse(spec).applied():
        assert (a @ b).item() == expected


# --- the rounding, bit pattern by bit pattern ---------------------------------------------------------

def reference(bits: np.ndarray, rounding: str) -> np.ndarray:
    """The float32 values of ``bits`` rounded to TF32 by arithmetic in float64: the grid step of each
    value's binade (2^-136 for float32 subnormals), the integer part and the remainder, then the rule."""
    x = bits.view(np.float32).astype(np.float64)
    mag = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    step = np.exp2(np.maximum(e, -126) - 10)  # TF32: 10 stored bits, float32's smallest normal exponent
    # log2 may round at a binade's edge: put every value in [2^e, 2^(e+1)) exactly
    step = np.where((mag >= 2 * np.exp2(e)) & (e >= -126), step * 2, step)
    step = np.where((mag < np.exp2(e)) & (e > -126), step / 2, step)
    scaled = mag / step  # exact: a power-of-two scaling
    whole = np.floor(scaled)
    rest = scaled - whole
    if rounding == RZ:
        up = np.zeros_like(rest, dtype=bool)
    elif rounding == RNA:
        up = rest >= 0.5
    else:
        up = (rest > 0.5) | ((rest == 0.5) & (np.mod(whole, 2) == 1))
    out = np.copysign((whole + up) * step, x)
    out = np.where(np.abs(out) > TF32.largest, np.copysign(np.inf, x), out)  # rounded past the top
    return np.where(np.isfinite(x), out, x).astype(np.float32)


def patterns() -> np.ndarray:
    """Every low-13-bit pattern (the bits TF32 drops: ties at 0x1000) under kept mantissas at both ends
    and the middle, in subnormal, small, unit, large and top binades, both signs: 2^20 bit patterns."""
    exponents = np.array([0, 1, 2, 112, 126, 127, 128, 137, 253, 254], dtype=np.int64)
    kept = np.array([0, 1, 2, 3, 511, 512, 513, 1021, 1022, 1023], dtype=np.int64)
    low = np.arange(1 << 13, dtype=np.int64)
    e, k, lo = np.meshgrid(exponents, kept, low, indexing="ij")
    mag = (e << 23) | (k << 13) | lo
    both = np.concatenate([mag.ravel(), mag.ravel() | (1 << 31)])
    return both.astype(np.uint32).view(np.int32)


def same_bits(got: torch.Tensor, want: np.ndarray) -> np.ndarray:
    g = got.numpy().view(np.int32)
    w = want.view(np.int32)
    nan = np.isnan(got.numpy()) & np.isnan(want)
    return (g == w) | nan


@pytest.mark.parametrize("rounding", [RNE, RNA, RZ])
def test_every_bit_pattern_around_the_ties_rounds_as_its_rule_says(rounding):
    bits = patterns()
    got = round_to(torch.from_numpy(bits.copy()).view(torch.float32), BY_MODE[rounding])
    want = reference(bits, rounding)
    ok = same_bits(got, want)
    assert ok.all(), [(hex(b & 0xFFFFFFFF), float(g), float(w)) for b, g, w in
                      zip(bits[~ok][:5], got.numpy()[~ok][:5], want[~ok][:5])]
    assert int((got.view(torch.int32) & 0x1FFF).abs().sum()) == 0  # at most 10 stored bits, subnormals too


@pytest.mark.slow
@pytest.mark.parametrize("rounding", [RNE, RNA, RZ])
def test_every_float32_with_one_exponent_rounds_as_its_rule_says(rounding):
    """Exhaustive over one binade's 2^23 mantissas, each sign, around 1.0 (both ties and every non-tie)."""
    mag = (np.int64(127) << 23) | np.arange(1 << 23, dtype=np.int64)
    bits = np.concatenate([mag, mag | (1 << 31)]).astype(np.uint32).view(np.int32)
    got = round_to(torch.from_numpy(bits.copy()).view(torch.float32), BY_MODE[rounding])
    assert same_bits(got, reference(bits, rounding)).all()


def f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


EDGES = {  # bit pattern -> (RNE, RNA, RZ), as float32 values
    0x00000001: (0.0, 0.0, 0.0),  # the smallest subnormal: below half of TF32's 2^-136
    0x00001000: (0.0, 2.0**-136, 0.0),  # 2^-137: halfway between 0 and 2^-136
    0x00003000: (2.0**-135, 2.0**-135, 2.0**-136),  # 3 x 2^-137: halfway, 2^-136 odd
    0x00001FFF: (2.0**-136, 2.0**-136, 0.0),
    0x007FFFFF: (2.0**-126, 2.0**-126, f32(0x007FE000)),  # the largest subnormal carries into the normals
    0x00800000: (2.0**-126, 2.0**-126, 2.0**-126),  # the smallest normal is TF32's
    0x7F7FE000: (TF32.largest,) * 3,  # TF32's largest finite is kept
    0x7F7FEFFF: (TF32.largest,) * 3,  # just below halfway to 2^128
    0x7F7FF000: (math.inf, math.inf, TF32.largest),  # halfway to 2^128: overflows to Inf rounding up
    0x7F7FFFFF: (math.inf, math.inf, TF32.largest),  # float32's largest finite: Inf, but not truncated
    0x7F800000: (math.inf,) * 3,
    0x44801000: (1024.0, 1025.0, 1024.0),  # 1024.5
}


@pytest.mark.parametrize("sign", [0, 1 << 31], ids=["plus", "minus"])
@pytest.mark.parametrize("rounding", [RNE, RNA, RZ])
def test_the_edges_subnormals_largest_finite_and_overflow(rounding, sign):
    col = [RNE, RNA, RZ].index(rounding)
    x = torch.tensor([f32(b | sign) for b in EDGES], dtype=torch.float32)
    want = torch.tensor([v[col] for v in EDGES.values()], dtype=torch.float32) * (-1 if sign else 1)
    got = round_to(x, BY_MODE[rounding])
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(torch.signbit(got), torch.signbit(x))  # -0.0 stays negative
    assert TF32.largest == f32(0x7F7FE000)


@pytest.mark.parametrize("rounding", [RNE, RNA, RZ])
def test_nan_inf_and_zeros_are_kept(rounding):
    nan_payloads = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00001]
    x = torch.tensor([f32(b) for b in [*nan_payloads, 0x7F800000, 0xFF800000, 0, 0x80000000]])
    got = round_to(x, BY_MODE[rounding])
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))  # NaN payloads too: never rounded into Inf


def test_float64_floors_round_as_the_float32_operands_do():
    """The floors round float64 references of float32 values: the same result, rounding by rounding."""
    bits = patterns()
    x = torch.from_numpy(bits.copy()).view(torch.float32)
    normal = torch.isfinite(x) & (x.abs() >= FLOAT32.smallest_normal)
    x = x[normal]
    for fmt in BY_MODE.values():
        wide, narrow = round_to(x.double(), fmt), round_to(x, fmt).double()
        # float64 keeps its range: a value rounding up past TF32's largest is 2^128 there, Inf in float32
        past = narrow.isinf()
        assert torch.equal(wide[~past], narrow[~past]), fmt.rounding
        assert (wide[past].abs() == 2.0**128).all() and (past.sum() == 0) == (fmt.rounding == RZ)


def test_the_frexp_form_rounds_as_the_bits_do():
    """float64 subnormals go the frexp way: the same rule on the scaled significand."""
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-11 + 2.0**-30, 1024.5], dtype=torch.float64)
    tiny = torch.tensor([5e-324], dtype=torch.float64)  # forces the frexp path
    zeros = round_to(torch.tensor([-0.0, 0.0, 5e-324], dtype=torch.float64), TF32)
    assert torch.signbit(zeros[:2]).tolist() == [True, False]  # -0.0 stays negative there too
    for fmt, want in [(TF32, [1 + 2.0**-10, 1 + 2.0**-9, 1 + 2.0**-10, 1025.0]),
                      (TF32_RNE, [1.0, 1 + 2.0**-9, 1 + 2.0**-10, 1024.0]),
                      (TF32_RZ, [1.0, 1 + 2.0**-10, 1.0, 1024.0])]:
        both = round_to(torch.cat([x, -x, tiny]), fmt)
        assert both[:4].tolist() == want and both[4:8].tolist() == [-w for w in want], fmt.rounding


# --- bias ---------------------------------------------------------------------------------------------

def test_truncation_is_biased_toward_zero_and_ties_away_is_not():
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 4)
    rel = {m: ((round_to(x, f).double() - x.double()) / x.double().abs() * x.sign()) for m, f in BY_MODE.items()}
    rz, rna = rel[RZ].mean().item(), rel[RNA].mean().item()
    assert rz < -2e-4  # every operand's magnitude shrinks: about -0.72 x 2^-11 on average
    assert abs(rna) < 0.02 * abs(rz)  # to nearest: errors of both signs
    assert (rel[RZ] <= 0).all() and rel[RZ].min().item() > -2.0**-10  # at most a whole ulp: TF32_RZ's u
    assert TF32_RZ.unit_roundoff == 2.0**-10 and TF32.unit_roundoff == 2.0**-11


def test_truncated_matmuls_and_convs_come_out_smaller():
    """Positive operands (post-ReLU activations, a positive kernel): truncated, every product and sum
    shrinks, so the mean relative error of the results is about -2 x 0.72 x 2^-11; to nearest it is ~0."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.rand(64, 256, generator=gen) + 0.1, torch.rand(256, 64, generator=gen) + 0.1
    img, k = torch.rand(4, 8, 12, 12, generator=gen), torch.rand(16, 8, 3, 3, generator=gen)
    exact = {"mm": a.double() @ b.double(), "conv": F.conv2d(img.double(), k.double())}
    mean = {}
    for fmt in (TF32, TF32_RZ):
        with EmulateTF32(fmt):
            got = {"mm": a @ b, "conv": F.conv2d(img, k)}
        mean[fmt.rounding] = {op: ((got[op].double() - exact[op]) / exact[op]).mean().item() for op in exact}
    for op in exact:
        assert mean[RZ][op] < -5e-4, mean
        assert abs(mean[RNA][op]) < 0.1 * abs(mean[RZ][op]), mean


# --- the target kind and its floors -------------------------------------------------------------------

def test_the_rz_spec_parses_to_its_runner_and_format():
    t = Target.parse("cpu:emulate-tf32-rz")
    assert type(t.runner) is TruncatedTF32Runner and str(t) == "cpu:emulate-tf32-rz"
    p = t.runner.precision
    assert p.matmul.operand is TF32_RZ and p.conv.operand is TF32_RZ and p.matmul.accumulate is FLOAT32
    assert p.working is TF32_RZ and t.unit_roundoff == 2.0**-10
    assert t.runner.tf32_like and not t.runner.half_compute  # the remedy: turn TF32 (xf32) off
    assert Target.parse("cpu:emulate-tf32").runner.precision.conv.operand is TF32
    with pytest.raises(UsageError, match="is for the cpu"):
        Target.parse("cuda:emulate-tf32-rz")


def test_the_targets_command_names_which_hardware_each_follows(capsys):
    assert main(["targets"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert "NVIDIA" in lines["cpu:emulate-tf32"] and "ties away" in lines["cpu:emulate-tf32"]
    assert "gfx942" in lines["cpu:emulate-tf32-rz"] and " here " in lines["cpu:emulate-tf32-rz"]
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "cpu:emulate-tf32-rz" in capsys.readouterr().out


def tie_row(spec: str):
    """A user's Linear on an input whose values are TF32 ties: its parity row on ``spec``."""
    state = {"weight": torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)}

    def build(t: Target) -> nn.Module:
        m = nn.Linear(2, 2, bias=False)
        t.runner.place(m)
        with torch.no_grad():
            m.weight.copy_(state["weight"].to(m.weight.dtype))
        return m.train()

    x = torch.tensor([[1 + 2.0**-11, 1 + 3 * 2.0**-11]], dtype=torch.float64)  # ties at TF32's 10 stored bits
    r = run_parity(build, (x, torch.tensor([0])), [Target.parse(spec)])
    t = r.layers
    return t[(t["kind"] == "forward") & (t["module"] == "Linear")].iloc[0], r


def _rel(got: list[float], want: list[float]) -> float:
    return math.sqrt(sum((g - w) ** 2 for g, w in zip(got, want)) / sum(w * w for w in want))


@pytest.mark.parametrize("spec, rounded", [
    ("cpu:emulate-tf32", [1 + 2.0**-10, 1 + 2.0**-9]),  # both ties away
    ("cpu:emulate-tf32-rz", [1.0, 1 + 2.0**-10]),  # both truncated
])
def test_the_floor_rounds_the_operands_as_the_target_does(spec, rounded):
    """The target's error on ties is exactly its floor's (the floor rounds the same way). Rounded to
    nearest even (1 and 1 + 2^-9) the two ties' errors cancel in the sum: a floor of 0, and the
    target's 2^-10 would be flagged against it."""
    row, r = tie_row(spec)
    exact = 2 + 2.0**-9  # both outputs: x0 + x1
    want = abs(rounded[0] + rounded[1] - exact) / exact
    assert 1 + (1 + 2.0**-9) == exact  # what a floor rounding to nearest even would compute: no error
    assert want == pytest.approx(2.0**-10 / exact, rel=1e-12)
    assert row["local"] == pytest.approx(want, rel=1e-12) and row["floor"] == pytest.approx(want, rel=1e-12)
    assert r.first_flagged[Target.parse(spec)] is None, r.flagged()


def test_lenet_on_truncated_tf32_is_judged_against_its_own_floors():
    r = compare("lenet", "cpu,cpu:emulate-tf32-rz", steps=3, envelope=0, env_findings=[])
    assert r.verdict.category == "ok", r.verdict.headline
    rows = r.parity.layers[r.parity.layers["target"] == "cpu:emulate-tf32-rz"]
    convs = rows[(rows["kind"] == "forward") & rows["module"].isin(["Conv2d", "Linear"])]
    assert len(convs) == 5 and (convs["u"] == 2.0**-10).all()
    assert not rows["flagged"].any()
