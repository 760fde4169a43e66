"""One self-contained HTML page per run: verdict, evidence, plots (embedded), worst layers, findings."""

from __future__ import annotations

import base64
import html

from convcheck.report.plots import is_ddp_rows

from convcheck.report.summary import fmt, is_diff, model_line, recipe_line
from convcheck.report.verification import verification_lines

# The page is read in a browser window 1100-1200 px wide (issue 44): the body is at most 1100 px, long words
# (paths, layer names, the verdict's quoted code) wrap anywhere, and a table wider than the page scrolls inside
# its own box (.scroll) rather than the page; the column a table is sorted by is marked (th.sort) and, in
# watch_report.html, shown right after the row's name (tests/report/test_html_width.py renders both in Chromium).
SORT_COLUMN = "own/floor"

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.4em;overflow-wrap:anywhere} h2{font-size:1.1em;margin-top:1.6em}
.verdict{padding:.8em 1em;border-radius:6px;font-size:1.1em;overflow-wrap:anywhere}
.ok{background:#e6f4ea;border:1px solid #34a853}.bad{background:#fce8e6;border:1px solid #d93025}.inconclusive{background:#fef7e0;border:1px solid #f9ab00}
li,p{overflow-wrap:anywhere}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.85em}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:right}
td:first-child,th:first-child,td.l,th.l{text-align:left}td.l{overflow-wrap:anywhere;min-width:8em}
th.sort,td.sort{font-weight:bold;background:#f6f8fa}.flag{color:#d93025;font-weight:bold}
img{max-width:100%} code{background:#f3f3f3;padding:0 .2em}pre{white-space:pre-wrap;overflow-wrap:anywhere}
"""


def render_html(result, images: dict[str, bytes]) -> str:
    e = html.escape
    v = result.verdict
    m = result.model
    cfg = result.config
    command = "convcheck diff" if is_diff(result) else "convcheck compare"
    what = "the recorded runs " if is_diff(result) else ""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{command}: {e(m.name)}</title>"
             f"<style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>{command}: {e(m.name)}, {what}{e(' vs '.join(str(t) for t in cfg.targets))}</h1>")
    parts.append(f"<p class='run'>model {e(model_line(result))}<br>recipe: {e(recipe_line(result))}<br>"
                 f"seed {cfg.seed}; {cfg.steps} steps; batch {cfg.batch_size}; data {e(result.data_source)}; "
                 f"judge {e(str(cfg.judge))} ({e(result.judge_reason)}); envelope {cfg.envelope} runs</p>")
    for note in result.notes:
        parts.append(f"<p><em>note: {e(note)}</em></p>")
    if v is not None:
        cls = "ok" if v.category == "ok" else "bad"
        parts.append(f"<div class='verdict {cls}'><b>Verdict: {e(v.category)}</b> &mdash; {e(v.headline)}</div>")
        if v.evidence:
            parts.append("<h2>Evidence</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in v.evidence) + "</ul>")
        if v.remedies:
            parts.append("<h2>Remedies</h2><ul>" + "".join(f"<li><code>{e(x.text())}</code></li>" for x in v.remedies)
                         + "</ul>")
    parts.append(_verification(result, images))
    for name, title in (("loss.png", "Training"), ("layers.png", "Per-layer error")):
        if name in images:
            data = base64.b64encode(images[name]).decode("ascii")
            parts.append(f"<h2>{title}</h2><img alt='{name}' src='data:image/png;base64,{data}'>")
    parts.append(_layers_table(result))
    parts.append(_findings(result))
    parts.append(f"<p><small>initial weights sha256 {e(result.init_hash[:16])}…; "
                 f"{len(result.batch_hashes)} batches hashed; schema convcheck.summary/2 in summary.json</small></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _verification(result, images: dict[str, bytes]) -> str:
    """The verify stage's lines and, when a remedy was re-run, its before/after loss plot."""
    e = html.escape
    lines = verification_lines(result, snippet=False)
    if not lines:
        return ""
    v = result.verification
    cls = "ok" if v.status == "verified" else "bad"
    out = ["<h2>Verified remedy</h2>",
           f"<div class='verdict {cls}'>" + "<br>".join(e(x) for x in lines) + "</div>"]
    ok = v.verified
    if ok is not None and ok.snippet:
        out.append(f"<p>the change, applied:</p><pre><code>{e(ok.snippet)}</code></pre>")
    if "verify.png" in images:
        data = base64.b64encode(images["verify.png"]).decode("ascii")
        out.append("<p>Before and after: the failing arm as it ran, each re-run with its remedy, and the judge.</p>"
                   f"<img alt='verify.png' src='data:image/png;base64,{data}'>")
    return "\n".join(out)


def _layers_table(result) -> str:
    e = html.escape
    df = result.parity.layers
    if not len(df):
        return ""
    worst = result.parity.worst(10)
    rows = []
    for r in worst.itertuples():
        name = r.layer if r.kind == "forward" else r.param
        module = f" ({e(r.module)})" if r.module else ""
        flag = "<span class='flag'>FLAGGED</span>" if r.flagged else ""
        rows.append(f"<tr><td>{e(r.target)}</td><td class='l'>{e(r.kind)}</td><td class='l'>{e(name)}"
                    f"{module}</td><td>{fmt(r.K)}</td><td>{fmt(r.local)}</td><td>{fmt(r.intrinsic)}</td>"
                    f"<td>{fmt(r.floor)}</td><td class='sort'>{fmt(r.over_floor)}</td><td>{fmt(r.propagated)}</td>"
                    f"<td>{r.nan}/{r.inf}</td><td>{flag}</td></tr>")
    head = "".join(f"<th class='sort'>{h}</th>" if h == SORT_COLUMN else f"<th>{h}</th>"
                   for h in ("target", "kind", "layer (module)", "K", "local", "own", "floor", SORT_COLUMN,
                             "propagated", "nan/inf", ""))
    note = ""
    if any(is_ddp_rows(df[df["target"] == t]) for t in df["target"].unique()):
        note = ("<p><small>A data-parallel target's rows are its gradients after the all-reduce: propagated = "
                "their error against the judge, floor = one device's; no own error per layer (its arithmetic is "
                "the per-rank target's).</small></p>")
    return (f"<h2>Each target's worst {min(10, len(df))} of {len(df)} parity rows, by own error over floor</h2>"
            f"<div class='scroll'><table><tr>{head}</tr>{''.join(rows)}</table></div>{note}")


def _findings(result) -> str:
    e = html.escape
    if not result.findings:
        return "<h2>Environment</h2><p>No audit findings.</p>"
    items = "".join(f"<li><b>{e(f.severity.upper())} {e(f.id)}</b>: {e(f.message)}<br><small>fix: {e(f.remedy)}"
                    f"</small></li>" for f in result.findings)
    return f"<h2>Environment findings</h2><ul>{items}</ul>"
