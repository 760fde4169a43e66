"""What the float64 judge checked, held against what a watched verdict rests on (issue 43): ``inconclusive``
instead of an ``ok`` the judge could not back.

*The layers that decide the outcome*:

- **one run** (``convcheck diff RUN --judge``, ``run_ok``): an ``ok`` says every layer computes within its floor
  and the run stays finite, so it rests on every leaf layer the run recorded. It stands only when the judge
  replayed each of them at a snapshot step (or the layer is exact at any precision: a lookup, a dropout mask,
  torch's in-place activation, or its inputs were already NaN/Inf): ``Replay.complete``. Otherwise the verdict
  is ``inconclusive``, naming n of m layers, the steps, and why each other one was not replayed. The other
  rules of ``watched_run.py`` rest on what the watch saw itself (a NaN/Inf's producer, the loss curve, a
  setup record) or on a layer the judge flagged, and stand with the coverage said in their evidence.
- **a pair** (``convcheck diff A B``, ``pair_ok``): an ``ok`` whose runs agree within rounding at every aligned
  step rests on the two runs' own records - the question a pair asks is whether they differ - and stands
  whatever the judge replayed. An ``ok`` whose runs *part* (a layer beyond rounding, or losses wandering apart)
  and end alike says the parting is the precisions' rounding: that rests on the layer where they part (every
  layer when it is the loss), which the judge must have checked in each replayed run; else ``inconclusive``.
"""

from __future__ import annotations

from convcheck.diagnose.verdict import Verdict

SIDES = ("A", "B")


def coverage_lines(replays, sides=SIDES) -> list[str]:
    """One line per replayed run: n of m layers checked, at which steps, what was not and why."""
    out = []
    for side, r in zip(sides, replays):
        if r is None:
            continue
        who = "" if side == "-" else f" on {side}"
        out.append(f"float64 judge{who}: " + (r.coverage() if getattr(r, "layers", None) or r.rows else
                                               f"nothing replayed ({r.note or 'no layer call to replay'})"))
    return out


def remedies_for(replays) -> list[str]:
    """How the judge could check what it did not: from the reasons it gave."""
    reasons = " ".join([str(r.note or "") for r in replays if r is not None]
                       + [str(w) for r in replays if r is not None for w in r.unchecked.values()])
    out = []
    if "--trust-run" in reasons:
        out.append("if you trust where this run folder came from, pass --trust-run to load the model it recorded "
                   "by value (loading a pickle runs code)")
    if "kept no snapshot" in reasons or "no snapshot was kept" in reasons or "before its first snapshot" in reasons:
        out.append("keep a snapshot for the judge to replay: convcheck.watch(..., snapshot_steps=(0,)) (the default)")
    if "compiled graph" in reasons:
        out.append("a compiled run's layers are not seen one by one: record it once without torch.compile for the "
                   "judge to replay each layer, and bisect the compiled stages against eager with "
                   "convcheck diff RUN --judge cpu:float64 --backends")
    if "defined inside a function" in reasons or "not importable" in reasons or "runs code when imported" in reasons:
        out.append("define the model's classes at the top level of a module, or record the run again with this "
                   "convcheck (it keeps the model by value, signed with your key)")
    if not out:
        out.append("record the run again with this convcheck: it keeps every layer's arguments (integers, tuples, "
                   "keyword arguments) and the model by value, so the judge can replay each layer")
    return out


def _unchecked(replays) -> list[str]:
    return [f"{n} ({why})" for r in replays if r is not None for n, why in r.unchecked.items()]


def run_judged(v: Verdict, replay) -> Verdict:
    """``run_ok``'s verdict ``v``, or ``inconclusive`` when the judge did not check every layer it rests on."""
    if replay is not None and replay.complete:
        return v
    missing = _unchecked((replay,))
    if replay is None or not replay.rows:
        why = (replay.note if replay is not None and replay.note else
               (missing[0] if missing else "no layer call to replay"))
        head = f"{v.headline.split(';')[0]}, but the judge replayed no layer ({why[:160]})"
    else:
        head = (f"{v.headline.split(';')[0].replace('every replayed layer is within its floor and ', '')}, and the "
                f"layers the judge replayed are within their floors, but it checked {len(replay.checked)} of "
                f"{len(replay.layers)} layers: not {', '.join(missing[:2])}{', ...' if len(missing) > 2 else ''}")
    return Verdict("inconclusive", head, evidence=list(v.evidence) + coverage_lines((replay,), "-")
                   + [f"not checked: {m}" for m in missing[:8]], remedies=remedies_for((replay,)),
                   sub_cause="judge coverage")


def _parted(ev) -> tuple[int, str] | None:
    if ev.parting is not None:
        return ev.parting.step, ev.parting.layer
    if ev.loss_step is not None:
        return ev.loss_step, "the loss"
    if ev.loss_wander is not None:
        return ev.loss_wander[0], "the loss"
    return None


def pair_judged(v: Verdict, ev) -> Verdict:
    """The pair's ``ok`` ``v``, or ``inconclusive`` when the runs part and the judge did not check where."""
    if v.category != "ok":
        return v
    part = _parted(ev)
    replays = [r for r in ev.replays if r is not None]
    if part is None:  # they agree at every aligned step: the runs themselves say so
        return v
    step, layer = part

    def covers(r) -> bool:
        if layer in r.layers:
            return layer in r.checked or layer in r.exempt
        return r.complete

    if replays and all(covers(r) for r in replays):
        return v
    what = f"{layer}" if layer != "the loss" else "every layer (they part in the loss)"
    return Verdict("inconclusive", f"the two watched runs part at step {step} in {layer} and end alike, but the "
                   f"float64 judge did not check {what}: whether the parting is rounding is not known",
                   evidence=list(v.evidence) + coverage_lines(ev.replays), remedies=remedies_for(ev.replays),
                   sub_cause="judge coverage")


def pair_ok(ev) -> Verdict:
    """``rules/watched.watched_ok`` held against the judge's coverage (``pair_judged``)."""
    from convcheck.diagnose.rules.watched import watched_ok

    return pair_judged(watched_ok(ev), ev)
