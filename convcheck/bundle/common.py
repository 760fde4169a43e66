"""What diff and rebuild share: the run's config read back from a bundle, and the judge's record."""

from __future__ import annotations

import dataclasses
import math

from convcheck.bundle.reader import Bundle
from convcheck.plan.config import CompareConfig
from convcheck.errors import UsageError
from convcheck.numerics.tolerances import Tolerances


def config_of(bundle: Bundle, targets, judge) -> CompareConfig:
    values = dict(bundle["config"])
    if isinstance(values.get("betas"), list):
        values["betas"] = tuple(values["betas"])
    fields = {f.name for f in dataclasses.fields(CompareConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise UsageError(f"bundle {bundle.path}: config.{unknown[0]} is not an option of this convcheck")
    try:
        tol = Tolerances(**bundle["tolerances"])
        return CompareConfig(**values, targets=targets, judge=judge, tolerances=tol)
    except TypeError as exc:
        raise UsageError(f"bundle {bundle.path}: config is not valid here ({exc})") from None


# --- the judge ------------------------------------------------------------------

@dataclasses.dataclass
class JudgeRecord:
    """The judge's per-layer outputs and parameter gradients of the parity step (float64 tensors)."""

    name: str
    reason: str
    outputs: dict
    grads: dict
    loss_batch_ratio: float = math.nan
    resolved: object = None
    recipe: object = None
