"""``assert_parity``: the assertion the pytest plugin's users call on a comparison result."""

from __future__ import annotations

import math

from convcheck.report.text import fmt, training_states
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
        for r in result.parity.worst(max_rows).itertuples():
            if not r.flagged:
                continue
            layer = r.layer if r.kind == 'forward' else r.param
            # the model's own code is its class's row: 'Net (own code: exp)', not 'Net (Net (own code: exp))'
            name = r.module if str(r.module).startswith(f"{layer} (") else f"{layer} ({r.module})"
            own = r.intrinsic if r.intrinsic == r.intrinsic else r.local  # NaN: not measured, the local error
            lines.append(f"{r.target:<18} {name:<40} {fmt(own):>10} {fmt(r.floor):>10} {fmt(r.over_floor):>10} "
                         f"{fmt(r.needed):>14}")
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


def assert_parity(result) -> None:
    """Fail the calling test, with the first diverging layers, unless ``result`` passes."""
    __tracebackhide__ = True
    if not result:
        raise AssertionError(failure_message(result))
