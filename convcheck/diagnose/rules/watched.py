"""The rules for two watched runs (``convcheck diff A B``), reading ``PairEvidence``; ``watched_ok`` when none
fires. In priority order:

==== ==== ==================== ============== =======================================================
id   prio name                 category       fires on
==== ==== ==================== ============== =======================================================
W001 10   watched-setup        setup          different data, optimizer, settings, learning rates or
                                              initial weights; a step-0 recipe difference or loss scale
W002 20   watched-nonfinite    numerics       NaN/Inf on one side (or from different producers); a fixed
                                              loss scale that overflows the backward
W003 30   watched-both-diverge setup          both runs' own losses explode
W004 33   watched-lost-updates numerics       small updates lost in a run's 16-bit weights (before W012: a run
                                              whose updates round away fails for that reason, whatever the other)
W012 35   watched-both-fail    setup          neither run converges on its own, and compare's training
                                              detectors find the same problem in both
W005 50   watched-layer        layer          a layer the float64 judge finds above its floor
W006 60   watched-underflow    numerics       a gradient exactly zero in one run only, no earlier parting
                                              (one run's own exploding loss is evidence of the parting below)
W013 79   watched-compiled-rng nondeterminism a parting beyond rounding, one run compiled and the other eager,
                                              with random layers (inductor draws its own masks; before W008:
                                              compiled against eager is also a precision policy difference)
W007 61   watched-zero-gradient layer         a gradient exactly zero in one run only that computes in no 16-bit
                                              format: another kernel's (a compiler's: bisect its backends)
W008 80   watched-precision    numerics       a parting beyond rounding at different precisions
W009 85   watched-stack        version        a parting beyond rounding with different stacks
W010 88   watched-unexplained  nondeterminism a parting beyond rounding, nothing recorded explains it
W011 90   watched-stopped      setup          no parting, but a run's block raised or was interrupted
==== ==== ==================== ============== =======================================================

A difference present at step 0, before any update, with equal weights and data is the recipe: it is
checked before any numerics verdict. Each run's own findings travel with the pair's (``PairEvidence.own``).
"""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.detectors.watched import LOSS_SCALE, RECIPE
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.remedies import (PYTHON_ORDER, BISECT_BACKENDS, KERNEL_ZEROS, BF16_ZEROS, COMPILED_RANDOM, DATA_REMEDIES, DETERMINISM_REMEDIES, GRAD_SCALER_UNDERFLOW,
                                         SEED_RANDOM_LAYERS,
                                         OUTCOME_STEPS, PRECISION_PARTING, RECIPE_REMEDIES, SCALE_REMEDIES,
                                         VERSION_REMEDIES)
from convcheck.numerics.thresholds import DESTROYED_ERROR, OUTCOME_MIN_STEPS
from convcheck.diagnose.rules.watched_lines import (layer_verdict, loss_scale_verdict, lost_updates_verdict,
                                                    nonfinite_cause, nonfinite_remedies, over, setup_remedies,
                                                    interrupted, stopped_verdict, training_problem)
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import (SIDES, PairEvidence, Parting, first_flagged, overflow_lines,
                                                 parting_lines, producer_text, producer_where)

_STEP0 = "at step 0, before any update, with the same weights and batch"


def _other(side: str) -> str:
    return "A" if side == "B" else "B"


def _recipe(r) -> tuple:
    """A recipe symptom (``detectors/watched.recipe_difference``) as a setup finding."""
    if r.name == LOSS_SCALE:
        head = (f"the runs scale the loss differently: {_STEP0}, B's gradients are {r.value:.4g}x A's for every "
                "parameter" + (f" and its loss {r.extra['loss_ratio']:.4g}x A's" if r.extra.get("loss_ratio") else
                               " (the losses recorded agree)"))
        return head, [r.evidence], SCALE_REMEDIES, "loss scale"
    return (f"the runs compute a different loss: {_STEP0}, B's loss is {r.value:.4g}x A's", [r.evidence],
            RECIPE_REMEDIES, "loss")


@verdict_rule("W001", "watched-setup", priority=10, category="setup", reads=PairEvidence,
              headline="{what}: set up differently, not the numerics")
def watched_setup(ev: PairEvidence) -> Verdict | None:
    """The first thing the runs were set up with differently (data, optimizer, settings, lr, initial weights,
    then a step-0 recipe difference), the others as evidence."""
    found = [((f.step or 0, 2 if f.sub_cause == "initial weights" else 0), (f.headline, f.evidence, f.remedies,
                                                                              f.sub_cause)) for f in ev.setup]
    if ev.data_step is not None:
        found.append(((ev.data_step, 1), (f"the runs did not see the same data: different data from step {ev.data_step} "
                                     "(batch hashes differ)",
                                     [f"batch hashes of step {ev.data_step} differ; a loader, sampler or "
                                      "worker-seeding difference, not the numerics"], DATA_REMEDIES, "data order")))
    found += [((0, 3), _recipe(r)) for r in ev.pair if r.name in (RECIPE, LOSS_SCALE)]
    if not found:
        return None
    # causal order: the first step a difference shows decides; at one step the recipe, then the data, then the
    # initial weights, then the loss (which needs both the same)
    found = [f for _, f in sorted(found, key=lambda sf: sf[0])]
    headline, evidence, _, sub_cause = found[0]
    evidence = list(evidence) + [f"also: {h}" for h, *_ in found[1:]] + parting_lines(ev)
    remedies = list(dict.fromkeys(r for *_, rs, _ in found for r in rs))
    return watched_setup.verdict(evidence, headline=headline, remedies=remedies, sub_cause=sub_cause)


def _diverged_text(x) -> str:
    return x.headline.removeprefix("the loss explodes: ")


@verdict_rule("W002", "watched-nonfinite", priority=20, category="numerics", reads=PairEvidence,
              headline="{side} turns non-finite at step {step} in {where}; {other} stays finite")
def watched_nonfinite(ev: PairEvidence) -> Verdict | None:
    """NaN/Inf in one run first (or from different producers): named with its module, op and step; the other
    run's own exploding loss said, never "stays finite" alone; a fixed loss scale overflowing the backward
    named as such."""
    pa, pb = ev.producers
    if pa is None and pb is None:
        return None
    if pa is not None and pb is not None and (pa["layer"], pa["step"]) == (pb["layer"], pb["step"]):
        return None
    side, p = ("B", pb) if pa is None or (pb is not None and pb["step"] < pa["step"]) else ("A", pa)
    other = _other(side)
    exploded = ev.divergence[SIDES.index(other)]
    if ev.producers[SIDES.index(other)] is not None:
        state = "turns non-finite later or elsewhere"
    elif exploded is not None:
        state = f"stays finite, but its own loss explodes too ({_diverged_text(exploded)})"
    else:
        state = "stays finite"
    before = [f"before it: {u.evidence}" for u in ev.pair
              if u.name == S.GRADIENT_UNDERFLOW and u.step is not None and u.step <= p["step"]]
    scaled = ev.scaled_backward[SIDES.index(side)]
    if scaled is not None:
        return loss_scale_verdict(watched_nonfinite, side, scaled, p, f"{other} {state}", before)
    return watched_nonfinite.verdict(
        [f"first non-finite in {side}: {producer_text(p)}"] + before + parting_lines(ev)
        + overflow_lines(ev.replays) + ([f"{other} on its own: {exploded.headline}"] if exploded else []),
        headline=f"{side} turns non-finite at step {p['step']} in {producer_where(p)}; {other} {state}",
        remedies=nonfinite_remedies(p) + (list(exploded.remedies) if exploded else []), target=side,
        layer=p["layer"], sub_cause=nonfinite_cause(p))


@verdict_rule("W003", "watched-both-diverge", priority=30, category="setup", reads=PairEvidence,
              headline="both runs diverge on their own: {a} (A); {b} (B)")
def watched_both_diverge(ev: PairEvidence) -> Verdict | None:
    """Both runs' own losses explode (finite): the training setup, whatever the difference between them."""
    a, b = ev.divergence
    if a is None or b is None:
        return None
    return watched_both_diverge.verdict(a.evidence + b.evidence, {"a": a.headline, "b": b.headline},
                                        remedies=list(a.remedies), sub_cause="divergence")


@verdict_rule("W012", "watched-both-fail", priority=35, category="setup", reads=PairEvidence,
              headline="both runs fail on their own: {label} in both ({evidence})")
def watched_both_fail(ev: PairEvidence) -> Verdict | None:
    """Neither run converges on its own and compare's training detectors find the same problem first in both
    (dead ReLUs, a weight decay too strong, vanishing gradients): the training setup, not the difference."""
    found = [training_problem(own, conv, min(ev.steps)) for own, conv in zip(ev.own, ev.converged)]
    if any(s is None for s in found) or found[0].name != found[1].name:
        return None
    a, b = found
    return watched_both_fail.verdict([f"A on its own: {a.evidence}", f"B on its own: {b.evidence}",
                                      "neither run converges on its own (compare's rule)"],
                                     {"label": a.label, "evidence": a.evidence}, remedies=setup_remedies(a),
                                     layer=a.layer if a.layer == b.layer else None, sub_cause=a.name)


@verdict_rule("W004", "watched-lost-updates", priority=33, category="numerics", reads=PairEvidence,
              headline="small updates lost in {side}: the weights are kept in {format} and most updates round away")
def watched_lost_updates(ev: PairEvidence) -> Verdict | None:
    """A run whose 16-bit weights drop most updates (its own ``small updates lost``)."""
    lost = [s for side in ev.own for s in side if s.name == S.SMALL_UPDATES_LOST]
    if not lost:
        return None
    return lost_updates_verdict(watched_lost_updates, lost, parting_lines(ev), both=len({x.arm for x in lost}) == 2)


@verdict_rule("W005", "watched-layer", priority=50, category="layer", reads=PairEvidence,
              headline="{side}'s {layer} computes beyond its floor at step {step}")
def watched_layer(ev: PairEvidence) -> Verdict | None:
    """The earliest layer call the float64 judge finds above its floor; in both runs, the run where it is worst."""
    flagged = first_flagged(ev.replays)
    if flagged is None:
        return None
    side, row = flagged
    other = ev.replays[SIDES.index(side) ^ 1]
    if other is None or not any(r.layer == row.layer for r in other.flagged):
        return layer_verdict(watched_layer, side, row, f"{side}'s ")
    worst = {s: max((r for r in rep.flagged if r.layer == row.layer), key=over)
             for s, rep in zip(SIDES, ev.replays) if rep is not None and any(r.layer == row.layer for r in rep.flagged)}
    side, row = max(worst.items(), key=lambda kv: over(kv[1]))
    v = layer_verdict(watched_layer, "", row, "in both runs, ")  # the layer's code, whatever the target
    return watched_layer.verdict([f"float64 judge on {s}: {r.text()}" for s, r in sorted(worst.items())],
                                 headline=v.headline + f" (worst in {side})", remedies=v.remedies,
                                 layer=row.layer, sub_cause=v.sub_cause)


@verdict_rule("W006", "watched-underflow", priority=60, category="numerics", reads=PairEvidence,
              headline="gradient underflow in {side}: {layer}'s gradient is exactly zero at step {step} where "
                       "{other}'s is not")
def watched_underflow(ev: PairEvidence) -> Verdict | None:
    """A parameter's gradient exactly zero in one run only, with no earlier parting of the forward to explain
    the zeros (zeros downstream of a parting are its consequence)."""
    u = next((x for x in ev.pair if x.name == S.GRADIENT_UNDERFLOW), None)
    if u is None or (ev.parting is not None and ev.parting.step <= u.step) or not _sixteen_bit(u):
        return None
    remedy = GRAD_SCALER_UNDERFLOW if u.extra.get("compute") == "float16" else BF16_ZEROS
    headline = (f"gradient underflow in {u.arm}: its gradients at step {u.step} lie in {u.extra['compute']}'s "
                "subnormal range" if u.extra.get("subnormal") else None)
    return watched_underflow.verdict([u.evidence] + parting_lines(ev),
                                     {"side": u.arm, "layer": u.layer, "step": u.step, "other": _other(u.arm)},
                                     headline=headline, remedies=[remedy], target=u.arm, layer=u.layer,
                                     sub_cause=u.name)


def _sixteen_bit(u) -> bool:
    return u.extra.get("compute") in ("float16", "bfloat16")


@verdict_rule("W007", "watched-zero-gradient", priority=61, category="layer", reads=PairEvidence,
              headline="{layer}'s gradient is exactly zero at step {step} in {side} where {other}'s is not, and {side} "
                       "computes in no 16-bit format: its kernels compute something else")
def watched_zero_gradient(ev: PairEvidence) -> Verdict | None:
    """A parameter's gradient exactly zero in one run only that no 16-bit format can have underflowed (the run
    computes in float32 or wider): another kernel computes it - a compiler's (bisect its backends), a library's."""
    u = next((x for x in ev.pair if x.name == S.GRADIENT_UNDERFLOW), None)
    if u is None or (ev.parting is not None and ev.parting.step <= u.step) or _sixteen_bit(u):
        return None
    compiled = ev.precision is not None and "compiled:" in ev.precision
    return watched_zero_gradient.verdict([u.evidence] + ([ev.precision] if compiled else []) + parting_lines(ev),
                                         {"side": u.arm, "layer": u.layer, "step": u.step, "other": _other(u.arm)},
                                         remedies=[BISECT_BACKENDS if compiled else KERNEL_ZEROS], target=u.arm,
                                         layer=u.layer, sub_cause="compiled kernels" if compiled else "kernels")


def _parting(ev: PairEvidence) -> Parting | None:
    if ev.parting is not None:
        return ev.parting
    if ev.loss_step is not None:
        return Parting(ev.loss_step, "the loss", f"the losses differ by more than {ev.loss_tol:.3g} (relative)")
    return None


def _precision_explains(ev: PairEvidence) -> bool:
    """A parting between runs at different precisions (or thread counts) whose losses end alike against their own
    noise: drift the precision explains, with no effect on the outcome - a note of ok, not a verdict."""
    return ev.precision is not None and ev.outcome is not None and ev.outcome.alike is True


def _where(part: Parting) -> str:
    return f"the runs part at step {part.step} in {part.layer}"


def _own_divergence(ev: PairEvidence) -> list[str]:
    """A run's own exploding loss, said with the parting it comes with (it is the difference, not its cause)."""
    return [f"{side} on its own: {x.headline}" for side, x in zip(SIDES, ev.divergence) if x is not None]


@verdict_rule("W008", "watched-precision", priority=80, category="numerics", reads=PairEvidence,
              headline="the runs part at step {step} in {layer}: they compute at different precisions")
def watched_precision(ev: PairEvidence) -> Verdict | None:
    """A parting beyond rounding between runs at different precisions (layer dtypes or TF32 switches)."""
    part = _parting(ev)
    if part is None or ev.precision is None or _precision_explains(ev):
        return None
    if ev.outcome is not None and ev.outcome.short and not any(ev.divergence) and not _destroyed(part):
        return _precision_unjudged(ev, part)
    end = [ev.outcome.text()] if ev.outcome is not None and ev.outcome.alike is not None else []
    return watched_precision.verdict([f"{_where(part)}: {part.why}", ev.precision] + end + _own_divergence(ev),
                                     {"step": part.step, "layer": part.layer}, remedies=list(PRECISION_PARTING),
                                     layer=part.layer, sub_cause="precision")


def _destroyed(part: Parting) -> bool:
    """A parting the lower precision shows harmful by itself, outcome or none: the values differ by as much as they
    are (``DESTROYED_ERROR``, relative, element by element) or are non-finite in one run only."""
    return part.size is not None and part.size >= DESTROYED_ERROR


def _precision_unjudged(ev: PairEvidence, part: Parting) -> Verdict:
    """Runs at different precisions that part, no layer flagged, too few steps to see how they end: a precision is
    judged by its outcome (does the parting change how the runs converge?), and without one the parting is neither a
    fault nor shown harmless - ``inconclusive``, not a ``numerics`` finding (exit 1) nor an ``ok``."""
    judged = [f"float64 judge on {side}: every replayed layer within its floor" for side, r in zip(SIDES, ev.replays)
              if r is not None and r.rows and not r.flagged]
    return Verdict("inconclusive", f"{_where(part)}, as their precisions can explain, but too few steps were recorded "
                                   "to judge whether it changes how they end",
                   evidence=[f"{_where(part)}: {part.why}", ev.precision, ev.outcome.text()] + judged,
                   remedies=[OUTCOME_STEPS.remedy(steps=OUTCOME_MIN_STEPS)], layer=part.layer,
                   sub_cause="precision unjudged")


@verdict_rule("W009", "watched-stack", priority=85, category="version", reads=PairEvidence,
              headline="the runs part at step {step} in {layer}; the stacks differ")
def watched_stack(ev: PairEvidence) -> Verdict | None:
    """A parting beyond rounding between runs whose fingerprints differ."""
    part = _parting(ev)
    if part is None or not ev.env or _precision_explains(ev):
        return None
    return watched_stack.verdict([f"{_where(part)}: {part.why}"]
                                 + [f"{x.field}: {x.left} | {x.right} ({x.why})" for x in ev.env] + _own_divergence(ev),
                                 {"step": part.step, "layer": part.layer}, remedies=list(VERSION_REMEDIES),
                                 layer=part.layer)


@verdict_rule("W013", "watched-compiled-rng", priority=79, category="nondeterminism", reads=PairEvidence,
              headline="the runs part at step {step} in {layer}: one runs its model compiled, whose random layers "
                       "draw other masks than eager's")
def watched_compiled_random(ev: PairEvidence) -> Verdict | None:
    """A parting between a compiled run and an eager one whose model has random layers: inductor's masks are
    not eager's, so the runs differ by chance from the first step (the kernels are not shown at fault)."""
    part = _parting(ev)
    if part is None or ev.compiled_random is None:
        return None
    return watched_compiled_random.verdict([f"{_where(part)}: {part.why}", ev.compiled_random] + _own_divergence(ev),
                                           {"step": part.step, "layer": part.layer}, remedies=list(COMPILED_RANDOM),
                                           layer=part.layer, sub_cause="compiled random layers")


@verdict_rule("W010", "watched-unexplained", priority=88, category="nondeterminism", reads=PairEvidence,
              headline="the runs part at step {step} in {layer} with the same data, precision and stack")
def watched_unexplained(ev: PairEvidence) -> Verdict | None:
    """A parting beyond rounding that nothing recorded explains."""
    part = _parting(ev)
    if part is None or _precision_explains(ev):
        return None
    remedies = list(DETERMINISM_REMEDIES)
    if ev.random_layers:  # a Dropout's masks differ between two seeds: the seed, not the kernels
        names = ", ".join(ev.random_layers[:3]) + (" ..." if len(ev.random_layers) > 3 else "")
        remedies.insert(0, SEED_RANDOM_LAYERS.remedy(layers=f"the model's random layers ({names})"))
    headline, sub_cause, extra = None, None, []
    if part.layer in ev.random_layers:
        headline = (f"the runs part at step {part.step} in {part.layer}, a random layer (Dropout): its masks differ "
                    "with the same data, precision and stack")
        sub_cause = "random layer"
    elif ev.cpu_repeatable and not ev.random_layers:  # no kernel to blame: an order in the user's own code
        seeds = ev.hash_seeds
        headline = (f"the runs part at step {part.step} in {part.layer} with the same data, precision and stack, on "
                    "CPU kernels that repeat themselves bitwise: an order in the code (a set or dict iterated, "
                    "a hash seed) differs")
        sub_cause = "python order"
        extra = [f"both runs on the CPU at one thread count; PYTHONHASHSEED: {seeds[0] or 'unset (random)'} | "
                 f"{seeds[1] or 'unset (random)'}"]
        remedies.insert(0, PYTHON_ORDER)
    return watched_unexplained.verdict([f"{_where(part)}: {part.why}"] + extra + _own_divergence(ev),
                                       {"step": part.step, "layer": part.layer},
                                       headline=headline, remedies=remedies, layer=part.layer, sub_cause=sub_cause)


def _compared(ev: PairEvidence) -> list[str]:
    extra = [f"A ran {ev.steps[0]} steps, B {ev.steps[1]}: compared the first {min(ev.steps)}"] \
        if ev.steps[0] != ev.steps[1] else []
    extra += [f"{side}'s record was cut{' by its size cap' if 'max_bytes' in note else ''}: {note}; the steps after "
              "it were not compared"
              for side, note in zip(SIDES, ev.truncated) if note]
    if ev.precision is not None:  # agreeing at different precisions: within the coarser one's rounding, said so
        extra.append(f"{ev.precision}: they agree within the coarser precision's rounding")
    return extra


@verdict_rule("W011", "watched-stopped", priority=90, category="setup", reads=PairEvidence,
              headline="{side} stopped at step {step} with {what}; the watch saw no NaN/Inf and no layer beyond "
                       "its floor before it")
def watched_stopped(ev: PairEvidence) -> Verdict | None:
    """The runs agree up to where one stopped (its block raised or was interrupted): that stop is the finding."""
    stops = [(side, s) for side, s in zip(SIDES, ev.stopped) if s is not None and not interrupted(s)]
    if not stops:  # none, or Ctrl-C: the runs are judged on the steps they both have (``watched_ok``)
        return None
    side, s = stops[0]
    return stopped_verdict(watched_stopped, side, s, _compared(ev) + ["the runs agree within rounding at every "
                                                                       "aligned step before it"])


def watched_ok(ev: PairEvidence) -> Verdict:
    """No rule fired: the runs agree within rounding (what was let pass, and why, as evidence)."""
    extra = _compared(ev)
    part = _parting(ev)
    if part is not None and _precision_explains(ev):  # drift the precision explains, said with how far it went
        extra = [x for x in extra if not x.endswith("within the coarser precision's rounding")]
        return Verdict("ok", f"the two watched runs end alike: they part at step {part.step} in {part.layer}, as their "
                       "precisions explain, and their losses end within their own noise",
                       evidence=extra + [f"{_where(part)}: {part.why}", f"precision: {ev.precision}",
                                         ev.outcome.text()])
    if ev.loss_wander is not None:  # not "at every step": say what was let pass, and why
        k, ea, eb = ev.loss_wander
        return Verdict("ok", "the two watched runs agree within rounding: their losses wander apart from step "
                       f"{k} (different precisions) but end alike", evidence=extra + [
                           f"the losses differ by more than {ev.loss_tol:.3g} (relative) from step {k}, and end "
                           f"at {ea:.4g} (A) and {eb:.4g} (B): rounding differences compounding over the steps"])
    return Verdict("ok", "the two watched runs agree within rounding at every aligned step", evidence=extra)
