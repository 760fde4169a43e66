"""One tensor's statistics, as NVIDIA's per-layer FP8 inspector logs them, accumulated over a step.

Nothing here changes a tensor: every reduction reads a detached view. Half-precision tensors are
reduced in float32 so that the mean and std of a bfloat16 output are not themselves rounded to bfloat16."""

from __future__ import annotations

import math

import torch

FIELDS = ("n", "max_abs", "min_nonzero", "mean", "std", "zeros", "nan", "inf", "dtype", "calls")


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def reduce_dtype(t: torch.Tensor):
    """The dtype to reduce in: float32 for half types (torch would round their sum to the half type)."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else None


def finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one sum (no mask tensor); a sum that overflows from finite
    values is told apart by the exact check."""
    x = t.detach()
    return math.isfinite(float(x.sum(dtype=reduce_dtype(x)))) or bool(torch.isfinite(x).all())


def measure(t: torch.Tensor) -> dict:
    """Raw accumulators of one floating tensor: count, finite sums, extremes, zeros, NaN/Inf counts.
    Reductions without temporaries where torch has them (sum, norms, count_nonzero); the smallest
    nonzero magnitude needs a masked copy only when the tensor holds zeros."""
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
        return {"n": n, "sum": 0.0, "sumsq": 0.0, "max_abs": 0.0, "min_nonzero": None, "zeros": 0,
                "nan": nan, "inf": inf, "dtype": dtype_name(t), "calls": 1}
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
    return {"n": n, "sum": total, "sumsq": norm * norm, "max_abs": max_abs, "min_nonzero": min_nonzero,
            "zeros": zeros, "nan": nan, "inf": inf, "dtype": dtype_name(t), "calls": 1}


def merge(acc: dict | None, new: dict) -> dict:
    """Two calls' accumulators in one (a layer called twice in a step: gradient accumulation, reuse)."""
    if acc is None:
        return new
    mins = [v for v in (acc["min_nonzero"], new["min_nonzero"]) if v is not None]
    return {"n": acc["n"] + new["n"], "sum": acc["sum"] + new["sum"], "sumsq": acc["sumsq"] + new["sumsq"],
            "max_abs": max(acc["max_abs"], new["max_abs"]), "min_nonzero": min(mins) if mins else None,
            "zeros": acc["zeros"] + new["zeros"], "nan": acc["nan"] + new["nan"], "inf": acc["inf"] + new["inf"],
            "dtype": acc["dtype"], "calls": acc["calls"] + new["calls"]}


def finish(acc: dict) -> dict:
    """The recorded row: mean, std and the share of zeros over the finite values."""
    finite = acc["n"] - acc["nan"] - acc["inf"]
    mean = acc["sum"] / finite if finite else 0.0
    var = max(acc["sumsq"] / finite - mean * mean, 0.0) if finite else 0.0
    return {"n": acc["n"], "max_abs": acc["max_abs"], "min_nonzero": acc["min_nonzero"], "mean": mean,
            "std": math.sqrt(var), "zeros": acc["zeros"] / acc["n"] if acc["n"] else 0.0, "nan": acc["nan"],
            "inf": acc["inf"], "dtype": acc["dtype"], "calls": acc["calls"]}
