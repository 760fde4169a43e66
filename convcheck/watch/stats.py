"""One tensor's statistics, as NVIDIA's per-layer FP8 inspector logs them, accumulated over a step.

Nothing here changes a tensor: every reduction reads a detached view. Sums are taken in float64 so
that the mean and std of a bfloat16 output are not themselves rounded."""

from __future__ import annotations

import math

import torch

FIELDS = ("n", "max_abs", "min_nonzero", "mean", "std", "zeros", "nan", "inf", "dtype", "calls")


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def measure(t: torch.Tensor) -> dict:
    """Raw accumulators of one floating tensor: count, finite sums, extremes, zeros, NaN/Inf counts."""
    x = t.detach()
    n = x.numel()
    total = x.sum(dtype=torch.float64)
    a = x.abs()
    nan = inf = 0
    if not math.isfinite(float(total)):
        finite = torch.isfinite(x)
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        x = x[finite]
        a = a[finite]
        total = x.sum(dtype=torch.float64)
    if x.numel() == 0:
        return {"n": n, "sum": 0.0, "sumsq": 0.0, "max_abs": 0.0, "min_nonzero": None, "zeros": 0,
                "nan": nan, "inf": inf, "dtype": dtype_name(t), "calls": 1}
    sumsq = torch.dot(x.reshape(-1).to(torch.float64), x.reshape(-1).to(torch.float64)) \
        if x.dtype != torch.float64 else (x * x).sum()
    zero = a == 0
    zeros = int(zero.sum())
    max_abs = float(a.max())
    min_nonzero = None if zeros == x.numel() else float(a.masked_fill(zero, math.inf).min())
    return {"n": n, "sum": float(total), "sumsq": float(sumsq), "max_abs": max_abs, "min_nonzero": min_nonzero,
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
