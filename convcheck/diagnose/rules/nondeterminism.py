"""Rules of the ``nondeterminism`` category: randomness no mask is shared for, a target that differs from itself."""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.remedies import CUBLAS_WORKSPACE, DETERMINISTIC_KERNELS
from convcheck.diagnose.rules.lines import training_lines
from convcheck.diagnose.verdict import Verdict


@verdict_rule(
    "V001", "stochastic-layer", priority=10, category="nondeterminism",
    headline="layer '{layer}' draws its own random numbers, so every arm sees different randomness: "
             "differences between the targets are not evidence of numerics",
    remedies=("use nn.Dropout/Dropout2d modules (convcheck gives them the same masks on every arm) instead of "
              "functional or custom random draws",
              "or turn the randomness off for the comparison (model.eval() for that layer, or p=0)"))
def stochastic_layer(ev: Evidence) -> Verdict | None:
    """A layer draws random numbers no mask is shared for: no difference is evidence. When a target's
    executor found the draws itself (the ranks of a ``ddp:`` target), its own rule says it with that evidence."""
    if not ev.stochastic_layers or any(S.STOCHASTIC_LAYER in f.explains for f in ev.executor_findings):
        return None
    layer = ev.stochastic_layers[0]
    return stochastic_layer.verdict(
        [f"re-running the judge's forward under another seed changes the output of "
         f"{', '.join(repr(s) for s in ev.stochastic_layers)} while its input stays the same",
         *training_lines(ev)],
        {"layer": layer}, layer=layer, sub_cause="stochastic layer without shared masks",
        symptoms=[S.STOCHASTIC_LAYER])


@verdict_rule(
    "V004", "self-difference", priority=40, category="nondeterminism",
    headline="{target} gives different results for the same input and seed (relative difference {diff:.2e})",
    remedies=(DETERMINISTIC_KERNELS, CUBLAS_WORKSPACE))
def self_difference(ev: Evidence) -> Verdict | None:
    """A target differs from itself run to run by more than ``min_error`` (differences below
    it are reported with the ``ok`` verdict, not as one)."""
    for name, diff in ev.self_difference.items():
        if diff > ev.tolerances.min_error:
            return self_difference.verdict(
                [f"two identical forward/backward runs of {name} differ by {diff:.2e} (relative L2)"]
                + where_lines(ev, name),
                {"target": name, "diff": diff},
                target=name, sub_cause="nondeterministic kernels", symptoms=[S.SELF_DIFFERENCE])
    return None


def where_lines(ev: Evidence, name: str) -> list[str]:
    """Where two runs of ``name`` from the same state first differ, when the rerun localised it."""
    at = ev.self_difference_at.get(name)
    if not at:
        return []
    op = f", op {at['op']}" if at.get("op") else ""
    kind = "its own code, " if at.get("kind") == "own code" else ""
    line = (f"the first bitwise difference between two runs of {name} from the same state: layer '{at['layer']}' "
            f"({kind}{at['direction']}{op})")
    return [line + (f": {at['detail']}" if at.get("detail") else "")]
