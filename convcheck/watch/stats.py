"""One tensor's statistics, as NVIDIA's per-layer FP8 inspector logs them, accumulated over a step.

Nothing here changes a tensor: every reduction reads a detached view. Half-precision tensors are
reduced in float32 so that the mean and std of a bfloat16 output are not themselves rounded to bfloat16."""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import torch

from convcheck.runformat import statistics as _declared
from convcheck.watch import fused as _fused

FIELDS = ("n", "max_abs", "min_nonzero", "mean", "std", "zeros", "nan", "inf", "dtype", "calls")


def _resolved(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a lazy negation (``torch._neg_view``, what ``conj`` of a real view can give) applied: a bit view
    of a negated view is refused by torch."""
    return x.resolve_neg() if x.is_neg() else x


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
    outputs), and NaN/Inf are counted only for tensors that hold them (``_measure_nonfinite``). A float32/float64 CPU
    tensor takes ``fused.scan``'s one pass where numba is there (``_measure_fused``); else a large CPU tensor while
    torch runs on one thread takes ``_measure_serial``: the same values, with no pass that writes a tensor of its
    size."""
    x = _resolved(t.detach())
    n = x.numel()
    if n == 0:
        return _row(0, 0.0, 0.0, 0.0, None, 0, 0, 0, t)
    if x.dtype not in _BITS:
        return _measure_nonfinite(t)
    if x.dtype in _FUSED and not _declared.extensions():
        row = _measure_fused(x, t)
        if row is not None:
            return row
    u = _serial_bits(x)
    if u is not None:
        return _measure_serial(x, u, t)
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
    sumsq = precise_sumsq(x, n, total, sumsq, max_abs)
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


# --- the sum of squares where float32 sums lose the std -------------------------------------------------------------
# The torch passes sum a float32 (bfloat16, float16) tensor's squares in float32, fast, and right for most tensors. Not
# for two kinds: values whose squares float32 cannot hold (below ~1e-19: the std of 1e-25 values read 0), and values
# far from zero beside their spread (a std 1e-4 of the mean: sumsq / n - mean**2 cancels to nothing, 1M elements near 1
# read a std of 0). Both are told from the pass's own values, and only those tensors take a second, exact pass:
# ``torch.std`` (on the CPU, float32/float64 summed in float64 about the mean; elsewhere a copy scaled by a power of two
# first, so that no square underflows). The fused pass sums in float64 and needs none of this.
TINY = 2.0 ** -40  # a largest magnitude below this: some squares may have underflowed float32 (error <= n * 2**-46)
CANCEL = 1.01  # sumsq * n below this times sum**2 (a variance under 1% of mean**2): float32's rounding may be all of it


def lossy(n: int, total: float, sumsq: float, max_abs: float) -> bool:
    """Whether float32 sums ``total`` and ``sumsq`` of ``n`` finite values may have lost their std."""
    return 0.0 < max_abs < TINY or sumsq * n < CANCEL * total * total


def precise_sumsq(x: torch.Tensor, n: int, total: float, sumsq: float, max_abs: float) -> float:
    """``sumsq`` of the finite tensor ``x`` (``n`` elements, sum ``total``), recomputed from an exact std where
    ``reduce_dtype``'s float32 sums may have lost it (``lossy``); float64 tensors' are kept."""
    if x.dtype == torch.float64 or n < 2 or not lossy(n, total, sumsq, max_abs):
        return sumsq
    sd = float(spread(x, max_abs))
    return n * sd * sd + total * total / n


def spread(x: torch.Tensor, max_abs) -> torch.Tensor:
    """The population std of the finite tensor ``x`` (largest magnitude ``max_abs``: a float or a 0-d tensor on its
    device), as a float64 0-d tensor, without float32 squares underflowing or cancelling: on the CPU ``torch.std``
    of a float32/float64 tensor sums in float64; elsewhere (and for the half types) ``x`` is copied to float32 (float64
    kept) and scaled by the power of two that brings its largest magnitude into [0.5, 1) first."""
    if x.device.type == "cpu" and x.dtype in _FUSED:
        return torch.std(x, correction=0).double()
    y = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32, copy=True)
    floor = -1021 if y.dtype == torch.float64 else -125  # 2**-e must be a normal number of y's dtype
    e = torch.frexp(torch.as_tensor(max_abs, dtype=torch.float64, device=y.device))[1].clamp(min=floor)
    one = torch.ones((), dtype=y.dtype, device=y.device)
    sd = torch.std(y.mul_(torch.ldexp(one, -e)), correction=0)
    return sd.double() * torch.ldexp(torch.ones((), dtype=torch.float64, device=y.device), e)


# --- a large CPU tensor on one thread: each statistic from reading the tensor, nothing of its size written ----------
# (issue 45: on cifar_cnn the zero count and the smallest nonzero magnitude cost ~9 of the watch's ~14 ms a step.)
# A float's bits read as a signed integer order the values whose sign bit is clear by magnitude, above those whose
# sign bit is set, which order by magnitude from -0 up; read as an unsigned integer, the other way round. So the
# signed and unsigned minimum and maximum of the bits (numpy's: torch reduces no unsigned type on the CPU) are the
# smallest and largest magnitude of each sign: the extremes, whether a +0 (unsigned minimum 0) or a -0 (signed minimum
# the sign bit) is there, and the smallest nonzero magnitude of a tensor without zeros. A tensor holding zeros counts
# its nonzero bits (``np.count_nonzero``: one read, no branch on the values) and takes the minimum of its bits minus
# one (0 wraps to the top), written to a reused buffer of ``PIECE`` elements. All of it runs a ``PIECE`` at a time,
# so that the tensor comes from memory once and every pass after the first reads the cache; the sum and the 2-norm
# stay torch's own reductions of the whole tensor (bit for bit the values of the torch passes below). Numpy's
# reductions run on one thread, torch's on all of its own: with more than ``SERIAL_THREADS`` of them the torch passes
# below are kept.
LARGE = 1 << 14  # elements: up to this, the torch passes' fewer dispatches cost less (benchmarks/stats_pass.py)
PIECE = 1 << 17  # elements: 512 KB of float32's bits, read from the cache by the passes after the first
SERIAL_THREADS = 1
_UNSIGNED = {torch.float32: np.uint32, torch.float64: np.uint64, torch.float16: np.uint16, torch.bfloat16: np.uint16}
_FORMATS = {torch.float32: ("<I", "<f"), torch.float64: ("<Q", "<d"), torch.float16: ("<H", "<e")}


def _serial_bits(x: torch.Tensor) -> np.ndarray | None:
    """A large CPU tensor's bits as numpy's unsigned integers of its width, one contiguous row in memory order (a
    channels_last or transposed tensor read in the order of its strides), no copy; None where ``_measure_serial`` is
    not taken: a small tensor, another device, a tensor subclass, a lazily negated view, a tensor with gaps or
    overlaps (a slice), or torch running on more than ``SERIAL_THREADS`` threads."""
    if x.numel() <= LARGE or torch.get_num_threads() > SERIAL_THREADS:
        return None
    x = _in_memory_order(x)
    return None if x is None else x.view(_BITS[x.dtype][0]).numpy().reshape(-1).view(_UNSIGNED[x.dtype])


def _in_memory_order(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a plain CPU tensor numpy can read in the order of its memory (a channels_last or transposed one
    permuted by its strides, no copy), or None: another device, a subclass, a lazily negated view, gaps or overlaps."""
    if x.device.type != "cpu" or type(x) is not torch.Tensor or x.layout != torch.strided or x.is_neg():
        return None
    if not x.is_contiguous():
        x = x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))
        if not x.is_contiguous():
            return None
    return x


_FUSED = (torch.float32, torch.float64)


def _measure_fused(x: torch.Tensor, t: torch.Tensor) -> dict | None:
    """``measure`` in ``fused.scan``'s one pass, or None where it is not taken: numba missing, a tensor
    ``_serial_bits`` would not read (another device, a subclass, a view with gaps) or a large one while torch runs on
    more than ``SERIAL_THREADS`` threads (its passes then share the cores), or NaN/Inf in it (the exact path's)."""
    if x.numel() > LARGE and torch.get_num_threads() > SERIAL_THREADS:
        return None
    x = _in_memory_order(x)
    if x is None:
        return None
    values = x.numpy().reshape(-1)
    got = _fused.scan(values, values.view(_UNSIGNED[x.dtype]))
    if got is None:
        return None
    total, sumsq, top, least, zeros = got
    if not (math.isfinite(total) and math.isfinite(sumsq)):  # float64 values whose sum overflows: torch's path
        return None
    return _row(x.numel(), total, sumsq, _value(top, x.dtype), None if least is None else _value(least, x.dtype),
                zeros, 0, 0, t)


SMALL_READ = 1 << 16  # elements: ``largest`` reads a tensor this small through numpy (its abs a copy)


def largest(t: torch.Tensor) -> float:
    """max|x| of ``t``, Inf when it holds NaN or Inf (a snapshot's ``worst`` measure of a stacked call): numpy's
    ``abs().max()`` for a small float32/float64 CPU tensor (1.6 against ``measure``'s 6.8 us on a (16, 128) output,
    paid at every call of a cell unrolled over time), else ``measure``."""
    x = _resolved(t.detach())
    y = _in_memory_order(x) if x.dtype in _FUSED and 0 < x.numel() <= SMALL_READ else None
    if y is not None:
        m = float(np.abs(y.numpy()).max())
        return math.inf if m != m else m  # NaN propagates through max
    row = measure(t)
    return math.inf if row["nan"] or row["inf"] else float(row["max_abs"])


def _value(bits: int, dtype) -> float:
    """The float of ``dtype`` whose bits, read as an unsigned integer, are ``bits``."""
    if dtype == torch.bfloat16:  # a float32's upper half
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    ints, floats = _FORMATS[dtype]
    return struct.unpack(floats, struct.pack(ints, bits))[0]


def _measure_serial(x: torch.Tensor, u: np.ndarray, t: torch.Tensor) -> dict:
    """``measure`` of a large CPU tensor on one thread (``u``: its ``_serial_bits``): the same values, the sum and
    the 2-norm (and the declared statistics) read back in one ``tolist``, then ``_scan``."""
    n, dtype = x.numel(), x.dtype
    acc = reduce_dtype(x)
    parts = [x.sum(dtype=acc), torch.linalg.vector_norm(x, dtype=acc)]
    ext = _extra_reductions(x, acc)
    if ext or acc is not None:
        parts = [p.double() for p in parts] + ext
    total, norm, *extra = torch.stack(parts).tolist()
    sumsq = norm * norm
    if not (math.isfinite(total) and math.isfinite(sumsq)):  # NaN/Inf reach the sum, or finite values overflow acc
        if not bool(torch.isfinite(x).all()):
            return _measure_nonfinite(t)
        total = float(x.sum(dtype=torch.float64))
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        sumsq = norm * norm
    top, least, zeros = _scan(u)
    max_abs = _value(top, dtype)
    return _row(n, total, precise_sumsq(x, n, total, sumsq, max_abs), max_abs,
                None if least is None else _value(least, dtype), zeros, 0, 0, t, _extra_values(extra))


def _scan(u: np.ndarray) -> tuple[int, int | None, int]:
    """The largest magnitude's bits, the smallest nonzero magnitude's (None: none) and the number of zeros (+0 and
    -0) of a finite tensor's bits ``u`` (unsigned), a ``PIECE`` at a time: its unsigned minimum and maximum, then
    where both signs are in the piece its signed ones too, then where a zero is, the count and the least nonzero."""
    s = u.view(f"i{u.itemsize}")
    sign = 1 << (8 * u.itemsize - 1)
    mag = sign - 1
    mask, one = u.dtype.type(mag), u.dtype.type(1)
    buf = _np_buffer(u.dtype)
    top, least, zeros = 0, sign, 0
    for i in range(0, u.size, PIECE):
        c = u[i:i + PIECE]
        low, high = int(c.min()), int(c.max())
        if high < sign:  # no sign bit set: magnitudes low..high
            positive, negative = low, None
            top = max(top, high)
        elif low >= sign:  # every sign bit set
            positive, negative = None, low - sign
            top = max(top, high - sign)
        else:  # both: the unsigned minimum is the least positive, the maximum the lowest negative; the signed ones
            # the negative nearest 0 and the largest positive
            piece = s[i:i + PIECE]
            positive, negative = low, int(piece.min()) + sign
            top = max(top, high - sign, int(piece.max()))
        if positive == 0 or negative == 0:  # zeros: -0's need the sign bits cleared first; +0's bits are 0 as they are
            b = buf[:c.size]
            if negative == 0:
                c = np.bitwise_and(c, mask, out=b)
            nonzero = int(np.count_nonzero(c))
            zeros += c.size - nonzero
            if nonzero:  # the least nonzero bits, their sign bit cleared (the magnitude nearest 0 of either sign)
                least = min(least, (int(np.subtract(c, one, out=b).min()) + 1) & mag)
        least = min(least, positive or sign, negative or sign)
    return top, (least if least < sign else None), zeros


def _np_buffer(dtype) -> np.ndarray:
    """The reused numpy buffer of ``PIECE`` elements of ``dtype`` of this thread."""
    bufs = getattr(_scratch, "np", None)
    if bufs is None:
        bufs = _scratch.np = {}
    if dtype not in bufs or bufs[dtype].size < PIECE:
        bufs[dtype] = np.empty(PIECE, dtype=dtype)
    return bufs[dtype]


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
    x = _resolved(t.detach())
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
    top = torch.maximum(-lo, hi).double()
    total = xs.sum(dtype=acc).double()
    norm = torch.linalg.vector_norm(xs, dtype=acc).double()
    sumsq = norm * norm
    if x.dtype != torch.float64 and n > 1:  # ``precise_sumsq``'s choice, made on the device (no read to branch on)
        sd = spread(xs, top)  # the non-finite values' zeros add nothing to the sum of squares
        lost = ((top > 0) & (top < TINY)) | (sumsq * n < CANCEL * total * total)
        sumsq = torch.where(lost, sd * n * sd + total * total / n, sumsq)
    zeros = (xs == 0).sum() - nonfinite
    ints, mask = _BITS[x.dtype]
    # the smallest nonzero magnitude from |x|'s bits (0 -> the largest, as ``_zeros``); all zero: -0.0 -> none
    least = torch.bitwise_and(xs.view(ints), mask).sub_(1).bitwise_and_(mask).min().add(1)
    smallest = least.reshape(1).view(x.dtype).double().abs().reshape(())
    return torch.stack([torch.full((), float(n), dtype=torch.float64, device=x.device), total, sumsq,
                        top, smallest, zeros.double(), nan.double(),
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
