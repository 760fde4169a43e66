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
    """``stats.measure``'s row of each tensor of ``outs`` (the outputs of the layers ``names``): the layers whose
    calls have one shape, dtype and device stacked together (several layers of one shape: one stack; a layer's
    calls that differ: stacked by shape, dtype and device) and reduced along the stack, each stack read back in one
    ``tolist``; a tensor holding NaN/Inf (or any tensor, when a statistic is declared: ``runformat/statistics.py``;
    an empty one, or one of a dtype ``measure`` does not reduce) measured on its own."""
    if _declared.extensions():
        return [_stats.measure(t) for t in outs]
    layers: dict = {}
    for i, name in enumerate(names):
        layers.setdefault(name, []).append(i)
    stacks: dict = {}  # by each layer's first call: its calls have its shape, dtype and device as a rule
    for idx in layers.values():
        t = outs[idx[0]]
        stacks.setdefault((t.shape, t.dtype, t.device), []).extend(idx)
    got: list = [None] * len(outs)
    with torch.no_grad():  # the stacks are the flush's own (no graph), reduced in place
        for idx in stacks.values():
            # detached: stacking outputs that require grad costs twice as much, even without grad (a char_gru forward's
            # two stacks of 63 calls: 341 against 164 us)
            ts = [outs[i].detach() for i in idx]
            dtype = ts[0].dtype
            try:  # stack would promote mixed dtypes; it refuses mixed shapes and devices
                if any(t.dtype != dtype for t in ts):
                    raise RuntimeError("mixed dtypes")
                groups = [(idx, ts, torch.stack(ts))]
            except RuntimeError:
                by: dict = {}
                for i in idx:
                    by.setdefault((outs[i].shape, outs[i].dtype, outs[i].device), []).append(i)
                parts = [(g, [outs[i].detach() for i in g]) for g in by.values()]
                groups = [(g, part, torch.stack(part)) for g, part in parts]
            for g, ts, x in groups:
                _rows_into(got, g, ts, x)
    return got


def _rows_into(got: list, idx: list, ts: list, x: torch.Tensor) -> None:
    """The rows of the tensors ``ts`` (stacked: ``x``, changed here) written to ``got`` at ``idx``."""
    n = ts[0].numel()
    if n == 0 or x.dtype not in _stats._BITS:
        for i, t in zip(idx, ts):
            got[i] = _stats.measure(t)
        return
    values = _reduced(x if x.dim() > 1 else x.reshape(len(ts), 1))
    base = _stats._row(n, 0.0, 0.0, 0.0, None, 0, 0, 0, ts[0])  # what every row of the stack shares
    isfinite = math.isfinite
    wide = x.dtype == torch.float64  # float64 sums keep the std; float32 ones may not (``stats.lossy``)
    tiny, cancel = _stats.TINY, _stats.CANCEL
    for i, t, (top, total, norm, zeros, smallest) in zip(idx, ts, values):
        if not (isfinite(top) and isfinite(total) and isfinite(norm)) or not wide and (
                0.0 < top < tiny or norm * norm * n < cancel * total * total):
            got[i] = _stats.measure(t)  # NaN/Inf, a sum that overflows its accumulator, or float32 sums that lost
            continue  # the std (``stats.lossy``, written out: one test per call of a cell): the exact path
        row = base.copy()  # ``stats._row``'s, four dict entries set rather than a call building twelve
        row["sum"], row["sumsq"], row["max_abs"] = total, norm * norm, top
        row["min_nonzero"], row["zeros"] = (None if zeros == n else smallest), zeros
        got[i] = row


def _reduced(x: torch.Tensor) -> list[tuple]:
    """Per call of the stack ``x`` (calls first; the flush's own copy, changed in place): max |x|, sum, 2-norm, zero
    count and smallest nonzero |x|: seven dispatches (ten for the half types) and one read where no call holds a
    zero, ten more and a read where one does (the rows before: thirteen, and fifteen more).

    The sum and the 2-norm are torch's along each call in ``stats.reduce_dtype``'s accumulator (the values of the
    rows before, bit for bit: ``measure``'s up to the last bits of the summation order). Then ``x`` is made |x| in
    place (a new |x| is 512 KB written to memory a first stack of 63 x 2048 float32 inside a training step: 98
    against 29 us), and its maximum and minimum along each call are max |x| (NaN or Inf where the call holds one: the
    exact path's) and the smallest |x| (``amin``/``amax`` rather than ``aminmax``, ten times slower along a dimension
    on the CPU); the half types' from their bits read as integers, which order like |x| (4 against 26-36 us on
    63 x 2048). All four read in one ``tolist``, promoted to the sums' dtype (exact). Where the smallest |x| is 0 (+0
    or -0) the call holds zeros, and a pass more counts them (a sum of sign(|x|), exact in float32 up to 2**24
    elements) and takes the least nonzero bits (the bits minus one: 0's wrap to the top)."""
    dims = tuple(range(1, x.dim()))
    acc = _stats.reduce_dtype(x)
    total, norm = x.sum(dim=dims, dtype=acc), torch.linalg.vector_norm(x, dim=dims, dtype=acc)
    mag = x.abs_()
    ints, mask = _stats._BITS[x.dtype]
    if acc is None:  # float32, float64
        top, least = mag.amax(dim=dims), mag.amin(dim=dims)
    else:
        bits = mag.view(ints)
        top, least = bits.amax(dim=dims).view(x.dtype), bits.amin(dim=dims).view(x.dtype)
    first = torch.stack([top, total, norm, least], dim=1).tolist()
    if all(r[3] > 0 or not math.isfinite(r[0]) for r in first):  # no call holds a zero (NaN/Inf: the exact path's)
        return [(top, total, norm, 0, least) for top, total, norm, least in first]
    n = x.numel() // x.shape[0]
    nonzero = torch.sign(mag).sum(dim=dims, dtype=torch.float32 if n <= 1 << 24 else torch.float64)
    least = mag.view(ints).sub_(1).bitwise_and_(mask).amin(dim=dims).add_(1)  # a call of zeros only: 0 again
    more = torch.stack([nonzero, least.view(x.dtype)], dim=1).tolist()
    return [(top, total, norm, n - int(nz), low) for (top, total, norm, _), (nz, low) in zip(first, more)]


def all_finite(ts: list[torch.Tensor]) -> bool:
    """Whether every value of the tensors ``ts`` is finite: one concatenation and one read per device."""
    by_device: dict = {}
    for t in ts:
        by_device.setdefault(t.device, []).append(t.reshape(-1))
    return all(_stats.finite(torch.cat(parts) if len(parts) > 1 else parts[0]) for parts in by_device.values())
