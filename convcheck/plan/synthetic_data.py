"""Learnable synthetic data for the tasks beyond classification (``convcheck.plan.seeded_data`` makes the class images).

* segmentation: masks of ``num_classes`` regions cut from a smooth random
  field (class k where the field lies in the k-th band); the image is the
  mask's class level plus Gaussian noise, so a few conv layers can learn it.
  Targets are (N, H, W) int64 class indices: per-pixel cross-entropy.
* regression: features ~ N(0, 1); the target is a fixed random linear map plus
  a smooth nonlinearity and a little noise, (N, outputs) float64: mean squared error.

Both are made on the CPU in float64 from generators seeded by ``(seed, ...)``,
batch after batch, without end, at one thread (``threads.single_threaded``): the
same bits at any thread count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from convcheck.plan.seeded_data import check_args, seeded_generator
from convcheck.plan.threads import single_threaded
from convcheck.errors import UsageError

SEGMENTATION_NOISE = 0.3
REGRESSION_NOISE = 0.05


def task_source(task: str, *, input_shape, num_classes: int, batch_size: int, steps: int, seed: int):
    """``(source name, note, open_iter)`` of the synthetic data for ``task``."""
    if task == "segmentation":
        shape = check_args(input_shape, num_classes, batch_size, steps)
        return "synthetic", None, lambda: _segmentation(shape, num_classes, batch_size, seed)
    if task == "regression":
        if len(input_shape) != 1 or input_shape[0] < 1:
            raise UsageError(f"regression data needs one feature dimension, got input shape {input_shape}")
        return "synthetic", None, lambda: _regression(input_shape[0], num_classes, batch_size, seed)
    raise UsageError(f"no synthetic data for task {task!r}")


def _segmentation(shape, num_classes: int, batch_size: int, seed: int):
    c, h, w = shape
    g = seeded_generator(seed, "segmentation")
    while True:
        with single_threaded():
            coarse = torch.randn(batch_size, 1, max(2, h // 8), max(2, w // 8), generator=g, dtype=torch.float64)
            field = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[:, 0]
            # equal-probability bands of a standard normal field: class k in the k-th band
            edges = torch.distributions.Normal(0.0, 0.6).icdf(
                torch.linspace(0, 1, num_classes + 1, dtype=torch.float64)[1:-1])
            mask = torch.bucketize(field, edges).to(torch.int64)
            level = mask.to(torch.float64) / max(1, num_classes - 1) * 2 - 1
            x = level[:, None].expand(-1, c, -1, -1) + SEGMENTATION_NOISE * torch.randn(
                batch_size, c, h, w, generator=g, dtype=torch.float64)
            x, mask = x.contiguous(), mask.contiguous()
        yield x, mask


def _regression(features: int, outputs: int, batch_size: int, seed: int):
    g = seeded_generator(seed, "regression-weights")
    weight = torch.randn(features, outputs, generator=g, dtype=torch.float64) / features**0.5
    g = seeded_generator(seed, "regression")
    while True:
        with single_threaded():  # the matrix product's blocking may follow the thread count
            x = torch.randn(batch_size, features, generator=g, dtype=torch.float64)
            y = x @ weight + 0.5 * torch.sin(x[:, :1]) + REGRESSION_NOISE * torch.randn(
                batch_size, outputs, generator=g, dtype=torch.float64)
        yield x, y
