"""User code that calls sys.exit(...) in each place convcheck runs it; CC_EXIT is the code (default 0).
Inputs 1x4x4, 3 classes."""

import os
import sys

import torch
import torch.nn as nn



def _code() -> int:
    return int(os.environ.get("CC_EXIT", "0"))


if os.environ.get("CC_EXIT_AT") == "import":
    sys.exit(_code())


def factory_exits():
    sys.exit(_code())


class _ExitsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        sys.exit(_code())


def forward_exits():
    return _ExitsInForward()


def good():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def loss_exits(output, target):
    sys.exit(_code())


def data_exits():
    sys.exit(_code())


class _ExitingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        sys.exit(_code())


def dataset_exits():
    return _ExitingDataset()


def conv1():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3))


def loss_coloured_error(output, target):
    raise ValueError("\x1b[1;31mshape mismatch\x1b[0m in my loss\x1b]0;title\x07")
