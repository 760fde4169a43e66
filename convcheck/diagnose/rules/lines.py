"""Evidence lines more than one verdict rule writes: the training outcomes, the symptoms, the layer notes."""

from __future__ import annotations

import math

from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.target_symptoms import ends_apart


def training_lines(ev: Evidence) -> list[str]:
    out = []
    judge = ev.outcomes.get(ev.judge)
    for name, info in ev.outcomes.items():
        state = "converged" if info.converged else "did not converge"
        if not ev.judgeable and math.isfinite(info.final_loss):
            state = "trained (convergence not judged)"
        elif info.converged and judge is not None and name != ev.judge and judge.converged and ends_apart(
                info.final_loss, judge.final_loss, judge.first_loss):
            # the convergence rule is relative: 51 -> 27 converges by it, while the judge ends at 0.75
            state = (f"converged by the loss rule but ends {info.final_loss / judge.final_loss:.3g}x the "
                     f"judge's {judge.final_loss:.4g}")
        out.append(f"{name}: {state}, loss {info.first_loss:.4g} -> {info.final_loss:.4g}"
                   + (f", first non-finite at step {info.first_nonfinite_step}"
                      if info.first_nonfinite_step is not None else ""))
    return out


def symptom_lines(syms, n: int) -> list[str]:
    return [f"{s.label} ({s.arm}): {s.evidence}" for s in syms[:n]]


def where_in(layer: str | None) -> str:
    return f" in '{layer}'" if layer else ""


def layer_note_lines(ev: Evidence) -> list[str]:
    """Flagged layers too small to matter on a target with no other trouble."""
    return [f"note ({n.arm}): {n.evidence}; below min_error {ev.tolerances.min_error:g}, so not a cause"
            for n in ev.layer_notes]


def symptom_evidence(ev: Evidence) -> list[str]:
    math_notes = [f for f in ev.findings if getattr(f, "kind", None) == "numerics"]
    return (symptom_lines(ev.symptoms, 4) + training_lines(ev) + layer_note_lines(ev)
            + [f"{f.id}: {f.message}" for f in math_notes[:2]])
