"""A model whose aggregation kernel sums in another order each call, as a GPU's atomicAdd-based
``index_add``/``scatter_add`` does (pytorch#50469): the emulation of a nondeterministic kernel on the CPU.

``shuffled_index_add`` is a custom op (``torch.library``): to PyTorch and to convcheck it is one kernel, whose
result for the same inputs depends on the order it happens to add the rows in."""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

_calls = itertools.count()


@torch.library.custom_op("convcheck_scenarios::shuffled_index_add", mutates_args=())
def shuffled_index_add(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``x.index_add(0, index, src)`` with the rows of ``src`` added in another order on every call."""
    perm = torch.randperm(src.shape[0], generator=torch.Generator().manual_seed(next(_calls)))
    return x.index_add(0, index[perm], src[perm])


@shuffled_index_add.register_fake
def _(x, index, src):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad, None, grad[index]


shuffled_index_add.register_autograd(_backward, setup_context=_setup)


class ScatterPool(nn.Module):
    """Pools each sample's positions into one vector with the aggregation kernel; the features ride on a large
    offset (as positional sums in a graph network do), so the order of the adds shows."""

    def forward(self, x):
        n, c = x.shape[:2]
        rows = x.flatten(2).transpose(1, 2).reshape(-1, c)
        per = rows.shape[0] // n
        index = torch.arange(rows.shape[0], device=x.device) // per
        total = shuffled_index_add(torch.zeros(n, c, dtype=x.dtype, device=x.device), index, rows + 1e4)
        return (total - 1e4 * per) / per


class ScatterNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = ScatterPool()
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))))


def scatter_net():
    return ScatterNet()
