"""TF32 emulated on the CPU: matmul and convolution operands rounded to TF32's 10-bit mantissa."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round float32 values to TF32 (10 explicit mantissa bits), to nearest, ties to even.

    TF32 tensor cores read float32 operands with their mantissa cut to 10 bits
    and accumulate in float32; rounding the operands reproduces that on a CPU.
    """
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    finite = torch.isfinite(t)
    return torch.where(finite, rounded.view(torch.float32), t)


_TF32_OPS = None


def _tf32_ops():
    global _TF32_OPS
    if _TF32_OPS is None:
        aten = torch.ops.aten
        _TF32_OPS = {
            aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default, aten.convolution_backward.default,
        }
    return _TF32_OPS


class EmulateTF32(TorchDispatchMode):
    """Round the float32 operands of every matmul and convolution to TF32, forward and backward.

    A dispatch mode sees the aten ops autograd runs for the backward pass too,
    so weight and input gradients are emulated like the forward.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _tf32_ops():
            args = tuple(round_to_tf32(a) if isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **kwargs)
