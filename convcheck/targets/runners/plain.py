"""float32 runners: plain float32 (the stack's default flags), TF32 forced on/off, TF32 emulated on the CPU."""

from __future__ import annotations

import torch

from convcheck.targets.runners.base import Runner
from convcheck.targets.runners.emulation import EmulateTF32
from convcheck.targets.runners.flags import set_tf32
from convcheck.numerics.formats import FLOAT32, TF32
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel
from convcheck.targets.runners.registry import register

_F32 = (torch.float32, torch.float32)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def tensor_cores_have_tf32(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer run float32 matmul/conv in TF32 when allowed."""
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    except Exception:  # noqa: BLE001 - a probe, never raise
        return False


@register
class FloatRunner(Runner):
    """float32 with the stack's default math flags (cuDNN convs use TF32 by default on Ampere+)."""

    modes = ("float32",)
    descriptions = {"float32": "float32"}
    dtypes = {"float32": _F32}

    @property
    def precision(self) -> PrecisionModel:
        exact = OpPrecision(FLOAT32, FLOAT32)
        if self.target.device != "cuda" or not tensor_cores_have_tf32(self.torch_device):
            return PrecisionModel.uniform(FLOAT32)
        # FACTS.md, TF32 defaults: cudnn.allow_tf32 defaults to True, matmul's to False.
        tf32 = OpPrecision(TF32, FLOAT32)
        conv = tf32 if torch.backends.cudnn.allow_tf32 else exact
        matmul = tf32 if torch.backends.cuda.matmul.allow_tf32 else exact
        return PrecisionModel(matmul=matmul, conv=conv, elementwise=exact)

    @classmethod
    def runnable_here(cls) -> list[str]:
        specs = ["cpu"]
        n = _cuda_count()
        if n:
            specs += ["cuda"] + [f"cuda:{i}" for i in range(1, n)]
        if _mps():
            specs.append("mps")
        return specs


@register
class TF32Runner(Runner):
    """float32 on a GPU with TF32 forced on (``tf32``) or off (``no-tf32``) for matmul and conv."""

    modes = ("tf32", "no-tf32")
    devices = ("cuda",)
    descriptions = {"tf32": "float32, TF32 forced on for matmul and conv", "no-tf32": "float32, TF32 forced off"}
    dtypes = {"tf32": _F32, "no-tf32": _F32}

    @property
    def precision(self) -> PrecisionModel:
        if self.target.mode == "no-tf32":
            return PrecisionModel.uniform(FLOAT32)
        tf32 = OpPrecision(TF32, FLOAT32)
        return PrecisionModel(matmul=tf32, conv=tf32, elementwise=OpPrecision(FLOAT32, FLOAT32))

    def _enter(self, stack) -> None:
        set_tf32(self.target.mode == "tf32")

    @classmethod
    def runnable_here(cls) -> list[str]:
        return ["cuda:tf32", "cuda:no-tf32"] if _cuda_count() else []


@register
class EmulatedTF32Runner(Runner):
    """A CPU run whose matmul/conv operands are rounded to TF32: an upper bound of a GPU's TF32."""

    modes = ("emulate-tf32",)
    devices = ("cpu",)
    descriptions = {"emulate-tf32": "float32, matmul/conv inputs rounded to TF32 (10-bit mantissa, to nearest, "
                                    "ties away: NVIDIA)"}
    dtypes = {"emulate-tf32": _F32}

    @classmethod
    def wrong_device_message(cls, mode: str, device: str) -> str:
        return "emulate-tf32 is for the cpu; on a GPU use cuda:tf32"

    @property
    def precision(self) -> PrecisionModel:
        tf32 = OpPrecision(TF32, FLOAT32)
        return PrecisionModel(matmul=tf32, conv=tf32, elementwise=OpPrecision(FLOAT32, FLOAT32))

    def _enter(self, stack) -> None:
        stack.enter_context(EmulateTF32())

    @classmethod
    def runnable_here(cls) -> list[str]:
        return ["cpu:emulate-tf32"]
