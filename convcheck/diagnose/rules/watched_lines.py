"""What the watched-run rules (``watched.py``: two runs, ``watched_run.py``: one run against the judge) say
alike: the layer the judge flags, a NaN/Inf's remedies, a fixed loss scale that overflows, weights that drop
their updates, a run that stopped. Each helper fills the verdict of the rule that calls it
(``VerdictRule.verdict``: that rule's category)."""

from __future__ import annotations

from convcheck.diagnose.remedies import (KEEP_FLOAT32, LAYER_REMEDIES, LOSS_FLOAT32, LOSS_SCALE_REMEDIES,
                                         MASTER_WEIGHTS, NONFINITE_REMEDIES, STOPPED_REMEDIES)
from convcheck.diagnose.rules.numerics import op_remedies
from convcheck.diagnose.rules.setup import SETUP_PRIORITY, SETUP_REMEDIES
from convcheck.numerics.thresholds import SETUP_MIN_STEPS
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import LOSS, producer_text


def nonfinite_remedies(p: dict) -> list[str]:
    """As ``compare`` (``rules/numerics.op_remedies``): the stable form of the op that made the first NaN/Inf
    when it has one (``exp``: subtract the maximum), then float32 - for the loss, the loss computed in float32;
    else float32 or rescaling."""
    own = op_remedies(p.get("op")) if isinstance(p.get("op"), str) else []
    if p.get("layer") == LOSS:
        return own + [LOSS_FLOAT32]
    return own + [KEEP_FLOAT32] if own else list(NONFINITE_REMEDIES)


def nonfinite_cause(p: dict) -> str:
    return "overflow" if p["direction"] == "forward" else "backward"


def over(row) -> float:
    return row.local / row.floor if row.floor > 0 else float("inf")


def layer_verdict(rule, side: str, row, prefix: str) -> Verdict:
    """``row`` (a replayed layer call above its floor) as the verdict of ``rule`` (category ``layer``)."""
    return rule.verdict([f"float64 judge on {side or 'the run'}: {row.text()}"],
                        headline=f"{prefix}{row.layer} computes beyond its floor at step {row.step}: local error "
                                 f"{row.local:.3g}, {over(row):.3g}x its measured floor",
                        remedies=list(LAYER_REMEDIES), target=side or None, layer=row.layer, sub_cause="local error")


def loss_scale_verdict(rule, who: str, sym, producer: dict, other: str | None, before: list) -> Verdict:
    """A fixed loss scale whose backward overflows (``detectors/watched.scaled_backward``'s ``sym``)."""
    what = sym.extra.get("what", "the gradient into the model's output")
    owner = f"{who}'s scaled backward" if who in ("A", "B") else "the scaled backward"
    headline = (f"{owner} overflows at step {sym.step}: {what} is Inf while the loss itself is finite "
                f"({sym.value:.4g})" + (f"; {other}" if other else ""))
    return rule.verdict([f"first non-finite: {producer_text(producer)}",
                         "no GradScaler was recorded (watch(..., scaler=)): a fixed loss scale - (loss * S)."
                         "backward() - makes gradients S times larger, past float16's 65504"] + list(before),
                        headline=headline, remedies=list(LOSS_SCALE_REMEDIES),
                        target=who if who in ("A", "B") else None, layer=sym.layer, sub_cause=sym.name)


def lost_updates_verdict(rule, lost: list, extra: list, both: bool = False) -> Verdict:
    """Weights kept in bfloat16/float16 that drop most updates (``lost``: the runs' ``small updates lost``)."""
    s = lost[0]
    who = ("in both runs" if both else f"in {s.arm}") if s.arm in ("A", "B") else ""
    return rule.verdict([f"{x.arm} on its own: {x.evidence}" if x.arm in ("A", "B") else x.evidence for x in lost]
                        + list(extra),
                        headline=f"{s.name}{' ' + who if who else ''}: the weights are kept in "
                                 f"{s.extra.get('format')} and most updates round away",
                        remedies=[MASTER_WEIGHTS], target=None if both or s.arm not in ("A", "B") else s.arm,
                        sub_cause=s.name)


# a stop the user made (Ctrl-C): not a finding - the run is judged on the steps it recorded, and nothing is said of
# the steps it never reached (issue 47)
INTERRUPTS = ("KeyboardInterrupt",)


def interrupted(s: dict | None) -> bool:
    """Whether a run's ``stopped`` record is the user's own interrupt (Ctrl-C), not the loop failing."""
    return s is not None and s.get("exception") in INTERRUPTS


def interrupt_line(s: dict, who: str = "the run") -> str:
    """What a verdict says of an interrupted run: where it stopped, and that what follows is judged on the steps
    before it only."""
    return (f"{who} was interrupted ({s['exception']}) at step {s['step']}: judged on the {s['step']} steps recorded "
            "before it; the steps after it never ran and nothing is said of them")


def stopped_verdict(rule, who: str, s: dict, evidence: list) -> Verdict:
    """A run whose block raised (a NaN-loss check, say) or was interrupted, where nothing the watch saw
    explains it: never ``ok`` - the training did not finish, and the watch cannot say why."""
    what = f"{s['exception']}" + (f" ({s['message']})" if s["message"] else "")
    return rule.verdict(list(evidence) + ["a loss the loop checks itself is seen by the watch only when it is "
                                          "handed to w.step(loss) before the check"],
                        headline=f"{who} stopped at step {s['step']} with {what}; the watch saw no NaN/Inf and no "
                                 "layer beyond its floor before it",
                        remedies=list(STOPPED_REMEDIES), sub_cause="stopped")


def training_problem(own, converged: bool | None, steps: int):
    """The run's first training problem by compare's setup order (``rules/setup.SETUP_PRIORITY``) when the run
    did not converge on its own over ``SETUP_MIN_STEPS`` steps or more: a user's per-batch losses over a short run
    say too little to call its setup failed (compare reads a float64 judge's). None else."""
    if converged is not False or steps < SETUP_MIN_STEPS:
        return None
    found = [s for s in own if s.name in SETUP_PRIORITY]
    return min(found, key=lambda s: SETUP_PRIORITY.index(s.name)) if found else None


def setup_remedies(sym) -> list[str]:
    return list(SETUP_REMEDIES.get(sym.name, ()))
