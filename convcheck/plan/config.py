"""``CompareConfig``: everything that defines a comparison, with its defaults, validated at the edge.

The defaults live here and only here: the CLI, the pytest plugin and the
Python API all build a ``CompareConfig`` (``convcheck.plan.options`` maps parsed
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
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances

# The optimizers most runs use; any torch.optim class name is accepted (convcheck.plan.recipe).
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")

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
    seed: int = 0
    envelope: int = 3  # perturbed runs of the lower-precision target; 0 turns the envelope off
    data: object = None  # synthetic (None), mnist:DIR, npz:PATH, digits, FILE.py:factory or a callable
    workers: int = 0  # DataLoader worker processes for a Dataset from a data factory
    tolerances: Tolerances = DEFAULT_TOLERANCES
    # The training recipe (convcheck.plan.recipe): the user's loss, optimizer, schedule, clipping.
    loss: object = None  # None: cross-entropy on class logits; FILE.py:fn, package.module:fn or a callable
    optimizer: object = "adam"  # a torch.optim class name (any case), FILE.py:factory or a callable
    lr: float = 1e-3
    momentum: float | None = None  # None: 0.9 for SGD, the optimizer's own default otherwise
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple | None = None
    eps: float | None = None
    schedule: object = "constant"  # constant, cosine, step:EVERY:GAMMA, onecycle, FILE.py:factory or a callable
    warmup: int = 0  # linear warm-up steps before the schedule
    clip_grad_norm: float | None = None
    ddp_sync_bn: bool = False  # data-parallel targets: convert BatchNorm to SyncBatchNorm (issue 12)
    ddp_no_broadcast_buffers: bool = False  # data-parallel targets: DistributedDataParallel(broadcast_buffers=False)
    # Re-run the failing arm with the verdict's remedies applied (issue 24): None (default) when that costs
    # one training run of one arm (the first remedy only), True every remedy that fits, False nothing.
    verify: bool | None = None
    threads: int | None = None  # torch's intra-op threads; None: the caller's setting, else the faster of 1 and the default
    # 2: rerun every target of this process from the same state at the parity step, documented-deterministic
    # kernels too; a difference is localised to its layer and op, none means differences are not chance
    repeat: int = 1

    def __post_init__(self):
        _need_int("steps", self.steps, 1, STEPS_MAX)
        _need_int("batch size", self.batch_size, 1, BATCH_MAX)
        _need_int("envelope", self.envelope, 0, ENVELOPE_MAX)
        _need_int("repeat", self.repeat, 1, 2)
        _need_int("seed", self.seed, 0)
        if self.seed > SEED_MAX:
            raise UsageError(f"seed must be at most 2^63-1, got {self.seed}")
        _need_int("warmup", self.warmup, 0)
        _need_real("learning rate", self.lr, lambda v: v > 0, "a positive number")
        _need_real("weight decay", self.weight_decay, lambda v: v >= 0, "a number of at least 0")
        for name in ("momentum", "eps", "clip_grad_norm"):
            value = getattr(self, name)
            if value is not None:
                least = (lambda v: v >= 0) if name == "momentum" else (lambda v: v > 0)
                _need_real(name.replace("_", " "), value, least, "a number of at least 0" if name == "momentum"
                           else "a positive number")
        if self.verify is not None and not isinstance(self.verify, bool):
            raise UsageError(f"verify must be True, False or None (the default: one re-run), got {self.verify!r}")
        if not isinstance(self.nesterov, bool):
            raise UsageError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.betas is not None:
            if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
                raise UsageError(f"betas must be two numbers, got {self.betas!r}")
            for b in self.betas:
                _need_real("each of betas", b, lambda v: 0 <= v < 1, "a number in [0, 1)")
        for name in ("optimizer", "schedule", "loss"):
            value = getattr(self, name)
            if not (callable(value) or (isinstance(value, str) and value.strip())
                    or (value is None and name == "loss")):
                raise UsageError(f"{name} must be a name, FILE.py:factory or a callable, got {value!r}")
        _need_int("workers", self.workers, 0)
        if self.threads is not None:
            _need_int("threads", self.threads, 1, THREADS_MAX)
        if self.data is not None and not isinstance(self.data, str) and not callable(self.data):
            raise UsageError(f"data must be a source (mnist:DIR, npz:PATH, digits, FILE.py:factory) or a "
                             f"factory, not {type(self.data).__name__}")
        if not isinstance(self.tolerances, Tolerances):
            raise UsageError(f"tolerances must be a convcheck.Tolerances, not {type(self.tolerances).__name__}")


SEED_MAX = 2**63 - 1


def _need_real(what: str, value, ok, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise UsageError(f"{what} must be {expected}, got {value!r}")


# Beyond these a run is a mistake, not a measurement (10^7 steps of the smallest model take days).
STEPS_MAX = 10_000_000
BATCH_MAX = 1 << 20
ENVELOPE_MAX = 64
THREADS_MAX = 1024


def _need_int(what: str, value, least: int, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise UsageError(f"{what} must be an integer of at least {least}, got {value!r}")
    if most is not None and value > most:
        raise UsageError(f"{what} must be at most {most}, got {value!r}")


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
