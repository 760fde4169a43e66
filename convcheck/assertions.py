"""``assert_parity``: the assertion the pytest plugin's users call on a comparison result."""

from __future__ import annotations

import math

from convcheck.report.summary import fmt, training_states
from convcheck.report.verification import verification_lines


def failure_message(result, max_rows: int = 5) -> str:
    """The verdict in its own words (headline, evidence), the first diverging layers as a small table, each
    arm's training as the terminal states it, then what would change the outcome."""
    lines = []
    v = result.verdict
    if v is not None:
        lines.append(f"convcheck verdict: {v.category} - {v.headline}")
    flagged = result.parity.flagged()
    if len(flagged):
        lines.append(f"{'target':<18} {'layer (module)':<40} {'own error':>10} {'floor':>10} {'own/floor':>10} "
                     f"{'needed factor':>14}")
        rows = [r for r in result.parity.worst(max_rows).itertuples() if r.flagged]
        rows, notes = _culprit_first(rows, v, result.config.tolerances.min_error)
        for r in rows:
            layer = r.layer if r.kind == 'forward' else r.param
            # the model's own code is its class's row: 'Net (own code: exp)', not 'Net (Net (own code: exp))'
            name = r.module if str(r.module).startswith(f"{layer} (") else f"{layer} ({r.module})"
            own = _own(r)
            lines.append(f"{r.target:<18} {name:<40} {fmt(own):>10} {fmt(r.floor):>10} {fmt(r.over_floor):>10} "
                         f"{fmt(r.needed):>14}")
        if notes:
            where = ", ".join(sorted({str(r.target) for r in notes}))
            lines.append(f"({len(notes)} flagged row(s) on {where} left out: below min_error "
                         f"{result.config.tolerances.min_error:g}, so not a cause)")
        needed = result.parity.needed_bound_factor()
        factor = f"bound_factor={result.config.tolerances.bound_factor:g}"
        if needed is not None and math.isfinite(needed):
            lines.append(f"({factor}; passing would need bound_factor >= {fmt(needed)})")
        else:
            lines.append(f"({factor}; no bound_factor would pass: a flagged error is non-finite or its result destroyed)")
    if v is not None:  # the verdict's evidence states each arm's training in the CLI's words
        lines += [f"evidence: {e}" for e in v.evidence]
    else:
        lines += [f"{name}: {state}" for name, state in training_states(result).items()]
    if v is not None:
        lines += [f"remedy: {r}" for r in v.remedies[:2]]
    lines += verification_lines(result, snippet=False)
    return "\n".join(lines) or "convcheck: parity failed"


def _own(r) -> float:
    return r.intrinsic if r.intrinsic == r.intrinsic else r.local  # NaN: not measured, the local error


def _culprit_first(rows: list, verdict, min_error: float) -> tuple[list, list]:
    """The verdict's target's rows first; another target's rows whose own error is below ``min_error`` (the
    verdict's notes: float32 losing 6e-05 in the same unstable formula) left out, so the table does not read as
    if that target failed too. (rows shown, rows left out); all rows, in order, without a verdict target."""
    target = getattr(verdict, "target", None)
    if not target or not any(str(r.target) == target for r in rows):
        return rows, []
    mine = [r for r in rows if str(r.target) == target]
    others = [r for r in rows if str(r.target) != target]
    notes = [r for r in others if math.isfinite(_own(r)) and _own(r) < min_error]
    dropped = {id(r) for r in notes}
    return mine + [r for r in others if id(r) not in dropped], notes


def assert_parity(result) -> None:
    """Fail the calling test, with the first diverging layers, unless ``result`` passes."""
    __tracebackhide__ = True
    if not result.ok:
        raise AssertionError(failure_message(result))
