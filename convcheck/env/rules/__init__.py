"""Audit rules: each a small function from a Fingerprint to zero or more Findings.

A rule stays quiet when the value it needs is unknown (``None``): the audit
reports what the evidence shows, never what it guesses. Every finding carries
a stable id, a severity, a kind (what verdict it can support), a message with
the numbers, a remedy and the source the rule rests on.

Kinds: ``version`` (DRV, ARCH, CUDA, DNN, BLAS, SDP, TRI), ``hardware`` (ECC, MEM, THR,
PCI), ``numerics`` (MATH, VAR), ``determinism`` (DET), ``info`` (PROBE).

Layout: ``base`` (Finding, the ``@rule`` registry, ``audit``, ``RULE_IDS``) and
one module per rule family: ``driver`` (DRV, ARCH, CUDA), ``libraries`` (DNN,
BLAS), ``mathmode`` (MATH, DET; ``tf32_state``), ``hardware`` (ECC, MEM, THR,
PCI, PROBE), ``dispatch`` (SDP, TRI, VAR: the attention backend, Triton, the numerics
environment variables). Importing the families registers their rules; the order below is
the order ``audit`` runs them in (and lists findings of one severity in); every
other module of this package is imported after them, by name, so a new family
is one new module with ``@rule`` functions (``import_rule_families``).
"""

from convcheck.discovery import import_modules
from convcheck.env.rules.base import RULE_IDS, RULES, SEVERITIES, Finding, Rule, audit, rule
from convcheck.env.rules import driver, libraries, mathmode, hardware  # noqa: E402,I001 - registration order
from convcheck.env.rules.hardware import NVML_DOC, THROTTLE_BITS
from convcheck.env.rules.mathmode import tf32_state


def import_rule_families() -> list[str]:
    """Import every module of this package (a family added beside the four registers its rules);
    returns their names."""
    return import_modules(__name__, __path__)


import_rule_families()

__all__ = [
    "NVML_DOC", "RULES", "RULE_IDS", "SEVERITIES", "THROTTLE_BITS", "Finding", "Rule", "audit", "driver",
    "hardware", "import_rule_families", "libraries", "mathmode", "rule", "tf32_state",
]
