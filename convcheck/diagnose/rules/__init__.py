"""The verdict rules, one module per category, and the ``ok`` verdict when none fires.

Each rule reads only an ``Evidence`` and returns a ``Verdict`` or ``None``; ``registry.decide`` runs
them by priority (not by module) and the first verdict wins. Ids are stable (V001...); priorities
leave gaps for new rules. Every module of this package is imported here, so a new rule is one new
module (``@verdict_rule`` registers it) plus its test; ``lines`` holds the evidence lines rules share.
"""

from __future__ import annotations

from convcheck.discovery import import_modules
from convcheck.diagnose.rules.layer import layer_error, layer_remedies
from convcheck.diagnose.rules.nondeterminism import self_difference, stochastic_layer
from convcheck.diagnose.rules.numerics import numerics_remedies, precision_effect
from convcheck.diagnose.rules.ok import ok_verdict
from convcheck.diagnose.rules.setup import SETUP_PRIORITY, SETUP_REMEDIES, fragile_envelope, judge_fails
from convcheck.diagnose.rules.stack import hardware_finding, version_finding



def import_rule_modules() -> list[str]:
    """Import every module of this package (a rule module added beside these registers itself);
    returns their names."""
    return import_modules(__name__, __path__)


import_rule_modules()

__all__ = ["SETUP_PRIORITY", "SETUP_REMEDIES", "fragile_envelope", "hardware_finding", "import_rule_modules", "judge_fails", "layer_error",
           "layer_remedies", "numerics_remedies", "ok_verdict", "precision_effect", "self_difference",
           "stochastic_layer", "version_finding"]
