"""The rules for one watched run against the float64 judge (``convcheck diff RUN --judge SPEC``), reading
``RunEvidence``; ``run_ok`` when none fires - and ``run_ok`` is ``inconclusive`` unless the judge checked every
layer (``watched_coverage.run_judged``: never ``ok`` on a judge that replayed nothing). The earliest of a flagged layer, an exploding loss and the
first NaN/Inf decides (in that order on the same step):

==== ==== =================== ========= ===========================================================
id   prio name                category  fires on
==== ==== =================== ========= ===========================================================
W109 5    run-setup           setup     the run was set up wrong on its own (clipping before scaler.unscale_)
W101 10   run-layer           layer     a layer above its floor, no later than the NaN/Inf or explosion
W102 20   run-diverge         setup     the loss explodes, no later than the first NaN/Inf
W103 30   run-loss-scale      numerics  a fixed loss scale that overflows the backward
W104 40   run-lost-updates    numerics  small updates lost in 16-bit weights (before any NaN/Inf)
W108 45   run-eval-mode       setup     the optimizer steps on forwards run in eval mode (model.train()
                                        not called after an evaluation)
W105 50   run-nonfinite       numerics  the first NaN/Inf producer
W107 55   run-training        setup     the run does not converge on its own and compare's training
                                        detectors name why (dead ReLUs, weight decay, vanishing gradients)
W106 60   run-stopped         setup     the block raised or was interrupted, nothing seen explains it
==== ==== =================== ========= ===========================================================
"""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.remedies import TRAIN_MODE_REMEDIES
from convcheck.diagnose.rules.watched_coverage import run_judged
from convcheck.diagnose.rules.watched_lines import (layer_verdict, loss_scale_verdict, lost_updates_verdict,
                                                    nonfinite_cause, nonfinite_remedies, setup_remedies,
                                                    interrupt_line, interrupted, stopped_verdict, training_problem)
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import RunEvidence, first_flagged, overflow_lines, producer_text, producer_where


def _step(p: dict | None) -> float:
    return p["step"] if p is not None else float("inf")


@verdict_rule("W109", "run-setup", priority=5, category="setup", reads=RunEvidence, headline="{what}")
def run_setup(ev: RunEvidence) -> Verdict | None:
    """A setup mistake the run shows on its own: it comes before any numerics (it changes every step after it)."""
    if not ev.setup:
        return None
    first = ev.setup[0]
    return run_setup.verdict(list(first.evidence), headline=first.headline, remedies=list(first.remedies),
                             sub_cause=first.sub_cause)


@verdict_rule("W101", "run-layer", priority=10, category="layer", reads=RunEvidence,
              headline="{layer} computes beyond its floor at step {step}")
def run_layer(ev: RunEvidence) -> Verdict | None:
    """A layer the judge finds above its floor at a snapshot step, no later than the first NaN/Inf or the
    loss's explosion."""
    flagged = first_flagged((ev.replay,))
    if flagged is None:
        return None
    row = flagged[1]
    diverged = ev.divergence.step if ev.divergence is not None else float("inf")
    if row.step > _step(ev.producer) or row.step > diverged:
        return None
    return layer_verdict(run_layer, "", row, "")


@verdict_rule("W102", "run-diverge", priority=20, category="setup", reads=RunEvidence,
              headline="the loss explodes: {what}")
def run_diverge(ev: RunEvidence) -> Verdict | None:
    """The run's own loss explodes (finite), no later than its first NaN/Inf."""
    d = ev.divergence
    if d is None or d.step > _step(ev.producer):
        return None
    extra = [f"then the first non-finite: {producer_text(ev.producer)}"] if ev.producer is not None else []
    return run_diverge.verdict(d.evidence + extra, headline=d.headline, remedies=list(d.remedies),
                               sub_cause=d.sub_cause)


@verdict_rule("W103", "run-loss-scale", priority=30, category="numerics", reads=RunEvidence,
              headline="the scaled backward overflows at step {step}")
def run_loss_scale(ev: RunEvidence) -> Verdict | None:
    """The first NaN/Inf is a fixed loss scale's backward passing float16's range."""
    if ev.producer is None or ev.scaled_backward is None:
        return None
    return loss_scale_verdict(run_loss_scale, "the run", ev.scaled_backward, ev.producer, None, [])


@verdict_rule("W104", "run-lost-updates", priority=40, category="numerics", reads=RunEvidence,
              headline="small updates lost: the weights are kept in {format} and most updates round away")
def run_lost_updates(ev: RunEvidence) -> Verdict | None:
    """16-bit weights that drop most updates, before any NaN/Inf."""
    lost = next((s for s in ev.own if s.name == S.SMALL_UPDATES_LOST), None)
    if lost is None or (ev.producer is not None and lost.step is not None and lost.step >= ev.producer["step"]):
        return None
    return lost_updates_verdict(run_lost_updates, [lost], [])


@verdict_rule("W105", "run-nonfinite", priority=50, category="numerics", reads=RunEvidence,
              headline="the run turns non-finite at step {step} in {where}")
def run_nonfinite(ev: RunEvidence) -> Verdict | None:
    """The first NaN/Inf producer, its op and magnitude."""
    p = ev.producer
    if p is None:
        return None
    return run_nonfinite.verdict([f"first non-finite: {producer_text(p)}"] + overflow_lines((ev.replay,)),
                                 {"step": p["step"], "where": producer_where(p)}, remedies=nonfinite_remedies(p),
                                 layer=p["layer"], sub_cause=nonfinite_cause(p))


@verdict_rule("W108", "run-eval-mode", priority=45, category="setup", reads=RunEvidence,
              headline="the run trains with the model in eval mode from step {step}: BatchNorm uses its running "
                       "statistics and Dropout is off (model.train() not called after an evaluation?)",
              remedies=tuple(TRAIN_MODE_REMEDIES))
def run_eval_mode(ev: RunEvidence) -> Verdict | None:
    """The optimizer stepped on forwards run with ``model.training`` False (no NaN/Inf or explosion first)."""
    if ev.eval_from is None or (ev.producer is not None and ev.producer["step"] < ev.eval_from):
        return None
    return run_eval_mode.verdict([f"steps.jsonl model_eval from step {ev.eval_from}: its forwards ran with "
                                  "model.training False before the optimizer's step"], {"step": ev.eval_from},
                                 sub_cause="eval mode")


@verdict_rule("W107", "run-training", priority=55, category="setup", reads=RunEvidence,
              headline="training setup: {label} ({evidence})")
def run_training(ev: RunEvidence) -> Verdict | None:
    """The run does not converge on its own (compare's rule on its losses) and compare's training detectors
    say why: the training setup, as compare's V002 says of a failing judge."""
    steps = max((s.step for s in ev.own if s.step is not None), default=0)
    sym = training_problem(ev.own, ev.converged, max(steps, ev.steps))
    if sym is None:
        return None
    return run_training.verdict([f"{s.label}: {s.evidence}" for s in ev.own] + ["the run does not converge on its "
                                                                                 "own (compare's rule)"],
                                {"label": sym.label, "evidence": sym.evidence}, remedies=setup_remedies(sym),
                                layer=sym.layer, sub_cause=sym.name)


@verdict_rule("W106", "run-stopped", priority=60, category="setup", reads=RunEvidence,
              headline="the run stopped at step {step} with {what}")
def run_stopped(ev: RunEvidence) -> Verdict | None:
    """The block raised or was interrupted and nothing the watch saw explains it: never ``ok``."""
    if ev.stopped is None or interrupted(ev.stopped):  # Ctrl-C: judged on what it has (``run_ok``)
        return None
    return stopped_verdict(run_stopped, "the run", ev.stopped, [ev.replay.summary()] if ev.replay is not None else [])


def run_ok(ev: RunEvidence) -> Verdict:
    cut = [f"the record was cut{' by its size cap' if 'max_bytes' in ev.truncated else ''}: {ev.truncated}; the "
           "steps after it were not seen"] \
        if ev.truncated else []
    cut += [interrupt_line(ev.stopped)] if interrupted(ev.stopped) else []
    upto = f" up to step {ev.stopped['step']}, where it was interrupted" if interrupted(ev.stopped) else ""
    if ev.replay is None or not ev.replay.rows:  # never ok: the judge checked nothing (issue 43)
        return run_judged(Verdict("ok", f"the run stays finite{upto}",
                                  evidence=([ev.replay.summary()] if ev.replay is not None else []) + cut), ev.replay)
    return run_judged(Verdict("ok", f"every replayed layer is within its floor and the run stays finite{upto}",
                              evidence=[ev.replay.summary()] + cut), ev.replay)
