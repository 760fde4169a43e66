"""A small U-Net for 1x64x64 segmentation: per-pixel class logits, 3 classes.

Two levels down (conv-BN-ReLU twice, max pooling), a bottleneck, two levels up
(transposed convolution, concatenation with the skip connection, conv-BN-ReLU
twice) and a 1x1 head. Widths 8/16/32. The concatenations happen in
``UNet.forward``: code in a module with children, as in every real U-Net.
"""

from __future__ import annotations

import torch
from torch import nn

from reference_models.spec import ModelSpec


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))


class UNet(nn.Module):
    input_shape = (1, 64, 64)

    def __init__(self, num_classes: int = 3, in_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.num_classes = num_classes
        w = width
        self.down1 = DoubleConv(in_channels, w)        # 64x64
        self.pool1 = nn.MaxPool2d(2)
        self.down2 = DoubleConv(w, 2 * w)              # 32x32
        self.pool2 = nn.MaxPool2d(2)
        self.bottom = DoubleConv(2 * w, 4 * w)         # 16x16
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, kernel_size=2, stride=2)
        self.dec2 = DoubleConv(4 * w, 2 * w)           # 32x32 (skip + up)
        self.up1 = nn.ConvTranspose2d(2 * w, w, kernel_size=2, stride=2)
        self.dec1 = DoubleConv(2 * w, w)               # 64x64
        self.head = nn.Conv2d(w, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.down1(x)
        s2 = self.down2(self.pool1(s1))
        b = self.bottom(self.pool2(s2))
        d2 = self.dec2(torch.cat([self.up2(b), s2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), s1], dim=1))
        return self.head(d1)  # N, classes, 64, 64


def unet(num_classes: int = 3) -> UNet:
    return UNet(num_classes=num_classes)


SPECS = (ModelSpec("unet", unet, (1, 64, 64), 3,
                   "small U-Net (1x64x64 segmentation, 3 classes per pixel), widths 8/16/32", "segmentation"),)
