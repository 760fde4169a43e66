"""A user's own BatchNorm CNN (3x32x32 images, 10 classes), passed to the CLI as ``--model path.py:bn_cnn``
(issue 24 item 5: DDP / SyncBatchNorm against one device)."""

import torch.nn as nn


def bn_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )
