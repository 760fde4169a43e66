"""What every rule shares: the ``Finding`` record, the ``@rule`` registry, ``audit``, the rule ids.

A leaf of the ``rules`` package: the rule families import it, it imports none of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from convcheck.env import tables as t
from convcheck.env.fingerprint import GPU, Fingerprint

SEVERITIES = ("critical", "warn", "info")
_KIND_BY_PREFIX = {
    "DRV": "version", "ARCH": "version", "CUDA": "version", "DNN": "version", "BLAS": "version",
    "ECC": "hardware", "MEM": "hardware", "THR": "hardware", "PCI": "hardware",
    "MATH": "numerics", "DET": "determinism", "PROBE": "info",
    "SDP": "version", "TRI": "version", "VAR": "numerics",
}


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "critical", "warn" or "info"
    kind: str  # "version", "hardware", "numerics", "determinism" or "info"
    message: str
    remedy: str
    source: str
    gpu: int | None = None  # the GPU index it concerns, if one

    def to_dict(self) -> dict:
        return asdict(self)


Rule = Callable[[Fingerprint], Iterable[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def audit(fp: Fingerprint) -> list[Finding]:
    """Every rule's findings, critical first, then warn, then info (stable within)."""
    findings = [f for r in RULES for f in r(fp)]
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def make_finding(rule_id: str, severity: str, message: str, remedy: str, source: str, gpu=None) -> Finding:
    kind = _KIND_BY_PREFIX[rule_id.rstrip("0123456789")]
    return Finding(rule_id, severity, kind, message, remedy, source, gpu)


def gpu_label(g: GPU) -> str:
    cc = f", compute capability {g.capability[0]}.{g.capability[1]}" if g.capability else ""
    return f"GPU {g.index} ({g.name or 'unknown'}{cc})"


def fmt_version(v) -> str:
    return t.format_version(v)


RULE_IDS: dict[str, str] = {
    rid: _KIND_BY_PREFIX[rid.rstrip("0123456789")]
    for rid in ("DRV001", "DRV002", "DRV003", "DRV004", "ARCH001", "ARCH002", "ARCH003", "CUDA001", "CUDA002",
                "DNN001", "DNN002", "DNN003", "BLAS001", "MATH001", "MATH002", "DET001", "DET002",
                "ECC001", "ECC002", "MEM001", "THR001", "PCI001", "PROBE001",
                "SDP001", "TRI001", "VAR001", "VAR002")
}
