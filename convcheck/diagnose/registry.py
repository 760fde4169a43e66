"""The verdict rule registry: ``VerdictRule``, the ``@verdict_rule`` decorator, ``RULES``, ``decide``.

A leaf of the ``diagnose`` package next to ``verdict`` and ``evidence``: ``rules``
imports it, it imports no rule. A rule is a small function ``(evidence) ->
Verdict | None`` registered with a stable id, a priority (lower runs first), the
category it decides, its headline template, its remedies and the evidence it
reads (``reads``: ``Evidence``, a comparison's - live or two bundles -, by default;
``watched_evidence.PairEvidence`` / ``RunEvidence`` for watched runs). ``decide``
runs the rules that read the evidence's type, by priority; the first verdict wins,
``otherwise(ev)`` when none fires. One chooser for every source.

The decorator returns the registered ``VerdictRule`` (callable like the
function), so a rule fills its own templates: ``my_rule.verdict(lines, fields,
...)`` inside ``def my_rule``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from convcheck.diagnose.catalogue import Entry
from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.verdict import CATEGORIES, Verdict

Check = Callable[[Evidence], "Verdict | None"]


@dataclass(frozen=True)
class VerdictRule:
    id: str  # "V001"
    name: str  # "stochastic-layer"
    priority: int  # lower runs first
    category: str  # the category of every verdict it returns
    headline: str  # str.format template (fields named by the rule); variants are noted in ``doc``
    remedies: tuple  # catalogue entries (or plain templates); the default a rule may replace from the evidence
    check: Check
    doc: str = ""
    reads: type = Evidence  # the evidence record this rule reads

    def __call__(self, ev: Evidence) -> Verdict | None:
        return self.check(ev)

    def verdict(self, evidence: list[str], fields: dict | None = None, *, headline: str | None = None,
                remedies: list[str] | None = None, **kw) -> Verdict:
        """This rule's verdict: its category, its headline and remedies filled from ``fields``
        unless given (a variant headline, remedies chosen from the evidence)."""
        fields = fields or {}
        return Verdict(
            self.category, self.headline.format(**fields) if headline is None else headline, list(evidence),
            [_filled(r, fields) for r in self.remedies] if remedies is None else list(remedies), **kw)


RULES: list[VerdictRule] = []


def _filled(template, fields: dict):
    """A rule's default remedy filled from ``fields``: a catalogue entry as a ``Remedy`` with the fields its template
    names, a plain template as its text (a ``written`` remedy)."""
    if isinstance(template, Entry):
        return template.remedy(**{k: v for k, v in fields.items() if "{" + k in template.template})
    return template.format(**fields)


def verdict_rule(rule_id: str, name: str, *, priority: int, category: str, headline: str,
                 remedies: tuple[str, ...] = (), reads: type = Evidence) -> Callable[[Check], VerdictRule]:
    """Register ``fn`` as a verdict rule; ids and names are unique, priorities among the rules that read the
    same evidence."""
    if category not in CATEGORIES or category == "ok":
        raise ValueError(f"verdict rule {rule_id}: category {category!r} is not a verdict a rule can return")

    def register(fn: Check) -> VerdictRule:
        for r in RULES:
            if rule_id == r.id or name == r.name or (priority == r.priority and reads is r.reads):
                raise ValueError(f"verdict rule {rule_id} ({name}, {priority}) clashes with {r.id} "
                                 f"({r.name}, {r.priority})")
        doc = (fn.__doc__ or "").strip()
        spec = VerdictRule(rule_id, name, priority, category, headline, tuple(remedies), fn, doc, reads)
        RULES.append(spec)
        RULES.sort(key=lambda r: r.priority)
        return spec

    return register


def rules_for(ev) -> list[VerdictRule]:
    """The rules that read this evidence's type, in priority order."""
    return [r for r in RULES if isinstance(ev, r.reads)]


def decide(ev, otherwise: Callable) -> Verdict:
    """The first verdict of the rules that read ``ev`` in priority order; ``otherwise(ev)`` when none fires."""
    for r in rules_for(ev):
        v = r.check(ev)
        if v is not None:
            return v
    return otherwise(ev)
