"""FP8 emulated on the CPU: matmul and convolution operands rounded to E4M3 or E5M2, sums in float32.

The worked example of a target kind that is one file: the formats come from the table
(``convcheck.numerics.formats``), the rounding from ``EmulateFormat``, and ``@register`` makes the modes
known to target parsing, ``convcheck targets`` and ``compare --help`` (``runners/__init__.py``
imports every module of this package). What it leaves out: the per-tensor scaling FP8 recipes
apply before the cast (Transformer Engine), so values beyond the format's range saturate
(E4M3, at 448) or overflow to Inf (E5M2, beyond 57344) as an unscaled cast does.
"""

from __future__ import annotations

import torch

from convcheck.numerics.formats import FLOAT32, FP8_E4M3, FP8_E5M2, NumberFormat
from convcheck.targets.runners.base import Runner
from convcheck.targets.runners.emulation import EmulateFormat
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel
from convcheck.targets.runners.registry import register

_FORMATS = {"emulate-fp8-e4m3": FP8_E4M3, "emulate-fp8-e5m2": FP8_E5M2}


@register
class EmulatedFP8Runner(Runner):
    """A CPU run whose matmul/conv operands are rounded to an FP8 format, forward and backward."""

    modes = tuple(_FORMATS)
    devices = ("cpu",)
    descriptions = {
        "emulate-fp8-e4m3": "float32, matmul/conv inputs rounded to FP8 E4M3 (3-bit mantissa, saturates at 448)",
        "emulate-fp8-e5m2": "float32, matmul/conv inputs rounded to FP8 E5M2 (2-bit mantissa, Inf beyond 57344)",
    }
    dtypes = {m: (torch.float32, torch.float32) for m in _FORMATS}

    @classmethod
    def wrong_device_message(cls, mode: str, device: str) -> str:
        return f"{mode} is for the cpu (FP8 emulated on float32)"

    @property
    def format(self) -> NumberFormat:
        return _FORMATS[self.target.mode]

    @property
    def precision(self) -> PrecisionModel:
        fp8 = OpPrecision(self.format, FLOAT32)
        return PrecisionModel(matmul=fp8, conv=fp8, elementwise=OpPrecision(FLOAT32, FLOAT32))

    def _enter(self, stack) -> None:
        stack.enter_context(EmulateFormat(self.format))

    @classmethod
    def runnable_here(cls) -> list[str]:
        return [f"cpu:{m}" for m in cls.modes]
