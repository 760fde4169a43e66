"""The verdict of a watched-run diff, in ``compare``'s categories (``diagnose/verdict.py``).

In order: different data, a different optimizer class, different learning rates at an aligned step,
different initial weights in the step-0 snapshots (``setup``, the first as the headline, the others as
evidence; ``setup.py``), non-finite values on one side or from different producers (``numerics``), a
layer the float64 judge finds above its floor at a snapshot step (``layer``), a parting beyond rounding
explained by different precisions (``numerics``), by different stacks (``version``), or by nothing
recorded (``nondeterminism``); otherwise ``ok``. ``decide_single``: one run against the judge alone,
its exploding loss a ``setup`` finding."""

from __future__ import annotations

from dataclasses import dataclass

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


def _nonfinite(d) -> Verdict | None:
    pa, pb = d.producers
    if pa is None and pb is None:
        return None
    if pa is not None and pb is not None and (pa["layer"], pa["step"]) == (pb["layer"], pb["step"]):
        return None
    side, p = ("B", pb) if pa is None or (pb is not None and pb["step"] < pa["step"]) else ("A", pa)
    other = "A" if side == "B" else "B"
    state = "stays finite" if d.producers["AB".index(other)] is None else "turns non-finite later or elsewhere"
    return Verdict("numerics", f"{side} turns non-finite at step {p['step']} in {producer_where(p)}; "
                               f"{other} {state}",
                   evidence=[f"first non-finite in {side}: {producer_text(p)}"] + _parting_lines(d)
                   + _overflow_lines(d.replays),
                   remedies=nonfinite_remedies(p), target=side, layer=p["layer"],
                   sub_cause="overflow" if p["direction"] == "forward" else "backward")


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


def decide_single(run, replay) -> Verdict:
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
    if not found:
        return None
    headline, evidence, remedies, sub_cause = found[0]
    evidence = list(evidence) + [f"also: {h}" for h, *_ in found[1:]] + _parting_lines(d)
    remedies = list(dict.fromkeys(r for *_, rs, _ in found for r in rs))
    return Verdict("setup", headline, evidence=evidence, remedies=remedies, sub_cause=sub_cause)


def decide(d, a, b) -> Verdict:
    setup = _setup_verdict(d)
    if setup is not None:
        return setup
    found = _nonfinite(d)
    if found is not None:
        return found
    flagged = first_flagged(d.replays)
    if flagged is not None:
        side, row = flagged
        other = d.replays["AB".index(side) ^ 1]
        if other is not None and any(r.layer == row.layer for r in other.flagged):
            return _both_runs(d.replays, row.layer)  # the layer's code, whatever the target
        return layer_verdict(side, row, f"{side}'s ")
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
