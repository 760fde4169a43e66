"""Every parameter's gradient norm at a step: one ``_foreach_norm`` per dtype, read at once or with the step's
other statistics (``deferred.StepBuffer.norms``)."""

from __future__ import annotations

import torch

from convcheck.watch import stats as _stats
from convcheck.watch.layouts import dense, stand_in


def grad_norms(params, buffer=None) -> dict[str, float]:
    """Every parameter's gradient norm: one ``_foreach_norm`` per dtype, one ``tolist`` for all."""
    named = [(n, g if dense(g) else stand_in(g)) for n, g in ((n, p.grad.detach()) for n, p in params
                                                         if p.grad is not None)]
    named = [(n, g) for n, g in named if g is not None]  # a sparse gradient's norm: its coalesced values'
    if not named:
        return {}
    norms: list = [None] * len(named)
    by_dtype: dict = {}
    for i, (_, g) in enumerate(named):
        by_dtype.setdefault((g.dtype, g.device), []).append(i)
    for (dtype, _), idx in by_dtype.items():
        grads = [named[i][1] for i in idx]
        if _stats.reduce_dtype(grads[0]) is None and all(not g.is_sparse for g in grads):
            got = torch._foreach_norm(grads)
        else:
            got = [torch.linalg.vector_norm(g, dtype=_stats.reduce_dtype(g)) for g in grads]
        if len(by_dtype) == 1:  # the common case: one stack and one cast for all (two dispatches a parameter fewer)
            return _read(named, torch.stack([v.detach() for v in got]).double(), buffer)
        for i, v in zip(idx, got):
            norms[i] = v.detach().double()
    if len({v.device for v in norms}) == 1:
        return _read(named, torch.stack(norms), buffer)
    return {n: float(v) for (n, _), v in zip(named, norms)}


def _read(named: list, stacked: torch.Tensor, buffer) -> dict[str, float]:
    """The norms ``stacked`` (float64, one device): read with the step's statistics when there is a ``buffer``, else
    in one transfer (one sync on an accelerator) for all."""
    if buffer is not None:
        buffer.norms([n for n, _ in named], stacked)
        return {}
    return dict(zip((n for n, _ in named), stacked.tolist()))
