"""One-step parity: per-layer forward and per-parameter gradient errors against the judge.

For every leaf-module call the table holds the *propagated* error (the
target's own forward vs the judge) and the *local* error (the judge's input,
cast to the target, through the target's copy of the layer, vs the judge's
output), the expected bound for that layer's precision and reduction length,
NaN/Inf counts, and whether the layer is flagged. The same for every
parameter's gradient: the target's own gradient vs the judge's, and the
gradient the target's copy of the layer computes from the judge's input and
output gradient.

Memory: only the judge's per-layer tensors are held in full (inputs, outputs, and
the output gradients of layers with parameters, the only ones read), as views of
the judge's own activations until something writes to them (``snapshots``); each
target is compared layer by layer while it runs and keeps scalars only, and the
last target's pass drops each call's record once it is measured. The run-to-run
reruns come after every target's pass, once the judge's record is dropped.

Time: building is a copy (``builder``); the stochastic-layer probe is skipped where
it can find nothing (``known.probe_needed``); stock layers get light private copies; the
rerun is skipped for a CPU pass whose kernels are all documented deterministic (``kernels``).

``judge_pass`` records the judge; ``target_pass`` compares one target with
that record; ``local`` holds the one-layer measurements. Each target's step goes
through its executor (``convcheck.targets.executors``): in this process, the pass above;
a data-parallel target's ranks give gradient rows of their own.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn

from convcheck.capture import SharedDropoutMasks
from convcheck.nested import tensors_in
from convcheck.targets.executors import ParityStep, TargetParity, executor_for
from convcheck.numerics.metrics import rel_l2
from convcheck.measure.parity.judge_pass import run_judge, stochastic_layers
from convcheck.measure.parity.kernels import rerun_needed
from convcheck.measure.parity.known import RandomDraws, probe_needed
from convcheck.measure.parity.result import COLUMNS, ParityResult
from convcheck.measure.parity.target_pass import TargetPass
from convcheck.targets.runners import cross_entropy
from convcheck.measure.parity.localise import first_difference
from convcheck.seeding import seed_all
from convcheck.targets.spec import CPU_JUDGE, Target
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances

ModelBuilder = Callable[[Target], nn.Module]

__all__ = ["COLUMNS", "ParityResult", "run_parity"]


def run_parity(
    build: ModelBuilder,
    batch: tuple[torch.Tensor, torch.Tensor],
    targets: list[Target],
    *,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
    judge: Target = CPU_JUDGE,
    seed: int = 0,
    loss_fn=cross_entropy,
    progress: Callable[[int, int], None] | None = None,
    repeat: int = 1,
) -> ParityResult:
    """One forward/backward step of every target against the judge.

    ``build(target)`` returns the model with the shared initial weights, cast
    and moved to ``target``, in training mode. ``repeat=2`` reruns every target run here from the same
    state (``--repeat 2``), documented-deterministic kernels included; a rerun that differs is localised
    (``localise.first_difference``).
    """
    others = [t for t in targets if t != judge]
    total = 2 + 2 * len(others)  # judge pass, stochastic probe, each target's pass, each target's rerun
    tick = (lambda done: progress(done, total)) if progress else (lambda done: None)
    seed_all(seed)
    judge_model = build(judge)
    probe = probe_needed(judge_model, judge.runner)
    ops: set = set()  # the operators the model runs (``kernels``)
    with RandomDraws(judge_model) as draws:
        calls, _, judge_grads, judge_loss = run_judge(judge_model, batch, judge.runner, seed, loss_fn, ops)
    probe = probe and (draws.drawn or judge.torch_device.type != "cpu")
    del judge_model  # its parameter gradients live on in judge_grads
    tick(1)
    stochastic = stochastic_layers(build(judge), batch[0], calls, judge.runner, seed) if probe else []
    tick(2)
    rows: list[dict] = []  # ``ParityRow``s
    losses: dict[Target, float] = {}
    selfdiff: dict[Target, float] = {}
    reruns: list[tuple[int, Target, list]] = []
    executors = {t: executor_for(t) for t in others}  # where each target's step runs
    last = max((i for i, t in enumerate(targets) if t != judge and executors[t].reads_judge_record), default=-1)

    def here(i: int, target: Target) -> TargetParity:
        """This target's pass in this process against the judge's record."""
        # Each device has its own random stream: a target's unshared random draws differ
        # from the judge's, as they would on another device.
        seed_all(seed + 1 + i)
        tp = TargetPass(str(target), target.runner, judge.runner, (calls, judge_grads), tolerances, stochastic, seed)
        tp.rerun_needed, tp.release = rerun_needed(ops, target.torch_device) or repeat >= 2, i == last
        loss, first_run = tp.run(build(target), batch, loss_fn)
        tick(3 + others.index(target))
        if tp.rerun_needed:
            return TargetParity(loss, tp.rows, rerun_against=first_run)
        # a CPU pass of documented-deterministic kernels (``kernels``): bitwise the same again
        return TargetParity(loss, tp.rows, self_difference=0.0)

    for i, target in enumerate(targets):
        if target == judge:
            continue
        measured = executors[target].parity(target, ParityStep(
            build, batch, judge_grads, loss_fn, seed, here=functools.partial(here, i)))
        losses[target] = measured.loss
        rows.extend(measured.rows)
        if measured.rerun_against is not None:
            reruns.append((i, target, measured.rerun_against))
        elif measured.self_difference is not None:
            selfdiff[target] = measured.self_difference
    del calls, judge_grads  # every target has used the judge's record: the reruns run without it
    selfdiff = _self_differences(reruns, selfdiff, others, build, batch, seed, loss_fn, tick)
    # where a target that differs from itself begins to: two more runs from the same state, compared bitwise
    where = {t: at for t, d in selfdiff.items() if d > 0 and (at := first_difference(build, t, batch, seed, loss_fn))}
    tick(total)
    return ParityResult.from_rows(rows, others, tolerances, judge_loss, losses=losses, stochastic_layers=stochastic,
                                  self_difference=selfdiff, judge=str(judge), self_difference_at=where,
                                  repeated=tuple(t for _, t, _ in reruns))


def _self_differences(reruns: list, selfdiff: dict, others: list, build, batch, seed: int, loss_fn, tick) -> dict:
    """Each rerun target's ``self_difference``, with ``selfdiff`` (those not rerun), in the targets' order."""
    for i, target, first_run in reruns:
        seed_all(seed + 1 + i)  # as before the parity run
        selfdiff[target] = self_difference(build(target), target, batch, seed, first_run, loss_fn)
        tick(3 + len(others) + others.index(target))
    return {t: selfdiff[t] for t in others if t in selfdiff}


def self_difference(model: nn.Module, target: Target, batch, mask_seed: int, first_run: list, loss_fn) -> float:
    """Largest relative difference of logits and gradients between the target's parity run
    and one identical rerun (same weights, input, seed and loss scale)."""
    runner = target.runner
    x, y = batch
    with runner.applied():
        with SharedDropoutMasks(model, mask_seed):
            out, loss = runner.forward_loss(model, x, y, loss_fn)
        runner.backward(loss, runner.parity_loss_scale)
    second = [t.detach() for t in tensors_in(out, sort_keys=True)] + \
        [p.grad.detach() for p in model.parameters() if p.grad is not None]
    worst = 0.0
    for a, b in zip(first_run, second):
        if not torch.equal(a, b):
            d = rel_l2(a, b)
            worst = max(worst, d if math.isfinite(d) else math.inf)
    return worst
