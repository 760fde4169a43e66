"""What the zoo knows of a model: ``ModelSpec``. Each model's module declares its own ``SPECS``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

# What a model learns; it decides the synthetic data and the default loss.
TASKS = ("classification", "segmentation", "regression")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: Callable[..., nn.Module]   # builds a fresh model; accepts num_classes=
    input_shape: tuple[int, ...]        # one sample: C, H, W (images) or F (tabular features)
    num_classes: int                    # classes (per pixel for segmentation); outputs for regression
    description: str
    task: str = "classification"        # classification | segmentation | regression
