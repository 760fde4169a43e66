"""The ``Verdict`` record and its categories (ARCHITECTURE.md, "Verdict categories")."""

from __future__ import annotations

from dataclasses import dataclass, field

from convcheck.diagnose.catalogue import Remedy, as_remedy

# ``inconclusive``: the float64 judge checked less than the layers the outcome rests on (a watched run whose
# layers it could not replay): never ``ok`` on a judge that replayed nothing (issue 43; exit code 5)
CATEGORIES = ("ok", "numerics", "layer", "version", "hardware", "setup", "nondeterminism", "inconclusive")


@dataclass(frozen=True)
class Verdict:
    category: str
    headline: str
    evidence: list[str] = field(default_factory=list)
    # ``catalogue.Remedy`` values (each its text as a ``str``, its entry's id and fields); a plain string given here
    # is a ``written`` remedy: a change to the user's code, no action
    remedies: list[Remedy] = field(default_factory=list)
    target: str | None = None
    layer: str | None = None
    sub_cause: str | None = None
    symptoms: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown verdict category {self.category!r}")
        object.__setattr__(self, "remedies", [as_remedy(r) for r in self.remedies])

    def to_dict(self) -> dict:
        return {
            "category": self.category, "headline": self.headline, "evidence": list(self.evidence),
            "remedies": [r.text() for r in self.remedies],
            "remedy_ids": [r.to_dict() for r in self.remedies], "target": self.target, "layer": self.layer,
            "sub_cause": self.sub_cause, "symptoms": list(self.symptoms),
        }
