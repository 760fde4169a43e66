"""The verified remedy's before/after loss plot (``verify.png``): the failing arm's curve as it ran, each
re-run's curve with its remedy applied, and the judge (matplotlib only inside, as ``plots``)."""

from __future__ import annotations

import math
import re

from convcheck.report.plots import LEGEND_OUTSIDE, _pyplot, loss_scale

JUDGE_ARM = "the float64 judge"


def verify_figure(result):
    """None when no re-run was made (nothing verified or not: the stage skipped or had no action)."""
    v = getattr(result, "verification", None)
    if v is None or not v.attempts:
        return None
    tr = result.training
    first = v.attempts[0]
    judge_name = str(result.config.judge)
    before_name = judge_name if first.arm == JUDGE_ARM else first.arm
    try:
        before = tr.arm_curve(before_name)
        judge = tr.arm_curve(judge_name)
    except Exception:  # noqa: BLE001 - a result without those arms: no plot
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    drawn: list[float] = []
    marks = []

    def curve(steps, losses, label, **style):
        steps, losses = list(steps), [float(x) for x in losses]
        line, = ax.plot(steps, losses, label=label, **style)
        drawn.extend(losses)
        bad = [s for s, x in zip(steps, losses) if not math.isfinite(x)]
        if bad:
            marks.append((bad, line.get_color(), label))

    if before_name != judge_name:
        # a wide pale band underneath, the judge dashed on top: curves that coincide stay visible
        curve(before["step"], before["loss"], f"{before_name} as run (before)", color="tab:red", lw=5, alpha=0.35,
              zorder=1)
    curve(judge["step"], judge["loss"], f"{judge_name} (judge)", color="k", ls="--", lw=1.2, zorder=4)
    for i, a in enumerate(v.attempts):
        status = "verified" if a.verified else "not verified"
        label = _short(f"{a.arm} {_plain(a.text)} ({status})")
        style = dict(lw=2.2, color="tab:green") if a.verified else dict(lw=1.2, ls=":", color=f"C{(i + 4) % 10}")
        curve(range(len(a.losses)), a.losses, label, **style)
        if a.judge_losses:
            curve(range(len(a.judge_losses)), a.judge_losses, "the judge re-run with the recipe change", color="0.45",
                  ls="-.", lw=1.0)
    scale = loss_scale(drawn)
    ax.set_yscale(scale)
    for steps, colour, label in marks:  # a NaN/Inf loss draws nothing: mark where it happened
        ax.plot(steps, [1.0] * len(steps), "x", ms=8, mew=2, color=colour, transform=ax.get_xaxis_transform(),
                clip_on=False, label=_short(f"non-finite: {label}"))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="step", ylabel=f"loss ({scale} scale)")
    ax.set_title(f"Remedy re-run: {v.status}", pad=14)
    ax.legend(**LEGEND_OUTSIDE)
    fig.tight_layout()
    return fig


def _plain(text: str) -> str:
    """An action's text without its explanations in brackets: what was changed, for a legend."""
    while True:
        shorter = re.sub(r" \([^()]*\)", "", text)
        if shorter == text:
            return text
        text = shorter


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
