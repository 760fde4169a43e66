"""A layer's repeated small calls measured together (issues 45 and 48): one stack of a step's calls, not one
``stats.measure`` per call.

A recurrent cell unrolled over 64 characters is 64 calls a step of a (batch, hidden) output; measured one by one,
each call pays ``measure``'s five torch dispatches and its read (~30 us of the watch's ~100 us a call, most of it
Python and dispatch, not memory). Here a layer's second and later calls in a step whose output is small (at most
``SMALL`` elements) are kept, and ``rows`` measures all of them at once, a few batched reductions along the
stacked calls and one read, when the model's forward ends (``ProducerHooks._flush_stacked``). An output may be
changed in place after its call (an in-place ReLU, ``h.clamp_()``): a layer's outputs are copied at the call until
a flush has seen, from their versions, that nothing changes them; then they are held as they are (``Stacked``).
A layer that starts changing them later is read changed at that one flush (said in the run's notes) and copied
from then on. The rows
are ``measure``'s: the same counts and extremes; the sum and sum of squares summed along a stack's rows (the same
values up to the last bits of the summation order).

What a call's own measurement gave at once is found at the flush instead: whether its output holds NaN/Inf (the
first such call in the order the calls ran, its inputs finite, is the forward producer; its inputs are held by
reference until then, with their versions, to say so) - the flush runs before any decision that needs it (a later
call's output found non-finite, a container's check, the forward's end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from convcheck.runformat import statistics as _declared
from convcheck.watch import stats as _stats

SMALL = 1 << 14  # elements: an output this small is dispatch-bound, worth stacking
HELD_MAX = 1 << 24  # elements held for a flush before one is forced (64 MiB of float32)


@dataclass
class Call:
    """One stacked call: its layer, its output and other outputs (held as they are, or copies), what it was called
    with (held by reference, each input with its version at the call, for the producer's check); ``seen``: the
    outputs' versions at the call, of ``src`` (the outputs themselves, when ``out`` and ``others`` are copies) or
    else of ``out`` and ``others``."""
    name: str
    out: torch.Tensor
    others: list
    args: tuple
    inputs: list
    versions: list
    seen: list | None = None
    src: list | None = None

    def changed(self) -> bool:
        """Whether an in-place op changed one of the call's outputs between the call and now."""
        held = self.src if self.src is not None else [self.out, *self.others]
        return self.seen is not None and any(t._version != v for t, v in zip(held, self.seen))

    def exact(self) -> bool:
        """Whether the values held are the ones the call returned (copies, or outputs no op has changed since)."""
        return self.src is not None or not self.changed()


@dataclass
class Stacked:
    """The calls waiting for a flush, in the order they ran. A layer's outputs are copied at the call (one more
    dispatch a call, ~7 us inside a loop) until a flush finds that no op changed them in place (``held``: from
    then on held as they are, their versions noted); one found changed is copied from then on (``copied``). Both
    sets are kept across steps: an in-place op after a call is the code's, the same each step."""
    calls: list = field(default_factory=list)
    held: int = 0
    trusted: set = field(default_factory=set)
    copied: set = field(default_factory=set)

    def takes(self, out: torch.Tensor, seen: bool) -> bool:
        """Whether a leaf's call goes to the stack: a layer's second or later call in the step (``seen``) of a small
        floating output that ``measure`` reduces (a dtype it knows)."""
        return seen and out.numel() <= SMALL and out.dtype in _stats._BITS and out.layout == torch.strided

    def add(self, name: str, outs: list, args, inputs: list) -> bool:
        """Keep the call; True when the held outputs reach ``HELD_MAX`` (the caller flushes)."""
        seen = [t._version for t in outs]
        if name in self.trusted:
            out, others, src = outs[0], list(outs[1:]), None
        else:  # copied; and, until a flush has found the layer's outputs changed or not, their versions watched
            out, others = outs[0].detach().clone(), [t.detach().clone() for t in outs[1:]]
            src, seen = (None, None) if name in self.copied else (list(outs), seen)
        self.calls.append(Call(name, out, others, args, inputs, [t._version for t in inputs], seen, src))
        self.held += out.numel() + sum(t.numel() for t in others)
        return self.held >= HELD_MAX

    def learn(self, calls: list) -> set:
        """After a flush of ``calls``: the layers whose outputs an op changed in place since their call, newly found
        (copied from now on); the layers copied whose outputs no op changed are held as they are from now on."""
        changed = {c.name for c in calls if c.changed()}
        watched = {c.name for c in calls if c.src is not None}
        new = changed - self.copied
        self.copied |= changed
        self.trusted -= changed
        self.trusted |= watched - changed - self.copied
        return new

    def take(self) -> list:
        got, self.calls, self.held = self.calls, [], 0
        return got


def merged(rows_: list[dict]) -> dict:
    """Consecutive finite calls' rows of one layer as one (what ``stats.merge`` makes of them one by one, in one
    pass: counts and sums added, extremes kept, the worst call the first of the largest)."""
    first = rows_[0]
    if len(rows_) == 1:
        return first
    mins = [r["min_nonzero"] for r in rows_ if r["min_nonzero"] is not None]
    peaks = [r["max_abs"] for r in rows_]
    top = max(peaks)
    return {"n": sum(r["n"] for r in rows_), "sum": sum(r["sum"] for r in rows_),
            "sumsq": sum(r["sumsq"] for r in rows_), "max_abs": top, "min_nonzero": min(mins) if mins else None,
            "zeros": sum(r["zeros"] for r in rows_), "nan": 0, "inf": 0, "dtype": first["dtype"],
            "calls": len(rows_), "worst_call": peaks.index(top), "nonfinite_call": None}


def rows(outs: list[torch.Tensor], names: list[str]) -> list[dict]:
    """``stats.measure``'s row of each tensor of ``outs`` (the outputs of the layers ``names``): each layer's
    tensors stacked (by shape, dtype and device when they differ) and reduced along the stack, each stack read
    back in one ``tolist``; a tensor holding NaN/Inf (or any tensor, when a statistic is declared:
    ``runformat/statistics.py``) measured on its own."""
    if _declared.extensions():
        return [_stats.measure(t) for t in outs]
    layers: dict = {}
    for i, name in enumerate(names):
        layers.setdefault(name, []).append(i)
    got: list = [None] * len(outs)
    for idx in layers.values():
        ts = [outs[i] for i in idx]
        dtype = ts[0].dtype
        try:  # one layer's calls: one shape, dtype and device as a rule (stack would promote mixed dtypes)
            if any(t.dtype != dtype for t in ts):
                raise RuntimeError("mixed dtypes")
            groups = [(idx, torch.stack(ts).reshape(len(ts), -1))]
        except RuntimeError:
            by: dict = {}
            for i in idx:
                by.setdefault((tuple(outs[i].shape), outs[i].dtype, outs[i].device), []).append(i)
            groups = [(g, torch.stack([outs[i] for i in g]).reshape(len(g), -1)) for g in by.values()]
        for g, x in groups:
            for i, values in zip(g, _reduced(x)):
                got[i] = _row(values, outs[i])
    return got


def _reduced(x: torch.Tensor) -> list[list[float]]:
    """Per row of ``x`` (calls x elements): min, max, sum, 2-norm, zero count, smallest nonzero |x|, as floats.
    As ``stats.measure``, the zero count and the smallest nonzero cost more passes only where a row can hold
    zeros: first the extremes, the sums and the smallest |x| (one read); then, for a stack with a row whose
    smallest |x| is 0, the |sign| sum and the sign-cleared bits (0's wrap to the sign bit: -0.0, none)."""
    acc = _stats.reduce_dtype(x)
    # ``amin`` and ``amax`` along the rows rather than ``aminmax`` (ten times slower along a dimension on the CPU:
    # 222 against 22 us on 63 x 2048 float32); the nonzero count as a sum of |sign| (exact: a row of at most
    # ``SMALL`` elements; 36 against 143 us for ``(x == 0).sum``)
    first = torch.stack([x.amin(dim=1).double(), x.amax(dim=1).double(), x.sum(dim=1, dtype=acc).double(),
                         torch.linalg.vector_norm(x, dim=1, dtype=acc).double(), x.abs().amin(dim=1).double()],
                        dim=1).tolist()
    if all(r[4] > 0 or r[4] != r[4] for r in first):  # no row holds a zero (NaN: the exact path's)
        return [r[:4] + [0.0, r[4]] for r in first]
    zeros = x.shape[1] - torch.sign(x).abs_().sum(dim=1, dtype=torch.float32)
    ints, mask = _stats._BITS[x.dtype]
    least = torch.bitwise_and(x.view(ints), mask).sub_(1).bitwise_and_(mask).amin(dim=1).add_(1)
    more = torch.stack([zeros.double(), least.view(x.dtype).double()], dim=1).tolist()
    return [r[:4] + m for r, m in zip(first, more)]


def _row(values: list, t: torch.Tensor) -> dict:
    lo, hi, total, norm, zeros, smallest = values
    if not (math.isfinite(lo) and math.isfinite(hi)) or not (math.isfinite(total) and math.isfinite(norm)):
        return _stats.measure(t)  # NaN/Inf, or a sum that overflows its accumulator: the exact path
    n, zeros = t.numel(), int(zeros)
    min_nonzero = None if zeros == n else abs(smallest)
    return _stats._row(n, total, norm * norm, max(-lo, hi), min_nonzero, zeros, 0, 0, t)


def all_finite(ts: list[torch.Tensor]) -> bool:
    """Whether every value of the tensors ``ts`` is finite: one concatenation and one read per device."""
    by_device: dict = {}
    for t in ts:
        by_device.setdefault(t.device, []).append(t.reshape(-1))
    return all(_stats.finite(torch.cat(parts) if len(parts) > 1 else parts[0]) for parts in by_device.values())
