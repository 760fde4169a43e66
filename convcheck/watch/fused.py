"""Every statistic of ``stats.measure`` in one pass over a CPU tensor's memory (issue 45: "all per-tensor statistics in
one pass, one fused reduction").

torch has no reduction that yields several statistics at once: ``measure`` reads a large activation four to seven
times (the sum, the 2-norm, then ``stats._scan``'s minima and maxima of its bits, and where zeros are, their count
and the least nonzero), each pass a dispatch. Here loops compiled by numba read each element once (``_extremes``):

* the sum and the sum of squares in float64 (a float32 value's square is exact there), over blocks of ``BLOCK``
  elements whose partial sums the compiler keeps in vector lanes (their order of summation is its own, so the sums may
  differ from torch's in the last bits). In float32 they were 1.5x faster, but a block's squares underflowed below
  about 1e-19 (a std of 1e-25 values read 40% of itself) and lost a std 1e6 times below its mean (1000 + 1e-3 x
  noise read 0), as torch's float32 norm does;
* the largest and least of the memory read as signed and as unsigned integers of the same width. A float's bits read
  as a signed integer order the values whose sign bit is clear (the non-negative ones) by magnitude; read as
  unsigned, the negative ones (sign bit set) lie above them, ordered by magnitude too. So the largest signed value
  is the largest non-negative one, the largest unsigned the largest-magnitude negative one (or, with none, the
  largest non-negative one), and the least of each the smallest magnitude of the other sign: the largest and least
  magnitudes follow (``scan``), NaN's bits above Inf's.

Only same-width integer minima and maxima and float sums: the compiler turns them into vector instructions of the
tensor's own width (an integer mask or subtraction would widen every lane to 64 bits: numba promotes them, and the
earlier single loop that did ran at 0.31 against 0.24 ns an element on a cached float32 tensor). A tensor whose
smallest magnitude is zero (a ReLU's output) takes one more pass over memory it has just read (``_zeros_least``): the
count of zeros (+0.0 and -0.0) and the least nonzero magnitude (the least unsigned value that is not +0.0, the least
signed one that is not -0.0). Counts and extremes are exact: the same values as ``measure``'s other paths.

float32 and float64 CPU tensors, contiguous in some order of their dimensions (``stats._serial_bits``). Without numba,
or where it fails to compile, ``scan`` returns None and ``measure`` keeps its torch and numpy passes; numba is a
dependency, compiled once per machine (cached beside this file, else in numba's user cache) and loaded at a watch's
start (``ready``), not inside the first step.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_LOCK = threading.Lock()
_KERNELS: dict | None = None  # numpy unsigned dtype -> (extremes, zeros_least); {} where numba is missing or failed
ENV_OFF = "CONVCHECK_NO_FUSED"  # set (to anything but 0): the torch and numpy passes, as without numba
BLOCK = 256  # elements a block: its float64 partial sums kept in vector lanes, then added to the totals


def _extremes(values, signed, unsigned):
    """``values`` the tensor's memory as floats, ``signed`` and ``unsigned`` the same memory as integers: the sum and
    the sum of squares, and the largest and least signed and unsigned values."""
    total = 0.0
    squares = 0.0
    smax = signed[0]
    smin = signed[0]
    umax = unsigned[0]
    umin = unsigned[0]
    n = values.size
    whole = n - n % BLOCK
    for start in range(0, whole, BLOCK):
        part = 0.0
        part_sq = 0.0
        for j in range(BLOCK):
            v = np.float64(values[start + j])
            part += v
            part_sq += v * v
            s = signed[start + j]
            u = unsigned[start + j]
            smax = max(smax, s)
            smin = min(smin, s)
            umax = max(umax, u)
            umin = min(umin, u)
        total += part
        squares += part_sq
    for i in range(whole, n):
        d = np.float64(values[i])
        total += d
        squares += d * d
        s = signed[i]
        u = unsigned[i]
        smax = max(smax, s)
        smin = min(smin, s)
        umax = max(umax, u)
        umin = min(umin, u)
    return total, squares, smax, smin, umax, umin


def _zeros_least(values, signed, unsigned, negative_zero, top, full):
    """How many of ``values`` are zero (+0.0 or -0.0: counted a block at a time in floats, exact below 2**24), the least
    unsigned value that is not +0.0 (the least positive's bits, if any) and the least signed one that is not -0.0
    (``negative_zero``: the least signed integer; the least-magnitude negative's, if any). Two loops a block: the
    count's float compare and the integers' minima, each vectorised, would not be in one."""
    nil = unsigned[0] - unsigned[0]
    upos = full
    sneg = top
    zeros = 0
    none = values[0] - values[0]
    one = none + 1
    n = values.size
    whole = n - n % BLOCK
    for start in range(0, whole, BLOCK):
        part = none
        for j in range(BLOCK):
            part += one if values[start + j] == none else none
        zeros += int(part)
        for j in range(BLOCK):
            s = signed[start + j]
            u = unsigned[start + j]
            upos = min(upos, u if u != nil else full)
            sneg = min(sneg, s if s != negative_zero else top)
    for i in range(whole, n):
        if values[i] == none:
            zeros += 1
        s = signed[i]
        u = unsigned[i]
        upos = min(upos, u if u != nil else full)
        sneg = min(sneg, s if s != negative_zero else top)
    return zeros, upos, sneg


_SIGNED = {np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}


def _compile() -> dict:
    if os.environ.get(ENV_OFF, "0") not in ("", "0"):
        return {}
    try:
        import numba
    except ImportError:
        return {}
    kernels = {}
    try:
        jit = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
        extremes, zeros_least = jit(_extremes), jit(_zeros_least)
        for floats, ints in ((np.float32, np.uint32), (np.float64, np.uint64)):
            probe = np.array([1.5, -0.0, -2.0] * 100, dtype=floats)
            kernels[np.dtype(ints)] = (extremes, zeros_least)  # compiled (or loaded) now, by the probe's scan
            got = _scan(kernels[np.dtype(ints)], probe, probe.view(ints))
            if got != (-50.0, 625.0, int(probe[2:3].view(ints)[0]) & ((1 << (8 * probe.itemsize - 1)) - 1),
                       int(probe[:1].view(ints)[0]), 100):
                return {}
    except Exception:  # noqa: BLE001 - a numba that cannot compile here: the torch and numpy passes stay
        return {}
    return kernels


def ready() -> bool:
    """Compile (or load) the passes now; whether they are there."""
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                _KERNELS = _compile()
    return bool(_KERNELS)


def _scan(kernels, values: np.ndarray, bits: np.ndarray):
    extremes, zeros_least = kernels
    width = 8 * bits.itemsize
    sign = 1 << (width - 1)
    mask, full = sign - 1, (1 << width) - 1
    signed = bits.view(_SIGNED[bits.dtype])
    total, squares, smax, smin, umax, umin = extremes(values, signed, bits)
    smax, smin, umax, umin = int(smax), int(smin), int(umax), int(umin)
    top = max(smax if smax >= 0 else 0, umax & mask)  # the largest non-negative's bits, the largest negative's
    if top >= (0x7F800000 if width == 32 else 0x7FF0000000000000):
        return None  # NaN or Inf in it
    low = min(umin if umin < sign else full, smin & mask if smin < 0 else full)  # zero among them, or not
    if low > 0:
        return float(total), float(squares), top, low, 0
    zeros, upos, sneg = zeros_least(values, signed, bits, signed.dtype.type(-sign), signed.dtype.type(mask),
                                    bits.dtype.type(full))
    zeros, upos, sneg = int(zeros), int(upos), int(sneg)
    if zeros == values.size:
        return float(total), float(squares), top, None, zeros
    return float(total), float(squares), top, min(upos if upos < sign else full, sneg & mask if sneg < 0 else full), \
        zeros


def scan(values: np.ndarray, bits: np.ndarray) -> tuple[float, float, int, int | None, int] | None:
    """``(sum, sum of squares, the largest magnitude's bits, the least nonzero magnitude's bits or None, zeros)`` of a
    finite float32/float64 array (``bits``: its memory as unsigned integers); None when it holds NaN or Inf (counted
    by the caller's exact path) or when the passes are not there."""
    if not ready():
        return None
    kernels = _KERNELS.get(bits.dtype)
    if kernels is None:
        return None
    if not values.size:  # the passes read the first element
        return 0.0, 0.0, 0, None, 0
    return _scan(kernels, values, bits)
