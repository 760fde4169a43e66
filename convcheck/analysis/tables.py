"""The tables people expect from a dump diff of two watched runs, B against A (issue 35): pure computation,
no verdict (``diff.py`` decides) and no files (``report/watch_report.py`` and ``convcheck diff --csv`` write them).

- ``layer_rows``: every aligned step (index k of both runs) and every layer both recorded at it: the relative
  error of each output statistic of ``steps.jsonl`` (max |x|, mean, std, fraction of zeros, smallest nonzero
  |x|), beside each side's NaN/Inf counts and, for a layer called several times in the step (a recurrent cell),
  each side's call count, worst call and first non-finite call. Cheap: every step has it. Its columns are the
  declared statistics' (``runformat/statistics.py``: ``layer_columns``), so a statistic declared there is tabled
  with nothing edited here.
- ``snapshot_rows``: every step both runs snapshotted, every layer input (``in/``), output (``out/``) and
  parameter gradient (``grad/``) both hold with the same shape: cosine similarity, max absolute error, max
  relative error and relative L2 error, element by element in float64. Arrays in one run only, or of other
  shapes, are left out and counted (``Table.skipped``).
- ``grad_rows``: every aligned step and parameter: the gradient-norm ratio B/A, at snapshot steps the cosine of
  the two gradients, and each run's update ratio |w[k+1] - w[k]| / |w[k]| where it snapshotted k and k+1.

Every relative error is ``|b - a| / max(|a|, |b|)`` (symmetric: A is no better than B, and the value stays in
[0, 2]); 0 when equal. A cell with no number to give (a statistic one run lacks, a NaN statistic, no finite
element to compare) is ``None`` (an empty CSV cell), an infinite one ``inf``: never a crash, never a number that
hides a non-finite value.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass, field

import numpy as np

from convcheck.diagnose.detectors.watched_setup import global_norm
from convcheck.runformat import statistics as _declared
from convcheck.runformat.reader import WatchedRun, open_watched


def layer_columns() -> tuple:
    """The layer table's columns: the row's step, layer and dtypes, then each declared statistic's (its per-side
    values ``<name>_a``, ``<name>_b`` and/or its relative error ``<name>_rel``, in declaration order), then
    ``worst_rel``."""
    cols = ["step", "layer", "dtype_a", "dtype_b"]
    for s in _declared.declared():
        cols += [f"{s.name}_a", f"{s.name}_b"] if s.sides else []
        cols += [f"{s.name}_rel"] if s.compared else []
    return (*cols, "worst_rel")


def stats_compared() -> tuple:
    """The statistics whose relative error is tabled, in declaration order."""
    return tuple(s.name for s in _declared.declared() if s.compared)


STATS = stats_compared()  # the core ones (a statistic declared later is read through ``stats_compared``)
LAYER_COLUMNS = layer_columns()
SNAPSHOT_COLUMNS = ("step", "kind", "name", "key", "shape", "dtype_a", "dtype_b", "cosine", "max_abs_err",
                    "max_rel_err", "rel_l2_err", "nonfinite_a", "nonfinite_b")
GRAD_COLUMNS = ("step", "param", "norm_a", "norm_b", "norm_ratio", "cosine", "update_ratio_a", "update_ratio_b")
KINDS = {"in": "input", "out": "output", "grad": "grad"}  # snapshot key prefix -> the table's ``kind``
EXAMPLES = 3  # how many left-out keys a ``skipped`` line names


@dataclass(frozen=True)
class Table:
    """One table: its column names (stable, in order), its rows (dicts with exactly those keys) and what was
    left out of it, one line each."""

    name: str
    columns: tuple
    rows: list
    skipped: tuple = ()

    def csv(self) -> str:
        """The table as CSV text: a header, one line per row; None (and NaN) an empty cell, infinities
        ``inf``/``-inf``, floats in full precision."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.columns)
        for r in self.rows:
            w.writerow([cell(r[c]) for c in self.columns])
        return buf.getvalue()


@dataclass(frozen=True)
class WatchTables:
    """The three tables of a pair, and each run's curves per step (``"loss"``, ``"grad_norm"``: the global
    gradient norm, sqrt of the sum of squares of ``grad_norms``) keyed ``"A"``, ``"B"``."""

    layers: Table
    snapshots: Table
    grads: Table
    curves: dict = field(default_factory=dict)

    def tables(self) -> tuple:
        return self.layers, self.snapshots, self.grads


def cell(v) -> str:
    """One CSV cell: ``""`` for None or NaN, ``inf``/``-inf``, ``repr`` of a float (every digit), else ``str``."""
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    return str(v)


def relative(a, b) -> float | None:
    """``|b - a| / max(|a|, |b|)``: 0 when equal (both 0, both None, the same infinity), ``inf`` when one is
    infinite and they differ, None when only one has a value or either is NaN (nothing to compare)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return None
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return None
    if a == b:
        return 0.0
    if math.isinf(a) or math.isinf(b):
        return math.inf
    scale = max(abs(a), abs(b))
    return abs(b / scale - a / scale)  # divided first: 1e308 against -1e308 is 2, not inf


def ratio(a, b) -> float | None:
    """``b / a`` of two norms: 1 when equal (both 0 included), ``inf`` when only A's is 0 or only B's is
    infinite, 0 when only A's is infinite, None when either is missing or NaN."""
    if a is None or b is None:
        return None
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return None
    if a == b:
        return 1.0
    if math.isinf(a) or math.isinf(b):
        return 0.0 if math.isinf(a) else math.inf
    return b / a if a != 0 else math.inf


def _run(x) -> WatchedRun:
    return x if isinstance(x, WatchedRun) else open_watched(x)


def _aligned(a: WatchedRun, b: WatchedRun) -> int:
    return min(len(a.steps), len(b.steps))


def layer_rows(a, b) -> Table:
    """Per aligned step and per layer both runs recorded at it (A's order): each declared statistic's ``relative``
    error, B against A, and each side's own values where it is tabled per side (NaN/Inf counts, calls).
    ``worst_rel`` (what the report sorts by): the largest error of the ``scale`` family (max |x|, std: scale-free,
    where a mean, a fraction of zeros or the smallest nonzero |x| near 0 reads a rounding difference as ~100%),
    ``inf`` when the NaN/Inf counts differ. The statistics are of the finite elements (``watch/stats.py``): a
    side with none (every element NaN or Inf) has no ``max_abs`` and every ``*_rel`` cell of the row is empty.
    A layer called several times in a step is one row of each run (its statistics over all its calls,
    ``calls_a``/``calls_b``; the call with the largest max |x| ``worst_call_*``, the first NaN/Inf one
    ``nonfinite_call_*``); a row of one call, or from a run recorded before them, shows call 0 / none."""
    a, b = _run(a), _run(b)
    declared = _declared.declared()
    scale = [s.name for s in declared if s.family == "scale" and s.compared]
    counts = [s.name for s in declared if s.family == "count"]
    rows, one_side = [], {}
    for k in range(_aligned(a, b)):
        la, lb = a.steps[k]["layers"], b.steps[k]["layers"]
        for name in [n for n in la if n not in lb] + [n for n in lb if n not in la]:
            one_side.setdefault(name, k)
        for name, ra in la.items():
            rb = lb.get(name)
            if rb is None:
                continue
            none = _all_nonfinite(ra) or _all_nonfinite(rb)  # statistics of no element: nothing to compare
            row = {"step": k, "layer": name, "dtype_a": ra["dtype"], "dtype_b": rb["dtype"]}
            for s in declared:
                if s.sides:
                    row.update({f"{s.name}_{side}": _side_value(s, r) for side, r in (("a", ra), ("b", rb))})
                if s.compared:
                    row[f"{s.name}_rel"] = None if none else relative(ra.get(s.name), rb.get(s.name))
            scalefree = [row[f"{s}_rel"] for s in scale if row[f"{s}_rel"] is not None]
            row["worst_rel"] = (math.inf if [ra[c] for c in counts] != [rb[c] for c in counts]
                                else max(scalefree) if scalefree else None)
            rows.append(row)
    skipped = ()
    if one_side:
        names = ", ".join(sorted(one_side)[:EXAMPLES]) + (", ..." if len(one_side) > EXAMPLES else "")
        skipped = (f"{len(one_side)} layer{'s' if len(one_side) != 1 else ''} recorded by one run only at some "
                   f"step ({names}): not compared there",)
    return Table("layers", layer_columns(), rows, _tail(a, b) + skipped)


_ONE_CALL = {"calls": 1, "worst_call": 0, "nonfinite_call": None}  # a row without them: one call (issue 48)


def _side_value(s, row: dict):
    """One run's own value of a statistic tabled per side: a magnitude is empty when the layer's every element was
    NaN/Inf (it describes none), a call index defaults to a row of one call (older runs, one call)."""
    if s.name in _ONE_CALL and s.name not in row:
        return 0 if s.name == "nonfinite_call" and row["nan"] + row["inf"] else _ONE_CALL[s.name]
    v = row.get(s.name)
    if s.family in ("scale", "location", "fine"):
        return None if v is None or _all_nonfinite(row) else float(v)
    return v


def _all_nonfinite(row: dict) -> bool:
    """A layer output whose every element was NaN or Inf: its statistics (of the finite elements) describe none."""
    return row["n"] > 0 and row["nan"] + row["inf"] >= row["n"]


def _tail(a: WatchedRun, b: WatchedRun) -> tuple:
    """A line when one run recorded more steps: those are in no table (steps are aligned by index)."""
    if len(a.steps) == len(b.steps):
        return ()
    longer, n = ("A", len(a.steps)) if len(a.steps) > len(b.steps) else ("B", len(b.steps))
    return (f"{longer} recorded {n} steps, the other {_aligned(a, b)}: its steps {_aligned(a, b)}..{n - 1} are "
            "compared with nothing",)


def compare_arrays(x: np.ndarray, y: np.ndarray) -> dict:
    """Two arrays of one shape, element by element in float64, over the elements finite in both (each
    side's non-finite count beside): ``cosine`` (1 when both are all zero, 0 when only one is),
    ``max_abs_err`` = max |y - x|, ``max_rel_err`` = max |y - x| over the largest |value| of either array
    (not element by element: an element near 0 would make any rounding ~100%), ``rel_l2_err`` =
    ||y - x|| / max(||x||, ||y||). None for each when no element is finite in both."""
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    fx, fy = np.isfinite(x), np.isfinite(y)
    out = {"nonfinite_a": int(x.size - fx.sum()), "nonfinite_b": int(y.size - fy.sum()), "cosine": None,
           "max_abs_err": None, "max_rel_err": None, "rel_l2_err": None}
    both = fx & fy
    if not both.any():
        return out
    xs, ys = x[both], y[both]
    d = np.abs(ys - xs)  # float64: finite for float32 data; for float64 data near its maximum, inf (said so)
    out["max_abs_err"] = float(d.max())
    scale = max(float(np.abs(xs).max()), float(np.abs(ys).max()))
    if scale == 0:  # both all zero
        out.update(cosine=1.0, max_rel_err=0.0, rel_l2_err=0.0)
        return out
    xs, ys = xs / scale, ys / scale  # scale-free measures, computed without overflow
    nx, ny = float(np.linalg.norm(xs)), float(np.linalg.norm(ys))
    diff = float(np.linalg.norm(ys - xs))
    out["max_rel_err"] = float(np.abs(ys - xs).max())
    out["rel_l2_err"] = diff / max(nx, ny)
    out["cosine"] = (1.0 if diff == 0 else 0.0 if nx == 0 or ny == 0 else  # equal arrays: 1 exactly, not 1 - 2e-16
                     float(np.clip(np.dot(xs, ys) / (nx * ny), -1.0, 1.0)))
    return out


def _key_order(a: WatchedRun, step: int):
    """Snapshot keys in the order a reader expects: each layer as it ran (its inputs, then its outputs,
    call by call), then the gradients in the model's parameter order; anything else after, by name."""
    layers = {n: i for i, n in enumerate(a.steps[step]["layers"])} if step < len(a.steps) else {}
    params = {p["name"]: i for i, p in enumerate(a["model"]["parameters"])}

    def key(k: str):
        kind, _, rest = k.partition("/")
        if kind == "grad":
            return (1, params.get(rest, len(params)), rest, 0, 0, 0)
        layer, call, index = _split(rest)
        return (0, layers.get(layer, len(layers)), layer, int(call), 0 if kind == "in" else 1, int(index))

    return key


def _split(rest: str) -> tuple[str, str, str]:
    """``<layer>/<call>/<i>`` (a layer's name may hold a slash) as its three parts; call and i as digits."""
    parts = rest.rsplit("/", 2)
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return rest, "0", "0"
    return parts[0], parts[1], parts[2]


def _index(run: WatchedRun, step: int) -> dict:
    """``{key: (shape, dtype)}`` of a run's snapshot at ``step``, from its manifest."""
    e = next(s for s in run["snapshots"] if s["step"] == step)
    return {x["key"]: (tuple(x["shape"]), x["dtype"]) for x in e["arrays"]}


def _snapped(run: WatchedRun) -> set:
    return {s["step"] for s in run["snapshots"]}


def _examples(keys: list) -> str:
    return ", ".join(keys[:EXAMPLES]) + (", ..." if len(keys) > EXAMPLES else "")


def snapshot_rows(a, b) -> Table:
    """At each step both runs snapshotted (and both recorded), each ``in/``, ``out/`` and ``grad/`` array
    both hold with the same shape: ``compare_arrays`` of B against A. ``kind`` is input, output or grad,
    ``name`` the layer or parameter, ``key`` the snapshot's own key (``in/<layer>/<call>/<i>``)."""
    a, b = _run(a), _run(b)
    steps = sorted(s for s in _snapped(a) & _snapped(b) if s < _aligned(a, b))
    rows, skipped = [], list(_one_sided_snapshots(a, b))
    for k in steps:
        ia, ib = _index(a, k), _index(b, k)
        keys = [x for x in ia if x.partition("/")[0] in KINDS]
        only = sorted(x for x in set(keys) ^ {x for x in ib if x.partition("/")[0] in KINDS})
        shaped = sorted(x for x in keys if x in ib and ia[x][0] != ib[x][0])
        if only:
            skipped.append(f"step {k}: {len(only)} array{'s' if len(only) != 1 else ''} in one run only "
                           f"({_examples(only)}): not compared")
        if shaped:
            skipped.append(f"step {k}: {len(shaped)} array{'s' if len(shaped) != 1 else ''} of different shapes "
                           f"({_examples(shaped)}): not compared")
        keys = sorted((x for x in keys if x in ib and x not in shaped), key=_key_order(a, k))
        if not keys:
            continue
        sa, sb = a.snapshot(k), b.snapshot(k)
        for x in keys:
            kind, _, rest = x.partition("/")
            name = rest if kind == "grad" else _split(rest)[0]
            shape = "x".join(str(n) for n in ia[x][0]) or "scalar"
            rows.append({"step": k, "kind": KINDS[kind], "name": name, "key": x, "shape": shape,
                         "dtype_a": ia[x][1], "dtype_b": ib[x][1], **compare_arrays(sa[x], sb[x])})
    return Table("snapshots", SNAPSHOT_COLUMNS, rows, tuple(skipped))


def _one_sided_snapshots(a: WatchedRun, b: WatchedRun):
    """A line for each run's snapshot steps the other did not take: nothing to compare them with."""
    for side, mine, other in (("A", a, b), ("B", b, a)):
        alone = sorted(s for s in _snapped(mine) - _snapped(other) if s < _aligned(a, b))
        if alone:
            yield (f"step{'s' if len(alone) > 1 else ''} {', '.join(map(str, alone))} snapshotted by {side} only: "
                   "no array compared there")


def update_ratios(run: WatchedRun) -> dict:
    """``{(step, param): |w[k+1] - w[k]| / |w[k]|}`` for each step k the run snapshotted with k+1 (the
    parameters are taken as the step's forward saw them, so their difference is step k's update), in float64;
    ``inf`` when w[k] is all zero and the update is not, None when either holds a non-finite value."""
    steps = _snapped(run)
    out = {}
    for k in sorted(s for s in steps if s + 1 in steps):
        now, then = run.snapshot(k), run.snapshot(k + 1)
        for key, w in now.items():
            if not key.startswith("param/") or key not in then or then[key].shape != w.shape:
                continue
            x, y = w.astype(np.float64).ravel(), then[key].astype(np.float64).ravel()
            if not (np.isfinite(x).all() and np.isfinite(y).all()):
                out[(k, key[6:])] = None
                continue
            scale = max(float(np.abs(x).max(initial=0.0)), float(np.abs(y).max(initial=0.0)))
            if scale == 0:
                out[(k, key[6:])] = 0.0
                continue
            step_norm = float(np.linalg.norm((y - x) / scale))
            w_norm = float(np.linalg.norm(x / scale))
            out[(k, key[6:])] = 0.0 if step_norm == 0 else step_norm / w_norm if w_norm else math.inf
    return out


def grad_rows(a, b, *, cosines: dict | None = None) -> Table:
    """Per aligned step and per parameter (the model's order): each run's gradient norm (``grad_norms``, None
    when the parameter got no gradient), ``norm_ratio`` = B's over A's (``ratio``), ``cosine`` of the two
    gradients at the steps both snapshotted (``compare_arrays``; None elsewhere), and each run's
    ``update_ratios`` where it snapshotted that step and the next. ``cosines``: ``{(step, param): cosine}``
    already computed (``watch_tables`` passes the snapshot table's)."""
    a, b = _run(a), _run(b)
    if cosines is None:
        cosines = {(r["step"], r["name"]): r["cosine"] for r in snapshot_rows(a, b).rows if r["kind"] == "grad"}
    ua, ub = update_ratios(a), update_ratios(b)
    names_b = {p["name"] for p in b["model"]["parameters"]}
    names = [p["name"] for p in a["model"]["parameters"] if p["name"] in names_b]
    rows = []
    for k in range(_aligned(a, b)):
        ga, gb = a.steps[k]["grad_norms"], b.steps[k]["grad_norms"]
        for n in names:
            if n not in ga and n not in gb:
                continue  # no gradient in either run (a frozen parameter): nothing to say
            na, nb = ga.get(n), gb.get(n)
            rows.append({"step": k, "param": n, "norm_a": None if na is None else float(na),
                         "norm_b": None if nb is None else float(nb), "norm_ratio": ratio(na, nb),
                         "cosine": cosines.get((k, n)), "update_ratio_a": ua.get((k, n)),
                         "update_ratio_b": ub.get((k, n))})
    return Table("grads", GRAD_COLUMNS, rows, _tail(a, b))


def curves(run: WatchedRun) -> dict:
    """A run's ``loss`` and global gradient norm per step: None where ``w.step()`` was not given the loss, or
    no parameter had a gradient; NaN or inf where the value was."""
    return {"loss": [s["loss"] for s in run.steps],
            "grad_norm": [global_norm(s["grad_norms"]) if s["grad_norms"] else None for s in run.steps]}


def watch_tables(a: str | os.PathLike | WatchedRun, b: str | os.PathLike | WatchedRun) -> WatchTables:
    """The three tables of a pair and both runs' curves, each snapshot read once per table that needs it."""
    a, b = _run(a), _run(b)
    snaps = snapshot_rows(a, b)
    cos = {(r["step"], r["name"]): r["cosine"] for r in snaps.rows if r["kind"] == "grad"}
    return WatchTables(layer_rows(a, b), snaps, grad_rows(a, b, cosines=cos), {"A": curves(a), "B": curves(b)})
