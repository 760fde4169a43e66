"""The rule of the ``numerics`` category: any other target symptom is a precision effect (overflow,
a NaN/Inf producer, underflow, lost updates, drift beyond the envelope), with remedies fitted to the target."""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.evidence import Evidence, TargetFacts
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose import remedies as RM
from convcheck.diagnose.remedies import GRAD_SCALER_UNDERFLOW, MASTER_WEIGHTS
from convcheck.diagnose.rules.lines import symptom_evidence, where_in
from convcheck.diagnose.verdict import Verdict
from convcheck.numerics.formats import FLOAT32, NumberFormat, format_named


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
    if main.name == S.DRIFT and drift_is_a_note(ev):
        return None
    layer = main.layer
    headline = None
    facts = ev.target_facts.get(main.arm) or TargetFacts()
    op = main.extra.get("op")
    narrow = _narrow_format(facts, main)
    at = f" at training step {main.step}" if main.step else ""
    if main.name == S.NONFINITE_USER_CODE:
        headline = _user_code_headline(main, narrow, at)
    elif main.name in (S.NONFINITE_FORWARD, S.OUT_OF_RANGE) and main.extra.get("overflow") and narrow:
        where = f"{op} in '{layer}' (its own code)" if op else f"'{layer}'"
        effect = ("it produces the first Inf" if main.name == S.NONFINITE_FORWARD
                  else f"the matmul/conv reading its values saturates them at {narrow.largest:g}")
        headline = (f"{narrow} overflow in {where} on {main.arm}{at}: {effect} "
                    f"(values reach {main.value:.4g} > {narrow.largest:g})")
    elif main.name in S.NONFINITE_TENSORS and op:
        headline = (f"{op} in '{layer}' (its own code) produces the first NaN/Inf on {main.arm}{at} from finite "
                    "inputs")
    elif main.name == S.NONFINITE_WEIGHTS:
        headline = (f"the optimizer step makes the weights of '{layer}' NaN/Inf on {main.arm} after training step "
                    f"{main.step - 1}" + (" (its gradients were finite)" if main.extra.get("finite_gradients") else ""))
    elif main.name in S.NONFINITE_TENSORS:
        headline = f"'{layer}' produces the first NaN/Inf on {main.arm} from finite inputs"
    elif main.name == S.DRIFT:
        envelope = main.extra.get("envelope", "one-ulp envelope").replace("envelope", "noise envelope")
        headline = (f"{main.arm} drifts from the other target {main.value:.3g}x beyond the {envelope} "
                    f"from step {main.step}, while every layer is within its floor's bound")
    elif main.name == S.OUTCOME_APART:
        headline = (f"{main.arm} converges, but ends at loss {main.value:.4g}, {main.value / main.extra['judge_final']:.3g}x "
                    f"the float64 judge's {main.extra['judge_final']:.4g}: its precision changes where training "
                    "ends, though no layer is above its floor at step 0 and no NaN/Inf reaches a module's output")
    elif main.name == S.ILL_CONDITIONED:
        headline = (f"'{layer}' ({main.extra.get('module')}) is ill-conditioned at {main.arm}'s precision: rounding "
                    f"its input to that precision already loses its result (floor {main.value:.2g})")
    return precision_effect.verdict(
        symptom_evidence(ev), {"symptom": main.name, "target": main.arm, "where": where_in(layer)},
        headline=headline, remedies=numerics_remedies(ev, main) or None, target=main.arm, layer=layer,
        sub_cause=main.name, symptoms=[s.name for s in ev.symptoms])


def drift_is_a_note(ev: Evidence) -> bool:
    """Drift beyond the one-ulp envelope between two targets of the same precision (they differ only in
    reduction order: a data-parallel target, SyncBatchNorm) that changes neither target's outcome beyond
    the envelope's own runs: rounding injected at every step, which a one-time one-ulp perturbation
    underestimates; a note of the ``ok`` verdict, not a verdict - unless it is more than DRIFT_NOTE_MAX times
    the envelope's spread."""
    if ev.drift_far and not any(getattr(f, "explains_drift", False) for f in ev.executor_findings):
        return False  # orders of magnitude beyond the envelope is no reduction order's rounding (unless an
        # executor's finding says what trains another model from the first step: a per-rank BatchNorm)
    return ev.same_precision() and not any(ev.outcome_changed(n) for n in ev.targets if n != ev.judge)



def _user_code_headline(main: S.Symptom, narrow: NumberFormat | None, at: str) -> str:
    """NaN/Inf made by a user callable of the step that is not a module: the loss, the schedule."""
    kind, op = main.extra.get("callable"), main.extra.get("op")
    if kind == "schedule":
        return (f"the learning-rate schedule makes lr {main.extra.get('lr')} on {main.arm} before training step "
                f"{main.step}: the optimizer step then makes the weights of '{main.layer}' NaN/Inf")
    where = f"the loss function '{main.extra.get('loss') or 'loss'}'"
    if main.extra.get("direction") == "backward":
        return (f"the backward of {where} makes the gradient into the model's output NaN/Inf on {main.arm}{at} "
                "while the loss itself is finite")
    if op and main.extra.get("overflow") and narrow:
        return (f"{narrow} overflow in {op} in {where} on {main.arm}{at}: it produces the first Inf "
                f"(values reach {main.value:.4g} > {narrow.largest:g})")
    if op and main.extra.get("operand_absmin") == 0.0:
        wide = main.extra.get("float64_operand_absmin")
        return (f"{op} in {where} produces the first NaN/Inf on {main.arm}{at}: its operand rounds to exactly 0 "
                f"at {main.arm}'s precision" + (f" (in float64 it is {wide:.3g})"
                                                if wide is not None and wide == wide and wide > 0 else ""))
    if op:
        return f"{op} in {where} produces the first NaN/Inf on {main.arm}{at} from the model's finite output"
    return f"{where} produces the first NaN/Inf on {main.arm}{at} from the model's finite output"


# What makes each op of user code stable, by the op that produced the first NaN/Inf.
_OP_REMEDIES = {
    "exp": ["subtract the maximum before exp (x - x.amax(dim, keepdim=True)), or use torch.softmax / "
            "F.log_softmax / torch.logsumexp, which do: exp of the raw values overflows"],
    "log": ["take the log from logits, not from probabilities: F.log_softmax / F.cross_entropy for a softmax, "
            "F.logsigmoid or F.binary_cross_entropy_with_logits for a sigmoid (log(1 - sigmoid(x)) = "
            "logsigmoid(-x)); else clamp its operand (x.clamp_min(1e-4))"],
    "div": ["guard the division: divide by d.clamp_min(eps) (eps >= 1e-4 at 16-bit precision)"],
    "sqrt": ["the value under the square root is negative or rounds to 0: clamp it and add an eps "
             "(torch.sqrt(x.clamp_min(0) + 1e-4)); a variance written as E[x^2] - E[x]^2 goes negative at low "
             "precision: use x.var(dim, unbiased=False) or F.layer_norm / F.group_norm"],
    "rsqrt": ["the value under the square root is negative or rounds to 0: torch.rsqrt(x.clamp_min(0) + 1e-4); "
              "a variance written as E[x^2] - E[x]^2 goes negative at low precision: use x.var(dim, unbiased=False)"],
    "pow": ["scale the operand down before the power, or compute it in float32"],
}
_OP_ALIASES = {"true_divide": "div", "divide": "div", "truediv": "div", "log1p": "log", "log2": "log",
               "log10": "log", "exp2": "exp", "expm1": "exp", "softmax": None}


def op_remedies(op: str | None) -> list[str]:
    """The stable form of ``op`` (``exp``: subtract the max; ``log``: from logits; ``div``: guard)."""
    if not op:
        return []
    base = _OP_ALIASES.get(op.rstrip("_"), op.rstrip("_"))
    return list(_OP_REMEDIES.get(base, [])) if base else []


def _keep_float32(t: TargetFacts | None, *, layer: str | None = None, loss: str | None = None):
    """The remedy that runs ``layer`` (or the loss function ``loss``) in float32 on this kind of target, or None where
    it already is: autocast off around it under autocast, its input cast in a cast model."""
    if t is None or not (t.mixed_precision or t.half_storage or t.half_compute):
        return None
    if loss is not None:
        return (RM.AUTOCAST_OFF_LOSS if t.mixed_precision else RM.CAST_LOSS_FLOAT32).remedy(loss=loss)
    return (RM.AUTOCAST_OFF_LAYER if t.mixed_precision else RM.CAST_LAYER_FLOAT32).remedy(layer=layer)


def _user_code_remedies(ev: Evidence, main: S.Symptom) -> list[str]:
    t = ev.target_facts.get(main.arm)
    if main.extra.get("callable") == "schedule":
        return ["check the learning-rate schedule: it returns NaN/Inf (a division by zero warm-up length, "
                "a log/pow of a non-positive value); print schedule.get_last_lr() over the run"]
    out = op_remedies(main.extra.get("op"))
    keep = _keep_float32(t, loss=main.extra.get("loss") or "loss")
    if keep:
        out.append(keep)
    if not out:
        out.append("find what in the loss makes NaN/Inf: its input range, a division by zero, log or sqrt of a "
                   "non-positive value")
    return out


def _named_optimizer(optimizer) -> bool:
    """An optimizer given by a torch.optim class name (``--optimizer adamw``: ``--eps`` reaches it), not
    the user's own factory (FILE.py:factory, a callable: its eps is set in the user's code)."""
    return isinstance(optimizer, str) and ":" not in optimizer


def _weights_remedies(t: TargetFacts | None, layer: str, main: S.Symptom | None = None, *,
                      own_factory: bool = False) -> list[str]:
    """An optimizer step that makes weights NaN/Inf: in float16 weights, Adam's eps is the usual cause
    when the optimizer has an eps; an SGD step is the learning rate times a too large gradient."""
    extra = main.extra if main is not None else {}
    opt = str(extra.get("optimizer") or "")
    has_eps = extra.get("eps") is not None if "optimizer" in extra else True  # unknown: as before
    if not has_eps:
        return [RM.UPDATE_OUT_OF_RANGE.remedy(opt=opt or "optimizer", layer=layer,
                                              fmt=t.compute_format if t else "weights")]
    if t is not None and t.half_storage and t.compute_format == "float16":
        opt = str(extra.get("optimizer") or "Adam/AdamW")
        how = (f"pass eps=1e-4 (or larger) to {opt} in your optimizer factory" if own_factory
               else "use eps >= 1e-4 (--eps 1e-4)")
        return [RM.FLOAT16_EPS.remedy(opt=opt, eps=extra.get("eps", "1e-8 by default"), how=how)]
    return [RM.FIND_UPDATE.remedy(layer=layer)]


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
    if main.name == S.NONFINITE_USER_CODE:
        return _user_code_remedies(ev, main)
    stable = op_remedies(op) if main.name in S.NONFINITE_TENSORS else []
    out.extend(stable)
    if main.name in S.NONFINITE_TENSORS and op and narrow and main.extra.get("overflow"):
        out.append(RM.OP_OVERFLOW.remedy(op=op, layer=layer, narrow=str(narrow), autocast=(
            " (torch.autocast(device_type, enabled=False) around it)" if t.mixed_precision else "")))
    elif main.name in S.NONFINITE_TENSORS and op and not stable:
        out.append(f"find what makes {op} in '{layer}' (its own code) produce NaN/Inf: its input range, a "
                   "division by zero, log or sqrt of a non-positive value")
    if main.name in S.NONFINITE_TENSORS or main.name == S.GRADSCALER_COLLAPSE:
        if t is not None and t.mixed_precision and float16:
            out.append(RM.AUTOCAST_LAYER_FLOAT32.remedy(layer=layer))
        elif layer and narrow:  # float16's range ends at 65504, FP8's at 448/57344; bfloat16's and float32's do not
            out.append(RM.LAYER_BELOW_RANGE.remedy(layer=layer, largest=f"{narrow.largest:g}"))
        elif layer:
            keep = _keep_float32(t, layer=layer)
            if keep:
                out.append(keep)
            if not op:
                out.append(f"find what makes '{layer}' produce NaN/Inf: its input range, a division by zero, "
                           "log or sqrt of a non-positive value")
        if not stable or main.extra.get("overflow"):
            out.append("scale activations down (add normalisation before the layer)")
    if main.name == S.OUT_OF_RANGE and narrow:
        out.append(f"scale what '{layer}' produces into {narrow}'s range (below {narrow.largest:g}) before the "
                   "matmul/conv that reads it: normalise it, or give that operand a per-tensor scale as FP8 recipes do")
    if main.name == S.NONFINITE_WEIGHTS:
        out.extend(_weights_remedies(t, layer, main, own_factory=not _named_optimizer(ev.optimizer)))
    if main.name == S.GRADIENT_UNDERFLOW and float16:
        out.append(GRAD_SCALER_UNDERFLOW)
    elif main.name == S.GRADIENT_UNDERFLOW:  # bfloat16 has float32's range: zeros are lost digits
        out.append(f"{t.compute_format if t else 'this format'} keeps float32's range, so these zeros are lost "
                   "digits, not underflow: find the layer before it whose result cancels (the parity table's "
                   "worst rows) and compute it in float32")
    if main.name == S.ILL_CONDITIONED:
        out.append(RM.FEEDING_FLOAT32.remedy(layer=layer))
        out.append("remove large offsets or scales before it (normalise its input), so fewer digits are needed")
    if main.name == S.SMALL_UPDATES_LOST:
        out.append(MASTER_WEIGHTS)
    if main.name == S.OUTCOME_APART:
        out.append("find where the runs part: record both with convcheck.watch and convcheck diff them (the step "
                   "and the layer; a value that overflows inside a module's own code and is zeroed after it shows "
                   "there)")
    if main.name in (S.DRIFT, S.OUTCOME_OUTSIDE_ENVELOPE, S.NO_CONVERGENCE, S.OUTCOME_APART):
        if t is not None and t.tf32_like:
            out.append(RM.DISABLE_TF32.remedy())
        if t is not None and t.half_compute:
            out.append("run the sensitive layers in float32 under autocast, or train in float32")
        out.append("compare with --targets using the higher precision on both sides to confirm")
    return out
