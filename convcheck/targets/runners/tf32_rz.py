"""TF32 that truncates, emulated on the CPU: matmul and convolution operands cut to 10 mantissa bits
toward zero, sums in float32.

ROCm's gfx942 (MI300) ``xf32`` MFMA converts fp32 operands to TF32 by round-toward-zero
(ROCm/rocm-libraries#9176: a downward bias of every operand's magnitude), where NVIDIA's tensor
cores round to nearest, ties away (``cpu:emulate-tf32``). Truncation is biased: each operand loses
up to a whole unit in the last place, always toward zero, so its unit roundoff is ``2^-10``
(``TF32_RZ``) and its errors add up coherently instead of cancelling. The floors round with the same
format, so the same truncation. What it leaves out: which kernels the GPU library runs in xf32
(hipBLASLt/MIOpen may pick fp32 kernels for some shapes), and the accumulation order of the MFMA.
"""

from __future__ import annotations

import torch

from convcheck.numerics.formats import FLOAT32, TF32_RZ
from convcheck.targets.runners.base import Runner
from convcheck.targets.runners.emulation import EmulateTF32
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel
from convcheck.targets.runners.registry import register

MODE = "emulate-tf32-rz"


@register
class TruncatedTF32Runner(Runner):
    """A CPU run whose matmul/conv operands are truncated to TF32, forward and backward (gfx942 xf32)."""

    modes = (MODE,)
    devices = ("cpu",)
    descriptions = {MODE: "float32, matmul/conv inputs truncated to TF32 (10-bit mantissa, toward zero: "
                          "ROCm gfx942 xf32)"}
    dtypes = {MODE: (torch.float32, torch.float32)}

    @classmethod
    def wrong_device_message(cls, mode: str, device: str) -> str:
        return f"{mode} is for the cpu (gfx942 xf32 emulated on float32); on a GPU use cuda:tf32"

    @property
    def precision(self) -> PrecisionModel:
        tf32 = OpPrecision(TF32_RZ, FLOAT32)
        return PrecisionModel(matmul=tf32, conv=tf32, elementwise=OpPrecision(FLOAT32, FLOAT32))

    def _enter(self, stack) -> None:
        stack.enter_context(EmulateTF32(TF32_RZ))

    @classmethod
    def runnable_here(cls) -> list[str]:
        return [f"cpu:{MODE}"]
