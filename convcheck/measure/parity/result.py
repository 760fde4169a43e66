"""The parity table and its result type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import pandas as pd

from convcheck.measure.table_schema import ParityRow, columns, frame
from convcheck.numerics.tolerances import Tolerances

if TYPE_CHECKING:
    from convcheck.targets.spec import Target

COLUMNS = columns(ParityRow)  # the table's columns: ``ParityRow``'s fields (what each means is there)


@dataclass(frozen=True)
class ParityResult:
    """Per-layer parity of every target against the judge. Truthy when nothing is flagged.

    Built complete, never changed. The per-target facts are keyed by the ``Target`` (in the
    targets' order); the table's ``target`` column holds ``str(target)``."""

    layers: pd.DataFrame  # ``ParityRow``s (``COLUMNS``)
    first_flagged: Mapping[Target, str | None]
    tolerances: Tolerances
    judge_loss: float
    losses: Mapping[Target, float] = field(default_factory=dict)
    # Leaf modules whose output changes with the random seed although their
    # input does not: stochastic layers that masks are not shared for.
    stochastic_layers: tuple[str, ...] = ()
    # Per target: largest relative difference between two identical runs
    # (same seed, same input) of its forward/backward - nondeterministic kernels.
    self_difference: Mapping[Target, float] = field(default_factory=dict)
    judge: str = "cpu:float64"
    # Per target that differs from itself: where two runs from the same state first differ
    # (``localise.first_difference``: layer, direction, op); and the targets that were rerun at all.
    self_difference_at: Mapping[Target, dict] = field(default_factory=dict)
    repeated: tuple = ()

    @classmethod
    def from_rows(cls, rows: list[dict], targets: list[Target], tolerances: Tolerances, judge_loss: float, *,
                  losses: Mapping[Target, float], stochastic_layers=(), self_difference: Mapping[Target, float],
                  judge: str, self_difference_at: Mapping[Target, dict] | None = None,
                  repeated: tuple = ()) -> ParityResult:
        """The result of ``rows`` (``ParityRow`` dicts, every target's, in order): the table and each
        target's first flagged layer are made here, for the live run and the rebuilt one alike."""
        mine = {t: [r for r in rows if r["target"] == str(t)] for t in targets}
        return cls(frame(ParityRow, rows), {t: first_flagged(mine[t]) for t in targets}, tolerances, judge_loss,
                   dict(losses), tuple(stochastic_layers), dict(self_difference), judge,
                   dict(self_difference_at or {}), tuple(repeated))

    @property
    def targets(self) -> tuple[Target, ...]:
        """The targets measured (the judge excluded), in order."""
        return tuple(self.first_flagged)

    def __bool__(self) -> bool:
        return not bool(self.layers["flagged"].any()) if len(self.layers) else True

    def flagged(self, target: Target | str | None = None) -> pd.DataFrame:
        """The flagged rows (of one target: a ``Target`` or its name in the table)."""
        t = self.layers[self.layers["flagged"]]
        return t if target is None else t[t["target"] == str(target)]

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
