"""One pass over a large judge tensor (``parity.judged``, ``metrics.chunked_norms``) gives what the
measures taken one by one give: the same rules, the values to the last bits."""

import math

import pytest
import torch

from convcheck.numerics.metrics import CHUNK, abs_max, chunked, rel_l2, rel_l2_finite, rounding_error
from convcheck.measure.parity.judge_measures import Judged

LARGE = (2, 16, 96, 97)  # 298,112 elements: taken in chunks, the last one short


def _large(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LARGE, generator=g, dtype=torch.float64) * 3


def test_a_large_cpu_float64_tensor_is_taken_in_chunks_and_a_small_one_is_not():
    e = _large()
    assert e.numel() > 4 * CHUNK and e.numel() % CHUNK
    assert chunked(e) and chunked(e, e.float())
    assert not chunked(e[:1, :1])  # small: the whole tensor at once (bitwise as before)
    assert not chunked(e.float())  # not the judge's float64
    assert not chunked(e, e.float()[:1])  # shapes differ: rel_l2 raises its own error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_pass_gives_what_each_measure_gives(dtype):
    e = _large()
    own, local = e.to(dtype), (e * (1 + 1e-3 * torch.rand_like(e))).to(dtype)
    j = Judged(e).take((own, None, local), dtype)
    for x in (own, local):
        assert j.rel(x) == pytest.approx(rel_l2(x, e), rel=1e-12)
        assert j.rel_finite(x)[1] is True
        assert j.rel(x, floor=1e9) == pytest.approx(rel_l2(x, e, floor=1e9), rel=1e-12)
    assert j.rounding(dtype) == pytest.approx(rounding_error(e, dtype), rel=1e-12)
    assert j.rounding(dtype) == pytest.approx(rel_l2(e.to(dtype), e), rel=1e-12)
    assert j.abs_max() == abs_max(e)
    other = e.to(dtype) * 2  # not taken: measured the usual way
    assert j.rel(other) == rel_l2(other, e)


def test_a_nan_or_inf_falls_back_to_the_rules_of_rel_l2():
    e = _large()
    x = e.float()
    x.view(-1)[CHUNK + 5] = math.nan
    j = Judged(e).take((x,), torch.float32)
    assert j.rel_finite(x) == rel_l2_finite(x, e) == (math.inf, False)
    big = _large() * 1e5  # past float16's range: its rounding is infinite, as rounding_error says
    j = Judged(big).take((big.float(),), torch.float16)
    assert j.rounding(torch.float16) == rounding_error(big, torch.float16) == math.inf
    assert j.abs_max() == abs_max(big)


def test_a_zero_reference_keeps_rel_l2s_rule():
    e = torch.zeros(LARGE, dtype=torch.float64)
    j = Judged(e).take((e.float(), e.float() + 1), torch.float32)
    assert j.rel(e.float()) == rel_l2(e.float(), e) == 0.0
    ones = e.float() + 1
    assert Judged(e).take((ones,)).rel(ones) == rel_l2(ones, e) == math.inf
