"""Formats emulated on the CPU: matmul and convolution operands rounded to a coarser format.

Any format of the table (``EmulateFormat``), with the format's own rounding (``precision.round_to``):
TF32 on the bit pattern, its 10-bit mantissa with NVIDIA's ties away from zero (``EmulateTF32``,
``TF32``) or truncated as ROCm gfx942's xf32 (``TF32_RZ``); FP8 E4M3/E5M2 through torch's cast,
which saturates E4M3FN at 448 and overflows E5M2 to Inf. The sums stay float32, as tensor cores
accumulate. The floors of such a target round with the same format, so the same rounding.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from convcheck.numerics.formats import TF32, NumberFormat
from convcheck.targets.runners.precision import check_rounding, round_to


def round_to_tf32(t: torch.Tensor, fmt: NumberFormat = TF32) -> torch.Tensor:
    """Round float32 values to TF32 (10 explicit mantissa bits) with ``fmt``'s rounding: NVIDIA's
    ties away from zero (``TF32``, the default), truncation (``TF32_RZ``), or any other rounding
    of the format (``dataclasses.replace(TF32, rounding=RNE)``). Other dtypes pass unchanged.

    TF32 tensor cores read float32 operands with their mantissa cut to 10 bits
    and accumulate in float32; rounding the operands reproduces that on a CPU.
    """
    return round_to(t, fmt) if t.dtype == torch.float32 else t


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


class EmulateFormat(EmulatedOperands):
    """Float32 operands rounded to ``fmt`` with its rounding: through its torch dtype, range
    included (FP8), or on the bit pattern (TF32, RNE/RNA/RZ)."""

    def __init__(self, fmt: NumberFormat):
        super().__init__()
        check_rounding(fmt)  # a rounding round_to cannot do fails here, not in the first matmul
        self.format = fmt

    def round(self, t: torch.Tensor) -> torch.Tensor:
        return round_to(t, self.format) if t.dtype == torch.float32 else t


class EmulateTF32(EmulateFormat):
    """TF32 tensor cores: float32 operands with their mantissa cut to 10 bits (``round_to_tf32``),
    NVIDIA's ties away from zero unless another TF32 format is given (``TF32_RZ``)."""

    def __init__(self, fmt: NumberFormat = TF32):
        super().__init__(fmt)
