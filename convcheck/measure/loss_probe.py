"""The loss-reduction probe: is the user's loss averaged over the batch, or summed? (Runs the judge's model.)"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from convcheck.measure.layer_names import NORM_MODULES


def loss_reduction_probe(model: nn.Module, runner, batch, loss_fn) -> float:
    """loss(batch) / mean(loss(first half), loss(second half)) in float64, in eval mode (no batch statistics):
    ~1 for a mean-reduced loss, ~2 for a loss summed over the batch; NaN when it cannot tell."""
    from convcheck.batch import batch_size_of
    from convcheck.nested import map_tensors

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


def norm_layers(model: nn.Module) -> list[str]:
    """Names of the model's normalisation layers."""
    return [n for n, m in model.named_modules() if type(m).__name__ in NORM_MODULES]
