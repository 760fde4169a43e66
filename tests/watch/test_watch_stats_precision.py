"""The std of a tensor whose float32 sums lose it, whichever path measures it.

Two kinds of tensor a user's model makes: values whose squares float32 cannot hold (a gradient that has all but
vanished, ~1e-25), and values far from zero beside their spread (a saturated sigmoid's, a layer whose bias dominates:
a std 1e-4 of the mean, where ``sumsq / n - mean**2`` in float32 cancels to nothing). Each path that measures a
tensor - the fused pass (numba), the torch passes (torch on several threads, or no numba), the serial scan, the
stacked calls of a cell, the device-side row of ``sync="step"`` - keeps the std a float64 reference gives."""

from __future__ import annotations

import math

import pytest
import torch

from convcheck.watch import fused, stacked, stats


def _cases():
    g = torch.Generator().manual_seed(3)
    return [
        ("float32 near 1e-25", torch.randn(5000, generator=g) * 1e-25),
        ("float32 a std 1e-4 of its mean", 1000 + 0.1 * torch.randn(4096, generator=g)),
        ("float32 1M elements near 1", 1 + 1e-4 * torch.randn(1 << 20, generator=g)),
        ("bfloat16 near 1e-25", (torch.randn(5000, generator=g) * 1e-25).bfloat16()),
        ("float16 a std 5e-4 of its mean", (100 + 0.05 * torch.randn(4096, generator=g)).half()),
        ("float32 ordinary", torch.randn(3000, generator=g)),
    ]


def _no_fused(m) -> None:
    fused.ready()
    m.setattr(fused, "_KERNELS", {})


def _fused(t, m):
    if not fused.ready():
        pytest.skip("numba cannot compile here")
    return stats.measure(t)


def _torch(t, m):  # torch on several threads (a user's default), or numba missing
    _no_fused(m)
    m.setattr(stats, "LARGE", 1 << 62)
    return stats.measure(t)


def _serial(t, m):
    _no_fused(m)
    m.setattr(stats, "LARGE", 0)
    m.setattr(stats, "SERIAL_THREADS", 1 << 20)
    return stats.measure(t)


def _stacked(t, m):  # a cell's calls stacked at the forward's end: the row of the second of three calls
    _no_fused(m)
    return stacked.rows([t * 2, t, t.neg()], ["cell"] * 3)[1]


def _device(t, m):
    return stats.row_of(stats.device_row(t).tolist(), stats.dtype_name(t))


@pytest.mark.parametrize("path", [_fused, _torch, _serial, _stacked, _device],
                         ids=["fused", "torch", "serial", "stacked", "device_row"])
@pytest.mark.parametrize("name,t", _cases(), ids=[c[0] for c in _cases()])
def test_every_path_keeps_the_std_float32_sums_would_lose(name, t, path, monkeypatch):
    if path is _fused and t.dtype not in (torch.float32, torch.float64):
        pytest.skip("the fused pass reads float32 and float64")
    ref = t.double()
    want_std, want_mean = float(ref.std(correction=0)), float(ref.mean())
    with monkeypatch.context() as m:
        got = stats.finish(path(t, m))
    assert math.isclose(got["std"], want_std, rel_tol=1e-3), (name, got["std"], want_std)
    assert math.isclose(got["mean"], want_mean, rel_tol=1e-5, abs_tol=1e-30), (name, got["mean"], want_mean)


def test_the_exact_std_is_taken_only_for_the_tensors_that_need_it():
    """An ordinary activation's float32 sums are kept (no second pass); a tensor of tiny values, or one far from zero
    beside its spread, is told apart from the pass's own values; float64 sums never need it."""
    assert not stats.lossy(1000, 3.0, 1000.0, 4.0)  # mean 0.003, std ~1
    assert stats.lossy(5000, 1e-23, 5e-47, 4e-25)  # tiny: squares below float32's range
    assert stats.lossy(4096, 4096 * 1000.0, 4096 * 1e6, 1000.4)  # std/mean 0 as float32 sums read it
    assert not stats.lossy(100, 0.0, 0.0, 0.0)  # all zero: nothing lost
    t = 1000 + 0.1 * torch.randn(4096, dtype=torch.float64)
    assert stats.precise_sumsq(t, t.numel(), 0.0, 12.5, 1000.0) == 12.5  # float64: kept as it is


@pytest.mark.parametrize("name,t", _cases(), ids=[c[0] for c in _cases()])
def test_the_device_row_makes_the_torch_passes_choice(name, t, monkeypatch):
    """``sync="step"``'s device-side row chooses the exact sum of squares where the torch passes would, on the
    device: the two rows alike bit for bit, so a run's ``steps.jsonl`` does not depend on when it was read."""
    with monkeypatch.context() as m:
        want = _torch(t, m)
    got = _device(t, None)
    assert (got["sum"], got["sumsq"]) == (want["sum"], want["sumsq"]), name
