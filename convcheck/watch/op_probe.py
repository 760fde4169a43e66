"""The op inside a module's code that made the first NaN/Inf, found in the user's process.

**The op** (``live_op``): called by the recorder once, when it finds the first non-finite producer in
a forward: a hook-less copy of the module re-runs on the same inputs under ``FirstNonfiniteOp`` (the
detector ``compare`` uses for own code), with the random state kept: the op that first turned finite
values into NaN/Inf, its float64 magnitude, and the format whose range it passed.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from convcheck.measure.train.nonfinite import FirstNonfiniteOp
from convcheck.nested import tensors_in


class _OpProbe(FirstNonfiniteOp):
    """``FirstNonfiniteOp`` that also keeps the dtype of the producing op's result."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None
        self.source: dict | None = None  # the user's line that called the op (``sourceline.caller_line``)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before = self.found
        out = super().__torch_function__(func, types, args, kwargs)
        if before is None and self.found is not None:
            res = [t for t in tensors_in(out) if t.is_floating_point()]
            self.dtype = res[0].dtype if res else None
            from convcheck.watch.sourceline import caller_line

            self.source = caller_line()
        return out


def live_op(module: nn.Module, args: tuple) -> dict:
    """``{"op", "magnitude", "dtype"}`` of the first op of ``module``'s forward (own code or leaf) that
    turns finite values into NaN/Inf on ``args``; ``{}`` when the re-run does not find it (another
    path, keyword arguments, a module that cannot be copied). Nothing of the caller's changes: a
    hook-less copy runs, without gradients, and the random generators are restored after."""
    devices = sorted({t.device.index or 0 for t in tensors_in(args) if t.device.type == "cuda"})
    probe = _OpProbe()
    try:
        twin = hookless_copy(module)
        with torch.random.fork_rng(devices=devices), torch.no_grad(), probe:
            twin(*args)
    except Exception:  # the module is still named; only its op is not
        return {}
    if probe.found is None:
        return {}
    found = {"op": probe.found[1], "magnitude": probe.magnitude}
    if probe.dtype is not None:
        found["dtype"] = str(probe.dtype).removeprefix("torch.")
    if probe.source is not None and not isinstance(module, _stock_leaf_types()):
        found["source"] = probe.source  # the op's line in the module's own forward
    return found


def _stock_leaf_types() -> tuple:
    """torch's own layers: the op inside one is torch's code, its line the caller's (kept by the recorder)."""
    return (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
            nn.Embedding, nn.MultiheadAttention, nn.Softmax, nn.LogSoftmax)


def hookless_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without its hooks: they are not copied at all (a hook holding the
    recorder, its open files, cannot be), each replaced by an empty one."""
    memo: dict = {}
    for sub in module.modules():
        for key, value in sub.__dict__.items():
            if "hooks" in key and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(module, memo)
