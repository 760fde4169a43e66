"""The targets' symptoms of one comparison, ranked (``gather``'s ``target_symptoms`` and ``layer_notes``): what each
target shows against the judge - NaN/Inf and its producer, a layer error, gradient underflow, lost updates - and
against the envelope and the judge's outcome (drift, no convergence, ending apart). Read from the parity table and
the training curves; never runs a model."""

from __future__ import annotations

import math

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.detectors.producers import nonfinite_producer, saturation, training_producer
from convcheck.numerics.thresholds import APART_FACTOR, CONVERGENCE_MIN_STEPS, OUTCOME_ABSOLUTE, OUTCOME_RELATIVE

# How target symptoms rank (the first one found is the verdict's main symptom); drift and
# outcome symptoms rank last. The drift beyond the envelope is appended after the ranking.
# A layer that computes something else outranks what it causes downstream (gradient zeros in
# the next layer, no convergence); among layer errors the largest comes first.
_TARGET_RANK = {S.NONFINITE_FORWARD: 0, S.OUT_OF_RANGE: 0, S.NONFINITE_USER_CODE: 0, S.NONFINITE_BACKWARD: 1,
                S.NONFINITE_WEIGHTS: 1, S.NONFINITE_LOSS: 1, S.GRADSCALER_COLLAPSE: 2, S.LAYER_ERROR: 3,
                S.ILL_CONDITIONED: 4, S.GRADIENT_UNDERFLOW: 5, S.SMALL_UPDATES_LOST: 6}
_UNRANKED = 9
_NONFINITE_KINDS = (S.NONFINITE_FORWARD, S.NONFINITE_BACKWARD, S.NONFINITE_WEIGHTS, S.NONFINITE_USER_CODE,
                    S.NONFINITE_LOSS)

def _envelope_finals(curves) -> tuple[float, ...]:
    env = curves[curves["role"] == "envelope"]
    if not len(env):
        return ()
    return tuple(float(v) for v in env[env["step"] == env["step"].max()]["loss"])


def _target_symptoms(result) -> tuple[S.Symptom, ...]:
    """Every target's symptoms against the judge, ranked by ``_TARGET_RANK`` (stable)."""
    cfg = result.config
    out: list[S.Symptom] = []
    for t in cfg.targets:
        if t != cfg.judge:
            out += _symptoms_of(result, t)
    return tuple(sorted(out, key=_rank))


def _rank(s: S.Symptom) -> tuple:
    size = -(s.value or 0.0) if s.name == S.LAYER_ERROR else 0.0  # the largest layer error first
    # among NaN/Inf producers of equal rank, the target that went non-finite first
    step = s.step if s.step is not None and s.name in _NONFINITE_KINDS else 0
    return _TARGET_RANK.get(s.name, _UNRANKED), step, size


def _symptoms_of(result, t) -> list[S.Symptom]:
    """One target's symptoms. A flagged layer this target's other symptoms already name is no
    second symptom; a target with a symptom gets no extra one for not converging."""
    parity, training, cfg = result.parity, result.training, result.config
    name, judge = str(t), str(cfg.judge)
    out = _nonfinite_symptoms(result, t)
    out.append(S.grad_scaler_problems(training.curves, name))
    out.append(S.underflow(training.layer_grads, name, judge) if t.runner.half_compute else None)
    # lr*|g|/|W| is the step size of SGD only (Adam's steps are ~lr per element)
    lost = (S.lost_updates(training.curves, name, t.unit_roundoff, t.runner.half_storage)
            if cfg.optimizer == "sgd" else None)
    info = training.outcomes.get(t)
    # a run too short to judge convergence is "not converged" by default: there the symptom stands only when
    # the target's loss ends apart from the judge's (``_tracks_judge``), as the outcome rules judge it
    short = cfg.steps < CONVERGENCE_MIN_STEPS
    out.append(lost if info is not None and not info.converged
               and not (short and _tracks_judge(result, t)) else None)
    out = [s for s in out if s]
    layer = _flagged_layer(result, t)
    if layer is not None and any(s.layer == layer.layer for s in out):
        layer = None  # another symptom names it already
    small = layer is not None and not _matters(result, layer)
    if layer is not None and not small:
        out.append(layer)
    ill = S.ill_conditioned(parity.layers, name)
    if ill is not None and layer is None:
        out.append(ill)
    if not out:
        out += _outcome_symptoms(result, t)
    if small and out:  # a small flagged layer on a target in trouble: the first suspect
        out.append(layer)
    return out


def _flagged_layer(result, t) -> S.Symptom | None:
    flagged = result.parity.first_flagged.get(t)
    return _layer_error(result.parity, str(t), flagged) if flagged else None


def _matters(result, layer: S.Symptom) -> bool:
    """A flagged layer whose own error is at least ``min_error`` (or destroyed, non-finite) is a
    culprit on its own; a smaller one (float32 losing 1e-4 in an unstable formula) is a note
    unless the target shows other trouble."""
    return not (layer.value < result.config.tolerances.min_error)


def _layer_notes(result, symptoms: tuple[S.Symptom, ...]) -> tuple[S.Symptom, ...]:
    """Flagged layers too small to matter that no target symptom carries."""
    cfg = result.config
    notes = []
    for t in cfg.targets:
        layer = _flagged_layer(result, t) if t != cfg.judge else None
        if layer is not None and not any(s.arm == layer.arm and s.layer == layer.layer for s in symptoms):
            notes.append(layer)
    return tuple(notes)


def _nonfinite_symptoms(result, t) -> list[S.Symptom]:
    """The one-step producer of NaN/Inf (parity), or the first call whose values a saturating format
    cuts (both against the target's narrowest format), else the first producer during training
    when the judge's training had none."""
    training, name = result.training, str(t)
    fmt = t.runner.precision.narrowest
    nf = nonfinite_producer(result.parity.layers, name, fmt) or saturation(result.parity.layers, name, fmt)
    arm, judge = training.arm_of(t), training.arm_of(result.config.judge)
    producer = training.nonfinite_producer.get(arm)
    detail = dict(getattr(training, "nonfinite_detail", {}).get(arm) or {})
    if (nf is not None and nf.name == S.NONFINITE_BACKWARD and producer is not None and producer[0] == 0
            and detail.get("callable") == "loss"):
        nf = None  # parity's first NaN gradient came from a loss that was NaN/Inf already: the loss is the producer
    if nf is not None:
        return [nf]
    if producer is not None and training.nonfinite_producer.get(judge) is None:
        step, layer = producer
        return [training_producer(name, step, layer, detail, fmt,
                                    weights=bool(training.nonfinite_weights.get(arm)),
                                    finite_gradients=_gradients_finite_before(training, name, step))]
    return _nonfinite_loss(result, t)


def _gradients_finite_before(training, name: str, step: int) -> bool:
    curve = training.arm_curve(name)
    before = curve[curve["step"] == step - 1]
    return bool(len(before)) and not bool(before["nonfinite_grad"].any())


def _nonfinite_loss(result, t) -> list[S.Symptom]:
    """A target whose loss goes non-finite while the judge's stays finite, no producer named: the
    target itself (a backward or an update no hook saw), never the setup."""
    per, cfg = result.training.outcomes, result.config
    info, judge_info = per.get(t), per.get(cfg.judge)
    if info is None or info.first_nonfinite_step is None:
        return []
    if judge_info is None or judge_info.first_nonfinite_step is not None:
        return []
    step = info.first_nonfinite_step
    return [S.Symptom(S.NONFINITE_LOSS, str(t), f"{t}'s loss or gradients are non-finite from training step {step} "
                      f"while the float64 judge's stay finite (loss {judge_info.first_loss:.4g} -> "
                      f"{judge_info.final_loss:.4g})", step=step)]


def _layer_error(parity, name: str, flagged: str) -> S.Symptom:
    rows = parity.flagged(name)
    r = rows[rows["layer"] == flagged].sort_values("order").iloc[0]
    own = r["intrinsic"] if math.isfinite(r["intrinsic"]) else r["local"]
    what = f"'{flagged}' ({r['module']})" + (f", gradient of '{r['param']}'," if r["kind"] == "grad" else "")
    if not math.isfinite(own):
        size = f"its own result is non-finite ({own})"
    elif S.destroyed(own, r["floor"]):
        size = f"its own error is {own:.3g}: the result is destroyed, while its floor is {r['floor']:.2e}"
    else:
        size = (f"its own error is {own:.3g}, {r['over_floor']:.3g}x its floor {r['floor']:.2e} (the best any "
                f"implementation at {name}'s precision does on this input)")
    return S.Symptom(S.LAYER_ERROR, name, f"{what}: {size}; local error {r['local']:.3g}, propagated "
                     f"{r['propagated']:.3g} (flagged above {r['bound']:.2e})",
                     layer=flagged, value=float(own), extra={"kind": r["kind"], "module": str(r["module"])})


def _tracks_judge(result, t) -> bool:
    """The target's final loss within the outcome rules' margin of the judge's (OUTCOME_RELATIVE of the loss's
    scale, as ``_apart_from_judge`` holds the other target) or inside the envelope runs' final losses."""
    per, name = result.training.outcomes, str(t)
    info, judge_info = per.get(t), per.get(result.config.judge)
    if info is None or judge_info is None or not (math.isfinite(info.final_loss)
                                                  and math.isfinite(judge_info.final_loss)):
        return False
    curves = result.training.curves
    if (curves["role"] == "envelope").any() and S.outcome_vs_envelope(curves, name) is None:
        return True
    margin = OUTCOME_RELATIVE * _loss_scale(judge_info.first_loss, judge_info.final_loss) + OUTCOME_ABSOLUTE
    return abs(info.final_loss - judge_info.final_loss) <= margin


def _outcome_symptoms(result, t) -> list[S.Symptom]:
    """A target that did not converge while the judge did, and with no other symptom.

    Borderline runs that only just miss the rule are not a finding: the outcome must be worse
    than the envelope runs', or (without an envelope) clearly worse than the judge's."""
    cfg, curves, per, name = result.config, result.training.curves, result.training.outcomes, str(t)
    info, judge_info = per.get(t), per.get(cfg.judge)
    judge_ok = judge_info.converged if judge_info else True
    if cfg.steps >= CONVERGENCE_MIN_STEPS and info and info.converged and judge_info and judge_ok:
        return _apart_from_judge(result, t, info, judge_info)
    if cfg.steps < CONVERGENCE_MIN_STEPS or not info or info.converged or not judge_ok:
        return []
    has_envelope = bool((curves["role"] == "envelope").any())
    oc = S.outcome_vs_envelope(curves, name) if has_envelope else None
    judge_final = judge_info.final_loss if judge_info else math.nan
    worse = (not math.isfinite(info.final_loss)
             or info.final_loss > judge_final * (1 + OUTCOME_RELATIVE) + OUTCOME_ABSOLUTE)
    if oc:
        return [oc]
    perturbs = has_envelope and bool((curves[(curves["role"] == "envelope")]["target"] == name).any())
    finals = _envelope_finals(curves) if perturbs else ()
    # every envelope run of this target fails alike, it and they far above the judge (``ends_apart``): the
    # precision fails deterministically, not by chance - within the envelope is no alibi then (a trial:
    # min_error=1000 turned a destroyed bf16 layer into a note, and the bf16 arm ending at 128 against the
    # judge's 0.87 was 'ok'); a borderline run just missing the rule beside its like envelope is no finding
    judge_first = judge_info.first_loss if judge_info else math.nan
    far = (lambda v: not math.isfinite(v) or ends_apart(v, judge_final, judge_first))  # noqa: E731
    alike = bool(finals) and far(info.final_loss) and all(far(v) for v in finals)
    if worse and (not has_envelope or alike):
        why = (f"; its {len(finals)} one-ulp envelope runs fail alike (final losses "
               f"{min(finals):.4g}..{max(finals):.4g}): its precision, not chance" if alike else "")
        return [S.Symptom(S.NO_CONVERGENCE, name,
                          f"{name} did not converge (loss {info.first_loss:.4g} -> "
                          f"{info.final_loss:.4g}) while the judge did (-> {judge_final:.4g}){why}")]
    return []


def _apart_from_judge(result, t, info, judge_info) -> list[S.Symptom]:
    """A target that converges, but ends far above the float64 judge while the other target ends with the
    judge, and (with an envelope) whose every envelope run ends as far off: its precision changes where
    training ends, though no NaN/Inf reaches a module's output (a silent overflow inside a module's own
    code, zeroed by what follows it, does this). Above the judge by more than OUTCOME_RELATIVE of the loss's
    scale and by APART_FACTOR times; the other target within OUTCOME_RELATIVE of it."""
    cfg, per, name = result.config, result.training.outcomes, str(t)
    jf, final = judge_info.final_loss, info.final_loss
    if not (math.isfinite(jf) and math.isfinite(final)):
        return []
    if not ends_apart(final, jf, judge_info.first_loss):
        return []
    margin = OUTCOME_RELATIVE * _loss_scale(judge_info.first_loss, jf) + OUTCOME_ABSOLUTE
    others = [(str(o), per[o]) for o in cfg.targets if o != t and o != cfg.judge and o in per]
    if any(not math.isfinite(o.final_loss) or abs(o.final_loss - jf) > margin for _, o in others):
        return []  # the other target ends elsewhere too: not this target's precision alone
    if any(math.isfinite(v) and v <= jf + margin for v in _envelope_finals(result.training.curves)):
        return []  # an envelope run ends with the judge: chance, not the precision
    other = f", {others[0][0]} at {others[0][1].final_loss:.4g}" if others else ""
    return [S.Symptom(S.OUTCOME_APART, name, f"{name} ends at loss {final:.4g}, {final / jf:.3g}x the float64 "
                      f"judge's {jf:.4g}{other} (first loss {info.first_loss:.4g})", value=final,
                      extra={"judge_final": jf})]


def ends_apart(final: float, judge_final: float, judge_first: float) -> bool:
    """Whether a final loss ends far above the float64 judge's: above it by more than OUTCOME_RELATIVE of
    the loss's scale and above APART_FACTOR times it (a bf16 arm converging 51 -> 27 by the relative rule
    while the judge ends at 0.75). ``_apart_from_judge``'s test, and what the training lines add to
    "converged"."""
    if not (math.isfinite(final) and math.isfinite(judge_final)):
        return False
    margin = OUTCOME_RELATIVE * _loss_scale(judge_first, judge_final) + OUTCOME_ABSOLUTE
    return final > judge_final + margin and final > APART_FACTOR * judge_final


def _loss_scale(first: float, final: float) -> float:
    """What a final loss is measured against: its own size, or how far the loss fell from its first value
    where that is more - near a loss of 0, two converged runs ending at 0.0047 and 0.0013 (from 2.4) end
    alike, though one is 3.7x the other (issue 24 item 5: a DDP arm with per-rank BatchNorm)."""
    fall = first - final if math.isfinite(first) and math.isfinite(final) else 0.0
    return max(abs(final), fall)
