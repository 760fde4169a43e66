"""The ``Verdict`` record and its categories (ARCHITECTURE.md, "Verdict categories")."""

from __future__ import annotations

from dataclasses import dataclass, field

# ``inconclusive``: the float64 judge checked less than the layers the outcome rests on (a watched run whose
# layers it could not replay): never ``ok`` on a judge that replayed nothing (issue 43; exit code 5)
CATEGORIES = ("ok", "numerics", "layer", "version", "hardware", "setup", "nondeterminism", "inconclusive")


@dataclass(frozen=True)
class Verdict:
    category: str
    headline: str
    evidence: list[str] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    target: str | None = None
    layer: str | None = None
    sub_cause: str | None = None
    symptoms: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown verdict category {self.category!r}")

    def to_dict(self) -> dict:
        return {
            "category": self.category, "headline": self.headline, "evidence": list(self.evidence),
            "remedies": list(self.remedies), "target": self.target, "layer": self.layer,
            "sub_cause": self.sub_cause, "symptoms": list(self.symptoms),
        }
