"""Each step's parameter distances, all pairs at once: ``metrics.param_distance`` values, fewer passes.

Per step every arm is measured against up to three partners (the judge, the run an envelope arm
perturbs, the other target): 8 pairs for five arms, each a float64 difference per parameter and
its norm. Done pair by pair (``param_distance``), a float32 arm is cast to float64 once per pair and
a float32 partner once per pair and once more for its norm, each into a fresh tensor (ResNet-18:
90 MB, faulted in page by page). Here, per step:

* each partner's parameters in float64 once (its own if float64, else a copy into a buffer kept
  for the run), and its ||theta||^2 from them;
* each arm's parameters cast once into a reused buffer, subtracted from each partner's into a
  second one (``copy_`` then ``sub`` equals ``torch.sub(a, b)`` promoting ``a`` inside the kernel:
  the same IEEE float64 subtraction of the same values, vectorised), one norm per parameter; the
  same pair asked twice (a target whose other target is the judge) is measured once;
* small parameters go together (``stats.groups``): one copy, one subtraction and one norm call for
  a run of them laid end to end, so a LeNet step costs a dozen calls, not a few hundred;
* each arm's ||theta||^2 (the next step's update ratio) from the cast it already has.

The per-parameter norms are summed in parameter order as ``param_distance`` sums them, so every
distance is the same float64 value bit for bit. A pair whose parameters are not all contiguous and on
one device goes the long way (``param_distance``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from convcheck.metrics import param_distance, param_norm_sq, relative_distance
from convcheck.train.stats import Scratch, flat64, groups, view_norms

_F64 = torch.float64


class _Layout:
    """One model's parameters (detached), its groups and their sizes; ``ok``: all contiguous floating
    tensors on one device (the shortcut's condition)."""

    def __init__(self, params: list[torch.Tensor], known: "_Layout | None" = None):
        self.params = [p.detach() for p in params]
        self.device = self.params[0].device if self.params else None
        self.ok = bool(self.params) and all(
            p.is_contiguous() and p.is_floating_point() and not p.is_complex() and p.device == self.device
            for p in self.params)
        self.shapes = [p.shape for p in self.params]
        same = known is not None and known.ok and self.ok and known.shapes == self.shapes
        self.groups = known.groups if same else groups(self.params) if self.ok else []

    def matches(self, other: "_Layout") -> bool:
        return self.ok and other.ok and self.shapes == other.shapes and self.device == other.device


class Distances:
    """``measure(states, partners)``: every arm's distance to each of its partners after a step."""

    def __init__(self, scratch: Scratch):
        self.scratch = scratch
        self._kept: dict[int, torch.Tensor] = {}  # id(partner state) -> a flat float64 buffer for the run
        # id(state) -> (its model, the model's parameter objects, the last layout): a model's parameters
        # are listed once per run (the optimizer holds the same objects), their groups kept while the
        # shapes stay; contiguity and devices are read again every step
        self._known: dict[int, tuple[nn.Module, list, _Layout | None]] = {}

    def _layout(self, s) -> _Layout:
        known = self._known.get(id(s))
        if known is None or known[0] is not s.model:
            known = (s.model, list(s.model.parameters()), None)
        lay = _Layout(known[1], known[2])
        self._known[id(s)] = (known[0], known[1], lay)
        return lay

    def measure(self, states, partners: dict[str, tuple], weights: bool) -> dict[tuple[int, int], float]:
        """{(id(arm), id(partner)): distance}; with ``weights``, each arm that can keep it is told its
        ||theta||^2 (``remember_weight_sq``) for the next step."""
        wanted = {id(p): p for trio in partners.values() for p in trio if p is not None}
        layout = {id(s): self._layout(s) for s in states}
        for key, b in wanted.items():
            if key not in layout:
                layout[key] = self._layout(b)
        theta64, norm_sq = {}, {}  # per partner: its groups in float64; its ||theta||^2
        for key, b in wanted.items():
            if layout[key].ok:
                theta64[key], norms = self._partner(key, layout[key])
                norm_sq[key] = sum((x ** 2 for x in norms), 0.0)
            else:
                norm_sq[key] = param_norm_sq(b.model)
        out: dict[tuple[int, int], float] = {}
        for s in states:
            mine = list({id(p): p for p in partners[s.arm.name] if p is not None and p is not s}.values())
            fast = [b for b in mine if id(b) in theta64 and layout[id(s)].matches(layout[id(b)])]
            for b in mine:
                if all(b is not f for f in fast):
                    out[(id(s), id(b))] = param_distance(s.model, b.model, norm_sq[id(b)])
            own = norm_sq.get(id(s))
            if fast:
                measured = self._arm(layout[id(s)], theta64.get(id(s)), [theta64[id(b)] for b in fast], weights)
                own = measured[0] if own is None else own
                for b, num in zip(fast, measured[1:]):
                    out[(id(s), id(b))] = relative_distance(num, norm_sq[id(b)])
            if weights and own is not None and hasattr(s, "remember_weight_sq"):
                s.remember_weight_sq(own)
        return out

    def _partner(self, key: int, lay: _Layout) -> tuple[list[torch.Tensor], list[float]]:
        """The partner's groups in float64 (copies into a buffer kept for the run, or its own float64
        tensors) and the norm of each parameter."""
        total = sum(p.numel() for p in lay.params)
        buf = self._kept.get(key)
        if buf is None or buf.numel() != total or buf.device != lay.device:
            buf = self._kept[key] = torch.empty(total, dtype=_F64, device=lay.device)
        flats, norms, start = [], [], 0
        for g in lay.groups:
            ts = [lay.params[i] for i in g]
            n = sum(t.numel() for t in ts)
            flats.append(flat64(ts, buf[start:start + n]))
            norms += view_norms(flats[-1], [t.numel() for t in ts])
            start += n
        return flats, torch.stack(norms).tolist() if norms else []

    def _arm(self, lay: _Layout, own64: list[torch.Tensor] | None, partners: list[list[torch.Tensor]],
             own: bool):
        """[||theta_s||^2 or None, then num^2 = sum of ||theta_s - theta_b||^2 per partner b]; per
        parameter in parameter order, summed as ``param_distance`` sums them. ``own64``: the arm's
        groups in float64 already (it is a partner too, its norm known); ``own``: whether to measure
        ||theta_s|| (another step follows)."""
        scratch = self.scratch
        own = own and own64 is None
        norms: list[torch.Tensor] = []
        for k, g in enumerate(lay.groups):
            ts = [lay.params[i] for i in g]
            sizes = [t.numel() for t in ts]
            n = sum(sizes)
            a = own64[k] if own64 is not None else flat64(ts, scratch.flat(n, _F64, lay.device, slot=0))
            if own:
                norms += view_norms(a, sizes)
            for theta in partners:
                diff = torch.sub(a, theta[k], out=scratch.flat(n, _F64, lay.device, slot=1))
                norms += view_norms(diff, sizes)
        values = torch.stack(norms).tolist()
        per_group = int(own) + len(partners)
        sums: list[float] = [0.0] * per_group  # num += x**2 in parameter order, as param_distance adds
        pos = 0
        for g in lay.groups:
            for j in range(per_group):
                for x in values[pos:pos + len(g)]:
                    sums[j] += x ** 2
                pos += len(g)
        return ([] if own else [None]) + sums
