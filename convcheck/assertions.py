"""``assert_parity``: the assertion the pytest plugin's users call on a comparison result."""

from __future__ import annotations

from convcheck.report.text import fmt


def failure_message(result, max_rows: int = 5) -> str:
    """The first diverging layers as a small table, then what would change the outcome."""
    lines = []
    v = result.verdict
    if v is not None:
        lines.append(f"convcheck verdict: {v.category} - {v.headline}")
    flagged = result.parity.flagged()
    if len(flagged):
        lines.append(f"{'target':<18} {'layer':<28} {'local':>10} {'bound':>10} {'needed factor':>14}")
        for r in flagged.sort_values("order").head(max_rows).itertuples():
            name = r.layer if r.kind == "forward" else r.param
            lines.append(f"{r.target:<18} {name:<28} {fmt(r.local):>10} {fmt(r.bound):>10} {fmt(r.needed):>14}")
        lines.append(f"(bound_factor={result.config.tolerances.bound_factor:g}; "
                     f"passing would need bound_factor >= {fmt(result.parity.needed_bound_factor())})")
    for name, info in result.training.outcomes.items():
        if not info.converged:
            lines.append(f"{name} did not converge (loss {fmt(info.first_loss)} -> {fmt(info.final_loss)})")
    if v is not None:
        lines += [f"remedy: {r}" for r in v.remedies[:2]]
    return "\n".join(lines) or "convcheck: parity failed"


def assert_parity(result) -> None:
    """Fail the calling test, with the first diverging layers, unless ``result`` passes."""
    __tracebackhide__ = True
    if not result:
        raise AssertionError(failure_message(result))
