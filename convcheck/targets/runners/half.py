"""16-bit runners: the whole model cast to bf16/fp16, and autocast (AMP) with its GradScaler."""

from __future__ import annotations

import torch

from convcheck.targets.runners.base import PARITY_LOSS_SCALE, Runner
from convcheck.numerics.formats import FLOAT32
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel, dtype_format
from convcheck.targets.runners.registry import register

def _half_precision(dtype: torch.dtype) -> PrecisionModel:
    """16-bit operands everywhere; matmul/conv accumulate in float32 (cuBLAS/cuDNN and oneDNN
    defaults), elementwise results are rounded to the 16-bit format."""
    half = dtype_format(dtype)
    wide = OpPrecision(half, FLOAT32)
    return PrecisionModel(matmul=wide, conv=wide, elementwise=OpPrecision(half, half))


def _cuda_here() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@register
class CastRunner(Runner):
    """The whole model (weights, buffers, inputs) cast to bfloat16 or float16."""

    modes = ("bf16", "fp16")
    descriptions = {"bf16": "whole model in bfloat16", "fp16": "whole model in float16"}
    dtypes = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16)}

    @property
    def precision(self) -> PrecisionModel:
        return _half_precision(self.compute_dtype)

    @classmethod
    def runnable_here(cls) -> list[str]:
        specs = ["cpu:bf16", "cpu:fp16"]
        if _cuda_here():
            specs += ["cuda:bf16", "cuda:fp16"]
        backend = getattr(torch.backends, "mps", None)
        if backend is not None and backend.is_available():
            specs.append("mps:fp16")
        return specs


class _AmpRunner(Runner):
    """float32 weights, matmul/conv under ``torch.autocast`` in a 16-bit dtype."""

    @property
    def precision(self) -> PrecisionModel:
        return _half_precision(self.compute_dtype)

    def autocast(self):
        return torch.autocast(device_type=self.target.device, dtype=self.compute_dtype)


@register
class AmpFloat16Runner(_AmpRunner):
    """Autocast float16 with a GradScaler (default settings), as the AMP recipe prescribes."""

    modes = ("amp-fp16",)
    devices = ("cuda",)
    descriptions = {"amp-fp16": "autocast float16 + GradScaler"}
    dtypes = {"amp-fp16": (torch.float32, torch.float16)}

    @property
    def parity_loss_scale(self) -> float:
        return PARITY_LOSS_SCALE

    def make_grad_scaler(self):
        try:
            return torch.amp.GradScaler(self.target.device)
        except (AttributeError, TypeError):  # torch < 2.3
            return torch.cuda.amp.GradScaler()

    @classmethod
    def runnable_here(cls) -> list[str]:
        return ["cuda:amp-fp16"] if _cuda_here() else []


@register
class AmpBFloat16Runner(_AmpRunner):
    """Autocast bfloat16 (float32's range: no GradScaler needed)."""

    modes = ("amp-bf16",)
    devices = ("cpu", "cuda")
    descriptions = {"amp-bf16": "autocast bfloat16"}
    dtypes = {"amp-bf16": (torch.float32, torch.bfloat16)}

    @classmethod
    def runnable_here(cls) -> list[str]:
        return ["cpu:amp-bf16"] + (["cuda:amp-bf16"] if _cuda_here() else [])
