"""Tolerances: one frozen dataclass for the CLI, the pytest plugin and the API (no torch import)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from convcheck.errors import UsageError
from convcheck.numerics.thresholds import DESTROYED_ERROR, FLOOR_ABSOLUTE


@dataclass(frozen=True)
class Tolerances:
    """When a layer's error counts as introduced by that layer, and when a difference matters.

    Every layer (and parameter gradient) is held against its **measured floor**: the same
    computation in float64 on its operands rounded to the target's precision, the best any
    implementation at that precision can do on that input (``convcheck.measure.parity.floor``). A row
    is flagged when its own error is above ``bound_factor`` times that floor plus a small
    absolute term (``thresholds.FLOOR_ABSOLUTE``), or when it destroys its result (a relative
    error of ``thresholds.DESTROYED_ERROR`` or more) although its floor does not; a non-finite
    error is always flagged. ``bound_factor`` was chosen from the healthy zoo in every precision
    and from real GPU layer tables (README, "How to read it").

    ``min_error`` is the size of a difference that matters on its own: a flagged layer whose
    error stays below it is a note unless the target shows other trouble (an unstable layer that
    loses 1e-4 in float32), and run-to-run differences below it are benign. The same object
    serves the CLI, the pytest plugin and the Python API.
    """

    bound_factor: float = 5.0
    min_error: float = 1e-3
    # Training: a target has converged when its final loss is below this
    # fraction of its first loss and finite (see convcheck.measure.train.converged).
    converged_loss_ratio: float = 0.9

    def __post_init__(self):
        _need("bound_factor", self.bound_factor, lambda v: v > 0, "a positive number")
        _need("min_error", self.min_error, lambda v: v >= 0, "a number of at least 0")
        _need("converged_loss_ratio", self.converged_loss_ratio, lambda v: 0 < v <= 1, "a number in (0, 1]")

    def bound(self, floor: float) -> float:
        """The largest error a row with this floor may have: ``bound_factor * floor + FLOOR_ABSOLUTE``."""
        return self.bound_factor * floor + FLOOR_ABSOLUTE if math.isfinite(floor) else math.nan

    def is_flagged(self, error: float, floor: float) -> bool:
        """Above ``bound(floor)``, or destroyed while the floor is not; a non-finite error always.
        A row without a finite floor (nothing measured) is flagged only for a non-finite error."""
        if not math.isfinite(error):
            return True
        if not math.isfinite(floor):
            return False
        return self.destroys(error, floor) or error > self.bound(floor)

    @staticmethod
    def destroys(error: float, floor: float) -> bool:
        """The result is (mostly) lost although the precision allows far better."""
        return error >= DESTROYED_ERROR and not floor >= DESTROYED_ERROR

    def needed(self, error: float, floor: float) -> float:
        """The ``bound_factor`` that would have let this row pass (inf: none would)."""
        if not math.isfinite(error) or self.destroys(error, floor):
            return math.inf
        if not math.isfinite(floor):
            return math.nan
        over = max(0.0, error - FLOOR_ABSOLUTE)
        if floor <= 0:
            return math.inf if over > 0 else 0.0
        return over / floor


def _need(name: str, value, ok, what: str) -> None:
    """A tolerance must be a finite real number in its range (NaN would turn every comparison into a pass)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise UsageError(f"tolerance {name} must be {what}, got {value!r}")


DEFAULT_TOLERANCES = Tolerances()
