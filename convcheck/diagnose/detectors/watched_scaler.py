"""A GradScaler's step skipped (issue 47): ``scaler.scale(loss).backward(); optimizer.step()``. The optimizer then
applies the scaled gradients - ``scale`` times too large, 65536 at first - and no step is skipped on Inf/NaN; the
loss explodes, and "lower the learning rate" would be the wrong remedy. ``watch/scaler_use.py`` marks such a step
``step_without_scaler``; this makes it a ``Setup``: alone rule W110, in a pair W014 (``rules/watched_scaler.py``)."""

from __future__ import annotations

import math

from convcheck.diagnose.detectors.watched_setup import global_norm
from convcheck.diagnose.remedies import STEP_WITH_SCALER
from convcheck.diagnose.watched_checks import pair_check
from convcheck.diagnose.watched_evidence import Setup

SUB_CAUSE = "optimizer step without scaler.step"


def step_without_scaler(run, side: str) -> Setup | None:
    """The run stepped its optimizer on the GradScaler's scaled gradients (neither ``scaler.step(optimizer)`` nor
    ``scaler.unscale_(optimizer)`` that step)."""
    marked = [k for k, s in enumerate(run.steps) if s.get("step_without_scaler")]
    if not marked:
        return None
    k = marked[0]
    scale = run.steps[k].get("scale")
    norm = global_norm(run.steps[k]["grad_norms"])
    said = [f"steps.jsonl step_without_scaler at {len(marked)} of {len(run.steps)} steps, from step {k}: "
            "optimizer.step() ran outside scaler.step() after scaler.scale(loss).backward()"]
    if isinstance(scale, (int, float)) and math.isfinite(scale):
        said.append(f"at step {k} the scale is {scale:g}: the gradients the optimizer applied (norm "
                    f"{norm:.4g}) were {scale:g} times the true ones, and no step was skipped on Inf/NaN")
    who = "the run" if side == "-" else side
    return Setup(f"{who} applies the GradScaler's scaled gradients unscaled: optimizer.step() was called directly "
                 f"from step {k} instead of scaler.step(optimizer)", SUB_CAUSE, said, list(STEP_WITH_SCALER), step=k)


@pair_check("step-without-scaler", order=40)  # before clipping: a clip on scaled gradients pins that run's norm
def _step_without_scaler_check(a, b, steps: int) -> list:
    return [step_without_scaler(a, "A"), step_without_scaler(b, "B")]
