"""Matplotlib figures of a comparison (matplotlib is imported here only, never at ``import convcheck``)."""

from __future__ import annotations

import io
import math

WORST = 25


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_figure(result):
    """Loss and parameter distance to the judge per step, every arm; envelope runs as a band."""
    plt = _pyplot()
    tr = result.training
    c = tr.curves
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    env = [a for a in tr.arms if a.role == "envelope"]
    if env:
        band = c[c["role"] == "envelope"].groupby("step")["loss"].agg(["min", "max"])
        ax1.fill_between(band.index, band["min"], band["max"], color="0.8",
                         label=f"envelope of {env[0].reference} ({len(env)} runs)")
        dband = c[c["role"] == "envelope"].groupby("step")["dist_ref"].max()
        ax2.plot(dband.index, dband.values, color="0.5", ls=":", label="envelope spread (to its target)")
    for a in tr.arms:
        if a.role == "envelope":
            continue
        arm = tr.arm_curve(a.name)
        style = dict(ls="--", color="k") if a.role == "judge" else {}
        ax1.plot(arm["step"], arm["loss"], label=a.name, **style)
        if a.role == "target":
            ax2.plot(arm["step"], arm["dist_judge"], label=f"{a.name} to judge")
            if arm["dist_other"].notna().any():
                ax2.plot(arm["step"], arm["dist_other"], label=f"{a.name} to the other target", alpha=0.7)
    ax1.set(xlabel="step", ylabel="loss", title="Loss per step")
    ax2.set(xlabel="step", ylabel="relative parameter distance", title="Drift", yscale="log")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def layers_figure(result):
    """Each layer's own error against its floor and bound, per target, for that target's worst rows
    (by own error over floor; log scale)."""
    plt = _pyplot()
    fwd = result.parity.worst(WORST * 2, kind="forward")
    targets = list(dict.fromkeys(fwd["target"]))
    fig, axes = plt.subplots(len(targets) or 1, 1, figsize=(11, 3.2 * max(1, len(targets))), squeeze=False)
    tiny = 1e-18
    for ax, target in zip(axes[:, 0], targets):
        t = fwd[fwd["target"] == target].sort_values("order")
        x = range(len(t))
        own = [i if math.isfinite(i) else v for i, v in zip(t["intrinsic"], t["local"])]
        ax.bar(x, [max(v, tiny) if math.isfinite(v) else tiny for v in own],
               color=["tab:red" if f else "tab:blue" for f in t["flagged"]], label="own error")
        ax.plot(x, [max(v, tiny) if math.isfinite(v) else tiny for v in t["floor"]], "o", ms=4, color="tab:green",
                label="floor (best at this precision)")
        ax.plot(x, t["bound"], "k_", ms=12, label=f"{result.config.tolerances.bound_factor:g} x floor + absolute term")
        ax.plot(x, [max(v, tiny) if math.isfinite(v) else tiny for v in t["propagated"]], "o", ms=3,
                color="tab:orange", label="propagated error")
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{n} ({m})" for n, m in zip(t["layer"], t["module"])], rotation=70, fontsize=7)
        ax.set_title(f"{target}: its worst layers by own error over floor (red = flagged)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _pyplot().close(fig)
    return buf.getvalue()


def render_plots(result) -> dict[str, bytes]:
    """``loss.png`` and ``layers.png`` as PNG bytes, by file name."""
    return {"loss.png": figure_png(loss_figure(result)), "layers.png": figure_png(layers_figure(result))}

