"""Verdict rule V009 ``ddp-setup``: the data-parallel findings (``diagnostics``) as a ``setup`` verdict.

Registered into the diagnosis (``convcheck.diagnose.registry``) when the
rank-pool executor loads (``executor``); it reads the ``DDPFinding`` among
``Evidence.executor_findings``.
"""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.ddp.diagnostics import DDPFinding
from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.rules.lines import training_lines
from convcheck.diagnose.verdict import Verdict


@verdict_rule(
    "V009", "ddp-setup", priority=65, category="setup",
    headline="data-parallel setup: {summary}",
    remedies=("compare the data-parallel setup with the single-device one (convcheck.ddp.diagnostics)",))
def ddp_setup(ev: Evidence) -> Verdict | None:
    """A ``ddp:`` target trains another model than one device: a loss off by the world size, ranks that see
    the same samples, buffers that differ across ranks, random draws the shared masks miss, an averaged
    gradient at step 0 far outside its bound (always: exact evidence), or BatchNorm layers normalising each rank's slice on its own (when the drift leaves the
    envelope, or there is no envelope to tell) - and then only when it changes the outcome beyond what the
    envelope's own runs reach (final loss, convergence: ``Evidence.outcome_changed``) or drifts more than
    DRIFT_NOTE_MAX times the envelope's spread (``Evidence.drift_far``); else it is a note of the ``ok``
    verdict. A per-rank BatchNorm (the standard DDP recipe at ``BN_RANK_BATCH_OK`` samples a rank or more) is
    judged by the outcome alone: it trains another model from the first step, so its drift is always far.
    Sub-cause ``ddp``."""
    beyond = ev.drift is None or ev.drift.name == S.DRIFT or bool(ev.target_symptoms)
    found = [f for f in ev.executor_findings if isinstance(f, DDPFinding)
             and (f.exact or (beyond and (ev.outcome_changed(f.arm) or (ev.drift_far and not f.explains_drift))))]
    if not found:
        return None
    main = found[0]
    evidence = list(main.evidence) + [f"also: {f.summary}" for f in found[1:]] + training_lines(ev)
    return ddp_setup.verdict(
        evidence, {"summary": main.summary}, remedies=list(dict.fromkeys(f.remedy for f in found)), target=main.arm,
        layer=main.layers[0] if main.layers else None, sub_cause="ddp",
        symptoms=list(dict.fromkeys(k for f in found for k in (f.kind, *f.covers))))

