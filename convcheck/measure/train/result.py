"""What training hands to the verdict: per-step tables, typed per-target outcomes, the envelope summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import pandas as pd

from convcheck.measure.table_schema import ActivationRow, CurveRow, LayerGradRow, frame
from convcheck.targets.spec import Target
from convcheck.numerics.thresholds import CONVERGED_TAIL, FRAGILE_MARGIN
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances
from convcheck.measure.train.arms import Arm, lower_precision

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
    every_step: bool = False  # nudged by one ulp after every step too (the null model of a same-precision pair)

    @property
    def null_model(self) -> str:
        """The envelope in words: "one-ulp envelope", or "per-step one-ulp envelope"."""
        return "per-step one-ulp envelope" if self.every_step else "one-ulp envelope"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 30
    seed: int = 0
    recipe: object = None  # a convcheck.plan.recipe.Recipe; None: the default (Adam, lr 1e-3, cross-entropy)


@dataclass(frozen=True)
class TrainResult:
    """Every arm's training: the three tables (``table_schema``), each target's and the judge's
    outcome, the envelope's summary. Built complete by ``from_rows`` (the live run and the one
    rebuilt from bundles alike), never changed.

    Per-target facts are keyed by the ``Target`` (the judge's included); per-arm facts, which the
    envelope runs have too, by the ``Arm``. ``arm_of`` finds a target's arm."""

    curves: pd.DataFrame  # ``CurveRow``s: one per (arm, step)
    layer_grads: pd.DataFrame  # ``LayerGradRow``s
    activations: pd.DataFrame  # ``ActivationRow``s
    arms: tuple[Arm, ...]
    config: TrainConfig
    judge: str = "cpu:float64"
    outcomes: Mapping[Target, ArmOutcome] = field(default_factory=dict)
    envelope: EnvelopeSummary | None = None
    lower_precision: Target | None = None  # the target with the larger unit roundoff
    # Per arm: (step, layer) where a leaf module first turned finite inputs into a
    # non-finite output during training, or None.
    nonfinite_producer: Mapping[Arm, tuple[int, str] | None] = field(default_factory=dict)
    # Per arm: whether that producer's own weights were already NaN/Inf (the optimizer step before made them so)
    nonfinite_weights: Mapping[Arm, bool] = field(default_factory=dict)
    # Per arm: what the producer is (``callable``: module, loss, optimizer, schedule), the op of user
    # code that made the first NaN/Inf and its float64 ``magnitude`` (``nonfinite.FirstProducer.detail``)
    nonfinite_detail: Mapping[Arm, dict] = field(default_factory=dict)
    # Per arm whose executor gathers evidence of its own (a ``ddp:`` target's ranks): that evidence, opaque
    # here, read by the executor's ``findings`` (``convcheck.targets.executors``).
    arm_evidence: Mapping[Arm, object] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, curves: list[dict], layer_grads: list[dict], activations: list[dict], arms, config: TrainConfig,
                  tolerances: Tolerances, *, nonfinite_producer: Mapping[Arm, tuple[int, str] | None],
                  nonfinite_weights: Mapping[Arm, bool], nonfinite_detail: Mapping[Arm, dict] | None = None,
                  arm_evidence: Mapping[Arm, object] | None = None) -> TrainResult:
        """The result of the three tables' rows (each arm's curve rows in step order): the tables, the
        outcomes, the envelope summary and the lower-precision target are all made here."""
        arms = tuple(arms)
        table = frame(CurveRow, curves)
        judge = next((a for a in arms if a.role == "judge"), None)
        return cls(
            curves=table, layer_grads=frame(LayerGradRow, layer_grads), activations=frame(ActivationRow, activations),
            arms=arms, config=config, judge=judge.name if judge else "",
            outcomes=outcomes_from_rows(arms, curves, tolerances), envelope=envelope_summary(arms, table, tolerances),
            lower_precision=_lower_precision(arms), nonfinite_producer=dict(nonfinite_producer),
            nonfinite_weights=dict(nonfinite_weights), nonfinite_detail=dict(nonfinite_detail or {}),
            arm_evidence=dict(arm_evidence or {}))

    def arm_of(self, target: Target) -> Arm:
        """The arm that trained ``target`` (a target's or the judge's; not an envelope run)."""
        return next(a for a in self.arms if a.target == target and a.role != "envelope")

    def arm_curve(self, arm: Arm | str) -> pd.DataFrame:
        """One arm's curve rows (the arm, or its name in the table)."""
        name = arm.name if isinstance(arm, Arm) else arm
        return self.curves[self.curves["arm"] == name]


def _lower_precision(arms) -> Target | None:
    """The lower-precision target of the two (``arms.lower_precision``); where one target is the judge
    itself (``cpu,cpu:float64``), the other against the judge."""
    targets = [a.target for a in arms if a.role == "target"]
    if len(targets) == 1:
        targets.append(next(a.target for a in arms if a.role == "judge"))
    return lower_precision(targets) if len(targets) == 2 else None


def arm_outcome(arm, curve: pd.DataFrame, tol: Tolerances) -> ArmOutcome:
    """An arm's outcome from its curve as a DataFrame (a ``TrainResult.arm_curve``): the rule
    ``outcomes_from_rows`` applies to the rows, in the form a reader of the table has (the tests hold
    the two equal)."""
    return _outcome(arm, curve.to_dict("records"), tol)


def outcomes_from_rows(arms, rows: list[dict], tol: Tolerances) -> dict[Target, ArmOutcome]:
    """``{arm.target: arm_outcome(arm, its curve, tol)}`` for the targets and the judge, read from the curve
    rows (each arm's in step order: as ``run_training`` made them, or as ``bundle.rebuild`` read them back)
    instead of one DataFrame filter per arm: the same values (a row's float is the one its DataFrame
    cell holds), a millisecond less."""
    by_arm: dict[str, list[dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r)
    return {arm.target: _outcome(arm, by_arm.get(arm.name, []), tol) for arm in arms if arm.role != "envelope"}


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


def envelope_summary(arms, curves: pd.DataFrame, tol: Tolerances) -> EnvelopeSummary | None:
    """Envelope runs that converge, and those that fail *clearly*: non-finite, or not converged and
    ending more than ``FRAGILE_MARGIN`` above the run they perturb (a run that only just misses the
    convergence rule next to a target that only just meets it is the same outcome)."""
    runs = [a for a in arms if a.role == "envelope"]
    if not runs:
        return None
    by_arm: dict[str, list[float]] = {}  # every arm's losses in step order, read once (not a filter per arm)
    for name, loss in zip(curves["arm"].tolist(), curves["loss"].tolist()):
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
    return EnvelopeSummary(reference=runs[0].reference, runs=len(runs), converged=ok, failed=failed,
                           every_step=bool(runs[0].every_step))
