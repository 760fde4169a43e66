"""The verify stage's result as the renderers show it: one function each for lines and for summary.json,
called by the terminal summary, ``export.summary_dict`` and ``assert_parity``'s message."""

from __future__ import annotations


def verification_lines(result, *, snippet: bool = True) -> list[str]:
    """``result.verification`` as lines: the verified/not verified line, each attempt that came before,
    the paste-ready code of a set of modules found by bisection (summary.json has every attempt's);
    why nothing ran when it was skipped for its cost."""
    v = getattr(result, "verification", None)
    if v is None:
        return []
    if v.status == "skipped":
        return [f"remedies not verified: {v.reason}"] if v.reason and v.untried else []
    lines = [v.line]
    ok = v.verified
    if ok is not None:
        lines = [a.line for a in v.attempts if a is not ok] + lines
        if snippet and ok.snippet and ok.kind == "bisect":  # a set of modules: the code to paste
            lines += ["the change, applied:", *("    " + s for s in ok.snippet.rstrip().splitlines())]
    elif len(v.attempts) > 1:
        lines += [f"  {a.line}" for a in v.attempts]
    return lines


def verification_dict(result) -> dict | None:
    """``result.verification`` for summary.json (None when the stage did not run)."""
    v = getattr(result, "verification", None)
    return v.to_dict() if v is not None else None
