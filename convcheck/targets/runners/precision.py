"""A runner's precision model: the number format of operands and of accumulation, per op class.

Formats (unit roundoff, range, dtype, rounding) come from the one table, ``convcheck.numerics.formats``.
Op classes: ``matmul`` (Linear, mm/bmm), ``conv`` (convolutions), ``elementwise`` (everything
else: activations, normalisation, pooling, additions).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
import torch.nn as nn

from convcheck.numerics.formats import FLOAT32, FLOAT64, FORMATS, RNA, RNE, RZ, NumberFormat, coarsest, narrowest_range

OP_CLASSES = ("matmul", "conv", "elementwise")


@dataclass(frozen=True)
class OpPrecision:
    operand: NumberFormat  # the format of the values an op reads (its inputs after any rounding)
    accumulate: NumberFormat  # the format of the sums it forms


@dataclass(frozen=True)
class PrecisionModel:
    matmul: OpPrecision
    conv: OpPrecision
    elementwise: OpPrecision

    @classmethod
    def uniform(cls, fmt: NumberFormat) -> "PrecisionModel":
        p = OpPrecision(fmt, fmt)
        return cls(p, p, p)

    def of(self, op_class: str) -> OpPrecision:
        return getattr(self, op_class)

    @property
    def operands(self) -> tuple[NumberFormat, NumberFormat, NumberFormat]:
        """The operand formats of ``matmul``, ``conv`` and ``elementwise``, in that order."""
        return self.matmul.operand, self.conv.operand, self.elementwise.operand

    @property
    def working(self) -> NumberFormat:
        """The coarsest operand format of any op class: the precision the run works in."""
        return coarsest(self.operands)

    @property
    def narrowest(self) -> NumberFormat:
        """The operand format with the smallest range: where the run overflows first."""
        return narrowest_range(self.operands)

    def for_module(self, module: nn.Module) -> OpPrecision:
        return self.of(op_class(module))


def op_class(module: nn.Module) -> str:
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    # a recurrent layer's gates are matmuls: autocast lowers it, cuDNN runs it in TF32 where allowed
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.MultiheadAttention, nn.RNNBase, nn.RNNCellBase)):
        return "matmul"
    return "elementwise"


# --- rounding to a format (the layer floors of parity) -------------------------------------

_DTYPE_FORMAT = {f.torch_dtype: f for f in FORMATS if f.dtype is not None}  # read on every row: keyed by dtype


def dtype_format(dtype: torch.dtype) -> NumberFormat:
    """The format a floating dtype holds (float64's for anything wider or unknown)."""
    return _DTYPE_FORMAT.get(dtype, FLOAT64)


def dtype_unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of a floating dtype (float64's for anything wider or unknown)."""
    return dtype_format(dtype).unit_roundoff


def round_to(t: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """``t`` rounded to ``fmt`` with ``fmt``'s rounding, in ``t``'s own dtype.

    A format with a torch dtype is gone through, range included (float16 overflows past 65504 to
    Inf, E4M3FN saturates at 448); torch's casts round to nearest, ties to even, so such a format
    rounds RNE only. One without (TF32) has its significand cut to its bits on the bit pattern, to
    nearest with ties to even (RNE) or away from zero (RNA), or toward zero (RZ). On float32 that
    is exact everywhere: TF32 shares float32's exponent, so its subnormals are float32's with the
    same bits dropped (steps of 2^-136), a value rounding up past the largest finite becomes Inf
    (never under RZ), NaN and Inf are kept. On float64 (the floors' references) ``t``'s range is
    kept. A finer format than ``t``'s is a no-op.
    """
    check_rounding(fmt)
    if not t.is_floating_point() or fmt.unit_roundoff <= dtype_unit_roundoff(t.dtype):
        return t
    if fmt.dtype is not None:
        return t.to(fmt.torch_dtype).to(t.dtype)
    bits = fmt.significand_bits
    if t.dtype == torch.float32 and fmt.exponent_bits == FLOAT32.exponent_bits:
        return _round_bits(t, bits, fmt.rounding)  # subnormals included (float32's grid, bits dropped)
    if t.dtype in _BIT_LAYOUT and not _has_subnormal(t):
        return _round_bits(t, bits, fmt.rounding)
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    # (torch.ldexp forms 2^exponent in the default dtype: float32 would flush small exponents)
    rounded = _ROUNDERS[fmt.rounding](mantissa * 2.0**bits) * torch.exp2((exponent - bits).to(t.dtype))
    return torch.where(torch.isfinite(t), rounded, t)


def check_rounding(fmt: NumberFormat) -> None:
    """A ``ValueError`` for a rounding ``round_to`` cannot do: a format with a torch dtype is
    rounded by torch's cast, which rounds to nearest, ties to even, only."""
    if fmt.rounding not in _ROUNDERS:
        raise ValueError(f"round_to: {fmt} rounds {fmt.rounding}, which it cannot do")
    if fmt.dtype is not None and fmt.rounding != RNE:
        raise ValueError(f"round_to: {fmt} goes through torch's cast, which rounds {RNE}, not {fmt.rounding}")


def _ties_away(x: torch.Tensor) -> torch.Tensor:
    return torch.copysign(torch.floor(x.abs() + 0.5), x)  # exact: |x| < 2^bits, far below the dtype's precision


_ROUNDERS = {RNE: torch.round, RNA: _ties_away, RZ: torch.trunc}  # on a scaled significand (frexp's form)

_BIT_LAYOUT = {torch.float64: (torch.int64, 52), torch.float32: (torch.int32, 23)}  # integer view, mantissa bits


def _has_subnormal(t: torch.Tensor) -> bool:
    """A subnormal keeps fewer significant bits than ``_round_bits`` assumes (``frexp`` rounds it).
    On the bit pattern (float32, float64): a subnormal's magnitude bits ``m`` are ``0 < m < 2^mantissa``;
    ``(m - 1)`` with the sign bit cleared turns a zero's into the largest value, so the least of them
    is below ``2^mantissa - 1`` exactly where a subnormal is. Three integer passes and a minimum
    instead of five float and boolean ones (``abs < tiny & != 0``, ``any``): 14 -> ~5 ms a million."""
    if not t.numel():
        return False
    if t.dtype not in _BIT_LAYOUT:
        return bool(torch.any((t.abs() < torch.finfo(t.dtype).tiny) & (t != 0)))
    int_dtype, mantissa_bits = _BIT_LAYOUT[t.dtype]
    magnitude = (1 << (torch.iinfo(int_dtype).bits - 1)) - 1
    m = t.contiguous().view(int_dtype) & magnitude
    return bool(m.sub_(1).bitwise_and_(magnitude).amin() < (1 << mantissa_bits) - 1)


def _round_bits(t: torch.Tensor, bits: int, rounding: str = RNE) -> torch.Tensor:
    """``round_to``'s rounding on the bit pattern: keep ``bits`` significant bits (``bits - 1``
    stored). The sign is its own bit, so the integer arithmetic acts on the magnitude: RNE adds
    half a unit less one plus the kept bit's parity, RNA half a unit, RZ nothing, and the dropped
    bits are cleared; a carry out of the mantissa raises the exponent, as the rounding should (the
    largest exponent's carry is Inf). Four integer passes instead of ``frexp``/``round``/``exp2``'s
    eight float ones (TF32 floors round every operand of every matmul/conv this way). The same
    values as the ``frexp`` form for every normal number; NaN and Inf are kept."""
    int_dtype, mantissa_bits = _BIT_LAYOUT[t.dtype]
    drop = mantissa_bits - (bits - 1)
    if drop <= 0:
        return t
    raw = t.contiguous().view(int_dtype)
    keep = ~((1 << drop) - 1)
    if rounding == RZ:
        rounded = raw & keep
    elif rounding == RNA:
        rounded = (raw + (1 << (drop - 1))) & keep
    else:
        odd = (raw >> drop) & 1
        rounded = (raw + ((1 << (drop - 1)) - 1) + odd) & keep
    return _keep_nonfinite(t, rounded.view(t.dtype))


def _keep_nonfinite(t: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` with ``t``'s NaN and Inf put back; one ``aminmax`` pass (it propagates NaN, an Inf is
    the least or the largest value) shows there are none, which ``isfinite`` + ``where`` took two slow
    passes to find (~15 ms a million float64 values, five times the rounding itself)."""
    if t.numel() and t.is_contiguous():  # (``where`` lays its result out as ``t``: kept for any other layout)
        lo, hi = torch.aminmax(t)
        if math.isfinite(float(lo)) and math.isfinite(float(hi)):
            return rounded
    return torch.where(torch.isfinite(t), rounded, t)
