"""Parity rows of a data-parallel target: the DDP-averaged gradient of one step against the judge's.

The ranks run one forward/backward on their slices of the first batch (no
update); rank 0's averaged gradient is compared per parameter with the
judge's (``propagated``). The same per-rank runner on one device, on the
whole batch with the same dropout masks, gives the error a correct
data-parallel setup should stay near (``floor``: DDP only changes the
reduction order); ``bound`` is ``DDP_GRAD_FACTOR`` times that (and at least
``DDP_GRAD_MIN_U`` units of roundoff): a DDP gradient beyond it is a setup
difference (``convcheck.ddp.diagnostics``), not a layer's arithmetic, so the
rows are never ``flagged``.
"""

from __future__ import annotations

import math
import torch

from convcheck.capture import SharedDropoutMasks
from convcheck.ddp.rank_pool import collective_timeout, threads_per_rank
from convcheck.ddp.pool_choice import open_pool
from convcheck.ddp.worker import RankJob
from convcheck.numerics.thresholds import DDP_GRAD_FACTOR, DDP_GRAD_MIN_U
from convcheck.numerics.metrics import rel_l2
from convcheck.measure.train.arms import Arm



def _frozen_sgd(params):
    return torch.optim.SGD(params, lr=0.0)


def _no_schedule(opt, steps):
    return None


def _parity_recipe(loss_fn):
    """The ranks' recipe for the parity step (no update); module-level functions so that it pickles."""
    from convcheck.plan.recipe import Recipe

    return Recipe(loss_fn, getattr(loss_fn, "__name__", "loss"), _frozen_sgd, "SGD", _no_schedule, "none", None)


def single_device_grads(target, build, batch, loss_fn, seed: int) -> dict[str, torch.Tensor]:
    runner = target.per_rank.runner
    model = build(target.per_rank)
    x, y = batch
    with runner.applied():
        with SharedDropoutMasks(model, seed):
            _, loss = runner.forward_loss(model, x, y, loss_fn)
        runner.backward(loss, runner.parity_loss_scale)
    scale = runner.parity_loss_scale
    return {n: p.grad.detach() / scale for n, p in model.named_parameters() if p.grad is not None}


def ddp_parity(target, build, batch, judge_grads: dict, loss_fn, seed: int) -> tuple[float, list[dict], dict]:
    """``(mean loss over ranks, gradient rows, {BatchNorm layer: (mean shift, std change)})``."""
    from convcheck.ddp.arm import check_batch_splits

    runner = target.runner
    x, y = batch
    check_batch_splits(x, runner.world, target)
    job = RankJob(arm=Arm(str(target), target.per_rank, "target"), build=build, target=target, steps=1,
                  recipe=_parity_recipe(loss_fn), timeout_s=collective_timeout(),
                  threads=threads_per_rank(runner.world))
    pool = open_pool(target, job)
    try:
        got = pool.call("grads", x, y, seed, runner.parity_loss_scale, what="the parity step")
    finally:
        pool.close()
    single = single_device_grads(target, build, batch, loss_fn, seed)
    u = runner.unit_roundoff
    rows = []
    for order, (name, g) in enumerate(got["grads"].items()):
        jg = judge_grads.get(name)
        if jg is None:
            continue
        err = rel_l2(g, jg)
        floor = rel_l2(single[name], jg) if name in single else math.nan
        bound = DDP_GRAD_FACTOR * max(floor if math.isfinite(floor) else 0.0, DDP_GRAD_MIN_U * u)
        layer, _, pname = name.rpartition(".")
        rows.append(dict(
            target=str(target), order=order, kind="grad", layer=layer or name, module="", param=name,
            shape="x".join(map(str, g.shape)), K=0, u=u, floor=floor, bound=bound, propagated=err,
            # no own-arithmetic error (intrinsic) here: over_floor stays NaN so no "closest layer" reads it
            local=math.nan, intrinsic=math.nan, over_floor=math.nan,
            needed=math.nan, nan=int(torch.isnan(g).sum()), inf=int(torch.isinf(g).sum()), input_nonfinite=0,
            grad_out_nonfinite=0, grad_in_nonfinite=0, ref_absmax=float(jg.abs().max()) if jg.numel() else math.nan,
            # never flagged as a *layer* (its own arithmetic is the per-rank runner's, checked on one
            # device); propagated > bound is read by convcheck.ddp.diagnostics as a setup problem
            flagged=False,
        ))
    return got["loss"], rows, got["bn"]
