"""A tabular regression MLP: 16 features -> 64 -> 64 -> 1, trained with mean squared error."""

from __future__ import annotations

import torch
from torch import nn

from reference_models.spec import ModelSpec


class MLPRegression(nn.Module):
    input_shape = (16,)

    def __init__(self, num_classes: int = 1, features: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.num_classes = num_classes  # outputs (1: one regression target)
        self.fc1 = nn.Linear(features, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU()
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


def mlp_regression(num_classes: int = 1) -> MLPRegression:
    return MLPRegression(num_classes=num_classes)


SPECS = (ModelSpec("mlp_regression", mlp_regression, (16,), 1,
                   "tabular regression MLP: 16 features -> 64 -> 64 -> 1, mean squared error", "regression"),)
