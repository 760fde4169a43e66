"""``Evidence``: everything the verdict rules read, gathered once from a comparison result.

``gather(result)`` runs the detectors of ``convcheck.diagnose.detectors.training`` over the parity
table and the training curves and copies the facts the rules need (per-arm
outcomes, the envelope summary, parity facts, environment findings, config
facts) into one frozen record. It never runs a model and never calls into
``convcheck.measure.train``: training has already summarised itself in
``training.outcomes``, ``training.envelope`` and ``training.lower_precision``.
The rules (``rules.py``) read nothing else, so a test can build an ``Evidence``
by hand. The results key their facts by ``Target`` (and ``Arm``); the evidence
keys them by the target's name, the one its messages print.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.detectors.producers import nonfinite_producer, saturation, training_producer
from convcheck.diagnose.detectors.recipe import peak_lr, recipe_problems
from convcheck.measure.table_schema import named
from convcheck.plan.config import CompareConfig
from convcheck.targets.executors import executor_for
from convcheck.numerics.thresholds import DRIFT_NOTE_MAX, APART_FACTOR, CONVERGENCE_MIN_STEPS, OUTCOME_ABSOLUTE, OUTCOME_RELATIVE, \
    OUTCOME_SPREADS
from convcheck.numerics.tolerances import Tolerances

if TYPE_CHECKING:  # types only: importing convcheck.measure.train would import the training loop
    from convcheck.measure.train.result import ArmOutcome, EnvelopeSummary

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
_CONFIG = CompareConfig()  # the defaults of the config facts


@dataclass(frozen=True)
class TargetFacts:
    """What the remedies need to know about one target's runner."""

    mixed_precision: bool = False  # autocast: half compute, float32 weights
    tf32_like: bool = False  # matmul/conv operands rounded to 10 mantissa bits
    half_compute: bool = False  # some arithmetic in bf16/fp16
    half_storage: bool = False  # the whole model cast to bf16/fp16 (weights included)
    compute_format: str = "float32"  # the dtype its matmuls/convs compute in: float16 ends at 65504


@dataclass(frozen=True)
class LayerMargin:
    """The row of one target whose own error is furthest above its floor (unflagged)."""

    target: str
    layer: str
    error: float  # its own error (intrinsic where measured, else local)
    ratio: float  # error / floor
    floor: float
    module: str = ""
    measured: bool = True  # False: settled against the free lower bound of its floor (no float64 re-run)


@dataclass(frozen=True)
class Evidence:
    """One comparison as the rules see it. Every field has a neutral default (nothing seen; the
    config facts default to ``CompareConfig``'s, without an envelope)."""

    # --- config facts
    targets: tuple[str, ...] = ()  # the two targets as asked for (the judge may be one of them)
    judge: str = "cpu:float64"
    steps: int = _CONFIG.steps
    lr: float = _CONFIG.lr  # the peak learning rate the judge ran (its curves), else the config's
    optimizer: str = _CONFIG.optimizer
    envelope_runs: int = 0  # envelope runs asked for (CompareConfig.envelope)
    tolerances: Tolerances = _CONFIG.tolerances
    target_facts: Mapping[str, TargetFacts] = field(default_factory=dict)
    # --- training: per-arm outcomes (targets and judge) and the envelope runs' summary
    outcomes: Mapping[str, ArmOutcome] = field(default_factory=dict)
    envelope: EnvelopeSummary | None = None
    envelope_finals: tuple[float, ...] = ()  # the envelope runs' final losses
    still_falling: Mapping[str, bool] = field(default_factory=dict)  # per arm: its loss still falls at the end
    # --- symptoms
    target_symptoms: tuple[S.Symptom, ...] = ()  # ranked; the drift is not among them
    drift: S.Symptom | None = None  # S.DRIFT or S.DRIFT_WITHIN, None without an envelope
    data_symptoms: tuple[S.Symptom, ...] = ()
    judge_problems: tuple[S.Symptom, ...] = ()  # training problems of the judge's own run
    # --- parity facts
    stochastic_layers: tuple[str, ...] = ()
    self_difference: Mapping[str, float] = field(default_factory=dict)
    flagged_layers: Mapping[str, str | None] = field(default_factory=dict)  # first flagged, per target
    closest_layers: tuple[LayerMargin, ...] = ()
    # flagged layers whose own error stays below min_error on a target with no other symptom
    layer_notes: tuple[S.Symptom, ...] = ()
    # --- environment findings (convcheck.env.Finding)
    findings: tuple = ()
    # --- findings of the targets' executors (``convcheck.targets.executors.Finding``: a ``ddp:`` target's ranks), arm by arm
    executor_findings: tuple = ()

    @property
    def judgeable(self) -> bool:
        """Whether convergence can be judged: one loss value says nothing about it."""
        return self.steps >= CONVERGENCE_MIN_STEPS

    @property
    def judge_outcome(self) -> ArmOutcome | None:
        return self.outcomes.get(self.judge)

    @property
    def envelope_failed(self) -> int:
        return self.envelope.failed if self.envelope else 0

    @property
    def step0_symptoms(self) -> tuple[S.Symptom, ...]:
        """Target symptoms one-step parity already shows: they name a target-only cause."""
        return tuple(s for s in self.target_symptoms if s.step == 0 or s.name == S.LAYER_ERROR)

    @property
    def symptoms(self) -> tuple[S.Symptom, ...]:
        """Every target symptom, ranked, the drift beyond the envelope last."""
        drift = (self.drift,) if self.drift is not None and self.drift.name == S.DRIFT else ()
        return self.target_symptoms + drift

    def outcome_changed(self, name: str) -> bool:
        """Whether target ``name`` ends differently beyond what the envelope's own runs reach: another
        convergence than the other target's, or a final loss outside the envelope runs' final losses
        (widened as ``outcome_vs_envelope`` widens them; without an envelope, the other target's final
        loss within OUTCOME_RELATIVE). A finding that changes nothing there is a note, not the verdict."""
        info = self.outcomes.get(name)
        if info is None or not math.isfinite(info.final_loss):
            return True
        others = [self.outcomes[n] for n in self.targets if n != name and n in self.outcomes]
        if self.judgeable and any(o.converged != info.converged for o in others):
            return True
        band = self.outcome_band(name)
        if band is not None:
            lo, hi, margin = band
            return not lo - margin <= info.final_loss <= hi + margin
        return any(abs(info.final_loss - o.final_loss) > OUTCOME_RELATIVE * _loss_scale(o.first_loss, o.final_loss)
                   + OUTCOME_ABSOLUTE for o in others)

    @property
    def drift_far(self) -> bool:
        """Drift beyond the envelope by more than DRIFT_NOTE_MAX times its spread: never a note of ``ok``."""
        d = self.drift
        largest = d.extra.get("largest", d.value) if d is not None else None  # over the run, not where it fired
        return d is not None and d.name == S.DRIFT and largest is not None and largest > DRIFT_NOTE_MAX

    def outcome_band(self, name: str) -> tuple[float, float, float] | None:
        """``(lo, hi, margin)``: the envelope runs' final losses and the margin ``outcome_changed`` widens them
        by (OUTCOME_SPREADS of their range + OUTCOME_RELATIVE of the loss's scale); None without them."""
        info = self.outcomes.get(name)
        finals = [v for v in self.envelope_finals if math.isfinite(v)]
        if info is None or not finals:
            return None
        lo, hi = min(finals), max(finals)
        return lo, hi, OUTCOME_SPREADS * (hi - lo) + OUTCOME_RELATIVE * _loss_scale(info.first_loss,
                                                                                    sum(finals) / len(finals))

    def outcome_text(self) -> str:
        """What the targets' final losses were held against (the ``ok`` verdict's drift note): the envelope
        runs' range and the margin, in numbers, not 'within the envelope'."""
        parts, bands = [], []
        for n in self.targets:
            info, band = self.outcomes.get(n), self.outcome_band(n)
            if n == self.judge or info is None or band is None:
                continue
            parts.append(f"{n} ends at {info.final_loss:.5g}")
            bands.append(band)
        if not parts:
            return "both targets converge alike and end alike"
        lo, hi = bands[0][0], bands[0][1]  # the envelope runs' finals: the same for every target
        margin = min(b[2] for b in bands)  # each target's margin scales with its own first loss: the tightest said
        return (f"{', '.join(parts)} against the envelope runs' {lo:.5g}..{hi:.5g}, within the margin of "
                f"{margin:.3g} that the outcome rule allows ({OUTCOME_RELATIVE:.0%} of the loss's size or fall)")

    def same_precision(self) -> bool:
        """Whether the two targets compute at the same precision (they differ at most in reduction order:
        data-parallel ranks, SyncBatchNorm, another BLAS)."""
        facts = [self.target_facts.get(n) for n in self.targets if n != self.judge]
        return len(facts) == 2 and None not in facts and facts[0] == facts[1]

    def findings_of(self, kind: str) -> list:
        """Critical and warn findings of one kind (``hardware``, ``version``, ...)."""
        return [f for f in self.findings if getattr(f, "kind", None) == kind
                and getattr(f, "severity", "") in ("critical", "warn")]


def gather(result) -> Evidence:
    """The evidence of one ``CompareResult`` (read only; no model runs)."""
    cfg, parity, training = result.config, result.parity, result.training
    names = [str(t) for t in cfg.targets]
    judge = str(cfg.judge)
    symptoms = _target_symptoms(result)
    ran = peak_lr(training.curves, judge)  # what the judge ran: an optimizer factory's own lr, a schedule's peak
    lr = ran if math.isfinite(ran) else cfg.lr
    return Evidence(
        targets=tuple(names), judge=judge, steps=cfg.steps, lr=lr, optimizer=cfg.optimizer,
        envelope_runs=cfg.envelope, tolerances=cfg.tolerances,
        target_facts={str(t): _facts(t.runner) for t in cfg.targets},
        outcomes=named(training.outcomes), envelope=training.envelope, envelope_finals=_envelope_finals(training.curves),
        still_falling={str(t): S.still_falling(training.curves, str(t)) for t in training.outcomes},
        target_symptoms=symptoms, layer_notes=_layer_notes(result, symptoms),
        drift=_drift(result) if cfg.envelope > 0 and len(cfg.targets) == 2 else None,
        data_symptoms=tuple(S.data_problems(result.data_stats)),
        judge_problems=tuple(S.training_problems(training.curves, training.layer_grads, training.activations,
                                                 judge, result.model.num_classes, lr))
        + tuple(recipe_problems(result)) + _judge_producer(result),
        stochastic_layers=tuple(parity.stochastic_layers), self_difference=named(parity.self_difference),
        flagged_layers=named(parity.first_flagged), closest_layers=_closest_layers(parity.layers),
        findings=tuple(result.findings or ()), executor_findings=_executor_findings(training, parity),
    )


def _envelope_finals(curves) -> tuple[float, ...]:
    env = curves[curves["role"] == "envelope"]
    if not len(env):
        return ()
    return tuple(float(v) for v in env[env["step"] == env["step"].max()]["loss"])


def _judge_producer(result) -> tuple[S.Symptom, ...]:
    """The judge's own first NaN/Inf when a user callable that is not a module made it (the loss,
    the schedule, the optimizer step): a setup problem, named by its producer."""
    training = result.training
    try:
        arm = training.arm_of(result.config.judge)
    except Exception:  # a result without the judge's arm (a bundle): nothing to name
        return ()
    producer = training.nonfinite_producer.get(arm)
    detail = dict(getattr(training, "nonfinite_detail", {}).get(arm) or {})
    if producer is None or detail.get("callable") not in ("loss", "schedule", "optimizer"):
        return ()
    step, layer = producer
    fmt = result.config.judge.runner.precision.narrowest
    sym = training_producer(str(result.config.judge), step, layer, detail, fmt,
                            weights=bool(training.nonfinite_weights.get(arm)), finite_gradients=True)
    return (sym,)


def _executor_findings(training, parity=None) -> tuple:
    """Each target arm's findings from its executor (none from the in-process one), arm by arm, from the
    training and the one-step parity result."""
    return tuple(f for a in getattr(training, "arms", ()) if a.role == "target"
                 for f in executor_for(a.target).findings(training, a.name, parity))


def _facts(runner) -> TargetFacts:
    return TargetFacts(runner.mixed_precision, runner.tf32_like, runner.half_compute, runner.half_storage,
                       str(runner.compute_dtype).removeprefix("torch."))


def _drift(result) -> S.Symptom | None:
    """Drift between the two targets against the lower-precision target's envelope, the pair as
    (a target arm, the other): the judge has no distance of its own to the other side."""
    judge = str(result.config.judge)
    pair = sorted((str(t) for t in result.config.targets), key=lambda n: n == judge)
    lower = result.training.lower_precision
    envelope = result.training.envelope
    return S.envelope_drift(result.training.curves, pair, str(lower) if lower is not None else None,
                            envelope.null_model if envelope is not None else "one-ulp envelope")


def _closest_layers(layers) -> tuple[LayerMargin, ...]:
    table = layers[~layers["flagged"]].dropna(subset=["over_floor"])
    table = table[table["over_floor"].map(math.isfinite) & (table["floor"] > 0)]
    out = []
    for name, rows in table.groupby("target", sort=False):
        w = rows.sort_values("over_floor").iloc[-1]
        measured = math.isfinite(w["intrinsic"])
        own = w["intrinsic"] if measured else w["local"]
        where = str(w["layer"] if w["kind"] == "forward" else w["param"])
        out.append(LayerMargin(str(name), where, float(own), float(w["over_floor"]), float(w["floor"]),
                               str(w["module"]), measured))
    return tuple(out)


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
