"""The watched pair's setup checks, registered where they are written: ``@pair_check`` and ``setup_findings``.

A leaf of the ``diagnose`` package beside ``registry`` (the verdict rules' registry): a check is a function
``(run_a, run_b, steps) -> Setup | None`` (or an iterable of them) in a module of ``diagnose/detectors/``,
registered with a name and an ``order`` - the order in which a training step uses what it reads (the
optimizer, then the recipe, the gradients' accumulation, the GradScaler, clipping, the modules' modes, the
initial weights, the loss's targets). ``setup_findings`` imports every detector module once (a module
dropped beside them registers itself), runs the checks in order and keeps what they found; rule W001
(``rules/watched.py``) takes the findings in causal order. So a new watched cause is one function in one
module plus its test (``tests/test_extending.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from convcheck.diagnose import detectors
from convcheck.diagnose.watched_evidence import Setup
from convcheck.discovery import import_modules

@dataclass(frozen=True)
class PairCheck:
    name: str  # "optimizer", "recipe", ... (unique)
    order: int  # lower runs first: where a training step uses what the check reads
    find: Callable  # (run_a, run_b, steps) -> Setup | iterable of Setup/None | None


PAIR_CHECKS: list[PairCheck] = []


def pair_check(name: str, *, order: int) -> Callable[[Callable], Callable]:
    """Register ``fn(run_a, run_b, steps)`` as a setup check of two watched runs; names and orders are unique."""

    def register(fn: Callable) -> Callable:
        for c in PAIR_CHECKS:
            if c.name == name or c.order == order:
                raise ValueError(f"watched check {name!r} (order {order}) clashes with {c.name!r} (order {c.order})")
        PAIR_CHECKS.append(PairCheck(name, order, fn))
        PAIR_CHECKS.sort(key=lambda c: c.order)
        return fn

    return register


def import_detector_modules() -> list[str]:
    """Import every module of ``diagnose/detectors/`` (each registers its checks as it is imported)."""
    return import_modules(detectors.__name__, detectors.__path__)


def setup_findings(a, b, steps: int) -> tuple[Setup, ...]:
    """Every registered check on two watched runs (``runformat.reader.WatchedRun``) over their ``steps`` aligned
    steps, in order; what they found, flattened."""
    import_detector_modules()
    out: list[Setup] = []
    for check in list(PAIR_CHECKS):
        found = check.find(a, b, steps)
        items = [found] if found is None or isinstance(found, Setup) else list(found)
        out += [f for f in items if f is not None]
    return tuple(out)
