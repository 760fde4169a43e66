"""The lines a watched diff shows beside its measurements: how a run stopped, what the float64 judge replayed,
whether torch.compile hid its layers, its notes on the GradScaler, and a symptom as JSON."""

from __future__ import annotations

import math

from convcheck.runformat.reader import WatchedRun


def symptom_dict(s) -> dict:
    """A symptom as JSON: what, on which side, where, when, how much."""
    value = s.value if s.value is None or math.isfinite(s.value) else str(s.value)
    return {"kind": s.name, "label": s.label, "side": s.arm, "layer": s.layer, "step": s.step, "value": value,
            "evidence": s.evidence}


def stopped_line(side: str, s: dict) -> str:
    """A run whose ``with convcheck.watch`` block raised or was interrupted: what, where; diffed up to there."""
    who = "the run" if side == "-" else f"{side}"
    return (f"stopped: {who} stopped at step {s['step']} with {s['exception']}"
            + (f" ({s['message']})" if s["message"] else "") + "; its steps up to there are diffed")


def judge_lines(replays, sides: str = "AB") -> list[str]:
    """The judge's replay in the report: one line per run (one in all when both were not replayed for
    the same reason), then what it skipped (the first three) and its rows above their floors."""
    reps = [(s, r) for s, r in zip(sides, replays) if r is not None]
    if not reps:
        return []
    judge = reps[0][1].judge
    if len(reps) > 1 and all(not r.rows and r.note for _, r in reps) and len({r.note for _, r in reps}) == 1:
        return [f"float64 judge ({judge}): not replayed: {reps[0][1].note}; diffed without the replay"]
    out = []
    for side, r in reps:
        label = f" on {side}" if len(sides) > 1 else ""
        out.append(f"float64 judge ({judge}){label}: {r.summary()}" + ("; diffed without the replay"
                                                                      if not r.rows and r.note else ""))
        if r.rows or r.layers:
            out.append(f"  coverage: {r.coverage()}")  # n of m layers, which steps, what was not (issue 43)
        out += [f"  kept: {line}" for line in r.kept[:5]]  # calls dropped over a snapshot's budget (issue 48)
        if len(r.kept) > 5:
            out.append(f"  kept: and {len(r.kept) - 5} more layers with calls dropped")
        out += [f"  above its floor: {row.text()}" for row in r.flagged[:5]]
        out += [f"  overflow: {row.text()}" for row in r.overflows[:3]]
        out += [f"  not replayed: {why}" for why in r.skipped[:3]]
    return out


SCALER_NOTES = ("the learning rate moved on after", "one GradScaler stepped")


def scaler_notes(run: WatchedRun) -> tuple[str, ...]:
    """The run's notes on how its loop used the GradScaler (a scheduler on skipped steps, several optimizers)."""
    return tuple(n for n in run.manifest.get("notes", []) if n.startswith(SCALER_NOTES))


def hidden_layers(run: WatchedRun) -> str | None:
    """One line when the run's layers ran inside a compiled graph (``compiled.py``): what was compared of it."""
    c = run.manifest.get("compiled") or {}
    if not c.get("layers_hidden"):
        return None
    return (f"layers ran inside a compiled graph ({c.get('how') or 'torch.compile'}): its layer boundaries are not "
            "seen; compared its loss and its parameters' gradients (the model's output, recorded as one layer, only "
            "against another compiled run)")
