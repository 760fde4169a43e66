"""Formats emulated on the CPU: matmul and convolution operands rounded to a coarser format.

TF32 (``EmulateTF32``: its 10-bit mantissa, on the bit pattern) and any format of the table
with a torch dtype (``EmulateFormat``: FP8 E4M3/E5M2, through torch's cast, which saturates
E4M3FN at 448 and overflows E5M2 to Inf). The sums stay float32, as tensor cores accumulate.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from convcheck.numerics.formats import NumberFormat
from convcheck.targets.runners.precision import round_to


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


_TF32_OPS = None  # the matmul and convolution ops tensor cores run (forward and backward)


def _tf32_ops():
    global _TF32_OPS
    if _TF32_OPS is None:
        aten = torch.ops.aten
        _TF32_OPS = {
            aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default, aten.convolution_backward.default,
        }
    return _TF32_OPS


class EmulatedOperands(TorchDispatchMode):
    """Round the float32 operands of every matmul and convolution, forward and backward (``round``
    says how). A dispatch mode sees the aten ops autograd runs for the backward pass too, so
    weight and input gradients are emulated like the forward."""

    def round(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _tf32_ops():
            args = tuple(self.round(a) if isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **kwargs)


class EmulateTF32(EmulatedOperands):
    """TF32 tensor cores: float32 operands with their mantissa cut to 10 bits (``round_to_tf32``)."""

    def round(self, t: torch.Tensor) -> torch.Tensor:
        return round_to_tf32(t)


class EmulateFormat(EmulatedOperands):
    """Float32 operands rounded to ``fmt`` through its torch dtype, range included (FP8)."""

    def __init__(self, fmt: NumberFormat):
        super().__init__()
        if fmt.dtype is None:
            raise ValueError(f"{fmt} has no torch dtype to round through")
        self.format = fmt

    def round(self, t: torch.Tensor) -> torch.Tensor:
        return round_to(t, self.format) if t.dtype == torch.float32 else t
