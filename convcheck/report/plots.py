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


LOG_RANGE = 1e3  # a loss whose largest and smallest magnitudes differ by more than this is drawn on a log axis
MAX_TICK_LABELS = 30  # more layers than this: every k-th name (and every flagged one) is written
LEGEND_OUTSIDE = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)


def loss_scale(values) -> str:
    """``linear``, ``log`` or ``symlog`` for a loss curve: log once the finite values span more than
    ``LOG_RANGE`` (symlog when one is 0 or negative), so the first steps of a loss that grows to 1e23 are
    not a flat line at 0."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    magnitudes = [abs(v) for v in finite if v != 0]
    if not magnitudes or max(magnitudes) / min(magnitudes) <= LOG_RANGE:
        return "linear"
    return "log" if min(finite) > 0 else "symlog"


def loss_figure(result):
    """Loss and parameter distance to the judge per step, every arm; envelope runs as a band; non-finite
    steps marked (x at the top of the axis); legends outside the axes."""
    plt = _pyplot()
    tr = result.training
    c = tr.curves
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    env = [a for a in tr.arms if a.role == "envelope"]
    if env:
        band = c[c["role"] == "envelope"].groupby("step")["loss"].agg(["min", "max"])
        ax1.fill_between(band.index, band["min"], band["max"], color="0.8",
                         label=f"envelope of {env[0].reference} ({len(env)} runs)")
        dband = c[c["role"] == "envelope"].groupby("step")["dist_ref"].max()
        ax2.plot(dband.index, dband.values, color="0.5", ls=":", label="envelope spread (to its target)")
    nonfinite = {}
    other_drawn = False  # the two targets' distance to each other is one line (the same pair both ways)
    for a in tr.arms:
        if a.role == "envelope":
            continue
        arm = tr.arm_curve(a.name)
        style = dict(ls="--", color="k") if a.role == "judge" else {}
        line, = ax1.plot(arm["step"], arm["loss"], label=a.name, **style)
        bad = [s for s, v in zip(arm["step"], arm["loss"]) if not math.isfinite(v)]
        if bad:
            nonfinite[a.name] = (bad, line.get_color())
        if a.role == "target":
            ax2.plot(arm["step"], arm["dist_judge"], label=f"{a.name} to judge")
            if arm["dist_other"].notna().any() and not other_drawn:
                other = next((b.name for b in tr.arms if b.role == "target" and b.name != a.name), "the other target")
                ax2.plot(arm["step"], arm["dist_other"], label=f"{a.name} to {other}", ls="--", alpha=0.7)
                other_drawn = True
    scale = loss_scale(list(c.loc[c["role"] != "envelope", "loss"]))
    ax1.set_yscale(scale)
    for name, (steps, colour) in nonfinite.items():  # a NaN/Inf loss draws nothing: mark where it happened
        ax1.plot(steps, [1.0] * len(steps), "x", ms=8, mew=2, color=colour, transform=ax1.get_xaxis_transform(),
                 clip_on=False, label=f"{name}: non-finite loss ({len(steps)} step{'s' if len(steps) > 1 else ''})")
    ax1.set(xlabel="step", ylabel=f"loss ({scale} scale)")
    ax1.set_title("Loss per step", pad=14)
    ax2.set(xlabel="step", ylabel="relative parameter distance", title="Drift", yscale="log")
    ax1.legend(**LEGEND_OUTSIDE)
    ax2.legend(**LEGEND_OUTSIDE)
    fig.tight_layout()
    return fig


def layer_points(rows) -> list[dict]:
    """One point per forward layer, in model order: ``ratio`` = own error / floor (the local error where
    the own one is not measured), ``bound`` = the flag line (bound / floor), ``nonfinite`` when the error is
    inf/NaN (drawn at the top of the axis, never as a tiny value). A data-parallel target's rows (gradients
    only, no own error: ``is_ddp_rows``) read their error against the judge (``propagated``) over one
    device's (``floor``)."""
    points = []
    ddp = is_ddp_rows(rows)
    for r in rows.sort_values("order").itertuples():
        own = r.propagated if ddp else r.intrinsic if r.intrinsic == r.intrinsic else r.local
        nonfinite = not math.isfinite(own)  # a finite own error on a non-finite input is not this layer's
        ratio = r.over_floor if math.isfinite(r.over_floor) else (
            own / r.floor if math.isfinite(own) and math.isfinite(r.floor) and r.floor > 0 else math.nan)
        bound = r.bound / r.floor if math.isfinite(r.bound) and math.isfinite(r.floor) and r.floor > 0 else math.nan
        if ddp:
            ratio = own / r.floor if math.isfinite(own) and math.isfinite(r.floor) and r.floor > 0 else math.nan
        name = r.param if ddp else f"{r.layer} ({r.module})" if r.module else r.layer
        points.append({"name": name, "ratio": ratio, "bound": bound,
                       "flagged": bool(r.flagged), "nonfinite": bool(nonfinite),
                       "what": "NaN" if own != own else "inf"})
    return points


def is_ddp_rows(rows) -> bool:
    """A data-parallel target's parity rows: gradients only, no module, no own error."""
    return bool(len(rows)) and bool((rows["kind"] == "grad").all() and (rows["module"] == "").all()
                                    and rows["intrinsic"].isna().all())


def layers_figure(result):
    """Per target: every layer in model order on x, its own error over its floor on a log y, the flag line
    (bound over floor), flagged layers in red and labelled, inf/NaN errors as a marker at the top of the
    axis. The depth at which the error is born reads at a glance."""
    plt = _pyplot()
    rows = result.parity.layers
    targets = list(dict.fromkeys(rows["target"]))
    fig, axes = plt.subplots(len(targets) or 1, 1, figsize=(13, 3.6 * max(1, len(targets))), squeeze=False)
    for ax, target in zip(axes[:, 0], targets):
        mine = rows[rows["target"] == target]
        ddp = is_ddp_rows(mine)
        pts = layer_points(mine if ddp else mine[mine["kind"] == "forward"])
        x = list(range(len(pts)))
        finite = [p["ratio"] for p in pts if not p["nonfinite"] and math.isfinite(p["ratio"]) and p["ratio"] > 0]
        bounds = [p["bound"] for p in pts if math.isfinite(p["bound"])]
        low = min(finite + bounds + [1.0]) / 3
        high = max(finite + bounds + [1.0]) * 30
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ax.plot(x, [p["bound"] if math.isfinite(p["bound"]) else math.nan for p in pts], drawstyle="steps-mid",
                color="k", lw=1, ls="--", label="flag line (the rank check's bound)" if ddp else
                f"flag line ({result.config.tolerances.bound_factor:g} x floor + absolute term)")
        ax.axhline(1.0, color="tab:green", lw=0.8, label="floor (the best at this precision)")
        ok = [(i, p) for i, p in zip(x, pts) if not p["nonfinite"] and math.isfinite(p["ratio"])]
        ax.plot([i for i, _ in ok], [max(p["ratio"], low) for _, p in ok], "-", color="0.6", lw=0.8)
        for flagged, colour, label in ((False, "tab:blue", "gradient error / one device's" if ddp else "own error / floor"),
                                       (True, "tab:red", "flagged layer")):
            sel = [(i, p) for i, p in ok if p["flagged"] == flagged]
            if sel:
                ax.plot([i for i, _ in sel], [max(p["ratio"], low) for _, p in sel], "o", color=colour,
                        ms=6 if flagged else 4, label=label)
        bad = [(i, p) for i, p in zip(x, pts) if p["nonfinite"]]
        if bad:
            ax.plot([i for i, _ in bad], [1.0] * len(bad), "^", ms=11, color="tab:red", clip_on=False,
                    transform=ax.get_xaxis_transform(), label="inf / NaN error (off the scale)")
            for i, p in bad:
                ax.annotate(p["what"], (i, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 8),
                            textcoords="offset points", ha="center", fontsize=8, color="tab:red")
        for i, p in zip(x, pts):  # name the flagged layers on the plot itself
            if p["flagged"]:
                y = 1.0 if p["nonfinite"] else max(p["ratio"], low)
                coords = ("data", "axes fraction") if p["nonfinite"] else "data"
                ax.annotate(p["name"], (i, y), xycoords=coords, xytext=(6, -14 if p["nonfinite"] else 4),
                            textcoords="offset points", fontsize=8, color="tab:red", weight="bold")
        step = max(1, math.ceil(len(pts) / MAX_TICK_LABELS))
        shown = [i for i, p in zip(x, pts) if i % step == 0 or p["flagged"] or p["nonfinite"]]
        ax.set_xticks(shown)
        ax.set_xticklabels([pts[i]["name"] for i in shown], rotation=60, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(pts) - 0.4)
        ax.set_ylabel("DDP gradient error / one device's" if ddp else "own error / floor")
        title = (f"{target}: each parameter's gradient after the all-reduce, against the judge, over one "
                 "device's" if ddp else f"{target}: every layer in model order (red = flagged)")
        ax.set_title(title, fontsize=10, pad=22)
        ax.legend(**LEGEND_OUTSIDE)
    fig.tight_layout()
    return fig


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _pyplot().close(fig)
    return buf.getvalue()
