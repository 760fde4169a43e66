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
from convcheck.diagnose.detectors.producers import training_producer
from convcheck.diagnose.detectors.recipe import peak_lr, recipe_problems
from convcheck.diagnose.target_symptoms import _envelope_finals, _layer_notes, _loss_scale, _target_symptoms
from convcheck.measure.table_schema import named
from convcheck.plan.config import CompareConfig
from convcheck.targets.executors import executor_for
from convcheck.numerics.thresholds import DRIFT_NOTE_MAX, CONVERGENCE_MIN_STEPS, OUTCOME_ABSOLUTE, OUTCOME_RELATIVE, \
    OUTCOME_SPREADS
from convcheck.numerics.tolerances import Tolerances

if TYPE_CHECKING:  # types only: importing convcheck.measure.train would import the training loop
    from convcheck.measure.train.result import ArmOutcome, EnvelopeSummary

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
    # where a target that differs from itself first does (``measure/parity/localise``), and the targets
    # rerun from the same state at all (``--repeat 2`` reruns every one)
    self_difference_at: Mapping[str, dict] = field(default_factory=dict)
    repeated: tuple[str, ...] = ()
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
        self_difference_at=named(getattr(parity, "self_difference_at", {}) or {}),
        repeated=tuple(str(t) for t in getattr(parity, "repeated", ()) or ()),
        flagged_layers=named(parity.first_flagged), closest_layers=_closest_layers(parity.layers),
        findings=tuple(result.findings or ()), executor_findings=_executor_findings(training, parity),
    )




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
