"""The measures a parity row reads of one judge tensor, from one pass over it.

A forward row reads five things of the judge's output: its norm, its largest magnitude
(``ref_absmax``), the target's own output against it (propagated error), the target's copy of the
layer against it (local error) and its rounding to the target's dtype (the floor's free lower
bound); a gradient row the same of the judge's gradient. Each alone streams the judge's float64
tensor from memory again. ``Judged.take`` reads a large one once, in cache-sized chunks
(``metrics.chunked_norms``), and answers each measure from what it found: ResNet-18's comparisons
read a third of the memory they did. Small tensors, other devices and any NaN/Inf go the usual
way (``metrics``), so every value keeps the rules of ``rel_l2``, ``abs_max`` and
``rounding_error``; a chunked norm differs from a whole one in its last bits only.
"""

from __future__ import annotations

import math

import torch

from convcheck.numerics.metrics import abs_max, chunked, chunked_norms, rel_l2_finite, remember_norm, rounding_error
from convcheck.targets.runners.precision import dtype_unit_roundoff
from convcheck.numerics.thresholds import TINY_NORM


class Judged:
    """One judge tensor ``ref`` and what one pass over it found (``take``)."""

    def __init__(self, ref: torch.Tensor):
        self.ref = ref
        self._differences: dict[int, tuple[torch.Tensor, float]] = {}  # id(x) -> (x, ||x - ref||)
        self._rounding: dict[torch.dtype, float] = {}  # dtype -> ||ref.to(dtype) - ref|| (absolute)
        self._norm: float | None = None
        self._absmax: float | None = None

    def take(self, xs: tuple, rounded_to: torch.dtype | None = None) -> "Judged":
        """Measure every tensor of ``xs`` (None skipped) against ``ref``, and ``ref``'s rounding to
        ``rounded_to``, in one pass where ``ref`` is large; otherwise nothing is measured yet."""
        e = self.ref.detach()
        xs = tuple(x for x in xs if x is not None)
        if not chunked(e) or not all(chunked(e, x) for x in xs):
            return self
        if rounded_to is not None and not dtype_unit_roundoff(rounded_to) > dtype_unit_roundoff(e.dtype):
            rounded_to = None  # rounding to a format as fine as float64 changes nothing: not a rounding_error
        found = chunked_norms(e, xs, rounded_to, whole=True)
        if not all(math.isfinite(v) for v in found):  # NaN/Inf, or past the dtype's range: the usual rules
            return self
        for x, v in zip(xs, found):
            self._differences[id(x)] = (x, v)
        if rounded_to is not None:
            self._rounding[rounded_to] = found[len(xs)]
        self._norm, self._absmax = found[-2], found[-1]
        remember_norm(self.ref, self._norm)  # a later ``rel_l2`` against ``ref`` reuses it
        return self

    def rel_finite(self, x: torch.Tensor, floor: float = 0.0) -> tuple[float, bool]:
        """``metrics.rel_l2_finite(x, ref, floor)``."""
        hit = self._differences.get(id(x))
        if hit is None or hit[0] is not x or self._norm is None:
            return rel_l2_finite(x, self.ref, floor)
        return _ratio(hit[1], max(self._norm, floor)), True

    def rel(self, x: torch.Tensor, floor: float = 0.0) -> float:
        """``metrics.rel_l2(x, ref, floor)``."""
        return self.rel_finite(x, floor)[0]

    def abs_max(self) -> float:
        """``metrics.abs_max(ref)``."""
        return self._absmax if self._absmax is not None else abs_max(self.ref)

    def rounding(self, dtype: torch.dtype) -> float:
        """``metrics.rounding_error(ref, dtype)``, for a ``dtype`` coarser than ``ref``'s."""
        found = self._rounding.get(dtype)
        return _ratio(found, self._norm) if found is not None else rounding_error(self.ref, dtype)


def _ratio(num: float, den: float) -> float:
    """``rel_l2``'s ratio of two finite norms."""
    if den < TINY_NORM:
        return 0.0 if num < TINY_NORM else math.inf
    return num / den
