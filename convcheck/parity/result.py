"""The parity table and its result type."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from convcheck.tolerances import Tolerances

# Per row: ``local`` (the judge's input through the target's layer, vs the judge), ``intrinsic``
# (the layer's own arithmetic: vs its float64 copy on the same cast input), ``floor`` (the best
# any implementation at the target's precision does: ``parity.floor``), ``bound`` (the largest
# intrinsic error that passes: bound_factor x floor + the absolute term), ``over_floor``
# (intrinsic / floor: how far above its precision the layer is), ``needed`` (the bound_factor
# that would let the row pass; inf when none would). ``u`` is the op's operand unit roundoff.
COLUMNS = [
    "target", "order", "kind", "layer", "module", "param", "shape", "K", "u", "floor", "bound",
    "propagated", "local", "intrinsic", "over_floor", "needed", "nan", "inf", "input_nonfinite",
    "grad_out_nonfinite", "grad_in_nonfinite", "ref_absmax", "flagged",
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

    def worst(self, per_target: int, kind: str | None = None) -> pd.DataFrame:
        """Each target's own worst rows (``per_target`` each, in the targets' order): flagged first,
        then by how far the row's own error is above its floor (``over_floor``)."""
        t = self.layers if kind is None else self.layers[self.layers["kind"] == kind]
        if not len(t):
            return t
        t = t.assign(_rank=t["over_floor"].fillna(-1.0))
        parts = [g.sort_values(["flagged", "_rank"], ascending=[False, False]).head(per_target)
                 for _, g in t.groupby("target", sort=False)]
        return pd.concat(parts).drop(columns="_rank")

    def needed_bound_factor(self) -> float:
        """The smallest ``bound_factor`` under which none of the flagged rows would be (inf when a
        flagged row fails whatever the factor: non-finite, or its result destroyed); 0 when none is."""
        t = self.flagged()
        return float(t["needed"].max()) if len(t) else 0.0


def first_flagged(rows: list[dict]) -> str | None:
    fwd = [r for r in rows if r["kind"] == "forward" and r["flagged"]]
    if fwd:
        return min(fwd, key=lambda r: r["order"])["layer"]
    grad = [r for r in rows if r["kind"] == "grad" and r["flagged"]]
    if grad:  # backward runs output -> input: the last layer in forward order comes first
        return max(grad, key=lambda r: r["order"])["layer"]
    return None
