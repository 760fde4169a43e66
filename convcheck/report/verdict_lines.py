"""A verdict in words, as every command prints it: one renderer for ``compare``'s terminal report (and so the
pytest plugin's and a bundle diff's) and ``convcheck diff`` of watched runs (a pair, one run against the judge,
DDP ranks). One line each here (summary.json keeps them so, for grep); ``compare``'s terminal report wraps them to
the terminal's width (``report.text.wrap_prose``, undone by ``unwrap_prose``).

``compare`` heads its report with ``Verdict: CATEGORY - headline`` under the tables; a watched diff's lines read
``verdict: CATEGORY: headline`` after its ``name: value`` lines. The evidence and remedies follow in that order.
"""

from __future__ import annotations

STYLES = {
    # (headline, evidence prefix, remedy prefix)
    "compare": ("Verdict: {category} - {headline}", "  evidence: ", "  remedy:   "),
    "diff": ("verdict: {category}: {headline}", "  - ", "  remedy: "),
}


def verdict_lines(v, style: str = "diff") -> list[str]:
    """``v``'s headline, evidence and remedies as lines in ``style`` (``STYLES``)."""
    head, evidence, remedy = STYLES[style]
    return ([head.format(category=v.category, headline=v.headline)] + [f"{evidence}{e}" for e in v.evidence]
            + [f"{remedy}{r}" for r in v.remedies])
