"""What training hands to the verdict: per-step curves, typed per-arm outcomes, the envelope summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from convcheck.thresholds import CONVERGED_TAIL, FRAGILE_MARGIN
from convcheck.tolerances import DEFAULT_TOLERANCES, Tolerances

CONVERGED_RULE = "converged = every loss finite and mean(last 3 losses) < {ratio:g} x first loss"


def converged(losses: list[float], tol: Tolerances = DEFAULT_TOLERANCES) -> bool:
    """The rule: every loss finite, and the mean of the last three losses is below
    ``tol.converged_loss_ratio`` times the first loss."""
    if not losses or not all(math.isfinite(v) for v in losses):
        return False
    tail = losses[-CONVERGED_TAIL:] if len(losses) > CONVERGED_TAIL else losses[-1:]
    return sum(tail) / len(tail) < tol.converged_loss_ratio * losses[0]


@dataclass(frozen=True)
class ArmOutcome:
    """How one arm's training ended (targets and judge; envelope runs are summarised apart)."""

    name: str
    role: str  # "target" | "judge"
    converged: bool
    first_loss: float
    final_loss: float
    first_nonfinite_step: int | None
    skipped_steps: int
    final_loss_scale: float
    final_dist_judge: float


@dataclass(frozen=True)
class EnvelopeSummary:
    """The perturbed runs of the lower-precision target, and how they ended."""

    reference: str  # the target they perturb (the lower-precision one)
    runs: int
    converged: int
    failed: int  # failed clearly: non-finite, or unconverged and > FRAGILE_MARGIN above the reference


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 30
    seed: int = 0
    recipe: object = None  # a convcheck.recipe.Recipe; None: the default (Adam, lr 1e-3, cross-entropy)


@dataclass
class TrainResult:
    curves: pd.DataFrame  # one row per (arm, step)
    layer_grads: pd.DataFrame  # arm, step, layer, grad_norm, zero_frac
    activations: pd.DataFrame  # arm, step, layer, kind, dead_frac, saturated_frac
    arms: list
    config: TrainConfig
    judge: str = "cpu:float64"
    outcomes: dict[str, ArmOutcome] = field(default_factory=dict)
    envelope: EnvelopeSummary | None = None
    lower_precision: str | None = None  # the target with the larger unit roundoff
    # Per arm: (step, layer) where a leaf module first turned finite inputs into a
    # non-finite output during training, or None.
    nonfinite_producer: dict[str, tuple[int, str] | None] = field(default_factory=dict)
    # Per arm: whether that producer's own weights were already NaN/Inf (the optimizer step before made them so)
    nonfinite_weights: dict[str, bool] = field(default_factory=dict)
    # Per arm whose executor gathers evidence of its own (a ``ddp:`` target's ranks): that evidence, opaque
    # here, read by the executor's ``findings`` (``convcheck.executors``).
    arm_evidence: dict[str, object] = field(default_factory=dict)

    def arm_curve(self, name: str) -> pd.DataFrame:
        return self.curves[self.curves["arm"] == name]


def arm_outcome(arm, curve: pd.DataFrame, tol: Tolerances) -> ArmOutcome:
    """An arm's outcome from its curve (a ``TrainResult.arm_curve``, or one read back from a bundle)."""
    return _outcome(arm, curve.to_dict("records"), tol)


def outcomes_from_rows(arms, rows: list[dict], tol: Tolerances) -> dict[str, ArmOutcome]:
    """``{arm: arm_outcome(arm, its curve, tol)}`` for the targets and the judge, read from the curve
    rows as ``run_training`` made them (in step order) instead of one DataFrame filter per arm: the
    same values (a row's float is the one its DataFrame cell holds), a millisecond less."""
    by_arm: dict[str, list[dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r)
    return {arm.name: _outcome(arm, by_arm.get(arm.name, []), tol) for arm in arms if arm.role != "envelope"}


def _outcome(arm, mine: list[dict], tol: Tolerances) -> ArmOutcome:
    """The outcome of one arm from its curve rows, in step order."""
    losses = [float(r["loss"]) for r in mine]
    bad = [r["step"] for r in mine if r["nonfinite_loss"] or r["nonfinite_grad"]]
    last = (lambda col: float(mine[-1][col]) if mine else math.nan)
    return ArmOutcome(
        name=arm.name, role=arm.role, converged=converged(losses, tol),
        first_loss=losses[0] if losses else math.nan, final_loss=losses[-1] if losses else math.nan,
        first_nonfinite_step=int(bad[0]) if bad else None,
        skipped_steps=int(sum(bool(r["skipped"]) for r in mine)), final_loss_scale=last("loss_scale"),
        final_dist_judge=last("dist_judge"),
    )


def envelope_summary(result: TrainResult, tol: Tolerances) -> EnvelopeSummary | None:
    """Envelope runs that converge, and those that fail *clearly*: non-finite, or not converged and
    ending more than ``FRAGILE_MARGIN`` above the run they perturb (a run that only just misses the
    convergence rule next to a target that only just meets it is the same outcome)."""
    runs = [a for a in result.arms if a.role == "envelope"]
    if not runs:
        return None
    by_arm: dict[str, list[float]] = {}  # every arm's losses in step order, read once (not a filter per arm)
    for name, loss in zip(result.curves["arm"].tolist(), result.curves["loss"].tolist()):
        by_arm.setdefault(name, []).append(float(loss))
    ok = failed = 0
    for a in runs:
        losses = by_arm.get(a.name, [])
        if converged(losses, tol):
            ok += 1
            continue
        mine = losses[-1] if losses else math.nan
        ref_losses = by_arm.get(a.reference, [])
        ref = ref_losses[-1] if ref_losses else math.nan
        if not math.isfinite(mine) or not math.isfinite(ref) or mine > ref * (1 + FRAGILE_MARGIN):
            failed += 1
    return EnvelopeSummary(reference=runs[0].reference, runs=len(runs), converged=ok, failed=failed)
