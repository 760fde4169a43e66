"""A small VGG-style CNN for 3x32x32 images (CIFAR-10), 10 classes.

Three blocks of [conv3x3 - BatchNorm - ReLU] x 2 followed by 2x2 max pooling,
widths 32 / 64 / 128, then a global average and one linear layer. BatchNorm
makes it a test of running statistics and of reductions over the batch; no
dropout, so every target sees the same computation.
"""

from __future__ import annotations

import torch
from torch import nn

from reference_models.spec import ModelSpec


class ConvBNReLU(nn.Sequential):
    """conv3x3 (no bias: BatchNorm supplies it) -> BatchNorm2d -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()


class Block(nn.Sequential):
    """Two ConvBNReLU at one width, then halve the spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.unit1 = ConvBNReLU(in_channels, out_channels)
        self.unit2 = ConvBNReLU(out_channels, out_channels)
        self.pool = nn.MaxPool2d(2)


class CifarCNN(nn.Module):
    input_shape = (3, 32, 32)

    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (32, 64, 128)) -> None:
        super().__init__()
        self.num_classes = num_classes
        w1, w2, w3 = widths
        self.block1 = Block(3, w1)    # 3x32x32 -> w1x16x16
        self.block2 = Block(w1, w2)   # -> w2x8x8
        self.block3 = Block(w2, w3)   # -> w3x4x4
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block3(self.block2(self.block1(x)))
        x = self.flatten(self.avgpool(x))
        return self.fc(x)


def cifar_cnn(num_classes: int = 10) -> CifarCNN:
    return CifarCNN(num_classes=num_classes)


SPECS = (ModelSpec("cifar_cnn", cifar_cnn, (3, 32, 32), 10,
                   "small VGG-style CNN (CIFAR-10): 6 conv with BatchNorm, widths 32/64/128"),)
