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

from convcheck.diagnose.target_symptoms import ends_apart
from convcheck.report.verdict_lines import PROSE_INDENT, PROSE_WIDTH, unwrap_prose, verdict_lines, wrap_prose
from convcheck.numerics.thresholds import CONVERGENCE_MIN_STEPS
from convcheck.report.console import is_plain, is_tty
from convcheck.report.shared import training_rule
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


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "-"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0:
        return "0"
    if 1e-3 <= abs(f) < 1e4:
        return f"{f:.{digits + 2}g}"
    return f"{f:.{digits}e}"


def optimizer_settings(result) -> dict:
    """The optimizer's settings as built (momentum, nesterov, betas, eps, weight decay): its defaults read from
    one built on a dummy parameter, so an SGD's implicit momentum 0.9 shows; the config's values where the
    optimizer cannot be built here (a user factory that fails, no torch)."""
    cfg, recipe = result.config, result.recipe
    given = {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov, "betas": cfg.betas, "eps": cfg.eps,
             "weight_decay": cfg.weight_decay}
    if recipe is None:
        return given
    try:
        import torch

        built = recipe.make_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults
    except Exception:  # noqa: BLE001 - the user's factory; the config says what was asked
        return given
    return {k: built.get(k, v) for k, v in given.items()}


def recipe_line(result) -> str:
    """``loss cross-entropy; sgd lr 0.05 (momentum 0.9, nesterov, weight decay 0.0005); schedule cosine + 5
    warm-up steps; clip grad norm 1``: the training recipe as run."""
    cfg, recipe = result.config, result.recipe
    settings = optimizer_settings(result)
    extras = [f"{k.replace('_', ' ')} {settings[k]:g}" for k in ("momentum", "weight_decay", "eps")
              if isinstance(settings.get(k), (int, float)) and not isinstance(settings.get(k), bool)
              and settings[k] and (k != "eps" or cfg.eps)]
    extras += ["nesterov"] if settings.get("nesterov") else []
    betas = settings.get("betas") if cfg.betas else None
    extras += [f"betas {betas[0]:g},{betas[1]:g}"] if betas else []
    lr = settings.get("lr") if isinstance(settings.get("lr"), (int, float)) else cfg.lr  # a factory's own lr
    opt = f"{cfg.optimizer if isinstance(cfg.optimizer, str) else recipe.optimizer_name} lr {lr:g}"
    parts = [f"loss {recipe.loss_name if recipe else 'cross-entropy'}", opt + (f" ({', '.join(extras)})" if extras
                                                                                else "")]
    schedule = recipe.schedule_name if recipe else cfg.schedule
    if cfg.warmup and "warm" not in str(schedule):
        schedule = f"{schedule} + {cfg.warmup} warm-up steps"
    parts.append(f"schedule {schedule}")
    if cfg.clip_grad_norm:
        parts.append(f"clip grad norm {cfg.clip_grad_norm:g}")
    return "; ".join(parts)


def model_line(result) -> str:
    """``lenet (zoo, input 1x28x28, 10 classes)``: the model and what it reads, as both reports head them."""
    m = result.model
    shape = f"input {'x'.join(map(str, m.input_shape))}" if m.input_shape else "input shape from the data"
    seen = (result.data_stats or {}).get("y_distinct") if isinstance(result.data_stats, dict) else None
    if m.num_classes:
        classes = f"{m.num_classes} classes"
    elif m.task != "classification":
        classes = m.task
    else:
        classes = f"{seen} classes seen in the data" if seen else "classes from the data"
    return f"{m.name} ({m.source}, {shape}, {classes})"


DIFF_NOTE = "a diff of the recorded runs"  # cli/diff.py's note on a diff's result: the reports title it so


def is_diff(result) -> bool:
    """A comparison of two recorded bundles (``convcheck diff``, ``compare --against``)."""
    return result.model.source == "bundle" or getattr(result, "diff_of", None) is not None


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


def training_states(result) -> dict[str, str]:
    """Each trained arm's outcome in the words the terminal and ``assert_parity`` both use (plain text):
    ``converged (loss 2.297 -> 0.134)``, ``trained, convergence not judged from 4 step(s) (...)``."""
    judged = result.config.steps >= CONVERGENCE_MIN_STEPS
    states = {}
    judge = result.training.outcomes.get(result.config.judge)
    # an ok verdict while the float64 judge itself has not converged: the run was too short to tell (issue 44)
    too_short = (judged and judge is not None and not judge.converged and math.isfinite(judge.final_loss)
                 and getattr(result.verdict, "category", None) == "ok")
    for name, info in named(result.training.outcomes).items():
        state = "converged" if info.converged else "did not converge"
        if not judged and math.isfinite(info.final_loss):
            state = f"trained, convergence not judged from {result.config.steps} step(s)"
        elif too_short and not info.converged and math.isfinite(info.final_loss):
            state = f"convergence not judged: {result.config.steps} steps, too few for the judge"
        extra = ""
        if (judged and info.converged and judge is not None and judge.converged and name != str(result.config.judge)
                and ends_apart(info.final_loss, judge.final_loss, judge.first_loss)):
            # the convergence rule is relative: a bf16 arm at 51 -> 27 converges by it, the judge ends at 0.75
            extra += f", but ends {info.final_loss / judge.final_loss:.3g}x the judge's {fmt(judge.final_loss, 3)}"
        if info.first_nonfinite_step is not None:
            extra += f", first non-finite at step {info.first_nonfinite_step}"
        if info.skipped_steps:
            extra += f", {info.skipped_steps} steps skipped by GradScaler (scale {fmt(info.final_loss_scale)})"
        if info.first_loss is None or info.first_loss != info.first_loss:
            losses = "no loss recorded" + extra
        else:
            losses = f"loss {fmt(info.first_loss, 3)} -> {fmt(info.final_loss, 3)}{extra}"
        states[name] = f"{state} ({losses})"
    return states


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
