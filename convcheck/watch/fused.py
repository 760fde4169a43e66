"""Every statistic of ``stats.measure`` in one pass over a CPU tensor's memory (issue 45: "all per-tensor statistics in
one pass, one fused reduction").

torch has no reduction that yields several statistics at once: ``measure`` reads a large activation four to seven
times (the sum, the 2-norm, then ``stats._scan``'s minima and maxima of its bits, and where zeros are, their count
and the least nonzero), each pass a dispatch. Here one loop compiled by numba reads each element once: the sum and
the sum of squares in float64 (vectorised: their order of summation is left to the compiler, so they may differ from
torch's in the last bits), and from the element's bits with the sign cleared - whose order, read as an unsigned
integer, is the order of the magnitudes, NaN's bits above Inf's - the largest magnitude, the least nonzero one (the
least of ``bits - 1``: a zero wraps to the largest integer) and the number of zeros. Counts and extremes are exact:
the same values as ``measure``'s other paths.

float32 and float64 CPU tensors, contiguous in some order of their dimensions (``stats._serial_bits``). Without numba,
or where it fails to compile, ``kernel`` is None and ``measure`` keeps its torch and numpy passes; numba is a
dependency, compiled once per machine (cached beside this file, else in numba's user cache) and loaded at a watch's
start (``ready``), not inside the first step.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_LOCK = threading.Lock()
_KERNELS: dict | None = None  # numpy unsigned dtype -> the compiled pass; {} where numba is missing or failed
ENV_OFF = "CONVCHECK_NO_FUSED"  # set (to anything but 0): the torch and numpy passes, as without numba


def _pass(values, bits, mask, one, full):
    """The pass numba compiles for each width: ``values`` the tensor's memory as floats, ``bits`` the same memory as
    unsigned integers; ``mask`` clears the sign bit, ``full`` is every bit set."""
    total = 0.0
    squares = 0.0
    nil = full - full  # 0 of the unsigned type (a literal 0 would make numba unify uint64 with int64 as float64)
    top = nil
    least = full
    zeros = 0
    for i in range(values.size):
        v = np.float64(values[i])
        total += v
        squares += v * v
        m = bits[i] & mask
        top = max(top, m)
        least = min(least, m - one)
        zeros += m == nil
    return total, squares, top, least, zeros


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
        kernel = jit(_pass)
        for floats, ints in ((np.float32, np.uint32), (np.float64, np.uint64)):
            probe = np.array([1.5, -0.0, 2.0], dtype=floats)
            full = np.iinfo(ints).max
            got = kernel(probe, probe.view(ints), ints(full >> 1), ints(1), ints(full))  # compiled (or loaded) now
            if (got[0], got[1], int(got[4])) != (3.5, 6.25, 1):
                return {}
            kernels[np.dtype(ints)] = kernel
    except Exception:  # noqa: BLE001 - a numba that cannot compile here: the torch and numpy passes stay
        return {}
    return kernels


def ready() -> bool:
    """Compile (or load) the pass now; whether it is there."""
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                _KERNELS = _compile()
    return bool(_KERNELS)


def scan(values: np.ndarray, bits: np.ndarray) -> tuple[float, float, int, int | None, int] | None:
    """``(sum, sum of squares, the largest magnitude's bits, the least nonzero magnitude's bits or None, zeros)`` of a
    finite float32/float64 array (``bits``: its memory as unsigned integers); None when it holds NaN or Inf (counted
    by the caller's exact path) or when the pass is not there."""
    if not ready():
        return None
    kernel = _KERNELS.get(bits.dtype)
    if kernel is None:
        return None
    width, ints = 8 * bits.itemsize, bits.dtype.type
    mask, full = ints((1 << (width - 1)) - 1), ints((1 << width) - 1)
    total, squares, top, least, zeros = kernel(values, bits, mask, ints(1), full)
    inf = 0x7F800000 if width == 32 else 0x7FF0000000000000
    if int(top) >= inf:
        return None
    zeros = int(zeros)
    return float(total), float(squares), int(top), (None if zeros == values.size else int(least) + 1), zeros
