"""convcheck.numerics.metrics: error measures, precision bounds, tolerances."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from convcheck.numerics.metrics import (
    DEFAULT_TOLERANCES,
    Tolerances,
    cosine,
    expected_bound,
    max_abs,
    nonfinite_count,
    reduction_length,
    rel_l2,
    ulp_distance,
)
from convcheck.numerics.thresholds import FLOOR_ABSOLUTE

INF, NAN = math.inf, math.nan


# --- rel_l2 ---------------------------------------------------------------------------------

def test_rel_l2_basic():
    ref = torch.tensor([3.0, 4.0])
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.5 / 5)
    assert rel_l2(torch.zeros(2), ref) == pytest.approx(1.0)


def test_rel_l2_is_computed_in_float64_across_dtypes():
    ref = torch.randn(1000, dtype=torch.float64)
    x = ref.float()
    e = rel_l2(x, ref)
    assert 0 < e < 2.0**-24 * 2
    assert rel_l2(ref.to(torch.bfloat16), ref) == pytest.approx(rel_l2(ref.to(torch.bfloat16).double(), ref))
    assert 2.0**-10 < rel_l2(ref.to(torch.bfloat16), ref) < 2.0**-8


def test_rel_l2_inf_when_the_target_is_not_finite_and_the_reference_is():
    ref = torch.ones(4)
    for bad in (NAN, INF, -INF):
        x = torch.ones(4)
        x[2] = bad
        assert rel_l2(x, ref) == INF


def test_rel_l2_ignores_positions_where_the_reference_is_not_finite():
    ref = torch.tensor([1.0, NAN, 2.0, INF])
    x = torch.tensor([1.0, NAN, 2.0, INF])
    assert rel_l2(x, ref) == 0.0
    x = torch.tensor([1.0, 5.0, 2.5, -INF])
    assert rel_l2(x, ref) == pytest.approx(0.5 / math.sqrt(5))


def test_rel_l2_zero_reference():
    assert rel_l2(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_l2(torch.tensor([0.0, 1e-3, 0.0]), torch.zeros(3)) == INF
    assert rel_l2(torch.zeros(0), torch.zeros(0)) == 0.0


def test_rel_l2_large_finite_values_do_not_overflow():
    big = torch.full((100,), 3e38, dtype=torch.float32)
    assert rel_l2(big, big.double()) == 0.0


def test_rel_l2_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_l2(torch.zeros(3), torch.zeros(4))


def test_other_measures():
    ref = torch.tensor([1.0, -2.0, 3.0])
    x = torch.tensor([1.0, -2.5, 3.0])
    assert max_abs(x, ref) == pytest.approx(0.5)
    assert cosine(ref, ref) == pytest.approx(1.0)
    assert cosine(-ref, ref) == pytest.approx(-1.0)
    one_ulp = torch.tensor([1.0 + 2.0**-23])
    assert ulp_distance(one_ulp, torch.tensor([1.0], dtype=torch.float64), torch.float32) == pytest.approx(1.0)


def test_nonfinite_count():
    t = torch.tensor([1.0, NAN, INF, -INF, NAN, 0.0])
    assert nonfinite_count(t) == (2, 2)
    assert nonfinite_count(torch.ones(5)) == (0, 0)
    assert nonfinite_count(torch.ones(5, dtype=torch.int64)) == (0, 0)
    assert nonfinite_count(torch.zeros(0)) == (0, 0)
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        assert nonfinite_count(t.to(dt)) == (2, 2)
    assert nonfinite_count(torch.full((10,), 3e38)) == (0, 0)  # huge but finite


# --- bounds -----------------------------------------------------------------------------------

def test_expected_bound_is_u_sqrt_k_and_at_least_u():
    u = 2.0**-24
    assert expected_bound(u, 1) == u
    assert expected_bound(u, 0) == u
    assert expected_bound(u, 100) == pytest.approx(10 * u)
    assert expected_bound(2.0**-8, 400) == pytest.approx(20 * 2.0**-8)


def _call_k(module, *inputs):
    out = module(*inputs)
    return reduction_length(module, inputs, out)


def test_reduction_length_linear_and_conv():
    assert _call_k(nn.Linear(120, 84), torch.randn(2, 120)) == 120
    assert _call_k(nn.Conv2d(6, 16, 5), torch.randn(2, 6, 12, 12)) == 6 * 25
    assert _call_k(nn.Conv2d(8, 8, 3, groups=4), torch.randn(1, 8, 5, 5)) == 2 * 9
    assert _call_k(nn.Conv2d(4, 4, (1, 3)), torch.randn(1, 4, 5, 5)) == 4 * 3
    assert _call_k(nn.Conv1d(3, 5, 7), torch.randn(1, 3, 20)) == 21


def test_reduction_length_batchnorm_training_vs_eval():
    bn = nn.BatchNorm2d(4)
    x = torch.randn(3, 4, 5, 6)
    assert _call_k(bn, x) == 3 * 5 * 6  # batch statistics: sums over N*H*W
    bn.eval()
    assert _call_k(bn, x) == 1          # running statistics: an affine map
    assert _call_k(nn.BatchNorm1d(7), torch.randn(10, 7)) == 10


def test_reduction_length_norms():
    assert _call_k(nn.LayerNorm(16), torch.randn(2, 16)) == 16
    assert _call_k(nn.LayerNorm([4, 5]), torch.randn(2, 3, 4, 5)) == 20
    assert _call_k(nn.GroupNorm(2, 8), torch.randn(2, 8, 3, 3)) == 4 * 9


def test_reduction_length_pooling():
    x = torch.randn(2, 3, 8, 8)
    assert _call_k(nn.AvgPool2d(2), x) == 4
    assert _call_k(nn.AvgPool2d((2, 4)), x) == 8
    assert _call_k(nn.AdaptiveAvgPool2d(1), x) == 64
    assert _call_k(nn.AdaptiveAvgPool2d((2, 2)), x) == 16
    assert _call_k(nn.MaxPool2d(2), x) == 1
    assert _call_k(nn.ReLU(), x) == 1
    assert _call_k(nn.Flatten(), x) == 1
    assert _call_k(nn.Identity(), x) == 1


class _Unknown(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=(1, 2, 3), keepdim=True)


def test_reduction_length_unknown_module_assumes_a_whole_sample():
    assert _call_k(_Unknown(), torch.randn(2, 3, 4, 5)) == 60
    flat = nn.Softmax(dim=-1)
    assert reduction_length(flat, (torch.randn(7),), torch.randn(7)) == 7
    assert reduction_length(flat, (torch.tensor(1.0),), torch.tensor(1.0)) == 1
    assert reduction_length(flat, (), torch.tensor(1.0)) == 1


# --- tolerances -----------------------------------------------------------------------------

def test_tolerances_are_a_frozen_dataclass():
    assert dataclasses.is_dataclass(Tolerances)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TOLERANCES.bound_factor = 1.0
    assert Tolerances() == DEFAULT_TOLERANCES
    assert hash(Tolerances()) == hash(DEFAULT_TOLERANCES)


def test_is_flagged_against_the_floor():
    """The rule itself is tested in tests/measure/test_floor.py; here its shape: bound_factor x floor plus
    the small absolute term, a destroyed result, a non-finite error."""
    tol = Tolerances(bound_factor=8.0, min_error=1e-3)
    assert not tol.is_flagged(5e-2, 1e-2)  # large, but within 8x its floor
    assert tol.is_flagged(8.01e-2 + FLOOR_ABSOLUTE, 1e-2)  # just above 8x its floor plus the absolute term
    assert not tol.is_flagged(8e-2, 1e-2)
    assert tol.is_flagged(1e-4, 1e-7)  # a float32-sized floor: 1e-4 is far above what float32 allows
    assert not tol.is_flagged(0.5 * FLOOR_ABSOLUTE, 0.0)


def test_is_flagged_on_non_finite_error():
    tol = Tolerances()
    assert tol.is_flagged(INF, 1e-3)
    assert tol.is_flagged(NAN, 1e-3)


def test_needed_is_the_bound_factor_that_would_pass():
    tol = Tolerances(bound_factor=8.0, min_error=1e-3)
    local, floor = 0.3, 1e-2
    need = tol.needed(local, floor)
    assert need == pytest.approx((0.3 - FLOOR_ABSOLUTE) / 1e-2)
    assert not Tolerances(bound_factor=need * 1.001, min_error=1e-3).is_flagged(local, floor)
    assert Tolerances(bound_factor=need * 0.99, min_error=1e-3).is_flagged(local, floor)
    assert tol.needed(1e-2, 0.0) == INF


def test_rel_l2_floor_treats_a_cancelled_reference_as_zero():
    ref = torch.tensor([1e-17, -1e-17], dtype=torch.float64)  # a sum that cancelled to rounding noise
    x = torch.tensor([1e-9, 2e-9])
    assert rel_l2(x, ref) > 1e7
    assert rel_l2(x, ref, floor=1.0) == pytest.approx(math.sqrt(5) * 1e-9)
    # a floor below the reference's norm changes nothing
    big = torch.tensor([3.0, 4.0])
    assert rel_l2(big * 1.1, big, floor=1.0) == pytest.approx(0.1)
    # non-finite values still give inf
    assert rel_l2(torch.tensor([math.inf, 0.0]), ref, floor=1.0) == INF
