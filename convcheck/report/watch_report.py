"""The report folder of ``convcheck diff RUN_A RUN_B --out DIR`` on two watched runs, beside ``watch_diff.json``:
the three tables of ``analysis/tables.py`` as CSV (``watch_layers.csv``, ``watch_snapshots.csv``,
``watch_grads.csv``) and one self-contained ``watch_report.html``: the diff's lines (verdict included), the loss
and the global gradient norm of both runs per step (PNG plots embedded), and each table's worst rows first
(``SHOWN`` at most, the rest counted: every row is in its CSV). Every text that comes from a run (paths, layer
and parameter names, dtypes, the lines) is HTML-escaped: layer names are whatever the user's model called them.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from convcheck.files import atomic_write_text, check_writable_file
from convcheck.runformat import statistics as _declared

TABLE_FILES = (("layers", "watch_layers.csv"), ("snapshots", "watch_snapshots.csv"), ("grads", "watch_grads.csv"))
HTML_FILE = "watch_report.html"
REPORT_FILES = tuple(name for _, name in TABLE_FILES) + (HTML_FILE,)  # beside watch_diff.json
SHOWN = 50  # rows of each table on the page, worst first
TEXT_COLUMNS = {"layer", "dtype_a", "dtype_b", "kind", "name", "key", "shape", "param"}  # the rest are numbers
# The column(s) a table's rows are ordered by (``badness``): on the page they follow the row's step and name,
# marked, so they stay in view in a window 1200 px wide however many columns follow (the CSV keeps its order).
SORT_COLUMNS = {"layers": ("worst_rel",), "snapshots": ("rel_l2_err",), "grads": ("norm_ratio", "cosine")}
NAME_COLUMNS = ("step", "layer", "kind", "name", "key", "param")

_CSS_EXTRA = """
pre.lines{white-space:pre-wrap;overflow-wrap:anywhere;font-size:.9em;margin:0}
"""
_TITLES = {
    "layers": ("Layer statistics, B against A (every step)",
               "Each statistic's relative error |b - a| / max(|a|, |b|) at each step, from steps.jsonl; worst_rel is "
               "the larger of max_abs_rel and std_rel (inf when the NaN/Inf counts differ). Worst first."),
    "snapshots": ("Tensors at the snapshot steps, B against A",
                  "Each layer input, output and parameter gradient both runs saved, element by element in float64: "
                  "cosine similarity, max |b - a|, max |b - a| over the largest |value| of either tensor, and "
                  "||b - a|| / max(||a||, ||b||). Ordered by the relative L2 error, worst first."),
    "grads": ("Gradients, B against A",
              "Each parameter's gradient norm per step (B/A), the cosine of the two gradients at the snapshot steps, "
              "and each run's update |w[k+1] - w[k]| / |w[k]| where it snapshotted both steps. Ordered by the larger "
              "of |ln(norm ratio)| and the angle between the gradients, worst first."),
}


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def badness(table: str, row: dict) -> float:
    """How far apart a row says the runs are, to show the worst first: -1 for a row with no number."""
    if table == "layers":
        v = row["worst_rel"]
    elif table == "snapshots":
        v = math.inf if row["nonfinite_a"] != row["nonfinite_b"] else row["rel_l2_err"]
    else:
        r, c = row["norm_ratio"], row["cosine"]
        parts = []
        if r is not None:
            parts.append(math.inf if r == 0 or math.isinf(r) else abs(math.log(r)))
        if c is not None:
            parts.append(math.acos(max(-1.0, min(1.0, c))))
        v = max(parts) if parts else None
    return -1.0 if v is None or v != v else v


def worst(table, n: int = SHOWN) -> list[dict]:
    """The table's ``n`` worst rows (``badness``), ties in the table's own order (step, then model order)."""
    order = sorted(range(len(table.rows)), key=lambda i: -badness(table.name, table.rows[i]))
    return [table.rows[i] for i in order[:n]]


def cell_html(v, digits: int = 3) -> str:
    """One cell as HTML: numbers as the terminal report shows them (``report.summary.fmt``), text escaped."""
    from convcheck.report.summary import fmt

    if isinstance(v, str):
        return _e(v)
    return _e(fmt(v, digits))


def column_meanings(table_name: str) -> dict[str, tuple[str, int]]:
    """``{column: (what it means, significant digits)}`` of the layer table's statistic columns, from their
    declarations (``runformat/statistics.py``): the page's header tooltips and cell formats."""
    if table_name != "layers":
        return {}
    out = {}
    for s in _declared.declared():
        out.update({f"{s.name}_{side}": (f"{s.title} of run {side.upper()}", s.digits) for side in "ab"})
        out[f"{s.name}_rel"] = (f"{s.title}: relative error |b - a| / max(|a|, |b|)", s.digits)
    return out


def page_columns(table) -> list[str]:
    """The table's columns in the page's order: the row's step and name, the column(s) it is sorted by, the
    rest as in the CSV."""
    sort = [c for c in SORT_COLUMNS.get(table.name, ()) if c in table.columns]
    names = [c for c in table.columns if c in NAME_COLUMNS]
    return names + sort + [c for c in table.columns if c not in names and c not in sort]


def table_html(table, n: int = SHOWN) -> str:
    """A table's heading, what its columns mean, its worst ``n`` rows and how many were left out (and what the
    table itself left out, ``Table.skipped``)."""
    title, what = _TITLES.get(table.name, (table.name, ""))
    file = dict(TABLE_FILES).get(table.name, "")
    rows = worst(table, n)
    columns = page_columns(table)
    sort = SORT_COLUMNS.get(table.name, ())
    side = {c: " class='l'" if c in TEXT_COLUMNS else " class='sort'" if c in sort else "" for c in columns}
    meaning = column_meanings(table.name)  # a declared statistic's title and digits
    tip = {c: f" title='{_e(meaning[c][0])}'" if c in meaning else "" for c in columns}
    digits = {c: meaning[c][1] if c in meaning else 3 for c in columns}
    head = "".join(f"<th{side[c]}{tip[c]}>{_e(c)}</th>" for c in columns)  # text left, numbers right, sort marked
    body = "".join("<tr>" + "".join(f"<td{side[c]}>{cell_html(r[c], digits[c])}</td>" for c in columns) + "</tr>"
                   for r in rows)
    out = [f"<h2>{_e(title)}</h2>", f"<p><small>{_e(what)}</small></p>"]
    if rows:
        out.append(f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>")
    else:
        out.append("<p>No rows.</p>")
    left = len(table.rows) - len(rows)
    if left:
        out.append(f"<p><small>the worst {len(rows)} of {len(table.rows)} rows; {left} more left out here, all in "
                   f"{_e(file)}</small></p>")
    out += [f"<p><small>not compared: {_e(s)}</small></p>" for s in table.skipped]
    return "\n".join(out)


def _series(values) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def curve_png(curves: dict, what: str, ylabel: str, title: str) -> bytes | None:
    """A and B's ``what`` (``loss`` or ``grad_norm``) per step as PNG bytes; None when neither run has a
    finite value of it. A non-finite step draws nothing: it is marked with an x at the top of the axis."""
    from matplotlib.ticker import MaxNLocator

    from convcheck.report.plots import LEGEND_OUTSIDE, _pyplot, figure_png, loss_scale

    data = {side: _series(c[what]) for side, c in curves.items()}
    finite = [v for ys in data.values() for v in ys if math.isfinite(v)]
    if not finite:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for side, ys in data.items():
        line, = ax.plot(range(len(ys)), ys, marker="." if len(ys) < 50 else None, label=f"{side}",
                        ls="-" if side == "A" else "--")
        bad = [k for k, v in enumerate(curves[side][what]) if v is not None and not math.isfinite(v)]
        if bad:
            ax.plot(bad, [1.0] * len(bad), "x", ms=8, mew=2, color=line.get_color(), clip_on=False,
                    transform=ax.get_xaxis_transform(), label=f"{side}: non-finite ({len(bad)} steps)")
    scale = loss_scale(finite) if what == "loss" else ("log" if min(finite) > 0 and max(finite) / min(finite) > 1e3
                                                       else "linear")
    ax.set_yscale(scale)
    ax.set(xlabel="step", ylabel=f"{ylabel} ({scale} scale)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.legend(**LEGEND_OUTSIDE)
    fig.tight_layout()
    return figure_png(fig)


def render_images(tables) -> dict[str, bytes]:
    """``loss.png`` and ``grad_norm.png`` of the pair (each left out when neither run has a value to draw)."""
    out = {}
    for name, what, label, title in (("loss.png", "loss", "loss", "Loss per step"),
                                     ("grad_norm.png", "grad_norm", "global gradient norm",
                                      "Global gradient norm per step (sqrt of the sum of squares of grad_norms)")):
        png = curve_png(tables.curves, what, label, title)
        if png is not None:
            out[name] = png
    return out


def render_watch_report(diff, tables, images: dict[str, bytes] | None = None) -> str:
    """The page: the diff's lines, the two plots, the three tables worst first. ``images``: the plots as
    ``render_images`` makes them (made here when None)."""
    from convcheck.report.html import _CSS

    images = render_images(tables) if images is None else images
    v = diff.verdict
    cls = {"ok": "ok", "inconclusive": "inconclusive"}.get(v.category if v is not None else None, "bad")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>convcheck diff: {_e(diff.a)} vs "
             f"{_e(diff.b)}</title><style>{_CSS}{_CSS_EXTRA}</style></head><body>",
             "<h1>convcheck diff: two watched runs</h1>",
             f"<p>A = <code>{_e(diff.a)}</code> ({diff.steps[0]} steps)<br>B = <code>{_e(diff.b)}</code> "
             f"({diff.steps[1]} steps)</p>",
             f"<div class='verdict {cls}'><pre class='lines'>{_e(chr(10).join(diff.lines()))}</pre></div>"]
    for name, title, missing in (("loss.png", "Loss", "no loss recorded: w.step() was called without it"),
                                 ("grad_norm.png", "Global gradient norm", "no finite gradient norm recorded")):
        parts.append(f"<h2>{title}</h2>")
        if name in images:
            data = base64.b64encode(images[name]).decode("ascii")
            parts.append(f"<img alt='{name}' src='data:image/png;base64,{data}'>")
        else:
            parts.append(f"<p>{_e(missing)}</p>")
    parts += [table_html(t) for t in tables.tables()]
    parts.append("<p><small>every row of each table is in its CSV file beside this page: "
                 + ", ".join(_e(f) for _, f in TABLE_FILES) + "</small></p></body></html>")
    return "\n".join(parts)


def write_watch_report(folder: Path, diff, tables, *, force: bool) -> list[Path]:
    """The three CSV files and ``watch_report.html`` in ``folder`` (each checked by ``check_writable_file``:
    a file there replaced only with ``force``, never a link, FIFO or device), each written atomically."""
    written = []
    for name, file in TABLE_FILES:
        path = check_writable_file(Path(folder) / file, force=force, what="--out")
        written.append(atomic_write_text(path, getattr(tables, name).csv()))
    path = check_writable_file(Path(folder) / HTML_FILE, force=force, what="--out")
    written.append(atomic_write_text(path, render_watch_report(diff, tables)))
    return written
