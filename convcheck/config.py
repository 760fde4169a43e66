"""``CompareConfig``: everything that defines a comparison, with its defaults, validated at the edge.

The defaults live here and only here: the CLI, the pytest plugin and the
Python API all build a ``CompareConfig`` (``convcheck.options`` maps parsed
options onto it). This module imports no torch, so ``convcheck --help`` stays
fast. ``targets`` and ``judge`` hold what was asked for (spec strings, targets
or None for "choose for this machine"); the config on a ``CompareResult``
holds the parsed targets and the judge that was used.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from convcheck.errors import UsageError
from convcheck.tolerances import DEFAULT_TOLERANCES, Tolerances

OPTIMIZERS = ("sgd", "adam")

# Option names (as the CLI spells them, dashes or underscores) that are not config fields.
_TOLERANCE_OPTIONS = {"bound_factor", "min_error"}


@dataclass(frozen=True)
class CompareConfig:
    """A comparison run (recorded in the summary)."""

    # Two target specs ("cpu,cuda", ["cpu", "cuda:tf32"]); None: cpu,cuda with a GPU, else cpu,cpu:float64.
    targets: object = None
    # A float64 target; None: cuda:float64 with a fast-float64 GPU, else cpu:float64.
    judge: object = None
    steps: int = 30
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    envelope: int = 3  # perturbed runs of the lower-precision target; 0 turns the envelope off
    data: str | None = None  # synthetic (None), mnist:DIR or npz:PATH
    tolerances: Tolerances = DEFAULT_TOLERANCES

    def __post_init__(self):
        _need_int("steps", self.steps, 1)
        _need_int("batch size", self.batch_size, 1)
        _need_int("envelope", self.envelope, 0)
        _need_int("seed", self.seed, 0)
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r} (expected {' or '.join(OPTIMIZERS)})")
        if isinstance(self.lr, bool) or not isinstance(self.lr, numbers.Real) or not (
                math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"learning rate must be a positive number, got {self.lr!r}")
        if self.data is not None and not isinstance(self.data, str):
            raise UsageError(f"data must be a source string (mnist:DIR, npz:PATH), not {type(self.data).__name__}")
        if not isinstance(self.tolerances, Tolerances):
            raise UsageError(f"tolerances must be a convcheck.Tolerances, not {type(self.tolerances).__name__}")


def _need_int(what: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise UsageError(f"{what} must be an integer of at least {least}, got {value!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(CompareConfig))


def default(name: str):
    """The default of one config field (the options' declared defaults read it)."""
    if name in _TOLERANCE_OPTIONS:
        return getattr(DEFAULT_TOLERANCES, name)
    return next(f.default for f in dataclasses.fields(CompareConfig) if f.name == name)


def with_options(config: CompareConfig, **options) -> CompareConfig:
    """``config`` with options replaced; names as the CLI spells them (``bound-factor`` or
    ``bound_factor``) or as fields (``batch_size``). Unknown names are a usage error."""
    changes, tol = {}, {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name in _TOLERANCE_OPTIONS:
            tol[name] = value
        elif name in FIELDS:
            changes[name] = value
        else:
            known = sorted([*FIELDS, *_TOLERANCE_OPTIONS])
            raise UsageError(f"unknown convcheck option {key!r} (expected one of {', '.join(known)})")
    if tol:
        base = changes.get("tolerances", config.tolerances)
        changes["tolerances"] = dataclasses.replace(base, **tol)
    return dataclasses.replace(config, **changes)
