"""A critical finding of the environment audit reaches the verdict, even when the targets agree.

``compare --env FILE`` audits the machine where training fails (or this one); a CRITICAL finding there (a
driver too old for the wheel's CUDA, a GPU the wheel has no kernels for, uncorrectable ECC errors) means the
stack is not fit to run the model, whatever this run's targets measured: exit 1, as ``convcheck env`` does.
Runs after every symptom rule: a target symptom together with the finding is V005/V006's verdict.
"""

from __future__ import annotations

import dataclasses

from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.rules.lines import training_lines
from convcheck.diagnose.verdict import Verdict

# the finding's kind -> the verdict's category (a kind with no category of its own reads as a version problem)
_CATEGORY = {"hardware": "hardware", "numerics": "numerics", "determinism": "nondeterminism"}


@verdict_rule("V010", "critical-environment", priority=90, category="version",
              headline="{finding} (critical): {message} - the audited stack is not fit to train on, "
                       "whatever this run's targets measured")
def critical_environment(ev: Evidence) -> Verdict | None:
    """A critical environment finding with no target symptom (a symptom with it is V005/V006).
    Remedies: the critical findings' own (up to three)."""
    found = [f for f in ev.findings if getattr(f, "severity", None) == "critical"]
    if not found:
        return None
    first = found[0]
    lines = [f"{f.id} ({f.severity}): {f.message} [source: {f.source}]" for f in found[:3]]
    lines += training_lines(ev)
    verdict = critical_environment.verdict(
        lines, {"finding": first.id, "message": first.message.rstrip(".")},
        remedies=[f.remedy for f in found[:3] if f.remedy], sub_cause=first.id, symptoms=[])
    return dataclasses.replace(verdict, category=_CATEGORY.get(first.kind, "version"))
