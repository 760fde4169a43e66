"""What a snapshot step kept, as the judge replays it (issue 48): its calls layer by layer (a step over its budget
keeps some of each layer's calls: ``watch/keep.py``), the closure evaluation each call ran in and the parameters it
ran with, the report's lines on what was dropped, and the replay's rows summarised per layer for the JSON."""

from __future__ import annotations

import math

from convcheck.watch.keep import kept_text

WORST_ROWS = 3  # rows the JSON keeps of each layer: its worst (flagged and overflowed first)
SHOWN_SKIPS = 50  # "not replayed" lines the JSON keeps (the count says how many there were)


def kept_calls(snap: dict) -> dict[str, list[int]]:
    """``{layer: [k, ...]}``: the calls whose first output the snapshot holds, in order (gaps where calls were
    dropped over the budget)."""
    out: dict[str, list[int]] = {}
    for key in snap:
        if key.startswith("out/") and key.endswith("/0"):
            layer, _, k = key[4:-2].rpartition("/")
            if k.isdigit():
                out.setdefault(layer, []).append(int(k))
    return {layer: sorted(ks) for layer, ks in out.items()}


def evaluations(entry: dict) -> list[dict]:
    """The entry's closure evaluations (``snapshots.take_params``): each a dict with the calls made before it
    (``calls``), its parameters' ``sha256`` and whether they were ``kept``; [] when the parameters never moved."""
    evs = entry.get("evaluations")
    if not isinstance(evs, list) or len(evs) < 2 or not all(isinstance(e, dict) for e in evs):
        return []
    return evs


def evaluation_of(evs: list[dict], layer: str, k: int) -> int:
    """The evaluation call ``k`` of ``layer`` ran in: the last one that began before it."""
    e = 0
    for i, ev in enumerate(evs):
        first = (ev.get("calls") or {}).get(layer, 0)
        if isinstance(first, int) and first <= k:
            e = i
    return e


def params_at(snap: dict, dtypes: dict, e: int) -> tuple[dict, dict]:
    """The snapshot and its dtypes with evaluation ``e``'s parameters in place of the step's first ones: those that
    moved since the step began are stored as ``eval/<e>/<name>``."""
    prefix = f"eval/{e}/"
    moved = {k[len(prefix):]: k for k in snap if k.startswith(prefix)}
    view = {**snap, **{f"param/{n}": snap[k] for n, k in moved.items()}}
    types = {**dtypes, **{f"param/{n}": dtypes[k] for n, k in moved.items() if k in dtypes}}
    return view, types


def kept_lines(entry: dict) -> list[str]:
    """One line per layer that lost calls at this snapshot step (``keep.kept_text``)."""
    kept = entry.get("kept")
    if not isinstance(kept, dict) or not isinstance(kept.get("layers"), dict):
        return []
    return [kept_text(entry["step"], layer, row, kept.get("budget")) for layer, row in kept["layers"].items()
            if isinstance(row, dict)]


def dropped_calls(entry: dict) -> int:
    kept = entry.get("kept") if isinstance(entry.get("kept"), dict) else {}
    rows = kept.get("layers") if isinstance(kept.get("layers"), dict) else {}
    return sum(int(r.get("calls", 0)) - int(r.get("kept", 0)) for r in rows.values() if isinstance(r, dict))


def _badness(row) -> tuple:
    over = row.local / row.bound if row.bound and row.bound > 0 else (math.inf if row.local > 0 else 0.0)
    return (row.overflow is not None, row.flagged, over if over == over else math.inf)


def _plain(row) -> dict:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in vars(row).items()}


def rows_summary(rows) -> dict:
    """The replay's rows for the JSON: per layer the calls replayed, flagged and overflowed, and its
    ``WORST_ROWS`` worst rows (``rows``, flagged and overflowed first), never one line per call."""
    by_layer: dict[str, list] = {}
    for r in rows:
        by_layer.setdefault(r.layer, []).append(r)
    layers, worst = {}, []
    for layer, mine in by_layer.items():
        layers[layer] = {"calls": len(mine), "flagged": sum(1 for r in mine if r.flagged and r.overflow is None),
                         "overflowed": sum(1 for r in mine if r.overflow is not None)}
        worst += sorted(mine, key=_badness, reverse=True)[:WORST_ROWS]
    return {"rows": [_plain(r) for r in worst], "rows_total": len(rows), "layers_replayed": layers}
