"""Detectors for the parts of the user's own training recipe, read when the judge itself fails.

Each returns a ``Symptom`` naming the part implicated, with the numbers:

* the loss is summed, not averaged, over the batch (or pixels): the loss of a
  batch is ~2x the mean of its two halves' losses (``loss_reduction_probe``);
* the learning-rate schedule: the divergence starts when warm-up ends or at a
  step of the schedule (within ``SCHEDULE_WINDOW`` steps after the change);
* gradient clipping too tight: (nearly) every step clipped and no convergence;
* weight decay that also shrinks normalisation layers' weights and biases.

Detectors never run a model; the probe runs in the pipeline and its ratio is evidence.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn as nn

from convcheck.symptoms import Symptom
from convcheck.thresholds import (
    CLIPPED_SHARE, LR_JUMP_FACTOR, SCHEDULE_WINDOW, SUMMED_LOSS_HIGH, SUMMED_LOSS_LOW,
)

LOSS_SUMMED = "loss summed over the batch"
SCHEDULE_DIVERGENCE = "learning-rate schedule"
CLIPPING_TOO_TIGHT = "gradient clipping too tight"
DECAY_ON_NORMS = "weight decay on normalisation parameters"
RECIPE_PROBLEMS = (LOSS_SUMMED, SCHEDULE_DIVERGENCE, CLIPPING_TOO_TIGHT, DECAY_ON_NORMS)

REMEDIES = {
    LOSS_SUMMED: ["average the loss over the batch (reduction='mean'), or divide the summed loss by the batch "
                  "size (and pixels); a summed loss scales the gradients, and so the learning rate, with them"],
    SCHEDULE_DIVERGENCE: ["lower the schedule's peak learning rate, or warm up for longer",
                          "check the schedule's jumps (step:EVERY:GAMMA with GAMMA > 1 raises the rate)"],
    CLIPPING_TOO_TIGHT: ["raise --clip-grad-norm above the typical gradient norm (see grad_norm in curves.csv), "
                         "or remove the clipping"],
    DECAY_ON_NORMS: ["exclude BatchNorm/LayerNorm weights and all biases from weight decay (two parameter groups)"],
}


def loss_reduction_probe(model: nn.Module, runner, batch, loss_fn) -> float:
    """loss(batch) / mean(loss(first half), loss(second half)) in float64, in eval mode (no batch statistics):
    ~1 for a mean-reduced loss, ~2 for a loss summed over the batch; NaN when it cannot tell."""
    from convcheck.batch import batch_size_of, map_tensors

    inputs, target = batch
    n = batch_size_of(inputs)
    if n < 2:
        return math.nan
    half = n // 2

    def part(sl):
        return map_tensors(inputs, lambda t: t[sl] if t.dim() and t.shape[0] == n else t), \
            map_tensors(target, lambda t: t[sl] if t.dim() and t.shape[0] == n else t)

    was_training = model.training
    model.eval()
    try:
        with runner.applied(), torch.no_grad():
            losses = [float(runner.forward_loss(model, *b, loss_fn)[1])
                      for b in (part(slice(0, 2 * half)), part(slice(0, half)), part(slice(half, 2 * half)))]
    finally:
        model.train(was_training)
    full, a, b = losses
    mean_halves = (a + b) / 2
    return full / mean_halves if all(map(math.isfinite, losses)) and mean_halves > 0 else math.nan


def loss_summed(ratio: float, arm: str) -> Symptom | None:
    if not (SUMMED_LOSS_LOW <= ratio <= SUMMED_LOSS_HIGH):
        return None
    return Symptom(LOSS_SUMMED, arm, f"the loss of a batch is {ratio:.2f}x the mean of its two halves' losses "
                   "(1 for a loss averaged over the batch, 2 for a summed one)", value=ratio)


def schedule_divergence(curves: pd.DataFrame, arm: str, warmup: int) -> Symptom | None:
    """The arm's loss turns non-finite (or first rises by LOSS_RISE) right after a rise of the learning rate."""
    c = curves[curves["arm"] == arm].sort_values("step")
    if "lr" not in c or len(c) < 2:
        return None
    lr, loss = list(c["lr"]), list(c["loss"])
    bad = next((i for i, v in enumerate(loss) if not math.isfinite(v) or (i and v > 1.5 * loss[0])), None)
    if bad is None:
        return None
    changes = [i for i in range(1, len(lr)) if lr[i] > LR_JUMP_FACTOR * lr[i - 1]]
    if warmup:
        changes.append(min(warmup, len(lr) - 1))
    near = [i for i in changes if 0 <= bad - i <= SCHEDULE_WINDOW]
    if not near:
        return None
    at = max(near)
    why = "warm-up ends" if warmup and at == min(warmup, len(lr) - 1) else f"the learning rate jumps to {lr[at]:.3g}"
    return Symptom(SCHEDULE_DIVERGENCE, arm, f"the loss diverges at step {bad} ({loss[bad]:.4g}), "
                   f"{bad - at} step(s) after {why} at step {at} (lr {lr[at]:.3g}, peak {max(lr):.3g})",
                   step=bad, value=lr[at])


def clipping_too_tight(curves: pd.DataFrame, arm: str, clip: float | None, converged: bool) -> Symptom | None:
    c = curves[curves["arm"] == arm]
    if clip is None or converged or "clipped" not in c or not len(c):
        return None
    share = float(c["clipped"].astype(bool).mean())
    if share < CLIPPED_SHARE:
        return None
    median = float(c["grad_norm"].median())
    return Symptom(CLIPPING_TOO_TIGHT, arm, f"--clip-grad-norm {clip:g} clipped {share:.0%} of the steps; the "
                   f"median gradient norm was {median:.3g}, so every update is shrunk by ~{median / clip:.3g}x",
                   value=share)


def decay_on_norms(model: nn.Module | None, weight_decay: float, optimizer: str, arm: str) -> Symptom | None:
    if model is None or not weight_decay or ":" in str(optimizer):
        return None  # a factory may exclude them itself
    norms = [n for n, m in model.named_modules()
             if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm))]
    if not norms:
        return None
    return Symptom(DECAY_ON_NORMS, arm, f"weight decay {weight_decay:g} applies to every parameter, the "
                   f"{len(norms)} normalisation layer(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
                   "and all biases included", value=weight_decay)
