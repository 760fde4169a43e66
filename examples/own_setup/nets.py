"""A small CNN for 3x32x32 images, as a user would write it (BatchNorm, residual add in forward)."""

import torch
import torch.nn as nn


class SmallNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        h = self.stem(x)
        h = self.relu(h + self.block(h))  # a residual add, written in forward
        return self.fc(self.pool(h).flatten(1))


def small_net():
    return SmallNet()
