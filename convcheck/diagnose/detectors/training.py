"""Detectors: read the parity table and the training curves, return ``Symptom`` records.

Each detector is a small function with its thresholds named at the top of this
file, each with the source it was taken from. Detectors never run a model;
``diagnose`` turns their symptoms into a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from convcheck.numerics.thresholds import (
    ACTIVATION_TAIL_STEPS,
    DEAD_RELU_FRACTION,
    DESTROYED_ERROR,
    ENVELOPE_BENIGN,
    ENVELOPE_FAR,
    ENVELOPE_RUN,
    ENVELOPE_SPREAD_FLOOR,
    EXPLODING_LAYER_RATIO,
    FALLING_MIN_POINTS,
    FALLING_SIGNIFICANCE,
    INPUT_ABS_MAX,
    INPUT_STD_MAX,
    LOSS_NAN_LIKE,
    LOSS_RISE_FACTOR,
    OSCILLATION_MIN_STEPS,
    OSCILLATION_NOT_FALLING,
    OSCILLATION_SHARE,
    OSCILLATION_SWING,
    OUTCOME_SPREADS,
    OUTCOME_RELATIVE,
    PLATEAU_MIN_DROP,
    PLATEAU_MIN_STEPS,
    PLATEAU_TOLERANCE,
    SATURATED_ABS,
    SATURATED_FRACTION,
    SCALE_COLLAPSED,
    SKIP_RATE_HIGH,
    TINY_NORM,
    UNDERFLOW_EXTRA_ZEROS,
    UPDATE_RATIO_HIGH,
    VANISHING_FIRST_NORM,
    VANISHING_LAYER_RATIO,
)

# --- symptom kinds: every Symptom.name, and the verdict's own symptom names ----------------
# Training problems (any arm; the judge's decide a "setup" verdict).
NONFINITE_LOSS = "non-finite loss"
# what a NONFINITE_LOSS symptom is called when every loss stayed finite (>= LOSS_NAN_LIKE: NaN-like by the rule)
EXPLODING_LOSS = "exploding loss"
EXPLODING_GRADIENTS = "exploding gradients / learning rate too high"
VANISHING_GRADIENTS = "vanishing gradients"
SATURATED_ACTIVATIONS = "saturated activations"
DEAD_RELUS = "dead ReLUs"
LOSS_PLATEAU = "loss plateau"
OSCILLATING_LOSS = "oscillating loss"
INPUT_OUT_OF_RANGE = "input data out of range"  # about the data, not an arm
# Target symptoms (a target against the judge, or against the other target's envelope).
NONFINITE_FORWARD = "non-finite forward"
NONFINITE_BACKWARD = "non-finite backward"
NONFINITE_WEIGHTS = "non-finite weights"  # an optimizer step turned finite weights into NaN/Inf
OUT_OF_RANGE = "values beyond the format's range"  # saturated by a format without Inf (FP8 E4M3)
GRADSCALER_COLLAPSE = "GradScaler collapse"
LAYER_ERROR = "layer error"
ILL_CONDITIONED = "ill-conditioned layer"  # its floor alone loses the result at this precision
GRADIENT_UNDERFLOW = "gradient underflow"
SMALL_UPDATES_LOST = "small updates lost"
DRIFT = "drift beyond envelope"
DRIFT_WITHIN = "drift within envelope"  # evidence for an ok verdict, never a target symptom
OUTCOME_OUTSIDE_ENVELOPE = "outcome outside envelope"
NO_CONVERGENCE = "no convergence"
OUTCOME_APART = "ends apart from the judge"  # converges, but systematically worse than the judge
# Symptoms only the verdict names (no detector returns them).
STOCHASTIC_LAYER = "stochastic layer"
ENVELOPE_RUNS_FAIL = "envelope runs fail"
SELF_DIFFERENCE = "self difference"

# NaN/Inf made by a user callable of the training step that is not a module: the loss, the schedule
NONFINITE_USER_CODE = "non-finite in user code"

NONFINITE_TENSORS = (NONFINITE_FORWARD, NONFINITE_BACKWARD)


@dataclass(frozen=True)
class Symptom:
    """One thing a detector saw: what, on which arm, where, and the numbers. ``label``: the words a reader
    sees for ``name`` (``extra["label"]`` where the name would say more than happened)."""

    name: str
    arm: str
    evidence: str
    layer: str | None = None
    step: int | None = None
    value: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.extra.get("label", self.name)


# --- training problems (run on every arm) ----------------------------------------------------

def training_problems(curves: pd.DataFrame, layer_grads: pd.DataFrame, acts: pd.DataFrame, arm: str,
                      num_classes: int, lr: float) -> list[Symptom]:
    """Exploding/vanishing gradients, dead ReLUs, plateau, oscillation, non-finite loss on ``arm``."""
    c = curves[curves["arm"] == arm].sort_values("step")
    out: list[Symptom] = []
    losses = [float(v) for v in c["loss"]]
    if not losses:
        return out
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v) or v >= LOSS_NAN_LIKE]
    if bad:
        step = int(c["step"].iloc[bad[0]])
        first = losses[bad[0]]
        nonfinite = next((i for i in bad if not math.isfinite(losses[i])), None)
        if nonfinite is None:  # every loss finite: it explodes, NaN-like by the rule - never "non-finite" in words
            peak = max(losses[i] for i in bad)
            out.append(Symptom(NONFINITE_LOSS, arm, f"the loss explodes to {first:.3g} at step {step}"
                               + (f" (up to {peak:.3g})" if peak > first else "")
                               + f", NaN-like by AUTOTRAINER's rule (>= {LOSS_NAN_LIKE:g}); every loss stays finite",
                               step=step, value=first, extra={"label": EXPLODING_LOSS}))
        else:
            later = "" if nonfinite == bad[0] else f", non-finite from step {int(c['step'].iloc[nonfinite])}"
            out.append(Symptom(NONFINITE_LOSS, arm, f"loss {first:.3g} at step {step}{later} "
                               f"(non-finite or >= {LOSS_NAN_LIKE:g}, AUTOTRAINER's NaN-like rule)", step=step))
    g = layer_grads[layer_grads["arm"] == arm]
    out += _gradient_problems(c, g, arm, lr, losses)
    mine = acts[acts["arm"] == arm]
    saturating = sorted(set(mine["kind"]) - {"relu"}) if len(mine) else []
    for sym in out:  # which saturating activations the model has: the remedy for vanishing gradients names them
        if sym.name == VANISHING_GRADIENTS:
            sym.extra["saturating"] = saturating
    out += _activation_problems(mine, arm)
    finite = [v for v in losses if math.isfinite(v)]
    half = finite[len(finite) // 2:]
    chance = math.log(num_classes) if num_classes and num_classes > 1 else math.nan
    if (len(half) >= PLATEAU_MIN_STEPS and math.isfinite(chance)
            and all(abs(v - chance) < PLATEAU_TOLERANCE * chance for v in half)
            and half[0] - half[-1] < PLATEAU_MIN_DROP * chance and not falling(finite)):
        out.append(Symptom(LOSS_PLATEAU, arm, f"loss stays at {half[-1]:.3f}, within "
                           f"{PLATEAU_TOLERANCE:.0%} of chance ln({num_classes}) = {chance:.3f}, "
                           f"over the last {len(half)} steps", value=half[-1]))
    if len(finite) >= OSCILLATION_MIN_STEPS:
        mean = sum(finite) / len(finite)
        swings = sum(1 for a, b, d in zip(finite, finite[1:], finite[2:])
                     if (b - a) * (d - b) < 0 and min(abs(b - a), abs(d - b)) >= OSCILLATION_SWING * mean)
        share = swings / (len(finite) - 2)
        if share >= OSCILLATION_SHARE and finite[-1] >= OSCILLATION_NOT_FALLING * finite[0]:
            out.append(Symptom(OSCILLATING_LOSS, arm, f"the loss changes direction by >= "
                               f"{OSCILLATION_SWING:.0%} in {share:.0%} of the steps without falling",
                               value=share))
    return out


def falling(losses: list[float]) -> bool:
    """The loss is still falling: over the second half of the run (at least FALLING_MIN_POINTS
    finite losses) a least-squares line falls by more than FALLING_SIGNIFICANCE times the
    root-mean-square spread of the losses around it."""
    finite = [v for v in losses if math.isfinite(v)]
    tail = finite[-max(FALLING_MIN_POINTS, len(finite) // 2):]
    n = len(tail)
    if n < FALLING_MIN_POINTS:
        return False
    mean_x, mean_y = (n - 1) / 2, sum(tail) / n
    slope = (sum((i - mean_x) * (v - mean_y) for i, v in enumerate(tail))
             / sum((i - mean_x) ** 2 for i in range(n)))
    spread = math.sqrt(sum((v - (mean_y + slope * (i - mean_x))) ** 2 for i, v in enumerate(tail)) / n)
    return slope < 0 and -slope * (n - 1) > FALLING_SIGNIFICANCE * spread


def still_falling(curves: pd.DataFrame, arm: str) -> bool:
    """``falling`` on one arm's loss curve."""
    c = curves[curves["arm"] == arm].sort_values("step")
    return falling([float(v) for v in c["loss"]])


def _gradient_problems(c: pd.DataFrame, g: pd.DataFrame, arm: str, lr: float, losses) -> list[Symptom]:
    out: list[Symptom] = []
    norms = [float(v) for v in c["grad_norm"]]
    nonfinite = [i for i, v in enumerate(norms) if not math.isfinite(v)]
    ratios = [float(v) for v in c["update_ratio"] if math.isfinite(v)]
    rising = all(math.isfinite(v) for v in losses[-1:]) and losses[-1] > losses[0] * LOSS_RISE_FACTOR
    finite_norms = [v for v in norms if math.isfinite(v)]
    grew = len(finite_norms) >= 2 and max(finite_norms) > EXPLODING_LAYER_RATIO * max(finite_norms[0], TINY_NORM)
    if nonfinite or grew or rising or (ratios and max(ratios) > UPDATE_RATIO_HIGH and rising):
        step = int(c["step"].iloc[nonfinite[0]]) if nonfinite else None
        why = []
        if nonfinite:
            why.append(f"gradient norm non-finite from step {step}")
        if grew:
            why.append(f"gradient norm grew {max(finite_norms) / max(finite_norms[0], TINY_NORM):.3g}x "
                       f"(> {EXPLODING_LAYER_RATIO:g}x)")
        if rising:
            why.append(f"loss rose from {losses[0]:.3g} to {losses[-1]:.3g}")
        if ratios:
            high = max(ratios) > UPDATE_RATIO_HIGH
            why.append(f"largest update ratio lr*|g|/|W| = {max(ratios):.3g} "
                       + (f"(DeepDiagnosis: > {UPDATE_RATIO_HIGH:g} is too high)" if high
                          else f"(below DeepDiagnosis' {UPDATE_RATIO_HIGH:g})"))
        out.append(Symptom(EXPLODING_GRADIENTS, arm, "; ".join(why), step=step,
                           value=max(ratios) if ratios else None, extra={"lr": lr}))
    if len(g):
        layers = list(dict.fromkeys(g["layer"]))
        first, last = layers[0], layers[-1]
        gf = g[g["layer"] == first].set_index("step")["grad_norm"]
        gl = g[g["layer"] == last].set_index("step")["grad_norm"]
        steps = [s for s in gf.index if s in gl.index]
        vanished = [s for s in steps if math.isfinite(gf[s]) and gl[s] > 0
                    and gf[s] / gl[s] < VANISHING_LAYER_RATIO and gf[s] < VANISHING_FIRST_NORM]
        if steps and len(vanished) >= max(1, len(steps) // 2):
            s = vanished[-1]
            out.append(Symptom(VANISHING_GRADIENTS, arm,
                               f"gradient norm of the first layer '{first}' is {gf[s]:.2e}, "
                               f"{gf[s] / gl[s]:.2e} of the last layer '{last}' ({gl[s]:.2e}) in "
                               f"{len(vanished)}/{len(steps)} steps (AUTOTRAINER: ratio < {VANISHING_LAYER_RATIO:g} "
                               f"and norm < {VANISHING_FIRST_NORM:g})", layer=first, value=float(gf[s])))
    return out


def _activation_problems(a: pd.DataFrame, arm: str) -> list[Symptom]:
    out: list[Symptom] = []
    if not len(a):
        return out
    last_steps = sorted(a["step"].unique())[-ACTIVATION_TAIL_STEPS:]
    tail = a[a["step"].isin(last_steps)]
    relu = tail[tail["kind"] == "relu"].groupby("layer", sort=False)["dead_frac"].mean()
    dead = relu[relu >= DEAD_RELU_FRACTION]
    if len(dead):
        layer = dead.idxmax()
        out.append(Symptom(DEAD_RELUS, arm, f"{dead.max():.0%} of the outputs of '{layer}' are <= 0 over the "
                           f"last {len(last_steps)} steps (DeepDiagnosis: >= {DEAD_RELU_FRACTION:.0%}); "
                           f"{len(dead)} ReLU layer(s) affected", layer=layer, value=float(dead.max())))
    sat = tail[tail["kind"] != "relu"].groupby("layer", sort=False)["saturated_frac"].mean()
    sat = sat[sat > SATURATED_FRACTION]
    if len(sat):
        layer = sat.idxmax()
        out.append(Symptom(SATURATED_ACTIVATIONS, arm, f"{sat.max():.0%} of the pre-activations of '{layer}' "
                           f"lie outside +-{SATURATED_ABS:g} (DeepDiagnosis: > {SATURATED_FRACTION:.0%})", layer=layer,
                           value=float(sat.max())))
    return out


def data_problems(stats: dict) -> list[Symptom]:
    """Input features far outside a normalised range (labels out of range are rejected when loading)."""
    if not stats:
        return []
    big = max(abs(stats.get("x_min", 0.0)), abs(stats.get("x_max", 0.0)))
    std = stats.get("x_std", 0.0)
    if big > INPUT_ABS_MAX or std > INPUT_STD_MAX:
        return [Symptom(INPUT_OUT_OF_RANGE, "data",
                        f"inputs span [{stats['x_min']:.3g}, {stats['x_max']:.3g}] with std {std:.3g} "
                        f"(expected roughly standardised values, |x| < {INPUT_ABS_MAX:g})", value=big)]
    return []


# --- numerics (targets against the judge) ----------------------------------------------------

def destroyed(error: float, floor: float) -> bool:
    """A result (mostly) lost although its floor is not (``Tolerances.destroys``)."""
    return error >= DESTROYED_ERROR and not floor >= DESTROYED_ERROR


def ill_conditioned(layers: pd.DataFrame, target: str) -> Symptom | None:
    """The first layer whose result is lost at the target's precision although its arithmetic is
    not to blame: its local error and its floor (exact arithmetic on its operands rounded to that
    precision) are both at least DESTROYED_ERROR. Not flagged: a numerics finding naming it."""
    t = layers[(layers["target"] == target) & (layers["kind"] == "forward") & ~layers["flagged"]]
    # finite only: an input the target's format cannot hold at all (an overflow upstream) is named
    # by the non-finite scan, not here
    lost = t[(t["local"] >= DESTROYED_ERROR) & (t["floor"] >= DESTROYED_ERROR)
             & t["local"].map(math.isfinite) & t["floor"].map(math.isfinite)]
    if not len(lost):
        return None
    r = lost.sort_values("order").iloc[0]
    return Symptom(ILL_CONDITIONED, target,
                   f"'{r['layer']}' ({r['module']}) loses its result at {target}'s precision: its floor (exact "
                   f"arithmetic on its input and parameters rounded to that precision) is {r['floor']:.3g}, its "
                   f"local error {r['local']:.3g}; its own arithmetic adds little", layer=r["layer"],
                   value=float(r["floor"]), extra={"module": str(r["module"])})


def grad_scaler_problems(curves: pd.DataFrame, target: str) -> Symptom | None:
    c = curves[curves["arm"] == target]
    scales = [float(v) for v in c["loss_scale"] if math.isfinite(v)]
    if not scales:
        return None
    skipped = int(c["skipped"].sum())
    rate = skipped / max(1, len(c))
    if rate > SKIP_RATE_HIGH or scales[-1] < SCALE_COLLAPSED:
        return Symptom(GRADSCALER_COLLAPSE, target,
                       f"GradScaler skipped {skipped}/{len(c)} steps ({rate:.0%}); scale ended at {scales[-1]:.3g} "
                       f"(from {scales[0]:.3g}); a scale below 1 means the forward pass itself overflows",
                       value=scales[-1], extra={"skip_rate": rate})
    return None


def underflow(layer_grads: pd.DataFrame, target: str, judge: str) -> Symptom | None:
    g = layer_grads.groupby(["arm", "layer"], sort=False)["zero_frac"].mean()
    if target not in g.index.get_level_values(0) or judge not in g.index.get_level_values(0):
        return None
    extra = (g[target] - g[judge]).dropna()
    worst = extra[extra > UNDERFLOW_EXTRA_ZEROS]
    if len(worst):
        layer = worst.idxmax()
        return Symptom(GRADIENT_UNDERFLOW, target,
                       f"{g[target][layer]:.0%} of the gradient entries of '{layer}' are exactly zero against "
                       f"{g[judge][layer]:.0%} for the judge", layer=layer, value=float(worst.max()))
    return None


def lost_updates(curves: pd.DataFrame, target: str, unit_roundoff: float, weights_low_precision: bool) -> Symptom | None:
    """Weights stored in bf16/fp16 drop updates smaller than about u of the weight (FACTS.md). The steps of a
    warm-up (the learning rate still rising to its peak) do not count: their small updates are the warm-up's
    design, and a short run that is mostly warm-up would be judged on them alone."""
    if not weights_low_precision:
        return None
    c = curves[curves["arm"] == target].sort_values("step")
    if "lr" in c and len(c):
        lr = [float(v) for v in c["lr"]]
        finite = [v for v in lr if math.isfinite(v)]
        peak = lr.index(max(finite)) if finite else 0
        c = c.iloc[peak:]  # before the first step at the peak the rate is still rising
    ratios = sorted(float(v) for v in c["update_ratio"] if math.isfinite(v))
    if not ratios:
        return None
    median = ratios[len(ratios) // 2]
    if median < unit_roundoff:
        return Symptom(SMALL_UPDATES_LOST, target,
                       f"median update ratio lr*|g|/|W| = {median:.2e} is below the weights' unit roundoff "
                       f"{unit_roundoff:.2e}: most updates round away", value=median)
    return None


def envelope_drift(curves: pd.DataFrame, targets: list[str], reference: str,
                   envelope: str = "one-ulp envelope") -> Symptom | None:
    """Drift between the two targets against the spread of the envelope runs of ``reference``.

    Returns a Symptom named "drift beyond envelope" when it leaves the envelope early and by
    far, else one named "drift within envelope" carrying the largest ratio seen. ``envelope`` names
    the envelope's null model (``EnvelopeSummary.null_model``); the symptom's ``extra["envelope"]``.
    """
    env = curves[curves["role"] == "envelope"]
    pair = curves[curves["arm"] == targets[0]].set_index("step")["dist_other"]
    if not len(env) or not len(pair) or pair.isna().all():
        return None
    spread = env.groupby("step")["dist_ref"].max()
    steps = sorted(set(spread.index) & set(pair.index))
    ratio = {s: (float(pair[s]) / max(float(spread[s]), ENVELOPE_SPREAD_FLOOR)) if math.isfinite(pair[s])
             else math.inf for s in steps}
    window = steps[: max(ENVELOPE_RUN, len(steps) // 2)]
    run, start = 0, None
    for s in window:
        run = run + 1 if ratio[s] > ENVELOPE_FAR else 0
        if run == 1:
            start = s
        if run >= min(ENVELOPE_RUN, len(window)):
            how = (f"is {ratio[s]:.3g}x the spread of {reference}'s {envelope}" if math.isfinite(ratio[s]) else
                   f"is not finite (a run's weights hold NaN/Inf), beyond any spread of {reference}'s {envelope}")
            return Symptom(DRIFT, reference,
                           f"parameter distance between {targets[0]} and {targets[1]} {how} from step {start} (> "
                           f"{ENVELOPE_FAR:g}x for "
                           f"{ENVELOPE_RUN} steps in the first half)", step=start, value=ratio[s],
                           extra={"envelope": envelope, "largest": max(ratio.values())})
    worst = max(ratio.values())
    if not math.isfinite(worst):  # a run's weights went NaN/Inf after the window: said in words, never "infx"
        k = next(s for s in steps if not math.isfinite(ratio[s]))
        return Symptom(DRIFT_WITHIN, reference,
                       f"the parameter distance between {targets[0]} and {targets[1]} is not finite from step {k} "
                       "(a run's weights hold NaN/Inf); no drift beyond the envelope before it", value=worst,
                       extra={"envelope": envelope})
    size = ("rounding noise" if worst <= ENVELOPE_BENIGN
            else f"above {ENVELOPE_BENIGN:g}x at times but not {ENVELOPE_FAR:g}x early and for long")
    return Symptom(DRIFT_WITHIN, reference,
                   f"drift between {targets[0]} and {targets[1]} stays within {worst:.3g}x the spread of "
                   f"{reference}'s {envelope} ({size})", value=worst, extra={"envelope": envelope})


def outcome_vs_envelope(curves: pd.DataFrame, target: str) -> Symptom | None:
    """A target's final loss outside the envelope runs' final losses (widened by a few spreads)."""
    env = curves[curves["role"] == "envelope"]
    if not len(env):
        return None
    last = env["step"].max()
    finals = [float(v) for v in env[env["step"] == last]["loss"]]
    mine = curves[(curves["arm"] == target) & (curves["step"] == last)]["loss"]
    if not len(mine) or not all(math.isfinite(v) for v in finals):
        return None
    value = float(mine.iloc[0])
    lo, hi = min(finals), max(finals)
    margin = OUTCOME_SPREADS * (hi - lo) + OUTCOME_RELATIVE * abs(sum(finals) / len(finals))
    if not math.isfinite(value) or value > hi + margin:
        return Symptom(OUTCOME_OUTSIDE_ENVELOPE, target,
                       f"final loss {value:.4g} against {lo:.4g}..{hi:.4g} for the envelope runs", value=value)
    return None
