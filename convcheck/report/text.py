"""The terminal summary of a comparison: readable at a glance.

Rich tables and colour on a terminal; the same tables as plain text when the
output is not a terminal or ``NO_COLOR`` is set.
"""

from __future__ import annotations

import math
import os
import sys

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from convcheck.report.verdict_lines import PROSE_WIDTH, verdict_lines, wrap_prose
from convcheck.report.console import is_plain, is_tty
from convcheck.report.shared import training_rule
from convcheck.report.summary import fmt, is_diff, model_line, recipe_line, training_states
from convcheck.report.verification import verification_lines
from convcheck.measure.table_schema import named

WORST_LAYERS = 8
CURVE_ROWS = 10
PIPED_WIDTH = 140  # the width when the output is not a terminal and COLUMNS is not set
NAME_MIN_WIDTH = 16  # a longer layer name wraps (folded) in a narrow table, never cut


def output_width(file, environ=None) -> int | None:
    """The width to render for: ``COLUMNS`` when it is set (a terminal or a pipe), else the terminal's own
    width (None: rich asks it), else ``PIPED_WIDTH``."""
    environ = os.environ if environ is None else environ
    columns = environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) >= 40:
        return int(columns)
    return None if is_tty(file) else PIPED_WIDTH


def make_console(file=None, width: int | None = None) -> Console:
    file = file or sys.stdout
    plain = is_plain(file)
    return Console(file=file, force_terminal=not plain, no_color=plain, highlight=False,
                   width=width or output_width(file), soft_wrap=False)


def _fit(c: Console, build, optional: list[str]) -> Table:
    """The table that fits ``c``'s width: ``build(dropped, tight)`` as it is when its natural width fits;
    else with ``tight`` (every column but the wrapping ones fixed at its narrowest, so rich never crops a
    number); else dropping the ``optional`` columns in order (the least useful first). The last try is kept
    when nothing fits."""
    unbounded = c.options.update(width=10_000)  # measured against the console's width, a size is capped
    dropped: list[str] = []
    for name in [*optional, None]:
        table = build(dropped, False)
        if c.measure(table, options=unbounded).maximum <= c.width:
            return table
        table = build(dropped, True)
        if c.measure(table, options=unbounded).maximum <= c.width or name is None:
            return table
        dropped.append(name)
    return table


def _title(c: Console, text: str) -> None:
    """A table's title on its own lines, wrapped at words to the console's width."""
    c.print(f"[bold]{escape(text)}[/bold]" if not is_plain(c.file) else escape(text))


def render_compare(result, console: Console | None = None) -> None:
    c = console or make_console()
    cfg = result.config
    command = "convcheck diff" if is_diff(result) else "convcheck compare"
    _wrapped_parts(c, "", [command, f"model {model_line(result)}", f"seed {cfg.seed}", f"{cfg.steps} steps",
                           f"batch {cfg.batch_size}", f"data {result.data_source}"], "  ")
    _wrapped_parts(c, "recipe: ", recipe_line(result).split("; "), "; ")
    c.print(f"judge {escape(str(cfg.judge))}: {escape(result.judge_reason)}")
    if getattr(result, "threads", None) is not None:
        c.print(escape(result.threads.line()))
    for note in result.notes:
        first, *more = wrap_prose(f"note: {note}", prose_width(c))
        c.print(f"[yellow]note:[/yellow] {escape(first[len('note: '):])}", soft_wrap=True)
        for line in more:
            c.print(escape(line), soft_wrap=True)
    _targets(c, result)
    _layers(c, result)
    _curves(c, result)
    _training(c, result)
    _verdict(c, result)


def _wrapped_parts(c: Console, lead: str, parts: list[str], sep: str) -> None:
    """``lead`` + ``parts`` joined by ``sep``, broken between parts (never inside one) at the console's width;
    the continuation lines indented under the first part."""
    lines, line = [], lead
    for i, part in enumerate(parts):
        piece = part + (sep.rstrip() if i < len(parts) - 1 else "")
        if line != lead and len(line.rstrip()) + len(sep) - len(sep.rstrip()) + len(piece) > c.width:
            lines.append(line.rstrip())
            line = " " * len(lead)
        elif line != lead and not line.endswith(" "):
            line += " "
        line += piece + (" " * (len(sep) - len(sep.rstrip())) if i < len(parts) - 1 else "")
    lines.append(line.rstrip())
    for text in lines:
        c.print(escape(text), soft_wrap=True)


def _targets(c: Console, result) -> None:
    _title(c, "Targets")
    t = Table(box=box.SIMPLE, pad_edge=False)
    for col in ("arm", "target", "precision", "unit roundoff"):
        t.add_column(col)
    a, b = result.config.targets
    for label, tgt in (("A", a), ("B", b), ("judge", result.config.judge)):
        t.add_row(label, str(tgt), tgt.runner.describe(), fmt(tgt.unit_roundoff))
    c.print(t)


LAYER_COLUMNS_DROPPED_FIRST = ("own", "propagated", "local", "kind", "floor")


def _layers(c: Console, result) -> None:
    p = result.parity
    df = p.layers
    if not len(df):
        return
    worst = p.worst(WORST_LAYERS)
    _title(c, f"One-step parity against the judge: each target's {WORST_LAYERS} worst of {len(df)} layer/gradient "
              "rows, by own error over floor (local = judge input through the target's layer; floor = the best "
              "at its precision)")
    # a data-parallel target's gradient rows name no module (they hold the all-reduced gradient): no "()"
    names = [f"{r.layer if r.kind == 'forward' else r.param}" + (f" ({r.module})" if r.module else "")
             for r in worst.itertuples()]
    nonfinite = bool((worst["nan"] + worst["inf"]).any())  # the column only when something is non-finite
    own_measured = bool(worst["intrinsic"].notna().any())
    # an unmeasured own error (all "-") goes first; the flag, the target, the name and own/floor never go
    optional = [col for col in LAYER_COLUMNS_DROPPED_FIRST if col != "own" or not own_measured]
    if not own_measured:
        optional.insert(0, "own")
    t = _fit(c, lambda dropped, tight: _layer_table(worst, names, nonfinite, dropped, tight), optional)
    c.print(t)
    firsts = ", ".join(f"{escape(tgt)}: [bold]{escape(layer or 'none')}[/bold]"
                       for tgt, layer in named(p.first_flagged).items())
    c.print(f"First flagged layer  {firsts}")


def _layer_table(worst, names: list[str], nonfinite: bool, dropped: list[str], tight: bool) -> Table:
    numbers = [col for col in ("local", "own", "floor", "own/floor", "propagated") if col not in dropped]
    columns = ["target", *(("kind",) if "kind" not in dropped else ()), "layer (module)", *numbers,
               *(("nan/inf",) if nonfinite else ()), "flag"]
    rows = []
    for r, name in zip(worst.itertuples(), names):
        values = {"local": r.local, "own": r.intrinsic, "floor": r.floor, "own/floor": r.over_floor,
                  "propagated": r.propagated}
        row = [escape(str(r.target))]
        if "kind" in columns:
            row.append("fwd" if r.kind == "forward" else "grad")
        row.append(escape(name))
        row += [fmt(values[col]) for col in numbers]
        row += [f"{r.nan}/{r.inf}"] if nonfinite else []
        row.append("[bold red]FLAGGED[/bold red]" if r.flagged else "")
        rows.append(row)
    t = Table(box=box.SIMPLE, pad_edge=False)
    for i, col in enumerate(columns):
        if col == "layer (module)":
            # Names are what the reader acts on: never cut short; a narrow table wraps them
            longest = max([len(col)] + [len(n) for n in names])
            t.add_column(col, min_width=min(longest, NAME_MIN_WIDTH), overflow="fold",
                         max_width=NAME_MIN_WIDTH if tight else None)
        else:
            width = "FLAGGED" if col == "flag" else max([col] + [Text.from_markup(r[i]).plain for r in rows], key=len)
            t.add_column(col, justify="right" if col in numbers else "left", no_wrap=True, min_width=len(width),
                         width=len(width) if tight else None)
    for row in rows:
        t.add_row(*row)
    return t


def _curves(c: Console, result) -> None:
    tr = result.training
    curves = tr.curves
    if not len(curves):
        return
    steps = sorted(curves["step"].unique())
    stride = max(1, math.ceil(len(steps) / CURVE_ROWS))
    shown = steps[::stride]
    if steps[-1] not in shown:
        shown.append(steps[-1])
    _title(c, "Loss per step (all arms start from the same weights and see the same batches)")
    # the loss columns and the two the drift verdict reads stay; the targets' distance to the judge goes first
    t = _fit(c, lambda dropped, tight: _curve_table(result, shown, dropped, tight), ["dist-judge", "envelope"])
    c.print(t)


def _curve_table(result, shown, dropped: list[str], tight: bool) -> Table:
    tr = result.training
    curves = tr.curves
    main_arms = [a for a in tr.arms if a.role != "envelope"]
    env_arms = [a for a in tr.arms if a.role == "envelope"] if "envelope" not in dropped else []
    headers = ["step"] + [a.name for a in main_arms]
    if env_arms:
        headers.append(f"envelope {env_arms[0].reference} (min..max of {len(env_arms)})")
    judge_dist = [x for x in main_arms if x.role == "target"] if "dist-judge" not in dropped else []
    headers += [f"dist {a.name}-judge" for a in judge_dist]
    # The drift verdict compares the targets' parameter distance with the envelope runs' spread:
    # show both, so the table and the verdict read the same numbers.
    pair = _drift_pair(result) if any(a.role == "envelope" for a in tr.arms) else None
    if pair is not None:
        headers += [f"dist {pair[0]}-{pair[1]}", "envelope spread (dist)"]
        other = curves[curves["arm"] == pair[0]].set_index("step")["dist_other"]
        spread = curves[curves["role"] == "envelope"].groupby("step")["dist_ref"].max()
    loss = curves.pivot(index="step", columns="arm", values="loss")
    dist = curves.pivot(index="step", columns="arm", values="dist_judge")
    rows = []
    for s in shown:
        row = [str(s)] + [fmt(loss.at[s, a.name], 3) for a in main_arms]
        if env_arms:
            vals = [loss.at[s, a.name] for a in env_arms]
            row.append(f"{fmt(min(vals), 3)}..{fmt(max(vals), 3)}")
        row += [fmt(dist.at[s, a.name]) for a in judge_dist]
        if pair is not None:
            row += [fmt(other.get(s)), fmt(spread.get(s))]
        rows.append(row)
    t = Table(box=box.SIMPLE, pad_edge=False)
    for i, header in enumerate(headers):
        # numbers are never cut or wrapped; a long heading wraps at its spaces (folded past a long word)
        longest = max([len(r[i]) for r in rows] + [max(len(w) for w in header.split())])
        t.add_column(header, justify="right", min_width=longest, overflow="fold", width=longest if tight else None)
    for row in rows:
        t.add_row(*row)
    return t


def _drift_pair(result) -> tuple[str, str] | None:
    """The two targets as the drift rule pairs them (a target arm first, the judge last)."""
    judge = str(result.config.judge)
    names = sorted((str(x) for x in result.config.targets), key=lambda n: n == judge)
    return (names[0], names[1]) if len(names) == 2 else None


def _training(c: Console, result) -> None:
    c.print("Training  [dim](" + training_rule(result.config) + ")[/dim]")
    for name, state in training_states(result).items():
        state = escape(state)
        for word, colour in (("converged (", "green"), ("did not converge", "red")):
            if state.startswith(word):
                state = f"[{colour}]{word.rstrip(' (')}[/{colour}]" + state[len(word.rstrip(" (")):]
        c.print(f"  {escape(name):<18} {state}")


def prose_width(c: Console, environ=None) -> int:
    """The width prose (the verdict, its evidence and remedies) is wrapped to: ``COLUMNS`` when it is set, else
    the terminal's, else ``PROSE_WIDTH`` (piped: the tables' ``PIPED_WIDTH`` is for tables, which stay whole)."""
    environ = os.environ if environ is None else environ
    columns = environ.get("COLUMNS", "").strip()
    if (columns.isdigit() and int(columns) >= 40) or is_tty(c.file):
        return c.width
    return min(c.width, PROSE_WIDTH)


def _verdict(c: Console, result) -> None:
    v = result.verdict
    if v is None:
        return
    colour = {"ok": "green", "inconclusive": "yellow"}.get(v.category, "red")
    c.print()
    # Headline, evidence and remedies quote code (E[x^2]) and layer names: print them literally. Wrapped at
    # spaces to the prose width, each continuation indented PROSE_INDENT, so unwrap_prose gives the lines back
    # (summary.json holds them whole, for grep).
    width = prose_width(c)
    head, *rest = verdict_lines(v, "compare")
    word = f"Verdict: {v.category}"
    first, *more = wrap_prose(head, width)
    c.print(f"[bold {colour}]{word}[/bold {colour}]{escape(first[len(word):])}", soft_wrap=True)
    for line in more + [w for line in rest for w in wrap_prose(line, width)]:
        c.print(escape(line), soft_wrap=True)
    for line in verification_lines(result):
        # the code of a remedy (indented) is printed as it is, never broken
        for w in ([f"  {line}"] if line.startswith("  ") else wrap_prose(f"  {line}", width)):
            c.print(escape(w), soft_wrap=True)
