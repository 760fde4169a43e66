"""The verdict of a watched-run diff, in ``compare``'s categories (``diagnose/verdict.py``).

In order: different data, a different optimizer class, different learning rates at an aligned step,
different initial weights in the step-0 snapshots (``setup``, the first as the headline, the others as
evidence; ``setup.py``), non-finite values on one side or from different producers (``numerics``), a
layer the float64 judge finds above its floor at a snapshot step (``layer``), a parting beyond rounding
explained by different precisions (``numerics``), by different stacks (``version``), or by nothing
recorded (``nondeterminism``); otherwise ``ok``. ``decide_single``: one run against the judge alone,
its exploding loss a ``setup`` finding."""

from __future__ import annotations

import math
from dataclasses import dataclass

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.detectors.watched import LOSS_SCALE, RECIPE
from convcheck.diagnose.rules.numerics import op_remedies
from convcheck.diagnose.verdict import Verdict
from convcheck.watch.setup import divergence

DATA_REMEDIES = ["give the DataLoader a seeded generator (DataLoader(..., generator=torch.Generator().manual_seed(s)))"
                 " and its workers a worker_init_fn, or call convcheck.seed_everything(seed) before building it",
                 "check the sampler (shuffle=, DistributedSampler.set_epoch) and num_workers are the same on both"]


@dataclass(frozen=True)
class Parting:
    """Where two watched runs part beyond rounding: the step, the layer, and by how much."""

    step: int
    layer: str
    why: str


def producer_where(p: dict) -> str:
    """``att (own code: matmul, forward)``: the producer, the op inside it when the run named one."""
    op = p.get("op")
    op = f": {op[:60]}" if isinstance(op, str) else ""
    return f"{p['layer']} ({p['kind']}{op}, {p['direction']})"


def producer_text(p: dict) -> str:
    from convcheck.watch.replay import magnitude_text

    detail = [str(p["detail"])[:200]] if p.get("detail") else []
    detail += [magnitude_text(p)] if magnitude_text(p) else []
    return f"{producer_where(p)} at step {p['step']}" + (f": {'; '.join(detail)}" if detail else "")

DETERMINISM_REMEDIES = ["torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False "
                        "on both sides (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)"]
VERSION_REMEDIES = ["run both sides with the same torch / CUDA / cuDNN build, then diff again"]


def _dtypes(run, step: int) -> set[str]:
    return {r["dtype"] for r in run.steps[step]["layers"].values()} if run.steps else set()


def _precision(d, a, b) -> str | None:
    """Why the two runs compute at different precisions, or None."""
    da, db = _dtypes(a, 0), _dtypes(b, 0)
    if da != db:
        return f"A's layers output {', '.join(sorted(da))}, B's {', '.join(sorted(db))}"
    tf32 = [f"{k}: {x} | {y}" for k, x, y in d.flags if "tf32" in k.lower() or "precision" in k]
    return "the TF32 switches differ (" + "; ".join(tf32) + ")" if tf32 else None


def _nonfinite(d, a, b) -> Verdict | None:
    pa, pb = d.producers
    if pa is None and pb is None:
        return None
    if pa is not None and pb is not None and (pa["layer"], pa["step"]) == (pb["layer"], pb["step"]):
        return None
    side, p = ("B", pb) if pa is None or (pb is not None and pb["step"] < pa["step"]) else ("A", pa)
    other = "A" if side == "B" else "B"
    exploded = divergence((a, b)["AB".index(other)])
    if d.producers["AB".index(other)] is not None:
        state = "turns non-finite later or elsewhere"
    elif exploded is not None:
        state = f"stays finite, but its own loss explodes too ({exploded.headline.removeprefix('the loss explodes: ')})"
    else:
        state = "stays finite"
    run = (a, b)["AB".index(side)]
    before = [f"before it: {u.evidence}" for u in d.pair
              if u.name == S.GRADIENT_UNDERFLOW and u.step is not None and u.step <= p["step"]]
    if _scaled_backward(run, p):
        return _loss_scale_overflow(side, run, p, f"{other} {state}", before)
    return Verdict("numerics", f"{side} turns non-finite at step {p['step']} in {producer_where(p)}; "
                               f"{other} {state}",
                   evidence=[f"first non-finite in {side}: {producer_text(p)}"] + before + _parting_lines(d)
                   + _overflow_lines(d.replays) + ([f"{other} on its own: {exploded.headline}"] if exploded else []),
                   remedies=nonfinite_remedies(p) + (list(exploded.remedies) if exploded else []), target=side,
                   layer=p["layer"], sub_cause="overflow" if p["direction"] == "forward" else "backward")


def _scaled_backward(run, p: dict) -> bool:
    """The first non-finite value is a gradient the loss's own backward hands the model while the loss itself
    is finite, with no GradScaler recorded: the backward was run on a scaled loss ((loss * S).backward())
    whose gradients pass the model's 16-bit range (a mean loss hands each output at most ~1/batch)."""
    if p.get("layer") != LOSS or p.get("direction") != "backward" or run.manifest.get("scaler"):
        return False
    k = p.get("step")
    loss = run.steps[k]["loss"] if isinstance(k, int) and 0 <= k < len(run.steps) else None
    return isinstance(loss, (int, float)) and math.isfinite(loss)


LOSS_SCALE_REMEDIES = ["use a dynamic torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(optimizer); "
                       "scaler.update()): it lowers the scale when the gradients overflow and skips that step",
                       "or a smaller fixed scale: the scale times the largest gradient must stay below 65504 in float16"]


def _loss_scale_overflow(who: str, run, p: dict, other: str | None, before: list) -> Verdict:
    loss = run.steps[p["step"]]["loss"]
    what = str(p.get("detail") or "the gradient into the model's output")
    headline = (f"{who}'s scaled backward overflows at step {p['step']}: {what} is Inf while the loss itself is "
                f"finite ({loss:.4g})" if who in "AB" else
                f"the scaled backward overflows at step {p['step']}: {what} is Inf while the loss itself is finite "
                f"({loss:.4g})")
    return Verdict("numerics", headline + (f"; {other}" if other else ""),
                   evidence=[f"first non-finite: {producer_text(p)}",
                             "no GradScaler was recorded (watch(..., scaler=)): a fixed loss scale - (loss * S)."
                             "backward() - makes gradients S times larger, past float16's 65504"] + before,
                   remedies=list(LOSS_SCALE_REMEDIES), target=who if who in "AB" else None, layer=p["layer"],
                   sub_cause="loss scale overflow")


NONFINITE_REMEDIES = ["keep that layer's operation in float32 (autocast(enabled=False) around it), or rescale its "
                      "operands (e.g. divide the scores by sqrt(d) before the matmul)"]
KEEP_FLOAT32 = "keep that layer's operation in float32 (autocast(enabled=False) around it)"
LOSS_FLOAT32 = ("compute the loss in float32: outside autocast, on the model's output cast with .float() "
                "(loss_fn(out.float(), y))")
LOSS = "the loss"  # the producer's name when the loss's own code made the first NaN/Inf (``Watch.step``)


def nonfinite_remedies(p: dict) -> list[str]:
    """As ``compare`` (``diagnose/rules/numerics.op_remedies``): the stable form of the op that made the first
    NaN/Inf when it has one (``exp``: subtract the maximum), then float32 - for the loss, the loss computed in
    float32; else float32 or rescaling."""
    own = op_remedies(p.get("op")) if isinstance(p.get("op"), str) else []
    if p.get("layer") == LOSS:
        return own + [LOSS_FLOAT32]
    return own + [KEEP_FLOAT32] if own else list(NONFINITE_REMEDIES)


LAYER_REMEDIES = ["that layer computes less accurately than its precision allows on its own input (the float64 "
                  "judge replayed it from the snapshot): check its implementation (a one-pass variance, a sum in "
                  "a 16-bit type, a cast inside it), or run it in float32"]


def _overflow_lines(replays) -> list[str]:
    return [f"{side}: {r.text()}" for side, rep in zip("AB", replays) if rep is not None for r in rep.overflows[:3]]


def first_flagged(replays) -> tuple[str, object] | None:
    """``(side, row)`` of the earliest layer call the judge found above its floor (None when none)."""
    rows = [(r.step, i, "AB"[i], r) for i, rep in enumerate(replays) if rep is not None for r in rep.flagged]
    return min(rows, key=lambda x: x[:2])[2:] if rows else None


def layer_verdict(side: str, row, prefix: str) -> Verdict:
    over = row.local / row.floor if row.floor > 0 else float("inf")
    return Verdict("layer", f"{prefix}{row.layer} computes beyond its floor at step {row.step}: local error "
                            f"{row.local:.3g}, {over:.3g}x its measured floor",
                   evidence=[f"float64 judge on {side or 'the run'}: {row.text()}"], remedies=list(LAYER_REMEDIES),
                   target=side or None, layer=row.layer, sub_cause="local error")


def _over(row) -> float:
    return row.local / row.floor if row.floor > 0 else float("inf")


def _both_runs(replays, layer: str) -> Verdict:
    """One layer above its floor in both runs: the headline quotes the run where it is worst (a float32
    run's 1.5e-4 beside a bfloat16 run's 155 is the bfloat16 run's problem), the evidence each run's worst."""
    worst = {side: max((r for r in rep.flagged if r.layer == layer), key=_over)
             for side, rep in zip("AB", replays) if rep is not None and any(r.layer == layer for r in rep.flagged)}
    side, row = max(worst.items(), key=lambda kv: _over(kv[1]))
    v = layer_verdict("", row, "in both runs, ")
    headline = v.headline + f" (worst in {side})"
    evidence = [f"float64 judge on {s}: {r.text()}" for s, r in sorted(worst.items())]
    return Verdict(v.category, headline, evidence=evidence, remedies=v.remedies, target=None, layer=layer,
                   sub_cause=v.sub_cause)


def _parting_lines(d) -> list[str]:
    if d.parting is None:
        return []
    return [f"the runs part at step {d.parting.step} in {d.parting.layer}: {d.parting.why}"]


def decide_single(run, replay, own=()) -> Verdict:
    """One watched run against the float64 judge: a layer above its floor at a snapshot step (``layer``),
    a loss that explodes (``setup``: ``setup.divergence``) or the first non-finite producer (``numerics``),
    the earliest of them (in that order on the same step); otherwise ``ok``."""
    p = run["first_nonfinite"]
    flagged = first_flagged((replay,))
    diverged = divergence(run)
    if flagged is not None and (p is None or flagged[1].step <= p["step"]) and (
            diverged is None or flagged[1].step <= diverged.step):
        return layer_verdict("", flagged[1], "")
    if diverged is not None and (p is None or diverged.step <= p["step"]):
        extra = [f"then the first non-finite: {producer_text(p)}"] if p is not None else []
        return Verdict("setup", diverged.headline, evidence=diverged.evidence + extra,
                       remedies=list(diverged.remedies), sub_cause=diverged.sub_cause)
    if p is not None and _scaled_backward(run, p):
        return _loss_scale_overflow("the run", run, p, None, [])
    lost = next((s for s in own if s.name == S.SMALL_UPDATES_LOST), None)
    if lost is not None and (p is None or lost.step is None or lost.step < p["step"]):
        return Verdict("numerics", f"small updates lost: the weights are kept in {lost.extra.get('format')} and most "
                                   "updates round away", evidence=[lost.evidence],
                       remedies=["keep float32 master weights (autocast instead of casting the model to bf16/fp16), "
                                 "or use an optimizer that keeps them"], sub_cause=S.SMALL_UPDATES_LOST)
    if p is not None:
        return Verdict("numerics", f"the run turns non-finite at step {p['step']} in {producer_where(p)}",
                       evidence=[f"first non-finite: {producer_text(p)}"] + _overflow_lines((replay,)),
                       remedies=nonfinite_remedies(p), layer=p["layer"],
                       sub_cause="overflow" if p["direction"] == "forward" else "backward")
    stopped = run.manifest.get("stopped")
    if stopped is not None:
        return stopped_verdict("the run", stopped, [replay.summary()] if replay is not None else [])
    if replay is None or not replay.rows:
        return Verdict("ok", "the run stays finite; no layer was replayed through the judge",
                       evidence=[replay.summary()] if replay is not None else [])
    return Verdict("ok", "every replayed layer is within its floor and the run stays finite",
                   evidence=[replay.summary()])


def stopped_verdict(who: str, s: dict, evidence: list) -> Verdict:
    """A run whose block raised (a NaN-loss check, say) or was interrupted, where nothing the watch saw
    explains it: never ``ok`` - the training did not finish, and the watch cannot say why."""
    what = f"{s['exception']}" + (f" ({s['message']})" if s["message"] else "")
    return Verdict("setup", f"{who} stopped at step {s['step']} with {what}; the watch saw no NaN/Inf and no "
                            "layer beyond its floor before it",
                   evidence=list(evidence) + ["a loss the loop checks itself is seen by the watch only when it is "
                                              "handed to w.step(loss) before the check"],
                   remedies=["pass the loss to w.step(loss) before the loop's own NaN check (or let the step "
                             "end at the optimizer's step), then run again and diff: the watch then names the "
                             "first NaN/Inf producer"], sub_cause="stopped")


def _setup_verdict(d) -> Verdict | None:
    """The first thing the runs were set up with differently (data, optimizer, lr, initial weights), the
    others as evidence; None when none."""
    found = []
    if d.data_step is not None:
        found.append((f"the runs did not see the same data: different data from step {d.data_step} "
                      "(batch hashes differ)",
                      [f"batch hashes of step {d.data_step} differ; a loader, sampler or worker-seeding "
                       "difference, not the numerics"], DATA_REMEDIES, "data order"))
    found += [(f.headline, f.evidence, f.remedies, f.sub_cause) for f in d.setup]
    found += [_recipe(r) for r in d.pair if r.name in (RECIPE, LOSS_SCALE)]
    if not found:
        return None
    headline, evidence, remedies, sub_cause = found[0]
    evidence = list(evidence) + [f"also: {h}" for h, *_ in found[1:]] + _parting_lines(d)
    remedies = list(dict.fromkeys(r for *_, rs, _ in found for r in rs))
    return Verdict("setup", headline, evidence=evidence, remedies=remedies, sub_cause=sub_cause)


RECIPE_REMEDIES = ["make both sides compute the same loss: the loss function and its arguments (label_smoothing=, "
                   "weight=, reduction=), what is added to it (regularisers, auxiliary terms) and how it is scaled; "
                   "then diff again"]
SCALE_REMEDIES = ["a gradient-accumulation loop divides each micro-batch's loss by the number of micro-batches "
                  "(loss / accumulation_steps) before backward(); a loss multiplied by a constant (a fixed loss scale, "
                  "the world size) on one side only: make both sides scale it alike, then diff again"]


def _recipe(r) -> tuple:
    """A recipe symptom (``detectors.watched.recipe_difference``) as a setup finding."""
    before = "at step 0, before any update, with the same weights and batch"
    if r.name == LOSS_SCALE:
        head = (f"the runs scale the loss differently: {before}, B's gradients are {r.value:.4g}x A's for every "
                "parameter" + (f" and its loss {r.extra['loss_ratio']:.4g}x A's" if r.extra.get("loss_ratio") else
                               " (the losses recorded agree)"))
        return head, [r.evidence], SCALE_REMEDIES, "loss scale"
    return (f"the runs compute a different loss: {before}, B's loss is {r.value:.4g}x A's", [r.evidence],
            RECIPE_REMEDIES, "loss")


def _own_failure(d, a, b) -> Verdict | None:
    """A run's own finding the other run does not have: its weights drop their updates (``numerics``)."""
    lost = [s for side in d.own for s in side if s.name == S.SMALL_UPDATES_LOST]
    if not lost:
        return None
    s = lost[0]
    both = len({x.arm for x in lost}) == 2
    who = "both runs" if both else s.arm
    return Verdict("numerics", f"small updates lost in {who}: the weights are kept in {s.extra.get('format')} and most "
                               "updates round away", evidence=[f"{x.arm} on its own: {x.evidence}" for x in lost]
                   + _parting_lines(d), remedies=["keep float32 master weights (autocast instead of casting the model "
                                                  "to bf16/fp16), or use an optimizer that keeps them"],
                   target=None if both else s.arm, sub_cause=S.SMALL_UPDATES_LOST)


def _underflow(d) -> Verdict | None:
    u = next((x for x in d.pair if x.name == S.GRADIENT_UNDERFLOW), None)
    if u is None or (d.parting is not None and d.parting.step <= u.step):
        return None  # the forward parted first: zeros downstream of it are its consequence, not an underflow
    other = "A" if u.arm == "B" else "B"
    dtype = u.extra.get("compute")
    remedy = ("use torch.amp.GradScaler to scale the loss, or bfloat16 instead of float16"
              if dtype == "float16" else "bfloat16 keeps float32's range: these zeros are lost digits; compute "
              "the layer before it in float32")
    return Verdict("numerics", f"gradient underflow in {u.arm}: {u.layer}'s gradient is exactly zero at step {u.step} "
                               f"where {other}'s is not", evidence=[u.evidence] + _parting_lines(d),
                   remedies=[remedy], target=u.arm, layer=u.layer, sub_cause=S.GRADIENT_UNDERFLOW)


def decide(d, a, b) -> Verdict:
    setup = _setup_verdict(d)
    if setup is not None:
        return setup
    found = _nonfinite(d, a, b)
    if found is not None:
        return found
    both = [divergence(r) for r in (a, b)]
    if all(x is not None for x in both):
        return Verdict("setup", f"both runs diverge on their own: {both[0].headline} (A); {both[1].headline} (B)",
                       evidence=both[0].evidence + both[1].evidence, remedies=list(both[0].remedies),
                       sub_cause="divergence")
    found = _own_failure(d, a, b)
    if found is not None:
        return found
    flagged = first_flagged(d.replays)
    if flagged is not None:
        side, row = flagged
        other = d.replays["AB".index(side) ^ 1]
        if other is not None and any(r.layer == row.layer for r in other.flagged):
            return _both_runs(d.replays, row.layer)  # the layer's code, whatever the target
        return layer_verdict(side, row, f"{side}'s ")
    found = _underflow(d)
    if found is not None:
        return found
    one = next(((side, x) for side, x in zip("AB", both) if x is not None), None)
    if one is not None:
        side, x = one
        return Verdict("setup", f"{side}'s own loss explodes: {x.headline.removeprefix('the loss ')}; the other run's "
                                "does not", evidence=x.evidence + _parting_lines(d), remedies=list(x.remedies),
                       target=side, sub_cause="divergence")
    part = d.parting
    if part is None and d.loss_step is not None:
        part = Parting(d.loss_step, "the loss", f"the losses differ by more than {d.loss_tol:.3g} (relative)")
    if part is None:
        extra = [f"A ran {d.steps[0]} steps, B {d.steps[1]}: compared the first {min(d.steps)}"] \
            if d.steps[0] != d.steps[1] else []
        why = _precision(d, a, b)
        if why is not None:  # agreeing at different precisions: within the coarser one's rounding, said so
            extra.append(f"{why}: they agree within the coarser precision's rounding")
        stops = [(side, s) for side, s in zip("AB", d.stopped) if s is not None]
        if stops:  # they agree up to where one stopped: that stop is the finding
            side, s = stops[0]
            return stopped_verdict(side, s, extra + ["the runs agree within rounding at every aligned step "
                                                     "before it"])
        wander = getattr(d, "loss_wander", None)
        if wander is not None:  # not "at every step": say what was let pass, and why
            k, ea, eb = wander
            return Verdict("ok", "the two watched runs agree within rounding: their losses wander apart from step "
                           f"{k} (different precisions) but end alike", evidence=extra + [
                               f"the losses differ by more than {d.loss_tol:.3g} (relative) from step {k}, and end "
                               f"at {ea:.4g} (A) and {eb:.4g} (B): rounding differences compounding over the steps"])
        return Verdict("ok", "the two watched runs agree within rounding at every aligned step", evidence=extra)
    where = f"the runs part at step {part.step} in {part.layer}"
    lines = [f"{where}: {part.why}"]
    why = _precision(d, a, b)
    if why is not None:
        return Verdict("numerics", f"{where}: they compute at different precisions", evidence=lines + [why],
                       remedies=["run that layer in float32 on the lower-precision side, or check it against "
                                 "the float64 judge with convcheck compare"], layer=part.layer,
                       sub_cause="precision")
    if d.env:
        return Verdict("version", f"{where}; the stacks differ", evidence=lines + [
            f"{x.field}: {x.left} | {x.right} ({x.why})" for x in d.env], remedies=list(VERSION_REMEDIES),
            layer=part.layer)
    return Verdict("nondeterminism", f"{where} with the same data, precision and stack", evidence=lines,
                   remedies=list(DETERMINISM_REMEDIES), layer=part.layer)
