"""Lockstep training on every arm, and the perturbation envelope; per-step curves.

Every arm (the two targets, the judge, and the envelope runs of the
lower-precision target, nudged by one ulp before step 0 and, for two targets of the
same precision, after every step: ``arms.make_arms``) starts from the same initial weights and sees the same
batches in the same order, one step at a time. Per step and arm we keep
scalars only, each role what the verdict reads of it (issue 28): the loss, the
global gradient norm, non-finite flags, the GradScaler's scale and skipped
steps of every arm; the per-layer gradient norms, the relative parameter
distance to the judge and the first NaN/Inf producer of the targets and the
judge; an envelope run's distance to the target it perturbs; the activation
statistics of the judge (the training-problem detectors run on it). Every step goes
through the arm's runner (``convcheck.targets.runners``); each arm is built by its
target's executor (``convcheck.targets.executors``): in this process, or a proxy for
rank processes whose extra evidence lands in ``TrainResult.arm_evidence``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from convcheck.errors import UsageError
from convcheck.targets.executors import ArmJob, executor_for
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances
from convcheck.measure.train.arm_state import ArmState
from convcheck.measure.table_schema import CurveRow, columns
from convcheck.measure.train.arms import PERTURB_SLOT, Arm, lower_precision, make_arms, perturb_, same_precision
from convcheck.measure.train.distances import Distances
from convcheck.measure.train.stats import Scratch
from convcheck.measure.train.result import (
    CONVERGED_RULE, ArmOutcome, EnvelopeSummary, TrainConfig, TrainResult, converged,
)

Progress = Callable[[int, int], None]

CURVE_COLUMNS = columns(CurveRow)

__all__ = [
    "Arm", "ArmOutcome", "CONVERGED_RULE", "CURVE_COLUMNS", "EnvelopeSummary", "TrainConfig",
    "TrainResult", "converged", "lower_precision", "make_arms", "perturb_", "run_training", "same_precision",
]

_SEED_MOD = 2**63  # torch seeds are 64-bit: derived seeds wrap instead of overflowing


def run_training(build, batches, arms: list[Arm], cfg: TrainConfig, *, tolerances: Tolerances = DEFAULT_TOLERANCES,
                 progress: Progress | None = None, keep=None) -> TrainResult:
    """Train every arm for ``cfg.steps`` steps in lockstep; return per-step curves and outcomes.

    ``batches`` is any iterable of ``(inputs, target)`` batches (a stream: one is held at a time).
    ``keep(curves=rows)`` receives the curve rows as they grow (a run stopped part-way keeps them)."""
    recipe = cfg.recipe if cfg.recipe is not None else _default_recipe()
    states = []
    rows, grad_rows, act_rows = [], [], []  # ``CurveRow``s, ``LayerGradRow``s, ``ActivationRow``s
    if keep is not None:
        keep(curves=rows)
    stream = iter(batches)
    scratch = Scratch()  # buffers the arms' statistics reuse (one set: arms step one at a time)
    distances = Distances(scratch)
    try:
        for arm in arms:  # inside the try: a data-parallel arm's processes are stopped on any failure
            states.append(_arm_state(arm, build, cfg, recipe, scratch))
        scratch.drop(PERTURB_SLOT)  # the envelope arms' one-ulp draws: not needed again
        for step in range(cfg.steps):
            try:
                x, y = next(stream)
            except StopIteration:
                raise UsageError(f"the data ran out after {step} batches; {cfg.steps} steps need {cfg.steps}") from None
            step_seed = (cfg.seed * 100003 + step) % _SEED_MOD
            results = {}
            for i, s in enumerate(states):
                s.step_index = step
                results[s.arm.name] = s.step(x, y, step_seed, (step_seed * 16 + i) % _SEED_MOD)
                if progress:
                    progress(step * len(states) + i + 1, cfg.steps * len(states))
            dist = distances.measure(states, _partners(states), weights=step + 1 < cfg.steps)
            _record(states, step, results, dist, rows, grad_rows, act_rows)
    finally:
        for s in states:
            s.close()
    return TrainResult.from_rows(
        rows, grad_rows, act_rows, arms, cfg, tolerances,
        nonfinite_producer={s.arm: s.producer for s in states},
        nonfinite_weights={s.arm: bool(getattr(s, "producer_weights", False)) for s in states},
        nonfinite_detail={s.arm: dict(getattr(s, "producer_detail", None) or {}) for s in states},
        arm_evidence={s.arm: s.evidence for s in states if s.evidence is not None},
    )


def _arm_state(arm: Arm, build, cfg: TrainConfig, recipe, scratch: Scratch):
    """The arm as its target's executor runs it: here an ``ArmState``; a data-parallel target's N rank
    processes behind a proxy."""
    here = functools.partial(ArmState, build=build, steps=cfg.steps, recipe=recipe, scratch=scratch)
    return executor_for(arm.target).training_arm(arm, ArmJob(build, cfg.steps, recipe, here=here))


def _default_recipe():
    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe

    return build_recipe(CompareConfig())


def _partners(states: list[ArmState]) -> dict[str, tuple]:
    """Per arm: (judge state, the envelope run's reference state, the other target's state). An envelope
    run is measured against the run it perturbs only (its distance to the judge is read by nothing:
    ``dist_judge`` NaN); the judge against nothing."""
    by_name = {s.arm.name: s for s in states}
    judge = next((s for s in states if s.arm.role == "judge"), None)
    pair = [s for s in states if s.arm.role == "target"]
    other = {a.arm.name: b for a, b in zip(pair, reversed(pair))} if len(pair) == 2 else {}
    if len(pair) == 1 and judge is not None:  # the other target is the judge itself (cpu,cpu:float64)
        other = {pair[0].arm.name: judge}
    return {s.arm.name: (judge if s is not judge and s.arm.role != "envelope" else None,
                         by_name.get(s.arm.reference) if s.arm.reference else None,
                         other.get(s.arm.name)) for s in states}


def _record(states, step, results, dist, rows, grad_rows, act_rows) -> None:
    """One step's rows; ``dist`` holds each arm's distance to each of its partners (``Distances``)."""
    partners = _partners(states)
    for s in states:
        r = results[s.arm.name]
        judge, ref, other = partners[s.arm.name]
        rows.append(dict(
            arm=s.arm.name, role=s.arm.role, target=str(s.arm.target), step=step,
            loss=r["loss"], grad_norm=r["grad_norm"],
            dist_judge=0.0 if s.arm.role == "judge" else dist[(id(s), id(judge))] if judge else math.nan,
            dist_ref=dist[(id(s), id(ref))] if ref else math.nan,
            dist_other=dist[(id(s), id(other))] if other else math.nan,
            nonfinite_loss=r["nonfinite_loss"], nonfinite_grad=r["nonfinite_grad"],
            loss_scale=r["loss_scale"], skipped=r["skipped"], update_ratio=r["update_ratio"],
            lr=r["lr"], clipped=r["clipped"],
        ))
        for (layer, norm), zf in zip(r["layer_norms"], r["zero_fracs"]):
            grad_rows.append(dict(arm=s.arm.name, step=step, layer=layer, grad_norm=norm, zero_frac=zf))
        for layer, kind, dead, sat in r["acts"]:
            act_rows.append(dict(arm=s.arm.name, step=step, layer=layer, kind=kind,
                                 dead_frac=dead, saturated_frac=sat))
