"""Each step's parameter distances, all pairs at once: ``metrics.param_distance`` values, fewer passes.

Per step every arm is measured against up to three partners (the judge, the run an envelope arm
perturbs, the other target): 8 pairs for five arms, each a float64 difference per parameter and
its norm. Done pair by pair (``param_distance``), a float32 arm is cast to float64 once per pair and
a float32 partner once per pair and once more for its norm, each into a fresh tensor (ResNet-18:
90 MB, faulted in page by page). Here, per step:

* the work goes parameter group by parameter group (``stats.groups``), every arm and partner of one
  layout at once: each partner's group in float64 (its own tensor if float64, else a copy into a
  buffer of the group's size, one per partner), its norms; then each arm's group cast once (or the
  partner copy it already has), subtracted from each partner's (``copy_`` then ``sub`` equals
  ``torch.sub(a, b)`` promoting ``a`` inside the kernel: the same IEEE float64 subtraction of the
  same values, vectorised), one norm per parameter. The buffers are a group's size, not a model's,
  and are read again while still in cache: a whole-model float64 copy per partner (ResNet-18: 90 MB
  each, faulted in page by page on every run) was written once and read from memory by every arm;
* small parameters go together: one copy, one subtraction and one norm call for a run of them laid
  end to end, so a LeNet step costs a dozen calls, not a few hundred;
* a pair asked both ways (the two targets, each the other's ``other``) is measured once: ``b - a`` is
  ``-(a - b)`` exactly in IEEE arithmetic, and a norm does not see the sign; the same pair asked twice
  (a target whose other target is the judge) is measured once too;
* each arm's ||theta||^2 (the next step's update ratio) from the cast it already has;
* every norm of a device is read back in one ``tolist``.

The per-parameter norms are summed in parameter order as ``param_distance`` sums them, so every
distance is the same float64 value bit for bit. A pair whose parameters are not all contiguous and on
one device goes the long way (``param_distance``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from convcheck.numerics.metrics import param_distance, param_norm_sq, relative_distance
from convcheck.measure.train.stats import Scratch, flat64, groups, view_norms

_F64 = torch.float64
_CAST, _DIFF = 0, 1  # Scratch slots: an arm's group in float64; a difference (a partner j's copy: ("theta", j))


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

    def key(self) -> tuple:
        """Layouts that match share this key (and so their groups)."""
        return (self.device, tuple(self.shapes))


class _Norms:
    """Norm tensors collected under labels as the groups go by, read back in one ``tolist`` per device."""

    def __init__(self):
        self._parts: dict[tuple, list[torch.Tensor]] = {}

    def add(self, label: tuple, norms: list[torch.Tensor]) -> None:
        self._parts.setdefault(label, []).extend(norms)

    def values(self) -> dict[tuple, list[float]]:
        labels = list(self._parts)
        flat = [t for label in labels for t in self._parts[label]]
        values = torch.stack(flat).tolist() if flat else []
        out, pos = {}, 0
        for label in labels:
            n = len(self._parts[label])
            out[label] = values[pos:pos + n]
            pos += n
        return out


class Distances:
    """``measure(states, partners)``: every arm's distance to each of its partners after a step."""

    def __init__(self, scratch: Scratch):
        self.scratch = scratch
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
        fast: dict[int, list] = {}  # id(arm) -> the partners measured group by group
        out: dict[tuple[int, int], float] = {}
        slow = []
        for s in states:
            mine = list({id(p): p for p in partners[s.arm.name] if p is not None and p is not s}.values())
            fast[id(s)] = [b for b in mine if layout[id(b)].ok and layout[id(s)].matches(layout[id(b)])]
            slow += [(s, b) for b in mine if all(b is not f for f in fast[id(s)])]
        values: dict[tuple, list[float]] = {}
        for members in self._clusters(states, wanted, layout, fast):
            values.update(self._measure_cluster(members, layout, fast, weights))
        norm_sq = {key: sum((x ** 2 for x in values[("theta", key)]), 0.0) if ("theta", key) in values
                   else param_norm_sq(b.model) for key, b in wanted.items()}
        for s, b in slow:
            out[(id(s), id(b))] = param_distance(s.model, b.model, norm_sq[id(b)])
        for s in states:
            for b in fast[id(s)]:
                out[(id(s), id(b))] = relative_distance(_sum_sq(values[_pair(s, b)]), norm_sq[id(b)])
            own = norm_sq.get(id(s))
            if own is None and ("own", id(s)) in values:
                own = _sum_sq(values[("own", id(s))])
            if weights and own is not None and hasattr(s, "remember_weight_sq"):
                s.remember_weight_sq(own)
        return out

    @staticmethod
    def _clusters(states, wanted: dict, layout: dict, fast: dict) -> list[tuple[list, list]]:
        """(partners, arms) of one layout each: the partners that can go group by group, and the arms
        that have such a partner."""
        by_key: dict[tuple, tuple[list, list]] = {}
        for key, b in wanted.items():
            if layout[key].ok:
                by_key.setdefault(layout[key].key(), ([], []))[0].append(b)
        for s in states:
            if fast[id(s)]:
                by_key[layout[id(s)].key()][1].append(s)
        return list(by_key.values())

    def _measure_cluster(self, members: tuple[list, list], layout: dict, fast: dict,
                         weights: bool) -> dict[tuple, list[float]]:
        """Per label, the per-parameter norms in parameter order: ("theta", id(partner)) its own,
        ("own", id(arm)) an arm's that is no partner (with ``weights``), _pair(arm, partner) their
        difference's."""
        partners, arms = members
        scratch, norms = self.scratch, _Norms()
        first = layout[id(partners[0])]
        device = first.device
        for g in first.groups:
            n = sum(first.params[i].numel() for i in g)
            sizes = [first.params[i].numel() for i in g]
            theta = {}
            for j, b in enumerate(partners):
                theta[id(b)] = flat64([layout[id(b)].params[i] for i in g],
                                      scratch.flat(n, _F64, device, slot=("theta", j)))
                norms.add(("theta", id(b)), view_norms(theta[id(b)], sizes))
            done = set()
            for s in arms:
                a, cast = theta.get(id(s)), None
                if a is None:
                    cast = scratch.flat(n, _F64, device, slot=_CAST)
                    a = flat64([layout[id(s)].params[i] for i in g], cast)
                    if weights:
                        norms.add(("own", id(s)), view_norms(a, sizes))
                todo = [b for b in fast[id(s)] if _pair(s, b) not in done]
                for k, b in enumerate(todo):
                    done.add(_pair(s, b))
                    # the last difference of an arm's own copy is taken in place (a third faster: no
                    # third buffer to write); never in a partner's copy, nor in a float64 model's tensor
                    last = a is cast and k == len(todo) - 1
                    diff = torch.sub(a, theta[id(b)], out=a if last else scratch.flat(n, _F64, device, slot=_DIFF))
                    norms.add(_pair(s, b), view_norms(diff, sizes))
        return norms.values()


def _pair(s, b) -> tuple:
    """The label of a pair's difference norms, the same both ways round (``b - a`` is ``-(a - b)``)."""
    return ("pair",) + tuple(sorted((id(s), id(b))))


def _sum_sq(values: list[float]) -> float:
    """num += x**2 in parameter order, as ``param_distance`` adds."""
    num = 0.0
    for x in values:
        num += x ** 2
    return num
