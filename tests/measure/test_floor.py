"""convcheck.measure.parity.floor and the flag rule: single layers at every CPU precision, rounding helpers.

Each layer runs first in a small model (the layer, then a Linear head), healthy: never flagged,
its floor measured or bounded from below by the rounding of the judge's result. Then the same
layer class, wrong by a relative EPS of 10x its own healthy local error whenever it does not run
in float64: flagged, and the first flagged layer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from convcheck.measure.parity import run_parity
from convcheck.measure.parity.floor import FloorMeter
from convcheck.targets.runners.emulation import round_to_tf32
from convcheck.numerics.formats import BFLOAT16, FLOAT16, FLOAT32, TF32
from convcheck.targets.runners.precision import (
    OpPrecision,
    PrecisionModel,
    dtype_unit_roundoff,
    round_to,
)
from convcheck.targets.spec import Target
from convcheck.numerics.thresholds import DESTROYED_ERROR, FLOOR_ABSOLUTE
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances

T = Target.parse

TARGETS = ("cpu", "cpu:bf16", "cpu:fp16", "cpu:amp-bf16", "cpu:emulate-tf32")
F64 = torch.float64


# --- rounding helpers (runners/precision.py) ------------------------------------------------------

def test_round_to_matches_the_formats():
    x = torch.randn(20000, dtype=F64, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(round_to(x, BFLOAT16), x.to(torch.bfloat16).to(F64))
    assert torch.equal(round_to(x, FLOAT16), x.to(torch.float16).to(F64))
    assert torch.equal(round_to(x, FLOAT32), x.float().to(F64))
    tf32 = round_to(x, TF32)  # 11 significant bits, float32's range
    assert ((tf32 - x).abs() <= TF32.unit_roundoff * x.abs()).all()
    # the same as the emulation's rounding of float32 values, but for a few double roundings
    assert (tf32 != round_to_tf32(x.float()).to(F64)).sum() < 10


def test_round_to_ties_to_even_range_and_non_finite():
    one = torch.tensor([1 + 2**-12, 1 + 3 * 2**-12, -(1 + 2**-12)], dtype=F64)  # ties at 11 bits
    assert round_to(one, TF32).tolist() == [1.0, 1 + 2**-10, -1.0]
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 1e-40, 1e300], dtype=F64)
    r = round_to(special, TF32)
    assert r[0] == math.inf and r[1] == -math.inf and math.isnan(r[2]) and r[3] == 0
    u = TF32.unit_roundoff
    assert r[4] == pytest.approx(1e-40, rel=u) and r[5] == pytest.approx(1e300, rel=u)
    assert round_to(torch.tensor([1e5], dtype=F64), FLOAT16).item() == math.inf  # float16's range
    assert round_to(torch.tensor([2.0**17], dtype=F64), TF32).item() == 2.0**17  # no dtype: the tensor's range
    f32 = torch.tensor([1.5], dtype=torch.float32)
    assert round_to(f32, FLOAT32) is f32  # already that coarse: unchanged
    assert dtype_unit_roundoff(torch.bfloat16) == BFLOAT16.unit_roundoff and dtype_unit_roundoff(torch.int64) == 2.0**-53


# --- the rule (tolerances.py) ------------------------------------------------------------------------

def test_the_bound_is_a_factor_of_the_floor_plus_the_absolute_term():
    tol = Tolerances(bound_factor=5.0)
    assert tol.bound(1e-3) == pytest.approx(5e-3 + FLOOR_ABSOLUTE)
    assert not tol.is_flagged(5e-3, 1e-3) and tol.is_flagged(5.01e-3 + FLOOR_ABSOLUTE, 1e-3)
    # a float32-sized error: the absolute term decides
    assert not tol.is_flagged(0.9 * FLOOR_ABSOLUTE, 0.0) and tol.is_flagged(1.1 * FLOOR_ABSOLUTE, 0.0)
    assert math.isnan(tol.bound(math.nan)) and not tol.is_flagged(1.0 - 1e-9, math.nan)


def test_a_destroyed_result_is_flagged_unless_the_floor_is_as_bad():
    tol = Tolerances(bound_factor=1e6)
    assert tol.is_flagged(DESTROYED_ERROR, 0.1)      # 1e6 x 0.1 would let it pass: destroyed anyway
    assert not tol.is_flagged(DESTROYED_ERROR, DESTROYED_ERROR)  # ill-conditioned at this precision
    assert tol.needed(0.9, 0.1) == math.inf
    assert tol.is_flagged(math.inf, 1.0) and tol.is_flagged(math.nan, 1e-3)


def test_needed_is_the_factor_that_would_pass():
    tol = Tolerances(bound_factor=2.0)
    need = tol.needed(0.3, 1e-2)
    assert need == pytest.approx((0.3 - FLOOR_ABSOLUTE) / 1e-2)
    assert not Tolerances(bound_factor=need * 1.001).is_flagged(0.3, 1e-2)
    assert Tolerances(bound_factor=need * 0.999).is_flagged(0.3, 1e-2)
    assert tol.needed(1e-7, 0.0) == 0.0 and tol.needed(1e-3, 0.0) == math.inf


# --- single layers at every precision ------------------------------------------------------------------

class UserGate(nn.Module):
    """A user's own element-wise module (the floor needs no formula for it)."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


LAYERS = {  # name -> (factory, input shape without the batch, features after Flatten)
    "conv": (lambda: nn.Conv2d(8, 16, 3, padding=1), (8, 6, 6), 16 * 36),
    "linear": (lambda: nn.Linear(64, 32), (64,), 32),
    "batchnorm": (lambda: nn.BatchNorm2d(8), (8, 6, 6), 8 * 36),
    "layernorm": (lambda: nn.LayerNorm(64), (64,), 64),
    "softmax": (lambda: nn.Softmax(dim=1), (64,), 64),
    "user": (UserGate, (64,), 64),
}


def wrong(layer: nn.Module, eps: float) -> nn.Module:
    """The same layer, its result multiplied by (1 + eps) whenever it does not run in float64."""
    base = type(layer)

    def forward(self, x):
        out = base.forward(self, x)
        return out if out.dtype == F64 else (out.float() * (1.0 + eps)).to(out.dtype)

    layer.__class__ = type(f"Wrong{base.__name__}", (base,), {"forward": forward})
    return layer


def layer_row(name: str, target: str, eps: float = 0.0, tolerances: Tolerances = DEFAULT_TOLERANCES):
    factory, shape, features = LAYERS[name]
    torch.manual_seed(0)
    layer = factory()
    head = nn.Linear(features, 4)
    state = {k: v.detach().to(F64) for k, v in nn.Sequential(layer, nn.Flatten(), head).state_dict().items()}

    def build(t: Target) -> nn.Module:
        m = nn.Sequential(wrong(factory(), eps) if eps else factory(), nn.Flatten(), nn.Linear(features, 4))
        t.runner.place(m)
        for k, p in m.state_dict().items():
            if p.is_floating_point():
                p.copy_(state[k].to(p.dtype))
        return m.train()

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn((8, *shape), generator=gen, dtype=F64), torch.randint(0, 4, (8,), generator=gen))
    r = run_parity(build, batch, [Target.parse(target)], tolerances=tolerances)
    t = r.layers
    return t[(t["kind"] == "forward") & (t["layer"] == "0")].iloc[0], r


@pytest.fixture(scope="module")
def healthy_rows():
    return {(name, target): layer_row(name, target) for name in LAYERS for target in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_healthy_layer_passes_against_its_floor(healthy_rows, name, target):
    row, r = healthy_rows[(name, target)]
    assert r.first_flagged[T(target)] is None, r.flagged()
    assert 0 < row["floor"] < 0.05 and math.isfinite(row["bound"])
    assert row["local"] <= row["bound"] and row["needed"] <= DEFAULT_TOLERANCES.bound_factor
    # the floor is at least the rounding of the judge's result to the target's output dtype:
    # float32 ~3e-8, float16 ~2e-4, bfloat16 ~1.6e-3 (relative, root mean square)
    u_out = {"cpu": FLOAT32.unit_roundoff, "cpu:emulate-tf32": FLOAT32.unit_roundoff, "cpu:fp16": FLOAT16.unit_roundoff}.get(target, BFLOAT16.unit_roundoff)
    if name in ("batchnorm", "layernorm", "softmax", "user") and target == "cpu:amp-bf16":
        u_out = FLOAT32.unit_roundoff  # autocast runs these in float32
    assert row["floor"] > 0.2 * u_out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layer_wrong_by_ten_times_its_noise_is_flagged_first(healthy_rows, name, target):
    healthy, _ = healthy_rows[(name, target)]
    eps = 10 * max(healthy["local"], 1e-7)  # 10x the healthy local error (the noise)
    row, r = layer_row(name, target, eps)
    assert row["flagged"], (row["local"], row["intrinsic"], row["floor"], row["bound"])
    assert r.first_flagged[T(target)] == "0"


def test_a_float32_conv_under_tf32_emulation_has_a_tf32_floor(healthy_rows):
    conv, _ = healthy_rows[("conv", "cpu:emulate-tf32")]
    norm, _ = healthy_rows[("layernorm", "cpu:emulate-tf32")]
    assert conv["u"] == TF32.unit_roundoff and 5e-5 < conv["floor"] < 2e-3  # operands rounded to TF32
    assert norm["u"] == FLOAT32.unit_roundoff and norm["floor"] < 1e-6      # element-wise: float32


def test_a_measured_floor_is_float64_on_rounded_operands_against_the_judge():
    """By hand: a Linear under TF32 operands, its floor is the float64 result of the rounded
    input and weight (rounded once more to float32) against the exact one."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    x = torch.randn(16, 32, dtype=F64)
    judge = Target.parse("cpu:float64").runner
    exact = lin.double()(x).detach()
    tf32 = OpPrecision(TF32, FLOAT32)
    meter = FloorMeter(PrecisionModel(tf32, tf32, OpPrecision(FLOAT32, FLOAT32)), judge)
    lin32 = nn.Linear(32, 8)
    lin32.load_state_dict(lin.state_dict())
    ref = judge.reference_module(lin32)
    floor = meter.forward(lin32, ref, (x.float(),), exact, None, torch.float32)
    w, b = (round_to(t.detach().float().to(F64), TF32) for t in (lin.weight, lin.bias))
    by_hand = (round_to(x.float().to(F64), TF32) @ w.T + b).float().to(F64)
    want = float((by_hand - exact).norm() / exact.norm())
    assert floor == pytest.approx(want, rel=1e-12)
    assert 1e-4 < floor < 1e-3
