"""The float64 runner: the judge every other target is measured against, on the CPU or a GPU.

Every float64 reference of a comparison (the judge's run, a layer recomputed
in float64, the size of a gradient's terms) is built through the judge's
runner, so a judge given as ``cuda:float64`` keeps all of them on the GPU.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from convcheck.env.tables import has_fast_float64
from convcheck.targets.runners.base import Runner
from convcheck.numerics.formats import FLOAT64
from convcheck.targets.runners.precision import PrecisionModel
from convcheck.targets.runners.registry import register


@register
class Float64Runner(Runner):
    modes = ("float64",)
    devices = ("cpu", "cuda")
    descriptions = {"float64": "float64"}
    dtypes = {"float64": (torch.float64, torch.float64)}

    @classmethod
    def wrong_device_message(cls, mode: str, device: str) -> str:
        return f"float64 runs on the cpu or a cuda GPU, not on {device}"

    @property
    def precision(self) -> PrecisionModel:
        return PrecisionModel.uniform(FLOAT64)

    @property
    def is_float64(self) -> bool:
        return True

    @property
    def fast(self) -> bool:
        """A CPU, or a GPU whose float64 runs at half its float32 rate (data-centre parts)."""
        if self.target.device == "cpu":
            return True
        try:
            return has_fast_float64(torch.cuda.get_device_capability(self.torch_device))
        except Exception:  # noqa: BLE001 - a probe, never raise
            return False

    # -- references -----------------------------------------------------------------------

    def reference(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a float64 reference on the judge's device (integer tensors only move)."""
        t = t.detach()
        if t.is_floating_point():
            return t.to(device=self.torch_device, dtype=torch.float64)
        return t.to(device=self.torch_device)

    def reference_module(self, module: nn.Module) -> nn.Module:
        """An independent float64 copy of ``module`` on the judge's device."""
        return copy.deepcopy(module).to(device=self.torch_device, dtype=torch.float64)

    @classmethod
    def runnable_here(cls) -> list[str]:
        specs = ["cpu:float64"]
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            specs += ["cuda:float64"]
        return specs
