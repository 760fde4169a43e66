"""Runners: one registered class per kind of target (see ``base.Runner``).

Importing this package registers every kind: float32 (``plain``), TF32 on/off
and emulated (``plain``), the float64 judge (``judge``), whole-model bf16/fp16
and autocast (``half``), listed in that order; then every other module of this
package, by name (FP8 emulated: ``fp8``). A new kind of target is one new module
here with a ``@register``-ed class (docs/ARCHITECTURE.md, "Adding a target kind").
"""

from convcheck.targets.runners import plain  # noqa: F401,I001 - registers the kinds, in listing order
from convcheck.targets.runners import float64  # noqa: F401,I001
from convcheck.targets.runners import half  # noqa: F401,I001
from convcheck.targets.runners.base import PARITY_LOSS_SCALE, Runner, cross_entropy
from convcheck.targets.runners.flags import preserved_global_flags, snapshot_global_flags
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel, op_class
from convcheck.targets.runners.registry import (
    ALIASES,
    import_kinds,
    known_modes,
    runnable_specs,
    runner_class,
    runner_classes,
    specs_on,
)

__all__ = [
    "ALIASES", "OpPrecision", "PARITY_LOSS_SCALE", "PrecisionModel", "Runner", "cross_entropy", "known_modes",
    "op_class", "preserved_global_flags", "runnable_specs", "runner_class", "runner_classes",
    "snapshot_global_flags", "specs_on",
]

import_kinds(__name__, __path__)  # last: a kind's module may import this package's names
