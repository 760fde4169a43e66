"""Tolerances: one frozen dataclass for the CLI, the pytest plugin and the API (no torch import)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from convcheck.errors import UsageError


@dataclass(frozen=True)
class Tolerances:
    """When a layer's local error counts as introduced by that layer.

    A layer is flagged when its local error (judge input -> target layer vs the
    judge's output) is above ``bound_factor`` times its expected bound *and*
    above ``min_error``, the size that matters (an ill-conditioned layer that
    loses 1e-4 in float32 is a note, not a culprit).

    The expected bound for a reduction of length K in a format with unit
    roundoff u is u*sqrt(K) (typical growth; u*K is the worst case), see
    ARCHITECTURE.md "Local vs propagated error". The same object serves the
    CLI, the pytest plugin and the Python API.
    """

    bound_factor: float = 8.0
    min_error: float = 1e-3
    # Training: a target has converged when its final loss is below this
    # fraction of its first loss and finite (see convcheck.train.converged).
    converged_loss_ratio: float = 0.9

    def __post_init__(self):
        _need("bound_factor", self.bound_factor, lambda v: v > 0, "a positive number")
        _need("min_error", self.min_error, lambda v: v >= 0, "a number of at least 0")
        _need("converged_loss_ratio", self.converged_loss_ratio, lambda v: 0 < v <= 1, "a number in (0, 1]")

    def is_flagged(self, local_error: float, bound: float) -> bool:
        if not math.isfinite(local_error):
            return True
        return local_error > max(self.bound_factor * bound, self.min_error)

    def needed(self, local_error: float, bound: float) -> float:
        """The ``bound_factor`` that would have let this error pass."""
        if bound <= 0:
            return math.inf
        return local_error / bound



def _need(name: str, value, ok, what: str) -> None:
    """A tolerance must be a finite real number in its range (NaN would turn every comparison into a pass)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise UsageError(f"tolerance {name} must be {what}, got {value!r}")


DEFAULT_TOLERANCES = Tolerances()
