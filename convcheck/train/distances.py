"""Each step's parameter distances, all pairs at once: ``metrics.param_distance`` values, fewer passes.

Per step every arm is measured against up to three partners (the judge, the run an envelope arm
perturbs, the other target): 8 pairs for five arms, each a float64 difference per parameter and
its norm. Done pair by pair (``param_distance``), a float32 arm is cast to float64 once per pair and
a float32 partner once per pair and once more for its norm, each into a fresh tensor (ResNet-18:
90 MB, faulted in page by page). Here, per step:

* each partner's parameters in float64 once (its own if float64, else a copy into a buffer kept
  for the run), and its ||theta||^2 from them;
* each arm's parameters cast once per parameter into a reused buffer, subtracted from each
  partner's into a second one (``copy_`` then ``sub`` equals ``torch.sub(a, b)`` promoting ``a``
  inside the kernel: the same IEEE float64 subtraction of the same values, vectorised), one norm
  each; the same pair asked twice (a target whose other target is the judge) is measured once;
* each arm's ||theta||^2 (the next step's update ratio) from the cast it already has.

The per-parameter norms are summed in parameter order as ``param_distance`` sums them, so every
distance is the same float64 value bit for bit. A pair whose parameters are not all contiguous and on
one device goes the long way (``param_distance``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from convcheck.metrics import param_distance, param_norm_sq, relative_distance
from convcheck.train.stats import Scratch, as64

_F64 = torch.float64


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in m.parameters()]


def _fast(params: list[torch.Tensor], device) -> bool:
    return all(p.is_contiguous() and p.is_floating_point() and not p.is_complex() and p.device == device
               for p in params)


class Distances:
    """``measure(states, partners)``: every arm's distance to each of its partners after a step."""

    def __init__(self, scratch: Scratch):
        self.scratch = scratch
        self._kept: dict[int, list[torch.Tensor]] = {}  # id(partner state) -> its float64 buffers

    def measure(self, states, partners: dict[str, tuple], weights: bool) -> dict[tuple[int, int], float]:
        """{(id(arm), id(partner)): distance}; with ``weights``, each arm that can keep it is told its
        ||theta||^2 (``remember_weight_sq``) for the next step."""
        wanted = {id(p): p for trio in partners.values() for p in trio if p is not None}
        theta64, norm_sq = {}, {}
        for key, b in wanted.items():
            params = _params(b.model)
            device = params[0].device if params else None
            if params and _fast(params, device):
                theta64[key] = self._keep(key, params)
                norm_sq[key] = sum((float(torch.linalg.vector_norm(v)) ** 2 for v in theta64[key]), 0.0)
            else:
                norm_sq[key] = param_norm_sq(b.model)
        out: dict[tuple[int, int], float] = {}
        for s in states:
            mine = [p for p in dict.fromkeys(partners[s.arm.name]) if p is not None and p is not s]
            own = self._arm(s, mine, theta64, norm_sq, out)
            if weights and hasattr(s, "remember_weight_sq"):
                own = norm_sq.get(id(s)) if own is None else own
                if own is not None:
                    s.remember_weight_sq(own)
        return out

    def _keep(self, key: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The partner's parameters in float64: its own, or a copy into buffers kept for the run."""
        if all(p.dtype == _F64 for p in params):
            return params
        kept = self._kept.get(key)
        if kept is None or [k.shape for k in kept] != [p.shape for p in params] or kept[0].device != params[0].device:
            kept = self._kept[key] = [torch.empty(p.shape, dtype=_F64, device=p.device) for p in params]
        for k, p in zip(kept, params):
            k.copy_(p)
        return kept

    def _arm(self, s, mine: list, theta64: dict, norm_sq: dict, out: dict) -> float | None:
        """Distances of ``s`` to each partner in ``mine``; its own ||theta||^2 where it measured it."""
        params = _params(s.model)
        device = params[0].device if params else None
        fast = [b for b in mine if id(b) in theta64 and params and _fast(params, device)
                and [v.shape for v in theta64[id(b)]] == [p.shape for p in params]
                and theta64[id(b)][0].device == device]
        for b in mine:
            if b not in fast:
                out[(id(s), id(b))] = param_distance(s.model, b.model, norm_sq[id(b)])
        if not fast:
            return None
        if id(s) in theta64:  # a partner too: float64 already, and its own norm is known
            own_norms, pair_norms = self._nums(theta64[id(s)], fast, theta64, own=False)
        else:
            own_norms, pair_norms = self._nums(params, fast, theta64, own=True)
        for b, norms in zip(fast, pair_norms):
            num = 0.0
            for x in norms:
                num += x ** 2
            out[(id(s), id(b))] = relative_distance(num, norm_sq[id(b)])
        return sum((x ** 2 for x in own_norms), 0.0) if own_norms is not None else None

    def _nums(self, params, fast: list, theta64: dict, own: bool):
        """Per parameter: ||theta_s|| (when ``own``) and ||theta_s - theta_b|| for each partner b."""
        scratch = self.scratch
        own_norms: list[float] | None = [] if own else None
        pair_norms: list[list[float]] = [[] for _ in fast]
        for i, p in enumerate(params):
            a = as64(p, scratch) if own else p  # a partner's ``params`` are float64 already
            if own_norms is not None:
                own_norms.append(float(torch.linalg.vector_norm(a)))
            for b, norms in zip(fast, pair_norms):
                diff = torch.sub(a, theta64[id(b)][i], out=scratch.like(a, _F64, slot=1))
                norms.append(float(torch.linalg.vector_norm(diff)))
        return own_norms, pair_norms
