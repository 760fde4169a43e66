"""A runner's precision model: unit roundoff of operands and of accumulation, per op class.

Unit roundoffs (FACTS.md): float64 2^-53, float32 2^-24, TF32 2^-11,
float16 2^-11, bfloat16 2^-8. Op classes: ``matmul`` (Linear, mm/bmm),
``conv`` (convolutions), ``elementwise`` (everything else: activations,
normalisation, pooling, additions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

U_FLOAT64 = 2.0**-53
U_FLOAT32 = 2.0**-24
U_TF32 = 2.0**-11
U_FLOAT16 = 2.0**-11
U_BFLOAT16 = 2.0**-8

OP_CLASSES = ("matmul", "conv", "elementwise")


@dataclass(frozen=True)
class OpPrecision:
    operand: float  # unit roundoff of the values an op reads (its inputs after any rounding)
    accumulate: float  # unit roundoff of the sums it forms


@dataclass(frozen=True)
class PrecisionModel:
    matmul: OpPrecision
    conv: OpPrecision
    elementwise: OpPrecision

    @classmethod
    def uniform(cls, u: float) -> "PrecisionModel":
        p = OpPrecision(u, u)
        return cls(p, p, p)

    def of(self, op_class: str) -> OpPrecision:
        return getattr(self, op_class)

    @property
    def working(self) -> float:
        """The coarsest operand roundoff of any op class: the precision the run works in."""
        return max(self.matmul.operand, self.conv.operand, self.elementwise.operand)

    def for_module(self, module: nn.Module) -> OpPrecision:
        return self.of(op_class(module))


def op_class(module: nn.Module) -> str:
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.MultiheadAttention)):
        return "matmul"
    return "elementwise"


# --- rounding to a format (the layer floors of parity) -------------------------------------

_DTYPE_U = {torch.float64: U_FLOAT64, torch.float32: U_FLOAT32, torch.float16: U_FLOAT16,
            torch.bfloat16: U_BFLOAT16}


def dtype_unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of a floating dtype (float64's for anything wider or unknown)."""
    return _DTYPE_U.get(dtype, U_FLOAT64)


def round_to(t: torch.Tensor, unit_roundoff: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` rounded to a format with this unit roundoff (to nearest, ties to even), same dtype.

    When ``dtype`` is a floating dtype with that unit roundoff the values go through it, range
    included (float16 overflows past 65504); otherwise (TF32: 2^-11 with float32's range) the
    significand is cut to -log2(u) bits in ``t``'s own dtype. A finer format than ``t``'s is a no-op.
    """
    if not t.is_floating_point() or unit_roundoff <= dtype_unit_roundoff(t.dtype):
        return t
    if dtype is not None and dtype_unit_roundoff(dtype) == unit_roundoff:
        return t.to(dtype).to(t.dtype)
    bits = round(-math.log2(unit_roundoff))
    if t.dtype in _BIT_LAYOUT and not _has_subnormal(t):
        return _round_bits(t, bits)
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    # (torch.ldexp forms 2^exponent in the default dtype: float32 would flush small exponents)
    rounded = torch.round(mantissa * 2.0**bits) * torch.exp2((exponent - bits).to(t.dtype))
    return torch.where(torch.isfinite(t), rounded, t)


_BIT_LAYOUT = {torch.float64: (torch.int64, 52), torch.float32: (torch.int32, 23)}  # integer view, mantissa bits


def _has_subnormal(t: torch.Tensor) -> bool:
    """A subnormal keeps fewer significant bits than ``_round_bits`` assumes (``frexp`` rounds it)."""
    return bool(torch.any((t.abs() < torch.finfo(t.dtype).tiny) & (t != 0))) if t.numel() else False


def _round_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``round_to``'s rounding on the bit pattern: keep ``bits`` significant bits (``bits - 1``
    stored), to nearest, ties to even; a carry out of the mantissa raises the exponent, as the
    rounding should. Four integer passes instead of ``frexp``/``round``/``exp2``'s eight float
    ones (TF32 floors round every operand of every matmul/conv this way). The same values as
    the ``frexp`` form for every normal number; NaN and Inf are kept."""
    int_dtype, mantissa_bits = _BIT_LAYOUT[t.dtype]
    drop = mantissa_bits - (bits - 1)
    if drop <= 0:
        return t
    raw = t.contiguous().view(int_dtype)
    odd = (raw >> drop) & 1
    half = (1 << (drop - 1)) - 1
    rounded = ((raw + half + odd) & ~((1 << drop) - 1)).view(t.dtype)
    return torch.where(torch.isfinite(t), rounded, t)

