"""convcheck.numerics.formats: the table against torch.finfo and the bit patterns, TF32 by definition, rounding to each."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from convcheck.numerics.formats import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    RNA,
    RNE,
    RZ,
    TF32,
    TF32_RZ,
    coarsest,
    format_named,
    format_of_dtype,
    narrowest_range,
)
from convcheck.targets.runners.precision import dtype_format, round_to

WITH_DTYPE = [f for f in FORMATS if f.dtype is not None]
F64 = torch.float64


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=str)
def test_a_format_with_a_dtype_agrees_with_torch(fmt):
    dtype = fmt.torch_dtype
    info = torch.finfo(dtype)
    assert fmt.unit_roundoff == info.eps / 2  # eps is the spacing above 1: 2u
    assert fmt.largest == info.max and fmt.smallest_normal == info.tiny
    assert fmt.exponent_bits + fmt.significand_bits == info.bits  # sign bit + exponent + (p - 1) stored bits
    one = torch.tensor(1, dtype={8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[info.bits])
    assert one.view(dtype).item() == fmt.smallest_subnormal  # the bit pattern 0...01
    assert format_of_dtype(dtype) is fmt and dtype_format(dtype) is fmt and format_named(fmt.name) is fmt


def test_tf32_by_definition():
    """TF32: float32's 8-bit exponent with 10 explicit significand bits (NVIDIA A100 whitepaper)."""
    assert TF32.dtype is None and TF32.torch_dtype is None
    assert TF32.significand_bits == 11 and TF32.unit_roundoff == 2.0**-11
    assert TF32.exponent_bits == FLOAT32.exponent_bits and TF32.smallest_normal == FLOAT32.smallest_normal
    assert TF32.largest == (2 - 2.0**-10) * 2.0**127 and TF32.smallest_subnormal == 2.0**-136


def test_formats_with_a_dtype_round_to_nearest_even_tf32_ties_away_or_truncates_and_only_e4m3_saturates():
    assert all(f.rounding == RNE for f in WITH_DTYPE)  # torch's casts
    assert TF32.rounding == RNA and TF32_RZ.rounding == RZ  # NVIDIA; ROCm gfx942 xf32
    assert TF32_RZ.same_values(TF32) and not TF32_RZ.same_values(FLOAT16) and format_named("tf32-rz") is TF32_RZ
    assert TF32_RZ.unit_roundoff == 2 * TF32.unit_roundoff == 2.0**-10  # truncation: a whole ulp
    assert [f.name for f in FORMATS if f.saturates] == [FP8_E4M3.name]
    assert FP8_E4M3.largest == 448.0 and FP8_E5M2.largest == 57344.0


def test_unknown_dtypes_are_float64_and_the_table_orders():
    assert format_of_dtype(torch.int64) is FLOAT64 and format_of_dtype("torch.float16") is FLOAT16
    assert coarsest([FLOAT32, TF32, FLOAT16]) is TF32  # equal roundoffs: the first
    assert coarsest([FLOAT32, BFLOAT16]) is BFLOAT16
    assert narrowest_range([FLOAT32, BFLOAT16, FP8_E5M2]) is FP8_E5M2
    with pytest.raises(KeyError):
        format_named("float128")


@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=str)
def test_fp8_round_trip_is_exact_on_every_finite_value(fmt):
    every = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fmt.torch_dtype).to(F64)
    finite = every[torch.isfinite(every)]
    assert torch.equal(round_to(finite, fmt), finite)
    assert torch.equal(round_to(finite.float(), fmt), finite.float())
    assert float(finite.abs().max()) == fmt.largest


def test_fp8_rounding_ties_range_and_non_finite():
    x = torch.tensor([1 + 2.0**-4, 1 + 3 * 2.0**-4, 2.0**-10, 3 * 2.0**-10, 500.0, -1e6, math.inf], dtype=F64)
    # E4M3: 3 stored bits (ties to even at 1 + 2^-4 and 1 + 3 * 2^-4), subnormals in steps of 2^-9,
    # and no Inf: beyond 448 (Inf included) it saturates
    assert round_to(x, FP8_E4M3).tolist() == [1.0, 1.25, 0.0, 2.0**-8, 448.0, -448.0, 448.0]
    y = torch.tensor([1 + 2.0**-3, 61440.0, 57343.0, -1e6, math.nan], dtype=F64)
    e5m2 = round_to(y, FP8_E5M2)  # 2 stored bits; beyond 57344 (rounded) it overflows to Inf
    assert e5m2[:4].tolist() == [1.0, math.inf, 57344.0, -math.inf] and math.isnan(e5m2[4])


def test_round_to_refuses_a_rounding_it_cannot_do():
    with pytest.raises(ValueError, match="torch's cast, which rounds RNE, not RZ"):
        round_to(torch.ones(2, dtype=F64), replace(FLOAT16, rounding=RZ))
    with pytest.raises(ValueError, match="unknown rounding 'RU'"):
        replace(TF32, rounding="RU")
