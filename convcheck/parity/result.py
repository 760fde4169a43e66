"""The parity table and its result type."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from convcheck.tolerances import Tolerances

COLUMNS = [
    "target", "order", "kind", "layer", "module", "param", "shape", "K", "u", "bound",
    "propagated", "local", "intrinsic", "needed", "nan", "inf", "input_nonfinite", "grad_out_nonfinite",
    "ref_absmax", "flagged",
]


@dataclass
class ParityResult:
    """Per-layer parity of every target against the judge. Truthy when nothing is flagged."""

    layers: pd.DataFrame
    first_flagged: dict[str, str | None]
    tolerances: Tolerances
    judge_loss: float
    losses: dict[str, float] = field(default_factory=dict)
    # Leaf modules whose output changes with the random seed although their
    # input does not: stochastic layers that masks are not shared for.
    stochastic_layers: list[str] = field(default_factory=list)
    # Per target: largest relative difference between two identical runs
    # (same seed, same input) of its forward/backward - nondeterministic kernels.
    self_difference: dict[str, float] = field(default_factory=dict)
    judge: str = "cpu:float64"

    def __bool__(self) -> bool:
        return not bool(self.layers["flagged"].any()) if len(self.layers) else True

    def flagged(self, target: str | None = None) -> pd.DataFrame:
        t = self.layers[self.layers["flagged"]]
        return t if target is None else t[t["target"] == target]

    def needed_bound_factor(self) -> float:
        """The smallest ``bound_factor`` under which no layer above ``min_error`` would be flagged."""
        t = self.layers
        t = t[t["local"] > self.tolerances.min_error]
        return float(t["needed"].max()) if len(t) else 0.0


def first_flagged(rows: list[dict]) -> str | None:
    fwd = [r for r in rows if r["kind"] == "forward" and r["flagged"]]
    if fwd:
        return min(fwd, key=lambda r: r["order"])["layer"]
    grad = [r for r in rows if r["kind"] == "grad" and r["flagged"]]
    if grad:  # backward runs output -> input: the last layer in forward order comes first
        return max(grad, key=lambda r: r["order"])["layer"]
    return None
