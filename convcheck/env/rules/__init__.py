"""Audit rules: each a small function from a Fingerprint to zero or more Findings.

A rule stays quiet when the value it needs is unknown (``None``): the audit
reports what the evidence shows, never what it guesses. Every finding carries
a stable id, a severity, a kind (what verdict it can support), a message with
the numbers, a remedy and the source the rule rests on.

Kinds: ``version`` (DRV, ARCH, CUDA, DNN, BLAS), ``hardware`` (ECC, MEM, THR,
PCI), ``numerics`` (MATH), ``determinism`` (DET), ``info`` (PROBE).

Layout: ``base`` (Finding, the ``@rule`` registry, ``audit``, ``RULE_IDS``) and
one module per rule family: ``driver`` (DRV, ARCH, CUDA), ``libraries`` (DNN,
BLAS), ``mathmode`` (MATH, DET; ``tf32_state``), ``hardware`` (ECC, MEM, THR,
PCI, PROBE). Importing the families registers their rules; the order below is
the order ``audit`` runs them in (and lists findings of one severity in).
"""

from convcheck.env.rules.base import RULE_IDS, RULES, SEVERITIES, Finding, Rule, audit, rule
from convcheck.env.rules import driver, libraries, mathmode, hardware  # noqa: E402,I001 - registration order
from convcheck.env.rules.hardware import NVML_DOC, THROTTLE_BITS
from convcheck.env.rules.mathmode import tf32_state

__all__ = [
    "NVML_DOC", "RULES", "RULE_IDS", "SEVERITIES", "THROTTLE_BITS", "Finding", "Rule", "audit", "driver",
    "hardware", "libraries", "mathmode", "rule", "tf32_state",
]
