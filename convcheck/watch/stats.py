"""One tensor's statistics, as NVIDIA's per-layer FP8 inspector logs them, accumulated over a step.

Nothing here changes a tensor: every reduction reads a detached view. Half-precision tensors are
reduced in float32 so that the mean and std of a bfloat16 output are not themselves rounded to bfloat16."""

from __future__ import annotations

import math
import threading

import torch

from convcheck.runformat import statistics as _declared

FIELDS = ("n", "max_abs", "min_nonzero", "mean", "std", "zeros", "nan", "inf", "dtype", "calls")


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def reduce_dtype(t: torch.Tensor):
    """The dtype to reduce in: float32 for half types (torch would round their sum to the half type)."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else None


def finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one vectorised sum (no mask tensor; NaN and Inf reach it,
    Inf - Inf as NaN; a sum is the cheapest pass: 1.0 ms on 51 MB against 1.8 ms for the 2-norm); a sum
    that overflows from finite values is told apart by the exact check."""
    x = t.detach()
    if x.numel() == 0:
        return True
    return math.isfinite(float(x.sum(dtype=reduce_dtype(x)))) or bool(torch.isfinite(x).all())


# The same-width integer view of each floating dtype and the mask that clears its sign bit: the bits of
# |x| order like |x| itself, which finds the smallest nonzero magnitude without a masked float copy.
_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF),
         torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF)}


def _row(n, total, sumsq, max_abs, min_nonzero, zeros, nan, inf, t, extra=None) -> dict:
    """One call's accumulators; ``extra``: the declared statistics' values (``runformat/statistics.py``)."""
    return {"n": n, "sum": total, "sumsq": sumsq, "max_abs": max_abs, "min_nonzero": min_nonzero,
            "zeros": zeros, "nan": nan, "inf": inf, "dtype": dtype_name(t), "calls": 1, "worst_call": 0,
            "nonfinite_call": 0 if nan + inf else None, **(extra or {})}


def _extra_reductions(x: torch.Tensor, acc) -> list:
    """The declared statistics' reductions of ``x`` (0-d tensors on its device), read with the core ones."""
    return [s.reduce(x, acc).double().reshape(()) for s in _declared.extensions()]


def _extra_values(values) -> dict:
    return dict(zip((s.name for s in _declared.extensions()), values)) if values else {}


def measure(t: torch.Tensor) -> dict:
    """Raw accumulators of one floating tensor: count, finite sums, extremes, zeros, NaN/Inf counts.

    The every-step path (issue 25: its cost is the watch's overhead): three vectorised reductions
    (``aminmax``, ``sum``, the 2-norm; issue 45: the declared statistics' own reductions beside them),
    converted to Python in one ``tolist``. Their values also say
    whether the tensor holds zeros at all (its sign is constant, or its smallest magnitude is
    positive) and whether anything is non-finite (NaN and Inf reach ``aminmax``), so the zero count
    and the smallest nonzero magnitude cost more passes only for tensors that do hold zeros (ReLU's
    outputs), and NaN/Inf are counted only for tensors that hold them (``_measure_nonfinite``)."""
    x = t.detach()
    n = x.numel()
    if n == 0:
        return _row(0, 0.0, 0.0, 0.0, None, 0, 0, 0, t)
    if x.dtype not in _BITS:
        return _measure_nonfinite(t)
    acc = reduce_dtype(x)
    lo, hi = torch.aminmax(x)
    # the 2-norm rather than ``dot(x, x)``: no faster on one thread (0.142 against 0.143 ms on 1M float32
    # elements, ``benchmarks/stats_pass.py``) and its BLAS sum less exact (std 1e-5 apart)
    parts = [lo, hi, x.sum(dtype=acc), torch.linalg.vector_norm(x, dtype=acc)]
    ext = _extra_reductions(x, acc)
    if ext or acc is not None:  # stacked in float64 (exact from float32 and the half types)
        parts = [p.double() for p in parts] + ext
    # else all four in x's own float32/float64, read as they are: the same values with four ops fewer (each
    # dispatch costs ~4 us inside a step, paid by a layer called once per time step at every call: issue 45)
    lo, hi, total, norm, *extra = torch.stack(parts).tolist()
    sumsq = norm * norm
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _measure_nonfinite(t)
    if not (math.isfinite(total) and math.isfinite(sumsq)):  # finite values whose sum overflows acc
        total = float(x.sum(dtype=torch.float64))
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        sumsq = norm * norm
    max_abs = max(-lo, hi)
    extra = _extra_values(extra)
    if lo > 0 or hi < 0:
        return _row(n, total, sumsq, max_abs, lo if lo > 0 else -hi, 0, 0, 0, t, extra)
    if hi == 0 and lo == 0:
        return _row(n, total, sumsq, 0.0, None, n, 0, 0, t, extra)
    if lo < 0:  # both signs: zeros only if the smallest magnitude is zero
        smallest = _min_abs(x)
        if smallest > 0:
            return _row(n, total, sumsq, max_abs, smallest, 0, 0, 0, t, extra)
    zeros, min_nonzero = _zeros(x, nonnegative=lo == 0)
    return _row(n, total, sumsq, max_abs, min_nonzero, zeros, 0, 0, t, extra)


# Passes that need a tensor of their own (|x|, signs, bits) run on a large CPU tensor chunk by chunk
# through one reused buffer per thread and dtype: a fresh buffer the size of a large activation
# (ResNet-18's first outputs are 51 MB at batch 16) comes from the system each time, and touching its new
# pages cost ten times the pass itself (12.6 ms against 1.0 ms for a sum of the same tensor, measured). A
# tensor of one chunk or less takes its temporaries whole: the allocator reuses blocks that size, and the
# chunks' bookkeeping would cost more than it saves.
CHUNK = 1 << 20  # elements: 4 MB of float32, cache-sized
_scratch = threading.local()


def _chunked(x: torch.Tensor) -> bool:
    return x.numel() > CHUNK and x.device.type == "cpu" and x.is_contiguous()


def _buffer(dtype) -> torch.Tensor:
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    if dtype not in bufs or bufs[dtype].numel() < CHUNK:
        with torch.inference_mode(False):  # a normal CPU tensor whatever mode or default device is in force
            bufs[dtype] = torch.empty(CHUNK, dtype=dtype, device="cpu")
    return bufs[dtype]


def _pieces(x: torch.Tensor):
    """A chunked tensor's flat views of at most CHUNK elements, each with its slice of the reused
    buffer for ``x``'s dtype and for its integer view."""
    flat = x.view(-1)
    ints = _BITS[x.dtype][0]
    for i in range(0, flat.numel(), CHUNK):
        piece = flat[i:i + CHUNK]
        yield piece, _buffer(x.dtype)[:piece.numel()], _buffer(ints)[:piece.numel()]


def _min_abs(x: torch.Tensor) -> float:
    """The smallest magnitude of a finite tensor."""
    if not _chunked(x):
        return float(x.abs().min())
    return float(torch.stack([torch.abs(c, out=buf).amin() for c, buf, _ in _pieces(x)]).amin())


def _zeros(x: torch.Tensor, nonnegative: bool = False) -> tuple[int, float | None]:
    """The number of zeros (+0 and -0) of a finite tensor and its smallest nonzero magnitude: a
    count of nonzero signs, and the minimum over |x|'s bits minus one with zero's wrapped to the top.
    ``nonnegative`` (its smallest value is 0, ReLU's outputs): the signs are 0 or 1 already, and the bits need no
    sign cleared first (-0's wrap to the top as +0's do), two passes fewer."""
    n = x.numel()
    ints, mask = _BITS[x.dtype]
    if nonnegative and not _chunked(x):
        nonzero = int(torch.sign(x).sum(dtype=torch.float32 if n <= 2**24 else torch.float64))
        least = x.view(ints).sub(1).bitwise_and_(mask).min()
    elif _chunked(x):  # float32 counts are exact up to 2**24 elements, a chunk's 2**20 included
        pieces = [(torch.sign(c, out=buf).abs_().sum(dtype=torch.float32),
                   torch.bitwise_and(c.view(ints), mask, out=ibuf).sub_(1).bitwise_and_(mask).min())
                  for c, buf, ibuf in _pieces(x)]
        nonzero = int(torch.stack([p[0] for p in pieces]).double().sum())
        least = torch.stack([p[1] for p in pieces]).min()
    else:
        nonzero = int(torch.sign(x).abs_().sum(dtype=torch.float32 if n <= 2**24 else torch.float64))
        # 0 -> mask (the largest), every nonzero magnitude -> its bits - 1
        least = torch.bitwise_and(x.view(ints), mask).sub_(1).bitwise_and_(mask).min()
    if nonzero == 0:
        return n, None
    smallest = torch.tensor([int(least) + 1], dtype=ints, device="cpu").view(x.dtype)
    return n - nonzero, float(smallest)


def _measure_nonfinite(t: torch.Tensor) -> dict:
    """The exact path for a tensor holding NaN or Inf (or of an unusual dtype): counts them and reduces
    the finite values only. Rare (once per run in the runs that have the problem), so not optimised."""
    x = t.detach()
    n = x.numel()
    acc = reduce_dtype(x)
    total = float(x.sum(dtype=acc))
    nan = inf = 0
    if not math.isfinite(total):
        keep = torch.isfinite(x)
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        x = x[keep]
        total = float(x.sum(dtype=acc))
    if x.numel() == 0:
        return _row(n, 0.0, 0.0, 0.0, None, 0, nan, inf, t, _extra_values([0.0] * len(_declared.extensions())))
    extra = _extra_values(torch.stack(_extra_reductions(x, acc)).tolist() if _declared.extensions() else [])
    norm = float(torch.linalg.vector_norm(x, dtype=acc))
    max_abs = float(torch.linalg.vector_norm(x, ord=math.inf, dtype=acc))
    zeros = x.numel() - int(torch.count_nonzero(x))
    if zeros == 0:
        min_nonzero = float(torch.linalg.vector_norm(x, ord=-math.inf, dtype=acc))
    elif zeros == x.numel():
        min_nonzero = None
    else:
        a = x.abs()
        min_nonzero = float(a.masked_fill_(a == 0, math.inf).min())
    return _row(n, total, norm * norm, max_abs, min_nonzero, zeros, nan, inf, t, extra)


_MERGE = {"sum": lambda a, b: a + b, "max": max, "min": min}


def merge(acc: dict | None, new: dict) -> dict:
    """Two calls' accumulators in one (issue 48: a layer called several times in a step - a recurrent cell
    unrolled over time, gradient accumulation, a shared block - is one row): counts and sums added, extremes
    kept, the mean and std combined from the sums (``finish``), and which call holds the largest max |x|
    (``worst_call``, the first of equals) and the first NaN/Inf (``nonfinite_call``), indexed from 0 in the order
    the calls ran."""
    if acc is None:
        return new
    mins = [v for v in (acc["min_nonzero"], new["min_nonzero"]) if v is not None]
    before = acc["calls"]
    bad = acc["nonfinite_call"] if acc["nonfinite_call"] is not None else \
        None if new["nonfinite_call"] is None else before + new["nonfinite_call"]
    out = {"n": acc["n"] + new["n"], "sum": acc["sum"] + new["sum"], "sumsq": acc["sumsq"] + new["sumsq"],
           "max_abs": max(acc["max_abs"], new["max_abs"]), "min_nonzero": min(mins) if mins else None,
           "zeros": acc["zeros"] + new["zeros"], "nan": acc["nan"] + new["nan"], "inf": acc["inf"] + new["inf"],
           "dtype": acc["dtype"], "calls": before + new["calls"],
           "worst_call": acc["worst_call"] if acc["max_abs"] >= new["max_abs"] else before + new["worst_call"],
           "nonfinite_call": bad}
    for s in _declared.extensions():
        if s.name in acc and s.name in new:
            out[s.name] = _MERGE[s.merge](acc[s.name], new[s.name])
    return out


def finish(acc: dict) -> dict:
    """The recorded row: mean, std and the share of zeros over the finite values; a layer called more than once
    in the step says which call was the worst and the first non-finite one; each declared statistic finished."""
    finite = acc["n"] - acc["nan"] - acc["inf"]
    mean = acc["sum"] / finite if finite else 0.0
    var = max(acc["sumsq"] / finite - mean * mean, 0.0) if finite else 0.0
    row = {"n": acc["n"], "max_abs": acc["max_abs"], "min_nonzero": acc["min_nonzero"], "mean": mean,
           "std": math.sqrt(var), "zeros": acc["zeros"] / acc["n"] if acc["n"] else 0.0, "nan": acc["nan"],
           "inf": acc["inf"], "dtype": acc["dtype"], "calls": acc["calls"]}
    if acc["calls"] > 1:  # one call: nothing to find (rows of one call stay as before issue 48)
        row.update(worst_call=acc.get("worst_call", 0), nonfinite_call=acc.get("nonfinite_call"))
    for s in _declared.extensions():
        if s.name in acc:
            row[s.name] = s.finish(acc[s.name], finite) if s.finish is not None else acc[s.name]
    return row


# --- one read per step (``deferred.py``): the same accumulators, left on the tensor's device -----------------
DEVICE_FIELDS = ("n", "sum", "sumsq", "max_abs", "min_nonzero", "zeros", "nan", "inf")


def device_row(t: torch.Tensor) -> torch.Tensor:
    """``measure``'s accumulators of a floating tensor as one float64 tensor on its device, in
    ``DEVICE_FIELDS`` order, then the declared statistics' values (``runformat/statistics.py``), computed without
    reading anything back (no branch on a value: every pass runs). Over the finite values only, as
    ``_measure_nonfinite`` (a declared statistic's ``reduce`` sees the non-finite values as 0);
    ``min_nonzero`` 0 means none."""
    x = t.detach()
    n = x.numel()
    if n == 0 or x.dtype not in _BITS:
        return torch.tensor([float(n)] + [0.0] * (len(DEVICE_FIELDS) - 1 + len(_declared.extensions())),
                            dtype=torch.float64, device=x.device) if n == 0 else \
            torch.tensor(list(_row_values(_measure_nonfinite(t))), dtype=torch.float64, device=x.device)
    acc = reduce_dtype(x)
    fin = torch.isfinite(x)
    nonfinite = n - fin.sum()
    nan = torch.isnan(x).sum()
    xs = torch.where(fin, x, torch.zeros((), dtype=x.dtype, device=x.device))
    lo, hi = torch.aminmax(xs)
    total = xs.sum(dtype=acc).double()
    norm = torch.linalg.vector_norm(xs, dtype=acc).double()
    zeros = (xs == 0).sum() - nonfinite
    ints, mask = _BITS[x.dtype]
    # the smallest nonzero magnitude from |x|'s bits (0 -> the largest, as ``_zeros``); all zero: -0.0 -> none
    least = torch.bitwise_and(xs.view(ints), mask).sub_(1).bitwise_and_(mask).min().add(1)
    smallest = least.reshape(1).view(x.dtype).double().abs().reshape(())
    return torch.stack([torch.full((), float(n), dtype=torch.float64, device=x.device), total, norm * norm,
                        torch.maximum(-lo, hi).double(), smallest, zeros.double(), nan.double(),
                        (nonfinite - nan).double(), *_extra_reductions(xs, acc)])


def _row_values(row: dict) -> tuple:
    return (row["n"], row["sum"], row["sumsq"], row["max_abs"], row["min_nonzero"] or 0.0, row["zeros"], row["nan"],
            row["inf"], *(row[s.name] for s in _declared.extensions()))


def row_of(values, dtype: str) -> dict:
    """A ``device_row`` read back (its ``DEVICE_FIELDS`` values, then the declared statistics') as ``measure``'s
    row."""
    n, total, sumsq, max_abs, smallest, zeros, nan, inf = values[:len(DEVICE_FIELDS)]
    return {"n": int(n), "sum": total, "sumsq": sumsq, "max_abs": max_abs,
            "min_nonzero": smallest if smallest > 0 else None, "zeros": int(zeros), "nan": int(nan),
            "inf": int(inf), "dtype": dtype, "calls": 1, "worst_call": 0, "nonfinite_call": 0 if nan + inf else None,
            **_extra_values(values[len(DEVICE_FIELDS):])}


def device_bad(ts) -> torch.Tensor | None:
    """Whether any of the tensors ``ts`` holds a NaN or Inf, as a float64 0/1 on their device (None: none given)."""
    flags = [(~torch.isfinite(t.detach())).any() for t in ts if t.numel()]
    if not flags:
        return None
    return torch.stack(flags).any().double() if len(flags) > 1 else flags[0].double()
