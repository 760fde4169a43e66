"""The verify stage's work: re-run the failing arm (same seed, weights, batches, steps) with each fitting
action applied (``actions.actions_for``), until one makes it converge and track the judge.

Which arm: the verdict's target; for a verdict about the setup (the judge fails too) the judge itself.
What "verified" means: every loss finite and, for a target, the run converges where the judge does and
ends within ``allowed`` of the judge's final loss (relative to it, or to how far the judge's loss fell
where that is more: ``_gap``), ``allowed`` being the larger of ``TRACK_MARGIN`` and the farthest
envelope run's gap when every envelope run is healthy (the one-ulp runs show how far honest rounding moves
the end; a broken arm's runs show nothing of the kind: ``_envelope_gap``) - or ends below the judge's (the
remedy fixed what failed; the line says it does not track); for the judge, the run converges.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

from convcheck.diagnose.detectors import training as S
from convcheck.measure.parity.localise import first_difference, location_text
from convcheck.diagnose.target_symptoms import _loss_scale
from convcheck.diagnose.verdict import Verdict
from convcheck.measure.train import TrainConfig, TrainResult, converged, run_training
from convcheck.measure.train.arms import Arm
from convcheck.numerics.thresholds import APART_FACTOR, FRAGILE_MARGIN, OUTCOME_ABSOLUTE, OUTCOME_RELATIVE
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances
from convcheck.plan.user_code import one_line
from convcheck.targets.spec import Target
from convcheck.verify.actions import RAISED_EPS, Action, Context, actions_for
from convcheck.verify.magnitudes import judge_magnitudes
from convcheck.verify.bisect import candidates, ddmin
from convcheck.verify.result import NO_ACTION, NOT_VERIFIED, SKIPPED, VERIFIED, Attempt, Verification

TRACK_MARGIN = FRAGILE_MARGIN  # a re-run ending within 10% of the judge's final loss tracks it


def verify_verdict(verdict: Verdict | None, *, build, data, recipe, steps: int, seed: int, training: TrainResult,
                   targets: Sequence[Target], judge: Target, mode: bool | None = None,
                   tolerances: Tolerances = DEFAULT_TOLERANCES, arm_seconds: float = math.nan,
                   actions: Sequence[Action] | None = None, layers=None, config=None) -> Verification:
    """``mode``: False runs nothing; None (the default) tries the first fitting action when that costs one
    training run of one in-process arm; True tries every fitting action. ``actions`` replaces the derived
    ones (a test plants a wrong diagnosis this way). ``layers``: the judge's output magnitude per module call
    (``magnitudes.judge_magnitudes``, measured here when None: which neighbours of a module kept in float32
    must stay with it)."""
    if mode is False:
        return Verification(SKIPPED, "", reason="--no-verify")
    if verdict is None or verdict.category == "ok":
        return Verification(SKIPPED, "", reason="the verdict is ok")
    target, is_judge = _failing(verdict, targets, judge)
    if target is None:
        return Verification(NO_ACTION, f"not verified: no arm of this run to re-run for a {verdict.category} verdict",
                            reason="no arm")
    if actions is None:
        model = build(target)
        if layers is None and not is_judge and target.runner.half_compute:
            layers = judge_magnitudes(build, judge, data, recipe.loss)
        actions = actions_for(Context(verdict, target, is_judge, model, recipe, layers, config))
        del model
    actions = list(actions)
    if mode is None and target.world is not None and actions:
        return Verification(SKIPPED, "", untried=tuple(a.text for a in actions),
                            reason=f"re-running {target} costs {target.world} processes, more than one arm: "
                                   "--verify runs it")
    if not actions:
        return Verification(NO_ACTION, "remedies not verified: none of them is one convcheck can apply and re-run",
                            reason="no action")
    if mode is None and actions[0].changes_recipe and not is_judge:
        return Verification(SKIPPED, "", untried=tuple(a.text for a in actions),
                            reason=f"'{actions[0].text}' changes the recipe, so the judge is re-run with it too: "
                                   "two training runs, more than the default's one (--verify runs it)")
    tried = actions[:1] if mode is None else actions
    judge_losses = _losses(training, training.arm_of(judge).name)
    allowed = max(TRACK_MARGIN, _envelope_gap(training, judge_losses, tolerances))
    attempts = []
    follow: Action | None = None
    for a in tried:
        attempts.append(_attempt(a, target, judge, is_judge, build, data, recipe, steps, seed, tolerances,
                                 judge_losses, allowed, config))
        if attempts[-1].verified:
            break
        follow = follow or _second_cause(a, attempts[-1], recipe, target)
        if follow is not None and mode is True:
            # the module kept in float32 fixed the first cause and the re-run found a second one, the
            # optimizer's eps (0 at this precision): both together
            attempts.append(_attempt(follow, target, judge, is_judge, build, data, recipe, steps, seed, tolerances,
                                     judge_losses, allowed, config))
            if attempts[-1].verified:
                break
    if mode is True and not attempts[-1].verified and _bisectable(verdict, target, is_judge):
        attempts.append(_bisect(target, judge, build, data, recipe, steps, seed, tolerances, training,
                                judge_losses, allowed))
    done = {a.text for a in attempts}
    untried = () if any(a.verified for a in attempts) else tuple(
        a.text for a in [*actions, *([follow] if follow is not None else [])] if a.text not in done)
    spent = sum(a.seconds for a in attempts)
    ratio = spent / arm_seconds if arm_seconds and math.isfinite(arm_seconds) and arm_seconds > 0 else math.nan
    ok = next((a for a in attempts if a.verified), None)
    if ok is not None:
        return Verification(VERIFIED, ok.line, tuple(attempts), (), cost_ratio=ratio)
    if untried:
        line = (f"{attempts[-1].line} ({len(untried)} more remedies not tried: "
                f"{'; '.join(untried)}; --verify tries them)")
    elif len(attempts) == 1 and attempts[0].kind == "lower-lr" and len(verdict.remedies) > 1:
        # one step of one knob: a learning rate 10x lower that is still too high, or a cause (the init) that
        # no re-run with another learning rate reaches, says nothing against the diagnosis
        line = (f"{attempts[0].line}; a 10x lower learning rate is the one remedy convcheck can apply here, so "
                "this is not verified either way: the other remedies are yours to try")
    elif len(attempts) == 1 and attempts[0].kind == "deterministic" and "still differs from itself" in attempts[0].line:
        # the difference is measured twice over, the remedy does not reach the op: the diagnosis stands
        line = (f"{attempts[0].line}; torch's deterministic algorithms do not cover that op (a custom or third-party "
                "kernel): make its reduction order fixed in its own code")
    elif len(attempts) == 1:
        line = f"{attempts[0].line}; no other remedy convcheck can apply: the diagnosis may be wrong (low confidence)"
    else:
        line = (f"not verified: none of the {len(attempts)} remedies convcheck can apply makes {attempts[0].arm} "
                f"converge and track the judge ({'; '.join(a.text for a in attempts)}): the diagnosis may be "
                "wrong (low confidence)")
    return Verification(NOT_VERIFIED, line, tuple(attempts), untried, cost_ratio=ratio)


# what a module's own precision causes (not weights an optimizer step breaks: every layer holds weights)
_MODULE_CAUSES = (*S.NONFINITE_TENSORS, S.OUT_OF_RANGE, S.ILL_CONDITIONED, S.GRADSCALER_COLLAPSE)


def _bisectable(verdict: Verdict, target: Target, is_judge: bool) -> bool:
    """Precision bisection fits a 16-bit target whose trouble one module's precision causes (a layer error,
    a NaN/Inf producer, an overflow), not weights the optimizer step makes NaN."""
    return (not is_judge and target.world is None and target.runner.half_compute
            and (verdict.category == "layer" or verdict.sub_cause in _MODULE_CAUSES))


def _bisect(target: Target, judge: Target, build, data, recipe, steps: int, seed: int, tolerances: Tolerances,
            training: TrainResult, judge_losses: list[float], allowed: float) -> Attempt:
    """Delta debugging over the model's modules for the smallest set kept in float32 that makes the arm
    track the judge; each probe runs up to two steps past the arm's first NaN/Inf (all steps without one),
    the set found is confirmed by a full re-run (the attempt returned)."""
    t0 = time.perf_counter()
    outcome = training.outcomes.get(target)
    bad = outcome.first_nonfinite_step if outcome is not None else None
    short = steps if bad is None else min(steps, bad + 2)
    names = candidates(build(target))
    probes = [0]

    def passes(kept: tuple[str, ...]) -> bool:
        probes[0] += 1
        a = Action("float32-module", "", modules=kept)
        return _attempt(a, target, judge, False, build, data, recipe, short, seed, tolerances,
                        judge_losses[:short], allowed).verified

    found = ddmin(names, passes)
    if found is None:
        return Attempt("bisect", "with every module in float32", "", str(target), False,
                       f"not verified: even with every module of the model in float32 ({probes[0]} probe), "
                       f"{target} does not track the judge: the cause is not the precision of some modules",
                       (), False, math.nan, allowed, time.perf_counter() - t0)
    quoted = ", ".join(f"'{n}'" for n in found)
    text = (f"with {quoted} in float32 (the smallest set: bisection over {len(names)} modules, "
            f"{probes[0]} probes of {short} steps)")
    done = _attempt(Action("float32-module", text, modules=found), target, judge, False, build, data, recipe, steps,
                    seed, tolerances, judge_losses, allowed)
    return dataclasses.replace(done, kind="bisect", seconds=time.perf_counter() - t0)


def _second_cause(action: Action, attempt: Attempt, recipe, target: Target) -> Action | None:
    """After an action (a module kept in float32, the loss in float32...) that did not verify because the
    optimizer step then made weights NaN/Inf with an eps the target's format cannot hold (Adam's 1e-8 is 0 in
    float16: below its smallest normal number): the same action with the eps raised (None when that is not
    what the re-run showed, or the format holds the eps - bfloat16, float32)."""
    if action.eps is not None or not attempt.by_optimizer:
        return None
    eps = _optimizer_eps(recipe)
    fmt = target.runner.precision.narrowest
    if eps is None or eps >= RAISED_EPS or eps >= fmt.smallest_normal:
        return None
    held = "0" if eps < fmt.smallest_subnormal / 2 else "below its precision"
    return action.with_eps(RAISED_EPS, f"its {eps:g} is {held} in {fmt}")


def _optimizer_eps(recipe) -> float | None:
    import torch

    try:
        opt = recipe.make_optimizer([torch.zeros(1, requires_grad=True)])
    except Exception:  # noqa: BLE001 - a factory that wants the model's own parameters: unknown
        return None
    eps = [g["eps"] for g in opt.param_groups if isinstance(g.get("eps"), (int, float))]
    return min(eps) if eps else None


def _cause(result: TrainResult, t: Target) -> tuple[str, bool]:
    """What made the re-run's first NaN/Inf: (the words, whether the optimizer step made weights NaN/Inf)."""
    try:
        arm = result.arm_of(t)
    except StopIteration:
        return "", False
    found = result.nonfinite_producer.get(arm)
    detail = dict(result.nonfinite_detail.get(arm) or {})
    weights = bool(result.nonfinite_weights.get(arm)) or detail.get("callable") == "optimizer"
    if weights:
        opt = detail.get("optimizer")
        eps = detail.get("eps")
        what = ", ".join(x for x in (opt or "", f"eps {eps:g}" if isinstance(eps, (int, float)) else "") if x)
        where = f" of '{found[1]}'" if found and found[1] else ""
        return f"the optimizer step{f' ({what})' if what else ''} made the weights{where} NaN/Inf", True
    if found:
        op = detail.get("op")
        who = f"'{found[1]}'" if detail.get("callable", "module") == "module" else f"the {detail['callable']}"
        return f"{who} produces it{f' ({op})' if op else ''}", False
    return "", False


def _failing(verdict: Verdict, targets: Sequence[Target], judge: Target) -> tuple[Target | None, bool]:
    """The arm to re-run: the verdict's target, else (a setup verdict: the judge fails too) the judge."""
    if verdict.target:
        for t in (*targets, judge):
            if str(t) == verdict.target:
                return t, t == judge
        return None, False
    if verdict.category == "setup":
        return judge, True
    return None, False


def _losses(training: TrainResult, arm: str) -> list[float]:
    return [float(v) for v in training.arm_curve(arm)["loss"].tolist()]


def _gap(final: float, judge_losses: list[float]) -> tuple[float, str]:
    """How far ``final`` ends from the judge's final loss, relative to that loss - or to how far the judge's
    loss fell, where that is more (two runs converging to 4.3e-05 and 3.5e-05 from 2.3 end alike, though
    24% apart) - and the words saying which ("of the judge's 0.968", "of the judge's fall 2.3 -> 3.5e-05").
    NaN where the judge gives no scale."""
    if not judge_losses or not math.isfinite(judge_losses[-1]):
        return math.nan, "of the judge's"
    first, last = judge_losses[0], judge_losses[-1]
    fall = first - last if math.isfinite(first) else 0.0
    scale = max(abs(last), fall)
    if not scale:
        return math.nan, f"of the judge's {_loss_text(last)}"
    if fall > abs(last):
        return abs(final - last) / scale, f"of the judge's fall {_loss_text(first)} -> {_loss_text(last)}"
    return abs(final - last) / scale, f"of the judge's {_loss_text(last)}"


def _loss_text(v: float) -> str:
    """A loss as the verify lines print it: 4 significant digits (1.2e-07 stays 1.2e-07), and a loss of
    exactly 0.0 (a float64 judge classifying every sample with certainty) says so rather than a bare 0."""
    return "exactly 0.0" if v == 0 else f"{v:.4g}"


def _envelope_gap(training: TrainResult, judge_losses: list[float],
                  tolerances: Tolerances = DEFAULT_TOLERANCES) -> float:
    """The farthest envelope run's final loss from the judge's, as ``_gap`` - only when every envelope run is
    itself healthy: every loss finite, converging where the judge converges, ending with the judge (not above
    ``APART_FACTOR`` times its final loss by more than ``OUTCOME_RELATIVE`` of the loss's scale). The envelope
    runs perturb the lower-precision target by one ulp; when that target is the broken one (a bf16 arm ending
    at loss 27 against the judge's 0.75) its runs show how far the breakage moves the end, not honest rounding,
    and would let almost any re-run "track" the judge. 0 without a healthy envelope (``TRACK_MARGIN`` rules)."""
    if not judge_losses or not all(math.isfinite(v) for v in judge_losses):
        return 0.0
    jf = judge_losses[-1]
    judge_conv = converged(judge_losses, tolerances)
    margin = OUTCOME_RELATIVE * _loss_scale(judge_losses[0], jf) + OUTCOME_ABSOLUTE
    gaps = []
    for a in training.arms:
        if a.role != "envelope":
            continue
        losses = _losses(training, a.name)
        if not losses or not all(math.isfinite(v) for v in losses):
            return 0.0
        if (judge_conv and not converged(losses, tolerances)) or (
                losses[-1] > jf + margin and losses[-1] > APART_FACTOR * jf):
            return 0.0
        gap, _ = _gap(losses[-1], judge_losses)
        if math.isfinite(gap):
            gaps.append(gap)
    return max(gaps, default=0.0)


def _attempt(action: Action, target: Target, judge: Target, is_judge: bool, build, data, recipe, steps: int,
             seed: int, tolerances: Tolerances, judge_losses: list[float], allowed: float, config=None) -> Attempt:
    """One re-run. The arm alone (role "judge": its own reference, no distance to measure) when the action
    leaves the judge's training as it was; with the judge beside it, both changed, when it changes the recipe."""
    t = action.target_for(target)
    name = "the float64 judge" if is_judge else str(target)
    with_judge = action.changes_recipe and not is_judge
    arms = [Arm(str(t), t, "target"), Arm(str(judge), judge, "judge")] if with_judge else [Arm(str(t), t, "judge")]
    t0 = time.perf_counter()
    try:
        with action.applied():
            result = run_training(action.wrap_build(build, config), data, arms,
                                  TrainConfig(steps=steps, seed=seed, recipe=action.recipe(recipe)),
                                  tolerances=tolerances)
            if with_judge:
                judge_losses = _losses(result, str(judge))
            # deterministic algorithms answer a target that differs from itself: run it twice more from the same
            # state with them on; the remedy is verified only if the two agree bitwise
            still = (first_difference(action.wrap_build(build, config), t, data.first(), seed, recipe.loss)
                     if action.deterministic and hasattr(data, "first") else None)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - an action that cannot run on this model is not a verified remedy
        return Attempt(action.kind, action.text, action.snippet(), name, False,
                       f"not verified: {action.text}, the re-run failed ({one_line(exc)})", (), False,
                       math.nan, allowed, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    losses = _losses(result, str(t))
    conv = converged(losses, tolerances)
    judge_final = judge_losses[-1] if judge_losses else math.nan
    final = losses[-1] if losses else math.nan
    gap, of = _gap(final, judge_losses)
    change = f"({_loss_text(losses[0])} -> {_loss_text(final)})" if losses else ""
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    judge_conv = converged(judge_losses, tolerances)
    cause, by_optimizer = _cause(result, t) if bad is not None else ("", False)
    if still is not None:
        ok, why = False, f"{name} still differs from itself run to run: {location_text(still)}"
    elif bad is not None:
        ok, why = False, f"{name} still goes NaN/Inf at step {bad}" + (f": {cause}" if cause else "")
    elif is_judge:
        ok = conv
        why = f"{name} converges {change}" if conv else f"{name} still does not converge {change}"
    elif not conv and judge_conv:
        ok, why = False, f"{name} still does not converge {change} while the judge does"
    elif math.isfinite(gap) and gap > allowed and final < judge_final and (conv or not judge_conv):
        # a remedy that leaves the arm ending lower than the judge fixed what failed; the rest is the
        # format's own effect on the trajectory (float16 Adam's second moment underflows, say): said so
        ok = True
        why = (f"{name} {'converges' if conv else 'trains'} {change}, ending {gap:.0%} {of} below it "
               f"(no worse than the judge; it does not track it within {allowed:.0%})")
    elif not math.isfinite(gap) or gap > allowed:
        ok, why = False, (f"{name} trains {change} but ends {gap:.0%} {of} from it (allowed {allowed:.0%})")
    else:
        ok = True
        how = "converges" if conv else "trains"
        why = (f"{name} {how} {change} and tracks the judge (final loss within {gap:.1%} {of}; "
               f"allowed {allowed:.0%})")
    line = f"{'verified' if ok else 'not verified'}: {action.text}, {why}"
    return Attempt(action.kind, action.text, action.snippet(), name, ok, line, tuple(losses), conv, gap, allowed,
                   seconds, cause=cause, by_optimizer=by_optimizer,
                   judge_losses=tuple(judge_losses) if with_judge else ())
