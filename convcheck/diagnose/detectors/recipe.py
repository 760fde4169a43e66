"""Detectors for the parts of the user's own training recipe, read when the judge itself fails.

Each returns a ``Symptom`` naming the part implicated, with the numbers:

* the loss is summed, not averaged, over the batch (or pixels): the loss of a
  batch is ~2x the mean of its two halves' losses (``loss_reduction_probe``);
* the learning-rate schedule: the divergence starts when warm-up ends or at a
  step of the schedule (within ``SCHEDULE_WINDOW`` steps after the change);
* gradient clipping too tight: (nearly) every step clipped and no convergence;
* weight decay that also shrinks normalisation layers' weights and biases;
* weight decay too strong: lr x weight_decay (what the weights lose a step, read from the optimizer's
  ``param_groups``, ``stages.measure_weight_decay``) at or above ``DECAY_PER_STEP_HIGH``.

Detectors never run a model (this module imports no torch); the probe
(``convcheck.measure.loss_probe``) runs in the pipeline and its ratio is evidence.
"""

from __future__ import annotations

import math

import pandas as pd

from convcheck.diagnose.remedies import LOWER_DECAY
from convcheck.diagnose.detectors.training import Symptom
from convcheck.measure.layer_names import NORM_MODULES
from convcheck.numerics.thresholds import (
    CLIPPED_SHARE, DECAY_PER_STEP_HIGH, LOSS_RISE_FACTOR, LR_JUMP_FACTOR, SCHEDULE_WINDOW, SUMMED_LOSS_HIGH, SUMMED_LOSS_LOW,
)

LOSS_SUMMED = "loss summed over the batch"
SCHEDULE_DIVERGENCE = "learning-rate schedule"
CLIPPING_TOO_TIGHT = "gradient clipping too tight"
DECAY_ON_NORMS = "weight decay on normalisation parameters"
DECAY_TOO_STRONG = "weight decay too strong"

REMEDIES = {
    LOSS_SUMMED: ["average the loss over the batch (reduction='mean'), or divide the summed loss by the batch "
                  "size (and pixels); a summed loss scales the gradients, and so the learning rate, with them"],
    SCHEDULE_DIVERGENCE: ["lower the schedule's peak learning rate, or warm up for longer",
                          "check the schedule's jumps (step:EVERY:GAMMA with GAMMA > 1 raises the rate)"],
    CLIPPING_TOO_TIGHT: ["raise --clip-grad-norm above the typical gradient norm (see grad_norm in curves.csv), "
                         "or remove the clipping"],
    DECAY_TOO_STRONG: [LOWER_DECAY],  # the catalogue's entry: verify lowers the weight decay
    DECAY_ON_NORMS: ["exclude BatchNorm/LayerNorm weights and all biases from weight decay (two parameter groups)"],
}


def loss_summed(ratio: float, arm: str) -> Symptom | None:
    if not (SUMMED_LOSS_LOW <= ratio <= SUMMED_LOSS_HIGH):
        return None
    return Symptom(LOSS_SUMMED, arm, f"the loss of a batch is {ratio:.2f}x the mean of its two halves' losses "
                   "(1 for a loss averaged over the batch, 2 for a summed one)", value=ratio)


def schedule_divergence(curves: pd.DataFrame, arm: str, warmup: int) -> Symptom | None:
    """The arm's loss turns non-finite (or rises by LOSS_RISE_FACTOR) during warm-up, within
    ``SCHEDULE_WINDOW`` steps after it ends, or right after the schedule raises the learning rate."""
    c = curves[curves["arm"] == arm].sort_values("step")
    if "lr" not in c or len(c) < 2:
        return None
    lr, loss = list(c["lr"]), list(c["loss"])
    bad = next((i for i, v in enumerate(loss) if not math.isfinite(v) or (i and v > LOSS_RISE_FACTOR * loss[0])),
               None)
    if bad is None:
        return None
    where = _schedule_change(lr, warmup, bad)
    if where is None:
        return None
    return Symptom(SCHEDULE_DIVERGENCE, arm, f"the loss diverges at step {bad} ({loss[bad]:.4g}) {where} "
                   f"(lr {lr[bad]:.3g} then, peak {max(lr):.3g})", step=bad, value=lr[bad])


def _schedule_change(lr: list[float], warmup: int, bad: int) -> str | None:
    """Where in the schedule step ``bad`` lies, if the schedule can be blamed; else None."""
    if warmup and bad < warmup:
        return f"during the {warmup}-step warm-up"
    if warmup and bad - warmup <= SCHEDULE_WINDOW:
        return f"{bad - warmup} step(s) after warm-up ends at step {warmup}"
    jumps = [i for i in range(max(1, warmup + 1), len(lr)) if lr[i] > LR_JUMP_FACTOR * lr[i - 1]]
    near = [i for i in jumps if 0 <= bad - i <= SCHEDULE_WINDOW]
    if near:
        return f"{bad - max(near)} step(s) after the learning rate jumps to {lr[max(near)]:.3g} at step {max(near)}"
    return None


def recipe_problems(result) -> list[Symptom]:
    """The judge's recipe symptoms of one comparison (read only: the probe ran in the pipeline)."""
    cfg, training = result.config, result.training
    judge = str(cfg.judge)
    outcome = training.outcomes.get(cfg.judge)
    layers = result.parity.layers
    norms = sorted(set(layers.loc[layers["module"].isin(NORM_MODULES), "layer"])) \
        if len(layers) and "module" in layers else []
    found = [loss_summed(getattr(result, "loss_batch_ratio", math.nan), judge),
             schedule_divergence(training.curves, judge, getattr(cfg, "warmup", 0)),
             clipping_too_tight(training.curves, judge, getattr(cfg, "clip_grad_norm", None),
                                bool(outcome and outcome.converged)),
             decay_too_strong(getattr(result, "weight_decay", None), judge, peak_lr(training.curves, judge)),
             decay_on_norms(norms, getattr(cfg, "weight_decay", 0.0), getattr(cfg, "optimizer", None), judge)]
    return [s for s in found if s is not None]


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




def decay_on_norms(norms: list[str], weight_decay: float, optimizer, arm: str) -> Symptom | None:
    """``norms``: names of the model's normalisation layers (``norm_layers``, or from the parity table)."""
    if not weight_decay or not isinstance(optimizer, str) or ":" in optimizer:
        return None  # a factory may exclude them itself
    if not norms:
        return None
    return Symptom(DECAY_ON_NORMS, arm, f"weight decay {weight_decay:g} applies to every parameter, the "
                   f"{len(norms)} normalisation layer(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
                   "and all biases included", value=weight_decay)


def peak_lr(curves: pd.DataFrame, arm: str) -> float:
    """The largest learning rate ``arm`` ran with (its group 0's, as the curves record it; NaN: not recorded)."""
    c = curves[curves["arm"] == arm] if "lr" in curves else curves.iloc[0:0]
    lrs = [float(v) for v in c["lr"] if math.isfinite(float(v))] if len(c) else []
    return max(lrs) if lrs else math.nan


def decay_too_strong(decay: dict | None, arm: str, ran_lr: float = math.nan) -> Symptom | None:
    """``decay``: the optimizer's strongest group (``stages.measure_weight_decay``); lr x weight_decay at or
    above ``DECAY_PER_STEP_HIGH``, the lr as the schedule ran it at its peak (``ran_lr``, group 0's: the
    strongest group's lr scaled as group 0's was), not as the optimizer was built (a LambdaLR of 1e-4 on lr 1
    decays 1e-6 a step, not wd)."""
    if not decay:
        return None
    lr, wd = decay["lr"], decay["weight_decay"]
    lr0 = decay.get("lr0", math.nan)
    if math.isfinite(ran_lr) and isinstance(lr0, (int, float)) and math.isfinite(lr0) and lr0 > 0:
        lr = lr * ran_lr / lr0
    rate = lr * wd
    if not (math.isfinite(rate) and rate >= DECAY_PER_STEP_HIGH):
        return None
    momentum = decay.get("momentum") or 0.0
    shrink = (f"the weights lose {rate:.3g} of their size every step" if rate < 1
              else "the decay alone overshoots the weights past zero every step")
    more = (f" ({rate / (1 - momentum):.3g} a step once SGD's momentum {momentum:g} has built up)"
            if 0 < momentum < 1 and rate < 1 else "")
    return Symptom(DECAY_TOO_STRONG, arm, f"{decay.get('optimizer', 'the optimizer')}'s weight decay {wd:g} at lr "
                   f"{lr:g}: lr x weight_decay = {rate:.3g}, {shrink}{more}, far above the 1e-6..1e-4 of common "
                   f"recipes (>= {DECAY_PER_STEP_HIGH:g}: more than the gradient can undo)", value=rate)
