"""The ``ok`` verdict, when no rule fires: both targets train alike, and how close they came to a finding."""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.rules.lines import layer_note_lines, training_lines
from convcheck.diagnose.rules.nondeterminism import where_lines
from convcheck.diagnose.verdict import Verdict
from convcheck.numerics.thresholds import CONVERGENCE_MIN_STEPS


def ok_verdict(ev: Evidence) -> Verdict:
    """Both targets train alike; the evidence says how close they came to a finding."""
    evidence = training_lines(ev)
    noted: dict[str, list[str]] = {}  # a target's flagged layers below min_error (their notes follow)
    for s in ev.layer_notes:
        if s.layer and s.layer not in noted.setdefault(s.arm, []):
            noted[s.arm].append(s.layer)
    for m in ev.closest_layers:
        but = noted.get(m.target)
        every = (f"every layer but {', '.join(repr(n) for n in but)} (flagged, below min_error: see the note) "
                 "within its floor's bound" if but else "every layer within its floor's bound")
        if m.measured:
            evidence.append(f"{m.target}: {every}; the furthest above its floor is "
                            f"'{m.layer}' ({m.module}) with its own error {m.error:.2e}, {m.ratio:.2g}x its floor "
                            f"{m.floor:.2e}")
        else:
            evidence.append(f"{m.target}: {every}; the furthest above is '{m.layer}' "
                            f"({m.module}) with local error {m.error:.2e}, {m.ratio:.2g}x the rounding of its "
                            f"result {m.floor:.2e} (a lower bound of its floor)")
    evidence += layer_note_lines(ev)
    if ev.drift is not None:
        evidence.append(ev.drift.evidence + (f"; both targets compute at the same precision and converge alike; "
                                             f"{ev.outcome_text()}: a note, not a cause"
                                             if ev.drift.name == S.DRIFT else ""))
    evidence += [f"note ({f.arm}): {f.summary}; it does not change the outcome beyond the envelope's own runs "
                 "(final loss, convergence)" for f in ev.executor_findings]
    evidence += [f"{f.id}: {f.message}" for f in ev.findings if getattr(f, "severity", "") in ("critical", "warn")]
    min_error = ev.tolerances.min_error
    for n, d in ev.self_difference.items():
        if d > 0:
            evidence.append(f"{n} differs from itself run to run by {d:.2e} (below {min_error:g}: benign)")
            evidence += where_lines(ev, n)
    evidence += [f"{n} ran twice from the same state at the first step: bitwise identical, so the differences "
                 "between the targets are not chance" for n in ev.repeated if ev.self_difference.get(n, 0.0) == 0.0]
    judge = ev.judge_outcome
    if ev.judgeable and judge is not None and not judge.converged:
        evidence.append(f"the float64 judge has not converged in {ev.steps} steps either (loss {judge.first_loss:.4g} -> "
                        f"{judge.final_loss:.4g}{', still falling' if ev.still_falling.get(ev.judge) else ''}) and the "
                        f"targets track it: run --steps {2 * ev.steps} or more to judge convergence")
        evidence += [f"note ({s.arm}): {s.label}: {s.evidence}" for s in ev.judge_problems]
    if not ev.judgeable:
        steps = f"{ev.steps} step" + ("s" if ev.steps != 1 else "")
        evidence.append(f"convergence is not judged from {steps}; run --steps {CONVERGENCE_MIN_STEPS} "
                        "or more for that")
    return Verdict("ok", f"both targets train alike: {' and '.join(ev.targets)} agree with the float64 judge "
                   "within the expected rounding", evidence, [], symptoms=[])
