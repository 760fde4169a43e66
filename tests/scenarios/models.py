"""Small models that really have the problems the scenario tests are about."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class NaiveNorm(nn.Module):
    """Per-sample normalisation with the variance computed as E[x^2] - E[x]^2.

    Exact in float32 for these inputs, but in bfloat16 (8-bit mantissa) the two
    terms are ~900 apart from a variance of ~1, so every digit cancels away.
    """

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        var = (x * x).mean(dim=(1, 2, 3), keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(1e-5))


class Offset(nn.Module):
    """Adds a large constant: the input of NaiveNorm sits far from zero."""

    def __init__(self, value: float = 30.0):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x + self.value


def cancelling_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), Offset(30.0), NaiveNorm(), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10),
    )


class Gain(nn.Module):
    """Multiplies by a large constant and divides it out in the next layer: harmless in
    float32, an overflow past float16's 65504 in between."""

    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def overflow_net() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), Gain(1e5), Gain(1e-5), nn.Linear(64, 10),
    )


def deep_sigmoid_net(depth: int = 12) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, 32), nn.Sigmoid()]
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    layers.append(nn.Linear(32, 10))
    return nn.Sequential(*layers)


class FunctionalDropout(nn.Module):
    """Dropout drawn with F.dropout inside forward: no module convcheck can share masks for."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


def functional_dropout_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), FunctionalDropout(), nn.Linear(64, 10))


def module_dropout_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))
