"""``round_to``'s bit-pattern checks (issue 28): the subnormal test and the NaN/Inf pass-through
give the values of the plain float forms they replace, bit for bit, on the values that could
tell them apart (zeros of both signs, subnormals, the smallest normal, the largest finite,
NaN, Inf)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from convcheck.numerics.formats import FORMATS, RNA, RNE, RZ, TF32
from convcheck.targets.runners import precision
from convcheck.targets.runners.precision import _has_subnormal, round_to


def _plain_has_subnormal(t: torch.Tensor) -> bool:
    return bool(torch.any((t.abs() < torch.finfo(t.dtype).tiny) & (t != 0))) if t.numel() else False


def _edges(dtype) -> list[float]:
    fi = torch.finfo(dtype)
    sub = fi.tiny / 2 ** 3
    return [0.0, -0.0, fi.tiny, -fi.tiny, fi.max, -fi.max, float("inf"), float("-inf"), 1.0, -1.5, sub, -sub,
            fi.smallest_normal * (1 - fi.eps)]


def _cases(dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=gen, dtype=torch.float64).to(dtype) * 1e3
    edges = torch.tensor(_edges(dtype), dtype=dtype)
    fi = torch.finfo(dtype)
    yield "normal", base
    yield "with zeros", torch.where(base > 0, base, torch.zeros_like(base))
    yield "negative zeros", torch.where(base > 0, base, torch.full_like(base, -0.0))
    yield "one subnormal", torch.cat([base, torch.tensor([fi.tiny / 4], dtype=dtype)])
    yield "largest subnormal", torch.cat([base, torch.tensor([fi.tiny * (1 - fi.eps)], dtype=dtype)])
    yield "smallest subnormal", torch.cat([base, torch.tensor([-torch.finfo(dtype).tiny * fi.eps], dtype=dtype)])
    yield "edges", edges
    yield "nan", torch.cat([base, torch.tensor([float("nan")], dtype=dtype)])
    yield "inf", torch.cat([base, torch.tensor([float("inf")], dtype=dtype)])
    # a NaN whose payload is all in the bits the rounding drops: cleared, it would read as Inf
    low = torch.tensor([0x7FF0000000000001 if dtype == torch.float64 else 0x7F800001],
                       dtype=torch.int64 if dtype == torch.float64 else torch.int32).view(dtype)
    yield "low-payload nan", torch.cat([base, low])
    yield "non-contiguous", base.view(64, 64).t()
    yield "channels last", base.view(4, 16, 8, 8).to(memory_format=torch.channels_last)
    yield "empty", base[:0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subnormal_check_on_the_bit_pattern_agrees_with_the_float_form(dtype):
    for label, t in _cases(dtype):
        assert _has_subnormal(t) == _plain_has_subnormal(t), label
    assert _has_subnormal(torch.tensor([torch.finfo(dtype).tiny / 2], dtype=dtype))
    assert not _has_subnormal(torch.tensor([0.0, -0.0, torch.finfo(dtype).tiny], dtype=dtype))


def _plain_round(t: torch.Tensor, fmt) -> torch.Tensor:
    """``round_to`` as it was: ``isfinite`` + ``where`` over the bit-pattern rounding, the float
    subnormal test choosing the ``frexp`` form."""
    keep, has = precision._keep_nonfinite, precision._has_subnormal
    precision._keep_nonfinite = lambda x, rounded: torch.where(torch.isfinite(x), rounded, x)
    precision._has_subnormal = _plain_has_subnormal
    try:
        return round_to(t, fmt)
    finally:
        precision._keep_nonfinite, precision._has_subnormal = keep, has


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_to_gives_the_same_bits_as_the_float_forms(dtype):
    tf32s = [f for f in FORMATS if f.dtype is None]
    assert {f.rounding for f in tf32s} == {RNA, RZ}
    formats = tf32s + [dataclasses.replace(TF32, name="tf32-rne", rounding=RNE)]
    for fmt in formats:
        for label, t in _cases(dtype):
            got, want = round_to(t, fmt), _plain_round(t, fmt)
            assert got.shape == want.shape and torch.equal(_bits(got), _bits(want)), (fmt.name, label)
            # the layout too: a kernel may take another path (other last bits) on another one
            assert got.stride() == want.stride(), (fmt.name, label)
