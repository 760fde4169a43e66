"""``Evidence``: everything the verdict rules read, gathered once from a comparison result.

``gather(result)`` runs the detectors of ``convcheck.symptoms`` over the parity
table and the training curves and copies the facts the rules need (per-arm
outcomes, the envelope summary, parity facts, environment findings, config
facts) into one frozen record. It never runs a model and never calls into
``convcheck.train``: training has already summarised itself in
``training.outcomes``, ``training.envelope`` and ``training.lower_precision``.
The rules (``rules.py``) read nothing else, so a test can build an ``Evidence``
by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from convcheck import symptoms as S
from convcheck.config import CompareConfig
from convcheck.thresholds import CONVERGENCE_MIN_STEPS, OUTCOME_ABSOLUTE, OUTCOME_RELATIVE
from convcheck.tolerances import Tolerances

if TYPE_CHECKING:  # types only: importing convcheck.train would import the training loop
    from convcheck.train.result import ArmOutcome, EnvelopeSummary

# How target symptoms rank (the first one found is the verdict's main symptom); drift and
# outcome symptoms rank last. The drift beyond the envelope is appended after the ranking.
_TARGET_RANK = {S.NONFINITE_FORWARD: 0, S.NONFINITE_BACKWARD: 1, S.GRADSCALER_COLLAPSE: 2, S.LAYER_ERROR: 3,
                S.GRADIENT_UNDERFLOW: 4, S.SMALL_UPDATES_LOST: 5}
_UNRANKED = 9
_CONFIG = CompareConfig()  # the defaults of the config facts


@dataclass(frozen=True)
class TargetFacts:
    """What the remedies need to know about one target's runner."""

    mixed_precision: bool = False  # autocast: half compute, float32 weights
    tf32_like: bool = False  # matmul/conv operands rounded to 10 mantissa bits
    half_compute: bool = False  # some arithmetic in bf16/fp16


@dataclass(frozen=True)
class LayerMargin:
    """The layer of one target whose local error comes closest to its bound."""

    target: str
    layer: str
    local: float
    ratio: float  # local / bound
    bound: float


@dataclass(frozen=True)
class Evidence:
    """One comparison as the rules see it. Every field has a neutral default (nothing seen; the
    config facts default to ``CompareConfig``'s, without an envelope)."""

    # --- config facts
    targets: tuple[str, ...] = ()  # the two targets as asked for (the judge may be one of them)
    judge: str = "cpu:float64"
    steps: int = _CONFIG.steps
    lr: float = _CONFIG.lr
    optimizer: str = _CONFIG.optimizer
    envelope_runs: int = 0  # envelope runs asked for (CompareConfig.envelope)
    tolerances: Tolerances = _CONFIG.tolerances
    target_facts: Mapping[str, TargetFacts] = field(default_factory=dict)
    # --- training: per-arm outcomes (targets and judge) and the envelope runs' summary
    outcomes: Mapping[str, ArmOutcome] = field(default_factory=dict)
    envelope: EnvelopeSummary | None = None
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
    # --- environment findings (convcheck.env.Finding)
    findings: tuple = ()

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

    def findings_of(self, kind: str) -> list:
        """Critical and warn findings of one kind (``hardware``, ``version``, ...)."""
        return [f for f in self.findings if getattr(f, "kind", None) == kind
                and getattr(f, "severity", "") in ("critical", "warn")]


def gather(result) -> Evidence:
    """The evidence of one ``CompareResult`` (read only; no model runs)."""
    cfg, parity, training = result.config, result.parity, result.training
    names = [str(t) for t in cfg.targets]
    judge = str(cfg.judge)
    return Evidence(
        targets=tuple(names), judge=judge, steps=cfg.steps, lr=cfg.lr, optimizer=cfg.optimizer,
        envelope_runs=cfg.envelope, tolerances=cfg.tolerances,
        target_facts={str(t): TargetFacts(t.runner.mixed_precision, t.runner.tf32_like, t.runner.half_compute)
                      for t in cfg.targets},
        outcomes=dict(training.outcomes), envelope=training.envelope,
        target_symptoms=_target_symptoms(result),
        drift=_drift(result) if cfg.envelope > 0 and len(cfg.targets) == 2 else None,
        data_symptoms=tuple(S.data_problems(result.data_stats)),
        judge_problems=tuple(S.training_problems(training.curves, training.layer_grads, training.activations,
                                                 judge, result.model.num_classes, cfg.lr)),
        stochastic_layers=tuple(parity.stochastic_layers), self_difference=dict(parity.self_difference),
        flagged_layers=dict(parity.first_flagged), closest_layers=_closest_layers(parity.layers),
        findings=tuple(result.findings or ()),
    )


def _drift(result) -> S.Symptom | None:
    """Drift between the two targets against the lower-precision target's envelope, the pair as
    (a target arm, the other): the judge has no distance of its own to the other side."""
    judge = str(result.config.judge)
    pair = sorted((str(t) for t in result.config.targets), key=lambda n: n == judge)
    return S.envelope_drift(result.training.curves, pair, result.training.lower_precision)


def _closest_layers(layers) -> tuple[LayerMargin, ...]:
    table = layers.assign(r=layers["local"] / layers["bound"])
    out = []
    for name, rows in table.dropna(subset=["r"]).groupby("target", sort=False):
        w = rows.sort_values("r").iloc[-1]
        out.append(LayerMargin(str(name), str(w["layer"]), float(w["local"]), float(w["r"]), float(w["bound"])))
    return tuple(out)


def _target_symptoms(result) -> tuple[S.Symptom, ...]:
    """Every target's symptoms against the judge, ranked by ``_TARGET_RANK`` (stable)."""
    cfg = result.config
    out: list[S.Symptom] = []
    for t in cfg.targets:
        if t != cfg.judge:
            out += _symptoms_of(result, t)
    return tuple(sorted(out, key=lambda s: _TARGET_RANK.get(s.name, _UNRANKED)))


def _symptoms_of(result, t) -> list[S.Symptom]:
    """One target's symptoms. A flagged layer this target's other symptoms already name is no
    second symptom; a target with a symptom gets no extra one for not converging."""
    parity, training, cfg = result.parity, result.training, result.config
    name, judge = str(t), str(cfg.judge)
    out = _nonfinite_symptoms(result, name)
    out.append(S.grad_scaler_problems(training.curves, name))
    out.append(S.underflow(training.layer_grads, name, judge) if t.runner.half_compute else None)
    # lr*|g|/|W| is the step size of SGD only (Adam's steps are ~lr per element)
    lost = (S.lost_updates(training.curves, name, t.unit_roundoff, t.runner.half_storage)
            if cfg.optimizer == "sgd" else None)
    info = training.outcomes.get(name)
    out.append(lost if info is not None and not info.converged else None)
    out = [s for s in out if s]
    flagged = parity.first_flagged.get(name)
    if flagged and not any(s.layer == flagged for s in out):
        out.append(_layer_error(parity, name, flagged))
    if not out:
        out += _outcome_symptoms(result, name)
    return out


def _nonfinite_symptoms(result, name: str) -> list[S.Symptom]:
    """The one-step producer of NaN/Inf (parity), else the first producer during training when
    the judge's training had none."""
    training, judge = result.training, str(result.config.judge)
    nf = S.nonfinite_producer(result.parity.layers, name)
    if nf is not None:
        return [nf]
    producer = training.nonfinite_producer.get(name)
    if producer is not None and training.nonfinite_producer.get(judge) is None:
        step, layer = producer
        return [S.Symptom(S.NONFINITE_FORWARD, name, f"'{layer}' turned finite inputs into NaN/Inf "
                          f"at training step {step}", layer=layer, step=step)]
    return []


def _layer_error(parity, name: str, flagged: str) -> S.Symptom:
    rows = parity.flagged(name)
    r = rows[rows["layer"] == flagged].iloc[0]
    return S.Symptom(S.LAYER_ERROR, name,
                     f"local error of '{flagged}' ({r['module']}) is {r['local']:.3g}, "
                     f"{r['local'] / r['bound']:.3g}x its expected bound {r['bound']:.2e} "
                     f"(u={r['u']:.2e}, K={int(r['K'])}); propagated error {r['propagated']:.3g}",
                     layer=flagged, value=float(r["local"]), extra={"kind": r["kind"]})


def _outcome_symptoms(result, name: str) -> list[S.Symptom]:
    """A target that did not converge while the judge did, and with no other symptom.

    Borderline runs that only just miss the rule are not a finding: the outcome must be worse
    than the envelope runs', or (without an envelope) clearly worse than the judge's."""
    cfg, curves, per = result.config, result.training.curves, result.training.outcomes
    info, judge_info = per.get(name), per.get(str(cfg.judge))
    judge_ok = judge_info.converged if judge_info else True
    if cfg.steps < CONVERGENCE_MIN_STEPS or not info or info.converged or not judge_ok:
        return []
    has_envelope = bool((curves["role"] == "envelope").any())
    oc = S.outcome_vs_envelope(curves, name) if has_envelope else None
    judge_final = judge_info.final_loss if judge_info else math.nan
    worse = (not math.isfinite(info.final_loss)
             or info.final_loss > judge_final * (1 + OUTCOME_RELATIVE) + OUTCOME_ABSOLUTE)
    if oc:
        return [oc]
    if not has_envelope and worse:
        return [S.Symptom(S.NO_CONVERGENCE, name,
                          f"{name} did not converge (loss {info.first_loss:.4g} -> "
                          f"{info.final_loss:.4g}) while the judge did (-> {judge_final:.4g})")]
    return []
