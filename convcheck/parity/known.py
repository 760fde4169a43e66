"""Stock layers: what parity knows of them without running them again, or copying them.

The stochastic-layer probe re-runs the judge's forward under another seed and names a leaf
whose output moved while its input did not (and a module whose own code's did). A stock
``torch.nn`` layer listed here computes its output from its input, parameters and buffers
alone (``nn.Dropout*``'s output is the shared mask's), and the CPU kernels behind it return
bitwise-equal results for equal operands. So on a CPU judge, when every leaf is such a layer
with no hook of the user's on it and every module with children only chains them
(``nn.Sequential``), no call can move while its input stays: the probe would find nothing, and
is not run (``probe_needed``). A GPU judge always runs it: a kernel there may differ from run
to run.

A stock layer's forward and backward write none of its parameters (BatchNorm writes only its
running statistics, buffers), so ``local.private_copy`` gives it a light copy: its own parameter
objects over the same storage, and its own buffers, instead of a deep copy.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.modules import module as _module

from convcheck.capture import leaf_modules
from convcheck.runners import Runner

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
