"""Stock layers: what parity knows of them without running them again, or copying them.

The stochastic-layer probe re-runs the judge's forward under another seed and names a leaf
whose output moved while its input did not (and a module whose own code's did). A stock
``torch.nn`` layer listed here computes its output from its input, parameters and buffers
alone (``nn.Dropout*``'s output is the shared mask's), and the CPU kernels behind it return
bitwise-equal results for equal operands. So on a CPU judge, when every leaf is such a layer
with no hook of the user's on it and every module with children only chains them
(``nn.Sequential``), no call can move while its input stays: the probe would find nothing, and
is not run (``probe_needed``). Nor when the judge's pass drew no random number at all
(``RandomDraws``: torch's, numpy's and Python's global generators did not move, and no module
holds a generator of its own): with deterministic CPU kernels no call can then move either. A GPU
judge always runs it: a kernel there may differ from run to run.

A stock layer's forward and backward write none of its parameters (BatchNorm writes only its
running statistics, buffers), so ``local.private_copy`` gives it a light copy: its own parameter
objects over the same storage, and its own buffers, instead of a deep copy.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from convcheck.capture import leaf_modules
from convcheck.targets.runners import Runner

STOCK_LAYERS = frozenset({
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.Bilinear,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
    nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Flatten, nn.Unflatten, nn.Identity, nn.Upsample, nn.ZeroPad2d,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,  # the shared masks (capture.SharedDropoutMasks)
})


# Each output value is one of the input's values (or 0, or 6): max/min of inputs and constants,
# a copy or a view. Rounding is monotone, so the layer on the judge's input rounded to the
# target's dtype gives exactly the judge's output rounded to it: the local error of the target's
# copy *is* the free lower bound of its floor, known without running the copy (``selects``).
SELECTION_LAYERS = frozenset({
    nn.ReLU, nn.ReLU6, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Flatten, nn.Unflatten, nn.Identity,
})


def selects(module: nn.Module) -> bool:
    """A stock layer whose output only selects input values (``SELECTION_LAYERS``)."""
    return type(module) in SELECTION_LAYERS and stock_type(module)


def stock_type(module: nn.Module) -> bool:
    """A layer of exactly a listed type, with its class's own ``forward``."""
    return type(module) in STOCK_LAYERS and "forward" not in vars(module)


def is_stock(module: nn.Module) -> bool:
    """A stock layer with no hook on it."""
    return stock_type(module) and not module._forward_hooks and not module._forward_pre_hooks


def probe_needed(model: nn.Module, judge: Runner) -> bool:
    """Whether the stochastic-layer probe can find anything: always on a GPU judge or under a
    global module hook; on a CPU judge only when some leaf is not a stock layer, or some module
    with children runs code of its own (anything but ``nn.Sequential``'s chaining: the probe
    also names a module whose own code draws)."""
    if judge.torch_device.type != "cpu":
        return True
    if getattr(_module, "_global_forward_hooks", None) or getattr(_module, "_global_forward_pre_hooks", None):
        return True
    leaves = {id(m) for _, m in leaf_modules(model)}
    return not all(is_stock(m) if id(m) in leaves else _plain(m) for m in model.modules())


def _plain(module: nn.Module) -> bool:
    """A module with children that only chains them (``nn.Sequential``'s own forward), no hook on it."""
    return (type(module).forward is nn.Sequential.forward and "forward" not in vars(module)
            and not module._forward_hooks and not module._forward_pre_hooks)


class RandomDraws:
    """Whether the model's forward inside drew random numbers: torch's CPU generator, numpy's or
    Python's global state moved between the start and the end of the model's call (hooks on the
    root: a runner's ``applied()`` restores torch's state afterwards), or a module holds a
    ``torch.Generator`` of its own (its draws move nothing global). ``nn.Dropout``'s own draw
    counts (its output is then replaced by the shared mask's)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.drawn = False
        self._before = None

    def __enter__(self) -> "RandomDraws":
        self._handles = [self.model.register_forward_pre_hook(self._start),
                         self.model.register_forward_hook(self._end)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        if self._before is None:  # the forward never ran here: nothing is known, assume draws
            self.drawn = True
        self.drawn = self.drawn or _holds_generator(self.model)

    def _start(self, module, args) -> None:
        self._before = _states()

    def _end(self, module, args, output) -> None:
        if self._before is None:
            return
        torch_after, np_after, py_after = _states()
        torch_before, np_before, py_before = self._before
        self.drawn = self.drawn or (
            not torch.equal(torch_before, torch_after) or py_before != py_after
            or np_before[0] != np_after[0] or not np.array_equal(np_before[1], np_after[1])
            or tuple(np_before[2:]) != tuple(np_after[2:]))


def _states():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _holds_generator(model: nn.Module) -> bool:
    return any(isinstance(v, torch.Generator) for m in model.modules() for v in vars(m).values())
