"""LeNet-5 for 1x28x28 images (MNIST), 10 classes.

The classic layout with ReLU and max pooling. Every layer is its own named
submodule, ReLUs included, so per-layer reports read ``conv1, relu1, pool1, ...``
and forward hooks see every activation.
"""

from __future__ import annotations

import torch
from torch import nn

from reference_models.spec import ModelSpec


class LeNet5(nn.Module):
    input_shape = (1, 28, 28)

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.num_classes = num_classes
        # 1x28x28 -> 6x28x28 (padding 2 keeps 28) -> 6x14x14
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5, padding=2)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        # 6x14x14 -> 16x10x10 -> 16x5x5
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        # 16*5*5 = 400 -> 120 -> 84 -> classes
        self.fc1 = nn.Linear(400, 120)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(120, 84)
        self.relu4 = nn.ReLU()
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu3(self.fc1(x))
        x = self.relu4(self.fc2(x))
        return self.fc3(x)


def lenet(num_classes: int = 10) -> LeNet5:
    return LeNet5(num_classes=num_classes)


SPECS = (ModelSpec("lenet", lenet, (1, 28, 28), 10, "LeNet-5 (MNIST): 2 conv, 3 fc, ReLU, max pooling"),)
