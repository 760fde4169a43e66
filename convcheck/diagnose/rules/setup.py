"""Rules of the ``setup`` category: the float64 judge fails too; the envelope runs fail. Both mean the
training setup, not the device. ``SETUP_PRIORITY`` orders the judge's symptoms; ``SETUP_REMEDIES`` fits each."""

from __future__ import annotations

from convcheck.diagnose.detectors import recipe as R
from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.evidence import Evidence
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.remedies import (CLIP_GRADIENTS, LOWER_LR_10X, LOWER_LR_DEAD,
                                         LOWER_LR_PLAIN, LOWER_LR_WARMUP)
from convcheck.diagnose.rules.lines import symptom_lines, training_lines, where_in
from convcheck.diagnose.verdict import Verdict
from convcheck.numerics.thresholds import SETUP_MIN_STEPS

_LOWER_LR = LOWER_LR_10X
_CLIP = CLIP_GRADIENTS
SETUP_REMEDIES = {
    S.NONFINITE_LOSS: [_LOWER_LR, _CLIP],
    S.EXPLODING_GRADIENTS: [_LOWER_LR, _CLIP],
    S.VANISHING_GRADIENTS: [
        "add BatchNorm between layers; use residual connections or fewer layers; use Kaiming initialisation"],
    S.SATURATED_ACTIVATIONS: ["normalise the inputs of saturating activations (BatchNorm) or use ReLU"],
    S.DEAD_RELUS: ["check the initialisation and the biases (a ReLU whose input is <= 0 for every sample passes "
                   "no gradient), or use LeakyReLU", LOWER_LR_DEAD],
    S.LOSS_PLATEAU: ["check that labels match inputs", "raise the learning rate or train longer",
                     "check the input normalisation"],
    S.OSCILLATING_LOSS: [LOWER_LR_PLAIN, "use a larger batch"],
    S.INPUT_OUT_OF_RANGE: ["normalise the inputs (e.g. scale pixels to [0, 1] and standardise)"],
}
# a weight decay too strong ranks after an exploding loss (the learning rate's) and before what it causes: the
# vanishing gradients, dead ReLUs and plateau of weights decayed towards zero
SETUP_PRIORITY = [S.NONFINITE_USER_CODE, R.LOSS_SUMMED, R.SCHEDULE_DIVERGENCE, R.CLIPPING_TOO_TIGHT,
                  S.NONFINITE_LOSS, S.EXPLODING_GRADIENTS, R.DECAY_TOO_STRONG, S.VANISHING_GRADIENTS,
                  S.SATURATED_ACTIVATIONS,
                  S.DEAD_RELUS, S.INPUT_OUT_OF_RANGE, S.LOSS_PLATEAU, S.OSCILLATING_LOSS, R.DECAY_ON_NORMS]
SETUP_REMEDIES.update(R.REMEDIES)
_UNLISTED = 99
# The judge's symptoms that a slow start shows too (a loss near chance, a small batch's loss swinging), and
# a recipe habit that fails nothing by itself (AdamW's weight decay on every parameter, norms included: a
# held-out 8-step run was `setup` on it alone): below ``SETUP_MIN_STEPS`` they are notes of ``ok``, not a
# setup verdict, unless something else is wrong.
SLOW_START = (S.LOSS_PLATEAU, S.OSCILLATING_LOSS, R.DECAY_ON_NORMS)


@verdict_rule(
    "V002", "judge-fails", priority=20, category="setup",
    headline="training setup: {symptom}{where} ({why})",
    remedies=("train longer or raise the learning rate", "check data, labels and loss"))
def judge_fails(ev: Evidence) -> Verdict | None:
    """The float64 judge does not converge either (and one-step parity names no target-only
    cause), or the judge's loss is NaN/Inf too (at any run length): the setup. A target that goes
    non-finite while the judge stays finite is never this rule's (the target's symptom decides). The
    main symptom is the judge's first training problem in ``SETUP_PRIORITY``; exploding gradients say
    "learning rate {lr} is too high, gradients explode ({why})"; without any, "no arm converges in
    {steps} steps ({why})" - unless the judge's loss is still falling, or the run is shorter than
    ``SETUP_MIN_STEPS`` and the judge shows nothing but a slow start (``SLOW_START``): then the judge
    has not converged yet and the targets are held against it (no verdict here; ``ok`` notes it). Remedies: the main symptom's in ``SETUP_REMEDIES``, else the registered ones."""
    judge = ev.judge_outcome
    if judge is None:
        return None
    judge_nan = judge.first_nonfinite_step is not None  # every arm NaN, the judge included: the setup
    if not judge_nan and (not ev.judgeable or judge.converged or ev.step0_symptoms):
        return None
    judge_explodes = any(p.name in (S.NONFINITE_LOSS, S.EXPLODING_GRADIENTS) for p in ev.judge_problems)
    if not (judge_nan or judge_explodes) and any(info.first_nonfinite_step is not None
                                                 for _, info in _target_outcomes(ev)):
        return None  # a target goes non-finite while the judge trains sanely: the target's own verdict
    targets_ok = all(info.converged for n, info in _target_outcomes(ev) if n != ev.judge)
    why = ("the float64 judge fails too, so the setup, not the device" if targets_ok
           else "every arm fails, the float64 judge included")
    syms = sorted(ev.judge_problems + ev.data_symptoms,
                  key=lambda s: SETUP_PRIORITY.index(s.name) if s.name in SETUP_PRIORITY else _UNLISTED)
    lines = symptom_lines(syms, 4) + training_lines(ev)
    names = [s.name for s in syms]
    if all(s.name in SLOW_START for s in syms) and (ev.steps < SETUP_MIN_STEPS
                                                     or (not syms and ev.still_falling.get(ev.judge))):
        return None  # the judge has not converged yet, nothing is wrong with it: the targets are judged by it
    if not syms:
        return judge_fails.verdict(
            lines, headline=f"training setup: no arm converges in {ev.steps} steps ({why})",
            sub_cause=S.NO_CONVERGENCE, symptoms=names)
    dead = next((x for x in syms if x.name == S.DEAD_RELUS), None)
    if syms[0].name == S.VANISHING_GRADIENTS and dead is not None:
        syms.remove(dead)  # every ReLU output <= 0 passes no gradient: the dead ReLUs are why it vanishes
        syms.insert(0, dead)
        names = [x.name for x in syms]
    main = syms[0]
    headline = None
    if main.name == S.NONFINITE_USER_CODE:
        return judge_fails.verdict(
            lines, headline=f"training setup: {_user_code_cause(main)} ({why})", remedies=_user_code_remedies(main),
            layer=main.layer, sub_cause=main.name, symptoms=names)
    if main.name == S.EXPLODING_GRADIENTS:
        headline = f"training setup: learning rate {ev.lr:g} is too high, gradients explode ({why})"
    elif main.label != main.name:  # a loss >= 1000 that stays finite: what happened, not the rule's name
        headline = (f"training setup: the loss explodes to {main.value:.3g} at step {main.step}, NaN-like by "
                    f"AUTOTRAINER's rule ({why})")
    remedies = list(SETUP_REMEDIES.get(main.name, []))
    kinds = main.extra.get("saturating") or []
    if main.name == S.VANISHING_GRADIENTS and (kinds or S.SATURATED_ACTIVATIONS in names):
        which = "/".join(kinds) or "sigmoid/tanh"
        remedies.insert(0, f"replace the saturating activations ({which}) with ReLU, or normalise their inputs")
    return judge_fails.verdict(
        lines, {"symptom": main.name, "where": where_in(main.layer), "why": why}, headline=headline,
        remedies=remedies, layer=main.layer, sub_cause=main.name, symptoms=names)


def _target_outcomes(ev: Evidence):
    """(name, outcome) of the targets that have one, in the order asked for."""
    return [(n, ev.outcomes[n]) for n in ev.targets if n in ev.outcomes]


@verdict_rule(
    "V003", "fragile-envelope", priority=30, category="setup",
    headline="{failed} of {runs} envelope runs of the lower-precision target fail from one-ulp "
             "changes of the initial weights: the setup is fragile, not the device",
    remedies=(LOWER_LR_WARMUP, "add normalisation layers; check the initialisation"))
def fragile_envelope(ev: Evidence) -> Verdict | None:
    """Every target converges, but envelope runs (one-ulp perturbations) fail: a fragile setup."""
    failed = ev.envelope_failed
    if (not ev.judgeable or not failed or ev.step0_symptoms
            or not all(info.converged for _, info in _target_outcomes(ev))):
        return None
    per_step = ev.envelope is not None and ev.envelope.every_step  # a same-precision pair's null model
    return fragile_envelope.verdict(
        [f"{failed}/{ev.envelope_runs} perturbed runs did not converge", *training_lines(ev)],
        {"failed": failed, "runs": ev.envelope_runs},
        headline=(f"{failed} of {ev.envelope_runs} envelope runs of the lower-precision target fail from one-ulp "
                  "changes of the weights and batches at every step: the setup is fragile, not the device")
        if per_step else None,
        sub_cause="fragile setup", symptoms=[S.ENVELOPE_RUNS_FAIL])


def _user_code_cause(main: S.Symptom) -> str:
    """What a user callable of the step did on the judge too (the schedule, the loss, the optimizer step)."""
    kind, op = main.extra.get("callable"), main.extra.get("op")
    if kind == "schedule":
        return (f"the learning-rate schedule makes lr {main.extra.get('lr')} before training step {main.step}, "
                f"and the optimizer step then makes the weights NaN/Inf")
    if kind == "loss":
        return (f"{op + ' in ' if op else ''}the loss function '{main.extra.get('loss') or 'loss'}' makes the "
                f"first NaN/Inf at training step {main.step} from the model's finite output")
    return (f"the optimizer step ({main.extra.get('optimizer') or 'optimizer'}) makes the weights NaN/Inf after "
            f"training step {main.step - 1} from finite gradients")


def _user_code_remedies(main: S.Symptom) -> list[str]:
    from convcheck.diagnose.rules.numerics import op_remedies

    kind = main.extra.get("callable")
    if kind == "schedule":
        return ["check the learning-rate schedule: it returns NaN/Inf (a warm-up or decay length of 0 steps, "
                "a log/pow of a non-positive value); print scheduler.get_last_lr() for the first steps"]
    if kind == "loss":
        return op_remedies(main.extra.get("op")) or [
            "find what in the loss makes NaN/Inf from finite inputs: a mean over no element (every label "
            "ignored), a division by zero, log or sqrt of a non-positive value"]
    return ["check the optimizer's update: a division by a zero state (eps 0), a NaN hyper-parameter"]
