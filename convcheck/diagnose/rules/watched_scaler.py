"""A GradScaler's step skipped (issue 47), before any other verdict on one watched run or a pair:

==== ==== ============================ ======== ========================================================
id   prio name                         category fires on
==== ==== ============================ ======== ========================================================
W110 4    run-step-without-scaler      setup    the run's optimizer stepped on the scaler's scaled gradients
W014 9    watched-step-without-scaler  setup    one run (or both) did so: the runs differ by that, not numerics
==== ==== ============================ ======== ========================================================

The finding is ``detectors/watched_scaler.step_without_scaler``'s ``Setup``; without these rules W109 / W001 would
say it too (they read every setup finding), these name it first and alone.
"""

from __future__ import annotations

from convcheck.diagnose.detectors.watched_scaler import SUB_CAUSE
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import PairEvidence, RunEvidence


def _found(ev):
    return next((f for f in ev.setup if f.sub_cause == SUB_CAUSE), None)


@verdict_rule("W110", "run-step-without-scaler", priority=4, category="setup", reads=RunEvidence, headline="{what}")
def run_step_without_scaler(ev: RunEvidence) -> Verdict | None:
    """The run applied its GradScaler's scaled gradients: optimizer.step() without scaler.step(optimizer)."""
    f = _found(ev)
    if f is None:
        return None
    return run_step_without_scaler.verdict(list(f.evidence), headline=f.headline, remedies=list(f.remedies),
                                           sub_cause=f.sub_cause)


@verdict_rule("W014", "watched-step-without-scaler", priority=9, category="setup", reads=PairEvidence,
              headline="{what}")
def watched_step_without_scaler(ev: PairEvidence) -> Verdict | None:
    """A run of the pair applied its GradScaler's scaled gradients: the runs differ by that setup, not the
    numerics."""
    f = _found(ev)
    if f is None:
        return None
    return watched_step_without_scaler.verdict(list(f.evidence), headline=f.headline, remedies=list(f.remedies),
                                               sub_cause=f.sub_cause)
