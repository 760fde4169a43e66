"""The result tables' row schemas: one frozen dataclass per table, whose fields ARE its columns.

Parity's per-layer table (``ParityRow``) and training's three tables (``CurveRow``,
``LayerGradRow``, ``ActivationRow``) are named and typed here and nowhere else: the live run
(``parity``, ``train``), the run rebuilt from two bundles (``bundle.rebuild``), the bundle reader's
field checks (``bundle.reader``) and the CSV exports (``report.export``) all take their columns
from these classes. The rows themselves travel as plain dicts (made once per layer or step, in
the hot loops) and are stored as DataFrames (what ``diagnose`` and ``report`` read), built by
``frame``, so the numbers are the same as from any other DataFrame of the same rows.
Results key their per-target facts by ``Target``; ``named`` gives such a mapping keyed by name,
as files and messages write it. No torch: the bundle reader imports this.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any, Mapping, TypeVar

import pandas as pd

V = TypeVar("V")


@dataclass(frozen=True)
class ParityRow:
    """One row of parity's table: a leaf call's forward (``kind`` "forward") or a parameter's
    gradient (``kind`` "grad") on one target, against the judge.

    ``local``: the judge's input through the target's copy of the layer, vs the judge;
    ``intrinsic``: the layer's own arithmetic, vs its float64 copy on the same cast input;
    ``floor``: the best any implementation at the target's precision does (``parity.floor``);
    ``bound``: the largest intrinsic error that passes (bound_factor x floor + the absolute term);
    ``over_floor``: intrinsic / floor (how far above its precision the layer is); ``needed``: the
    bound_factor that would let the row pass (inf when none would); ``u``: the op's operand unit
    roundoff; ``shape``: ``"2x6x28x28"``."""

    target: str
    order: int
    kind: str
    layer: str
    module: str
    param: str | None
    shape: str | None
    K: int | None
    u: float
    floor: float
    bound: float
    propagated: float
    local: float
    intrinsic: float
    over_floor: float
    needed: float
    nan: int
    inf: int
    input_nonfinite: int
    grad_out_nonfinite: int
    grad_in_nonfinite: int | None
    ref_absmax: float
    flagged: bool


@dataclass(frozen=True)
class CurveRow:
    """One arm's training step: its loss, gradient norm, relative parameter distances (to the judge,
    to the run an envelope run perturbs, to the other target), non-finite flags, the GradScaler's
    scale and skipped step, the update ratio, the learning rate and whether clipping acted."""

    arm: str
    role: str
    target: str
    step: int
    loss: float
    grad_norm: float
    dist_judge: float
    dist_ref: float
    dist_other: float
    nonfinite_loss: bool
    nonfinite_grad: bool
    loss_scale: float
    skipped: bool
    update_ratio: float
    lr: float
    clipped: bool


@dataclass(frozen=True)
class LayerGradRow:
    """One layer's gradient on one arm at one step: its norm and the fraction of exact zeros."""

    arm: str
    step: int
    layer: str
    grad_norm: float
    zero_frac: float


@dataclass(frozen=True)
class ActivationRow:
    """One activation layer on one arm at one step: the fraction of dead (ReLU) or saturated outputs."""

    arm: str
    step: int
    layer: str
    kind: str
    dead_frac: float
    saturated_frac: float


def columns(row_type: type) -> tuple[str, ...]:
    """The table's columns, in order: the row class's fields."""
    return tuple(f.name for f in fields(row_type))


def frame(row_type: type, rows: list[dict]) -> pd.DataFrame:
    """The table of ``rows`` (dicts holding the row class's fields) with exactly its columns, in order."""
    return pd.DataFrame(rows, columns=list(columns(row_type)))


def json_kinds(row_type: type) -> dict[str, type | tuple[type, ...]]:
    """Per column, the JSON value types a bundle may hold there (``isinstance`` kinds, as
    ``bundle.reader`` checks them): a ``float`` column takes an integer too, ``X | None`` adds ``None``."""
    hints = typing.get_type_hints(row_type)
    out: dict[str, type | tuple[type, ...]] = {}
    for name in columns(row_type):
        kinds: list[type] = []
        for t in typing.get_args(hints[name]) or (hints[name],):
            kinds += [int, float] if t is float else [t]
        out[name] = kinds[0] if len(kinds) == 1 else tuple(kinds)
    return out


def named(by_target: Mapping[Any, V]) -> dict[str, V]:
    """A result's per-target mapping (keyed by ``Target``) keyed by the targets' names instead, in
    its order: what summaries, messages and the verdict's evidence write."""
    return {str(t): v for t, v in by_target.items()}
