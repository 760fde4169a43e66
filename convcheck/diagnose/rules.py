"""The verdict rules, in priority order, and the ``ok`` verdict when none fires.

Each rule reads only an ``Evidence`` and returns a ``Verdict`` or ``None``;
``registry.decide`` runs them by priority and the first verdict wins. Ids are
stable (V001...); priorities leave gaps for new rules.
"""

from __future__ import annotations

import math

from convcheck import recipe_symptoms as R
from convcheck import symptoms as S
from convcheck.diagnose.evidence import Evidence, TargetFacts
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.verdict import Verdict
from convcheck.formats import FLOAT32, NumberFormat, format_named
from convcheck.thresholds import CONVERGENCE_MIN_STEPS

# --- training setup: the main symptom (first in this order) and its remedies ----------------
_LOWER_LR = "lower the learning rate (try 10x smaller)"
_CLIP = "clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
SETUP_REMEDIES = {
    S.NONFINITE_LOSS: [_LOWER_LR, _CLIP],
    S.EXPLODING_GRADIENTS: [_LOWER_LR, _CLIP],
    S.VANISHING_GRADIENTS: [
        "replace saturating activations (sigmoid/tanh) with ReLU, or add BatchNorm between layers",
        "use residual connections or fewer layers; use Kaiming initialisation"],
    S.SATURATED_ACTIVATIONS: ["normalise the inputs of saturating activations (BatchNorm) or use ReLU"],
    S.DEAD_RELUS: ["lower the learning rate", "use LeakyReLU, or check the initialisation and the biases"],
    S.LOSS_PLATEAU: ["check that labels match inputs", "raise the learning rate or train longer",
                     "check the input normalisation"],
    S.OSCILLATING_LOSS: ["lower the learning rate", "use a larger batch"],
    S.INPUT_OUT_OF_RANGE: ["normalise the inputs (e.g. scale pixels to [0, 1] and standardise)"],
}
# The parts of the user's own recipe come first: when one is implicated it is the cause the others show.
SETUP_PRIORITY = [R.LOSS_SUMMED, R.SCHEDULE_DIVERGENCE, R.CLIPPING_TOO_TIGHT,
                  S.NONFINITE_LOSS, S.EXPLODING_GRADIENTS, S.VANISHING_GRADIENTS, S.SATURATED_ACTIVATIONS,
                  S.DEAD_RELUS, S.INPUT_OUT_OF_RANGE, S.LOSS_PLATEAU, S.OSCILLATING_LOSS, R.DECAY_ON_NORMS]
SETUP_REMEDIES.update(R.REMEDIES)
_UNLISTED = 99


# --- evidence lines shared by the rules ----------------------------------------------------

def training_lines(ev: Evidence) -> list[str]:
    out = []
    for name, info in ev.outcomes.items():
        state = "converged" if info.converged else "did not converge"
        if not ev.judgeable and math.isfinite(info.final_loss):
            state = "trained (convergence not judged)"
        out.append(f"{name}: {state}, loss {info.first_loss:.4g} -> {info.final_loss:.4g}"
                   + (f", first non-finite at step {info.first_nonfinite_step}"
                      if info.first_nonfinite_step is not None else ""))
    return out


def symptom_lines(syms, n: int) -> list[str]:
    return [f"{s.name} ({s.arm}): {s.evidence}" for s in syms[:n]]


def _where(layer: str | None) -> str:
    return f" in '{layer}'" if layer else ""


# --- the rules -----------------------------------------------------------------------------

@verdict_rule(
    "V001", "stochastic-layer", priority=10, category="nondeterminism",
    headline="layer '{layer}' draws its own random numbers, so every arm sees different randomness: "
             "differences between the targets are not evidence of numerics",
    remedies=("use nn.Dropout/Dropout2d modules (convcheck gives them the same masks on every arm) instead of "
              "functional or custom random draws",
              "or turn the randomness off for the comparison (model.eval() for that layer, or p=0)"))
def stochastic_layer(ev: Evidence) -> Verdict | None:
    """A layer draws random numbers no mask is shared for: no difference is evidence. When a target's
    executor found the draws itself (the ranks of a ``ddp:`` target), its own rule says it with that evidence."""
    if not ev.stochastic_layers or any(S.STOCHASTIC_LAYER in f.explains for f in ev.executor_findings):
        return None
    layer = ev.stochastic_layers[0]
    return stochastic_layer.verdict(
        [f"re-running the judge's forward under another seed changes the output of "
         f"{', '.join(repr(s) for s in ev.stochastic_layers)} while its input stays the same",
         *training_lines(ev)],
        {"layer": layer}, layer=layer, sub_cause="stochastic layer without shared masks",
        symptoms=[S.STOCHASTIC_LAYER])


@verdict_rule(
    "V002", "judge-fails", priority=20, category="setup",
    headline="training setup: {symptom}{where} ({why})",
    remedies=("train longer or raise the learning rate", "check data, labels and loss"))
def judge_fails(ev: Evidence) -> Verdict | None:
    """The float64 judge does not converge either (and one-step parity names no target-only
    cause): the setup. The main symptom is the judge's first training problem in
    ``SETUP_PRIORITY``; exploding gradients say "learning rate {lr} is too high, gradients
    explode ({why})"; without any, "no arm converges in {steps} steps ({why})", or, when the judge's
    loss is still falling, "..., but the loss is still falling (a -> b): run more steps" with more
    steps as the remedy. Remedies: the main symptom's in ``SETUP_REMEDIES``, else the registered ones."""
    judge = ev.judge_outcome
    if not ev.judgeable or judge is None or judge.converged or ev.step0_symptoms:
        return None
    targets_ok = all(info.converged for n, info in _target_outcomes(ev) if n != ev.judge)
    why = ("the float64 judge fails too, so the setup, not the device" if targets_ok
           else "every arm fails, the float64 judge included")
    syms = sorted(ev.judge_problems + ev.data_symptoms,
                  key=lambda s: SETUP_PRIORITY.index(s.name) if s.name in SETUP_PRIORITY else _UNLISTED)
    lines = symptom_lines(syms, 4) + training_lines(ev)
    names = [s.name for s in syms]
    if not syms and ev.still_falling.get(ev.judge):
        return judge_fails.verdict(
            lines, headline=f"training setup: no arm converges in {ev.steps} steps, but the loss is still falling "
                            f"({judge.first_loss:.4g} -> {judge.final_loss:.4g}): run more steps ({why})",
            remedies=[f"run more steps (--steps {2 * ev.steps})", "or raise the learning rate"],
            sub_cause=S.NO_CONVERGENCE, symptoms=names)
    if not syms:
        return judge_fails.verdict(
            lines, headline=f"training setup: no arm converges in {ev.steps} steps ({why})",
            sub_cause=S.NO_CONVERGENCE, symptoms=names)
    main = syms[0]
    headline = None
    if main.name == S.EXPLODING_GRADIENTS:
        headline = f"training setup: learning rate {ev.lr:g} is too high, gradients explode ({why})"
    return judge_fails.verdict(
        lines, {"symptom": main.name, "where": _where(main.layer), "why": why}, headline=headline,
        remedies=SETUP_REMEDIES.get(main.name, []), layer=main.layer, sub_cause=main.name, symptoms=names)


def _target_outcomes(ev: Evidence):
    """(name, outcome) of the targets that have one, in the order asked for."""
    return [(n, ev.outcomes[n]) for n in ev.targets if n in ev.outcomes]


@verdict_rule(
    "V003", "fragile-envelope", priority=30, category="setup",
    headline="{failed} of {runs} envelope runs of the lower-precision target fail from one-ulp "
             "changes of the initial weights: the setup is fragile, not the device",
    remedies=("lower the learning rate or add warm-up", "add normalisation layers; check the initialisation"))
def fragile_envelope(ev: Evidence) -> Verdict | None:
    """Every target converges, but envelope runs (one-ulp perturbations) fail: a fragile setup."""
    failed = ev.envelope_failed
    if (not ev.judgeable or not failed or ev.step0_symptoms
            or not all(info.converged for _, info in _target_outcomes(ev))):
        return None
    return fragile_envelope.verdict(
        [f"{failed}/{ev.envelope_runs} perturbed runs did not converge", *training_lines(ev)],
        {"failed": failed, "runs": ev.envelope_runs},
        sub_cause="fragile setup", symptoms=[S.ENVELOPE_RUNS_FAIL])


@verdict_rule(
    "V004", "self-difference", priority=40, category="nondeterminism",
    headline="{target} gives different results for the same input and seed (relative difference {diff:.2e})",
    remedies=("torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False",
              "set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts"))
def self_difference(ev: Evidence) -> Verdict | None:
    """A target differs from itself run to run by more than ``min_error`` (differences below
    it are reported with the ``ok`` verdict, not as one)."""
    for name, diff in ev.self_difference.items():
        if diff > ev.tolerances.min_error:
            return self_difference.verdict(
                [f"two identical forward/backward runs of {name} differ by {diff:.2e} (relative L2)"],
                {"target": name, "diff": diff},
                target=name, sub_cause="nondeterministic kernels", symptoms=[S.SELF_DIFFERENCE])
    return None


_ENV_HEADLINE = "{finding}: {message} - and {target} shows {symptom}{where}"


def _env_verdict(rule, ev: Evidence, found: list) -> Verdict:
    f, main, syms = found[0], ev.symptoms[0], ev.symptoms
    lines = [f"{x.id} ({x.severity}): {x.message} [source: {x.source}]" for x in found[:3]]
    lines += symptom_lines(syms, 3) + training_lines(ev)
    return rule.verdict(
        lines, {"finding": f.id, "message": f.message.rstrip("."), "target": main.arm, "symptom": main.name,
                "where": _where(main.layer)},
        remedies=[x.remedy for x in found[:3] if x.remedy], target=main.arm, layer=main.layer,
        sub_cause=f.id, symptoms=[s.name for s in syms])


@verdict_rule("V005", "hardware-finding", priority=50, category="hardware", headline=_ENV_HEADLINE)
def hardware_finding(ev: Evidence) -> Verdict | None:
    """A target symptom and a critical/warn hardware finding (ECC, memory, throttling, PCIe).
    Remedies: the findings' own (up to three)."""
    found = ev.findings_of("hardware")
    return _env_verdict(hardware_finding, ev, found) if ev.symptoms and found else None


@verdict_rule("V006", "version-finding", priority=60, category="version", headline=_ENV_HEADLINE)
def version_finding(ev: Evidence) -> Verdict | None:
    """A target symptom and a critical/warn version finding (driver, architecture, CUDA,
    cuDNN, BLAS). Remedies: the findings' own (up to three)."""
    found = ev.findings_of("version")
    return _env_verdict(version_finding, ev, found) if ev.symptoms and found else None


def _symptom_evidence(ev: Evidence) -> list[str]:
    math_notes = [f for f in ev.findings if getattr(f, "kind", None) == "numerics"]
    return (symptom_lines(ev.symptoms, 4) + training_lines(ev) + layer_note_lines(ev)
            + [f"{f.id}: {f.message}" for f in math_notes[:2]])


def layer_note_lines(ev: Evidence) -> list[str]:
    """Flagged layers too small to matter on a target with no other trouble."""
    return [f"note ({n.arm}): {n.evidence}; below min_error {ev.tolerances.min_error:g}, so not a cause"
            for n in ev.layer_notes]


@verdict_rule(
    "V007", "layer-error", priority=70, category="layer",
    headline="layer '{layer}'{module} computes something else on {target}: its own error is far above "
             "what the precision allows; later layers only pass it on",
    remedies=("run '{layer}' in float32: disable autocast around it (torch.autocast(device_type, enabled=False)) "
              "and cast its input with .float()",
              "if '{layer}' is your own code, use a numerically stable formula (e.g. torch.var or a two-pass "
              "variance instead of E[x^2]-E[x]^2)"))
def layer_error(ev: Evidence) -> Verdict | None:
    """The main target symptom is a layer whose own error is far above its floor (or destroys its
    result). Remedies fit the target (``layer_remedies``): autocast off around it, the layer kept in
    float32 in a cast model, TF32 off, or (float32) only the stable formula."""
    if not ev.symptoms or ev.symptoms[0].name != S.LAYER_ERROR:
        return None
    main = ev.symptoms[0]
    module = main.extra.get("module")
    return layer_error.verdict(
        _symptom_evidence(ev), {"layer": main.layer, "target": main.arm, "module": f" ({module})" if module else ""},
        remedies=layer_remedies(ev, main), target=main.arm, layer=main.layer,
        sub_cause="own error above floor", symptoms=[s.name for s in ev.symptoms])


_STABLE_FORMULA = ("if '{layer}' is your own code, use a numerically stable formula (e.g. torch.var or a two-pass "
                   "variance instead of E[x^2]-E[x]^2; no large offset added and subtracted)")


def layer_remedies(ev: Evidence, main: S.Symptom) -> list[str]:
    """What runs the flagged layer at a higher precision on this kind of target."""
    t = ev.target_facts.get(main.arm) or TargetFacts()
    layer = main.layer
    out = []
    if t.mixed_precision:
        out.append(f"run '{layer}' in float32: disable autocast around it (torch.autocast(device_type, "
                   "enabled=False)) and cast its input with .float()")
    elif t.half_storage:
        out.append(f"keep '{layer}' in float32 in the {t.compute_format} model: call .float() on it after casting "
                   f"the model, cast its input with .float() and its output back to {t.compute_format}")
    elif t.tf32_like:
        out.append("disable TF32 for this model: torch.backends.cuda.matmul.allow_tf32 = False; "
                   "torch.backends.cudnn.allow_tf32 = False")
    out.append(_STABLE_FORMULA.format(layer=layer))
    return out


@verdict_rule(
    "V008", "precision-effect", priority=80, category="numerics",
    headline="{symptom} on {target}{where}",
    remedies=("rerun in float32 (cpu:float32 vs your target) to confirm the precision effect",))
def precision_effect(ev: Evidence) -> Verdict | None:
    """Any other main target symptom: a precision effect. Headline variants: "{format} overflow
    in '{layer}' on {target}: it produces the first Inf (values reach {v} > {its largest})" (float16,
    FP8 E5M2; FP8 E4M3 saturates instead: "the matmul/conv reading its values saturates them"), "'{layer}'
    produces the first NaN/Inf on {target} from finite inputs", "{target} drifts from the other
    target {r}x beyond the one-ulp noise envelope from step {step}, while every layer is within
    its bound". Remedies: chosen by the symptom and the target's runner (``numerics_remedies``),
    else the registered one."""
    if not ev.symptoms or ev.symptoms[0].name == S.LAYER_ERROR:
        return None
    main = ev.symptoms[0]
    layer = main.layer
    headline = None
    facts = ev.target_facts.get(main.arm) or TargetFacts()
    op = main.extra.get("op")
    narrow = _narrow_format(facts, main)
    if main.name in (S.NONFINITE_FORWARD, S.OUT_OF_RANGE) and main.extra.get("overflow") and narrow:
        where = f"{op} in '{layer}' (its own code)" if op else f"'{layer}'"
        effect = ("it produces the first Inf" if main.name == S.NONFINITE_FORWARD
                  else f"the matmul/conv reading its values saturates them at {narrow.largest:g}")
        headline = (f"{narrow} overflow in {where} on {main.arm}: {effect} "
                    f"(values reach {main.value:.4g} > {narrow.largest:g})")
    elif main.name in S.NONFINITE_TENSORS and op:
        headline = f"{op} in '{layer}' (its own code) produces the first NaN/Inf on {main.arm} from finite inputs"
    elif main.name == S.NONFINITE_WEIGHTS:
        headline = (f"the optimizer step makes the weights of '{layer}' NaN/Inf on {main.arm} after training step "
                    f"{main.step - 1}" + (" (its gradients were finite)" if main.extra.get("finite_gradients") else ""))
    elif main.name in S.NONFINITE_TENSORS:
        headline = f"'{layer}' produces the first NaN/Inf on {main.arm} from finite inputs"
    elif main.name == S.DRIFT:
        headline = (f"{main.arm} drifts from the other target {main.value:.3g}x beyond the one-ulp noise envelope "
                    f"from step {main.step}, while every layer is within its floor's bound")
    elif main.name == S.ILL_CONDITIONED:
        headline = (f"'{layer}' ({main.extra.get('module')}) is ill-conditioned at {main.arm}'s precision: rounding "
                    f"its input to that precision already loses its result (floor {main.value:.2g})")
    return precision_effect.verdict(
        _symptom_evidence(ev), {"symptom": main.name, "target": main.arm, "where": _where(layer)},
        headline=headline, remedies=numerics_remedies(ev, main) or None, target=main.arm, layer=layer,
        sub_cause=main.name, symptoms=[s.name for s in ev.symptoms])


def _weights_remedies(t: TargetFacts | None, layer: str) -> list[str]:
    """An optimizer step that makes weights NaN/Inf: in float16 weights, Adam's eps is the usual cause."""
    if t is not None and t.half_storage and t.compute_format == "float16":
        return ["the optimizer computes in the weights' float16: Adam/AdamW's eps (1e-8 by default) is 0 in float16, "
                "so every zero gradient entry divides 0 by 0; use eps >= 1e-4 (--eps 1e-4), or keep float32 weights "
                "and compute in float16 under autocast (amp-fp16) with a GradScaler"]
    return [f"find what makes the update of '{layer}' NaN/Inf: the learning rate, the optimizer's eps at this "
            "precision, or a division in a custom optimizer; clip gradients (--clip-grad-norm)"]


def _narrow_format(facts: TargetFacts, main: S.Symptom) -> NumberFormat | None:
    """The format whose range the symptom's values left (the detector's, else the target's compute
    format) when its range is float32's no longer (fewer exponent bits: float16, FP8); else None."""
    fmt = format_named(main.extra.get("format") or facts.compute_format)
    return fmt if fmt.exponent_bits < FLOAT32.exponent_bits else None


def numerics_remedies(ev: Evidence, main: S.Symptom) -> list[str]:
    """Remedies for a precision effect: by the symptom, and by what the target's runner does."""
    t = ev.target_facts.get(main.arm)
    layer = main.layer
    out = []
    float16 = t is not None and t.half_compute and t.compute_format == "float16"
    narrow = _narrow_format(t or TargetFacts(), main)
    op = main.extra.get("op")
    if main.name in S.NONFINITE_TENSORS and op and narrow and main.extra.get("overflow"):
        out.append(f"{op} in '{layer}' overflows {narrow}: scale its operands down before it (attention "
                   f"energies by 1/sqrt(d)), or run '{layer}' in float32 or bfloat16"
                   + (" (torch.autocast(device_type, enabled=False) around it)" if t.mixed_precision else ""))
    elif main.name in S.NONFINITE_TENSORS and op:
        out.append(f"find what makes {op} in '{layer}' (its own code) produce NaN/Inf: its input range, a "
                   "division by zero, log or sqrt of a non-positive value")
    if main.name in S.NONFINITE_TENSORS or main.name == S.GRADSCALER_COLLAPSE:
        if t is not None and t.mixed_precision and float16:
            out.append(f"keep '{layer}' in float32 under autocast (torch.autocast(device_type, enabled=False) "
                       "around it), or use bfloat16 autocast, which has float32's range")
        elif layer and narrow:  # float16's range ends at 65504, FP8's at 448/57344; bfloat16's and float32's do not
            out.append(f"keep '{layer}' in float32, or normalise its input so values stay below {narrow.largest:g}")
        elif layer:
            out.append(f"find what makes '{layer}' produce NaN/Inf: its input range, a division by zero, "
                       "log or sqrt of a non-positive value")
        out.append("scale activations down (add normalisation before the layer)")
    if main.name == S.OUT_OF_RANGE and narrow:
        out.append(f"scale what '{layer}' produces into {narrow}'s range (below {narrow.largest:g}) before the "
                   "matmul/conv that reads it: normalise it, or give that operand a per-tensor scale as FP8 recipes do")
    if main.name == S.NONFINITE_WEIGHTS:
        out.extend(_weights_remedies(t, layer))
    if main.name == S.GRADIENT_UNDERFLOW and float16:
        out.append("use torch.amp.GradScaler to scale the loss, or bfloat16 instead of float16")
    elif main.name == S.GRADIENT_UNDERFLOW:  # bfloat16 has float32's range: zeros are lost digits
        out.append(f"{t.compute_format if t else 'this format'} keeps float32's range, so these zeros are lost "
                   "digits, not underflow: find the layer before it whose result cancels (the parity table's "
                   "worst rows) and compute it in float32")
    if main.name == S.ILL_CONDITIONED:
        out.append(f"keep '{layer}' and the tensors feeding it in float32 (its input cannot be represented "
                   "precisely enough at this precision)")
        out.append("remove large offsets or scales before it (normalise its input), so fewer digits are needed")
    if main.name == S.SMALL_UPDATES_LOST:
        out.append("keep float32 master weights (autocast instead of casting the model to bf16/fp16)")
    if main.name in (S.DRIFT, S.OUTCOME_OUTSIDE_ENVELOPE, S.NO_CONVERGENCE):
        if t is not None and t.tf32_like:
            out.append("disable TF32: torch.backends.cuda.matmul.allow_tf32 = False; "
                       "torch.backends.cudnn.allow_tf32 = False")
        if t is not None and t.half_compute:
            out.append("run the sensitive layers in float32 under autocast, or train in float32")
        out.append("compare with --targets using the higher precision on both sides to confirm")
    return out


# --- no rule fired -------------------------------------------------------------------------

def ok_verdict(ev: Evidence) -> Verdict:
    """Both targets train alike; the evidence says how close they came to a finding."""
    evidence = training_lines(ev)
    for m in ev.closest_layers:
        if m.measured:
            evidence.append(f"{m.target}: every layer within its floor's bound; the furthest above its floor is "
                            f"'{m.layer}' ({m.module}) with its own error {m.error:.2e}, {m.ratio:.2g}x its floor "
                            f"{m.floor:.2e}")
        else:
            evidence.append(f"{m.target}: every layer within its floor's bound; the furthest above is '{m.layer}' "
                            f"({m.module}) with local error {m.error:.2e}, {m.ratio:.2g}x the rounding of its "
                            f"result {m.floor:.2e} (a lower bound of its floor)")
    evidence += layer_note_lines(ev)
    if ev.drift is not None:
        evidence.append(ev.drift.evidence)
    evidence += [f"{f.id}: {f.message}" for f in ev.findings if getattr(f, "severity", "") in ("critical", "warn")]
    min_error = ev.tolerances.min_error
    evidence += [f"{n} differs from itself run to run by {d:.2e} (below {min_error:g}: benign)"
                 for n, d in ev.self_difference.items() if d > 0]
    if not ev.judgeable:
        evidence.append(f"convergence is not judged from {ev.steps} step; run --steps {CONVERGENCE_MIN_STEPS} "
                        "or more for that")
    return Verdict("ok", f"both targets train alike: {' and '.join(ev.targets)} agree with the float64 judge "
                   "within the expected rounding", evidence, [], symptoms=[])
