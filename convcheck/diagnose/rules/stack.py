"""Rules of the ``hardware`` and ``version`` categories: a target symptom together with a finding of the
environment audit (``convcheck.env``) of that kind."""

from __future__ import annotations

from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.rules.lines import symptom_lines, training_lines, where_in
from convcheck.diagnose.verdict import Verdict

_ENV_HEADLINE = "{finding}: {message} - and {target} shows {symptom}{where}"


def _env_verdict(rule, ev: Evidence, found: list) -> Verdict:
    f, main, syms = found[0], ev.symptoms[0], ev.symptoms
    lines = [f"{x.id} ({x.severity}): {x.message} [source: {x.source}]" for x in found[:3]]
    lines += symptom_lines(syms, 3) + training_lines(ev)
    return rule.verdict(
        lines, {"finding": f.id, "message": f.message.rstrip("."), "target": main.arm, "symptom": main.name,
                "where": where_in(main.layer)},
        remedies=[x.remedy for x in found[:3] if x.remedy], target=main.arm, layer=main.layer,
        sub_cause=f.id, symptoms=[s.name for s in syms])


@verdict_rule("V005", "hardware-finding", priority=50, category="hardware", headline=_ENV_HEADLINE)
def hardware_finding(ev: Evidence) -> Verdict | None:
    """A target symptom and a critical/warn hardware finding (ECC, memory, throttling, PCIe).
    Remedies: the findings' own (up to three)."""
    found = ev.findings_of("hardware")
    return _env_verdict(hardware_finding, ev, found) if ev.symptoms and found else None


@verdict_rule("V006", "version-finding", priority=60, category="version", headline=_ENV_HEADLINE)
def version_finding(ev: Evidence) -> Verdict | None:
    """A target symptom and a critical/warn version finding (driver, architecture, CUDA,
    cuDNN, BLAS). Remedies: the findings' own (up to three)."""
    found = ev.findings_of("version")
    return _env_verdict(version_finding, ev, found) if ev.symptoms and found else None
