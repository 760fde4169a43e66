"""Number formats as data: the one table of every floating-point format convcheck reasons about.

A ``NumberFormat`` says what a value in that format can be: its precision (significand bits,
so its unit roundoff), its range (largest finite, smallest normal and subnormal), what an
overflow becomes (Inf, or the largest finite value for a format that saturates), how it rounds,
and the torch dtype that holds exactly it, if any (TF32 has none: it is float32 with its
significand cut). The rounding is part of the format: IEEE's round to nearest, ties to even
(``RNE``) for every format with a torch dtype (torch's casts round so), NVIDIA's ties away from
zero (``RNA``, PTX ``cvt.rna.tf32.f32``) for TF32, truncation (``RZ``) for the TF32 of hardware
that truncates (ROCm gfx942's ``xf32``: ``TF32_RZ``). Runners describe their precision per op class with these formats
(``runners.precision``), the layer floors round to them, and the overflow rules read their
range. A new format is one entry here.

Values: IEEE 754 binary64/binary32/binary16, bfloat16 and TF32 (NVIDIA A100 whitepaper: 10
explicit significand bits, 8 exponent bits; ``tf32`` rounds RNA, ``tf32-rz`` RZ), FP8 E4M3FN and E5M2 (OCP 8-bit floating point
spec 1.0, as torch's ``float8_e4m3fn``/``float8_e5m2``). No torch import: the rules and the
CLI's light paths read this table too.
"""

from __future__ import annotations

from dataclasses import dataclass

RNE = "RNE"  # round to nearest, ties to even (IEEE 754's default)
RNA = "RNA"  # round to nearest, ties away from zero (NVIDIA's fp32 -> tf32 conversion, PTX cvt.rna.tf32.f32)
RZ = "RZ"  # round toward zero: truncate the dropped bits (ROCm gfx942's xf32 conversion)
ROUNDINGS = {
    RNE: "to nearest, ties to even",
    RNA: "to nearest, ties away from zero",
    RZ: "toward zero (truncation)",
}


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format. ``significand_bits`` counts the implicit bit (float32: 24)."""

    name: str
    significand_bits: int
    exponent_bits: int
    largest: float  # the largest finite value
    smallest_normal: float
    smallest_subnormal: float
    dtype: str | None  # the torch dtype holding exactly this format (its name), None where none does
    saturates: bool = False  # an overflow becomes +-largest (E4M3FN has no Inf) instead of +-Inf
    rounding: str = RNE  # one of ``ROUNDINGS``

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"{self.name}: unknown rounding {self.rounding!r} (expected one of {', '.join(ROUNDINGS)})")

    @property
    def unit_roundoff(self) -> float:
        """``u``: the largest relative error of rounding a value in range: ``2^-p`` to nearest
        (RNE, RNA), ``2^(1-p)`` toward zero (RZ: a whole unit in the last place, Higham's u for chopping)."""
        return 2.0 ** (1 - self.significand_bits if self.rounding == RZ else -self.significand_bits)

    @property
    def torch_dtype(self):
        """The torch dtype of this format, or None (imports torch)."""
        if self.dtype is None:
            return None
        import torch

        return getattr(torch, self.dtype)

    def same_values(self, other: "NumberFormat") -> bool:
        """Whether ``other`` holds exactly the values this format holds (its rounding and name may differ:
        ``TF32`` and ``TF32_RZ``)."""
        fields = ("significand_bits", "exponent_bits", "largest", "smallest_normal", "smallest_subnormal",
                  "dtype", "saturates")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def __str__(self) -> str:
        return self.name


FLOAT64 = NumberFormat("float64", 53, 11, 1.7976931348623157e308, 2.0**-1022, 2.0**-1074, "float64")
FLOAT32 = NumberFormat("float32", 24, 8, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149, "float32")
# TF32 as NVIDIA's tensor cores read float32 operands: ties away from zero (pytorch/pytorch#53635:
# [1024.5] @ [[1.0]] gives 1025 with TF32 on); the same format truncated, as ROCm gfx942's xf32 MFMA
# converts fp32 (ROCm/rocm-libraries#9176)
TF32 = NumberFormat("tf32", 11, 8, (2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136, None, rounding=RNA)
TF32_RZ = NumberFormat("tf32-rz", 11, 8, (2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136, None, rounding=RZ)
BFLOAT16 = NumberFormat("bfloat16", 8, 8, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, "bfloat16")
FLOAT16 = NumberFormat("float16", 11, 5, 65504.0, 2.0**-14, 2.0**-24, "float16")
# E4M3FN: exponent 15 with mantissa 111 is NaN, so the largest finite is 1.75 x 2^8; no Inf
FP8_E4M3 = NumberFormat("float8_e4m3fn", 4, 4, 448.0, 2.0**-6, 2.0**-9, "float8_e4m3fn", saturates=True)
FP8_E5M2 = NumberFormat("float8_e5m2", 3, 5, 57344.0, 2.0**-14, 2.0**-16, "float8_e5m2")

FORMATS: tuple[NumberFormat, ...] = (FLOAT64, FLOAT32, TF32, TF32_RZ, BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2)
_BY_NAME = {f.name: f for f in FORMATS}
_BY_DTYPE = {f.dtype: f for f in FORMATS if f.dtype is not None}


def format_named(name: str) -> NumberFormat:
    """The registered format of this name (``KeyError`` for an unknown one)."""
    return _BY_NAME[name]


def format_of_dtype(dtype) -> NumberFormat:
    """The format a floating torch dtype holds (given as the dtype or its name); float64's for
    anything else (an integer tensor is never rounded)."""
    return _BY_DTYPE.get(str(dtype).removeprefix("torch."), FLOAT64)


def coarsest(formats) -> NumberFormat:
    """The format with the largest unit roundoff (the first of equals)."""
    return max(formats, key=lambda f: f.unit_roundoff)


def narrowest_range(formats) -> NumberFormat:
    """The format with the smallest largest-finite value (the first of equals): the one that overflows first."""
    return min(formats, key=lambda f: f.largest)


def unit_roundoff_of(dtype_name: str) -> float:
    """The unit roundoff of the format a dtype's name holds (``"bfloat16"``: 2^-8); float32's for a name
    that is no registered floating format (a watched run's dtype field is read from a file)."""
    fmt = _BY_DTYPE.get(str(dtype_name).removeprefix("torch."))
    return (fmt or FLOAT32).unit_roundoff


def coarsest_dtype(names) -> str | None:
    """The dtype name (of those given) whose format has the largest unit roundoff (unknown names count as
    float32's); None for none."""
    names = list(names)
    return max(names, key=unit_roundoff_of) if names else None
