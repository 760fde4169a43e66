"""Cheap exact forms of training's per-step statistics.

Every function here returns bit for bit what the plain expression in its docstring returns
(``tests/test_cheap_paths.py`` holds each against it); only the passes and allocations differ:

* a float64 copy of a float32 tensor made into a buffer that is reused (``Scratch``) costs about
  half a fresh one - a fresh 10-90 MB tensor is new memory the kernel faults in page by page -
  and the reduction that follows reads it from cache;
* a comparison written straight into a float32 buffer is vectorised, one into a bool tensor
  and then ``.float()`` is not (5x slower on a LeNet activation);
* ``torch.manual_seed`` queues a lazy seed (with a formatted stack) for every accelerator
  kind even where none exists: 0.3 ms per call, once per arm per step.

A reduction is only as exact as its order: each shortcut is taken for a contiguous tensor only
(its buffer holds the values in the same order), and the plain expression runs otherwise.
"""

from __future__ import annotations

import torch

_F64 = torch.float64


class Scratch:
    """Reusable flat buffers, one per (device, dtype, slot), grown to the largest request."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def like(self, t: torch.Tensor, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """A contiguous buffer shaped like ``t`` (its values are whatever was there)."""
        key, n = (t.device, dtype, slot), t.numel()
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=t.device)
        return buf[:n].view(t.shape)


def norm64(t: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``torch.linalg.vector_norm(t, dtype=torch.float64)`` (which casts ``t`` to a new float64
    tensor first), the float64 copy made into ``scratch``."""
    if t.dtype == _F64 or not t.is_floating_point() or t.is_complex() or not t.is_contiguous():
        return torch.linalg.vector_norm(t, dtype=_F64)
    return torch.linalg.vector_norm(scratch.like(t, _F64).copy_(t))


def as64(t: torch.Tensor, scratch: Scratch, slot: int = 0) -> torch.Tensor:
    """``t.to(torch.float64)`` for a contiguous floating ``t`` (itself if float64), in ``scratch``."""
    return t if t.dtype == _F64 else scratch.like(t, _F64, slot).copy_(t)


def zero_count(t: torch.Tensor, scratch: Scratch) -> int:
    """``t.numel() - int(torch.count_nonzero(t))``: ``count_nonzero`` branches per element (10x
    slower on a tensor that is half zeros); an equality written into a float buffer and summed counts
    the same - every partial sum is an integer, exact in float32 below 2**24 elements (float64 above)."""
    if not t.is_floating_point() or t.is_complex() or t.numel() >= 2 ** 53:
        return t.numel() - int(torch.count_nonzero(t))
    small = t.numel() <= 2 ** 24
    buf = scratch.like(t, torch.float32 if small else _F64, slot=2 if small else 1)
    return int(torch.eq(t, 0, out=buf).sum())


def fraction_le_zero(out: torch.Tensor, scratch: Scratch) -> float:
    """``float((out <= 0).float().mean())``, the comparison written into a reused float32 buffer."""
    if not out.is_contiguous():
        return float((out <= 0).float().mean())
    return float(torch.le(out, 0, out=scratch.like(out, torch.float32, slot=2)).mean())


def fraction_abs_above(x: torch.Tensor, limit: float, scratch: Scratch) -> float:
    """``float((x.abs() > limit).float().mean())``, the comparison written into a reused buffer."""
    a = x.abs()
    if not a.is_contiguous():
        return float((a > limit).float().mean())
    return float(torch.gt(a, limit, out=scratch.like(a, torch.float32, slot=2)).mean())


def seed_generators(seed: int) -> None:
    """``torch.manual_seed(seed)``; where no accelerator is available, only the CPU generator's
    (the accelerators' lazy seeds could never run there, and queueing them costs a stack trace each)."""
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))
