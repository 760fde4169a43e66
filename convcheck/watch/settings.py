"""What the watch records of the run's settings as the block starts, and the edge checks of what it is given: the
math-mode flags, the optimizer's hyperparameters per group, the model's module path, an optimizer that holds the
model's parameters."""

from __future__ import annotations

import math
import random
import os
import sys

import torch

from convcheck.errors import UsageError


def math_flags() -> dict:
    """Every switch that makes two runs of the same code differ, as set when the watch starts."""
    b = torch.backends
    return {"cudnn.benchmark": bool(b.cudnn.benchmark), "cudnn.deterministic": bool(b.cudnn.deterministic),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "matmul.allow_tf32": bool(b.cuda.matmul.allow_tf32), "cudnn.allow_tf32": bool(b.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"), "threads": torch.get_num_threads()}


# Entries of a param group that are no hyperparameter of the update: the parameters, the learning rate
# (recorded every step), and the implementation switches (one kernel or another for the same update:
# a GPU run with fused=True against a CPU run without is not a setup difference).
NOT_SETTINGS = ("params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable", "name")


def optimizer_settings(optimizer) -> list[dict] | None:
    """Each parameter group's hyperparameters as the block starts (momentum, weight decay, betas, eps, ...):
    numbers, booleans and short tuples of numbers; the learning rate is recorded every step instead."""
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return None

    def plain(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, str):
            return v[:60]  # line_search_fn="strong_wolfe" against None
        if isinstance(v, (int, float)):
            try:
                return float(v) if math.isfinite(float(v)) else None
            except OverflowError:
                return None
        if isinstance(v, (tuple, list)) and len(v) <= 4:
            v = [x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x for x in v]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                return [float(x) for x in v]
        return ...  # not a setting we compare

    out = []
    for g in optimizer.param_groups:
        kept = {k: plain(v) for k, v in g.items() if isinstance(k, str) and k not in NOT_SETTINGS}
        out.append({k: v for k, v in kept.items() if v is not ...})
    return out


def module_of(cls: type) -> str:
    """The module ``cls`` can be imported from: a script run with ``python -m pkg.script`` is ``__main__``
    here but ``pkg.script`` to ``convcheck diff`` (its float64 replay imports the model's class)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None) if cls.__module__ == "__main__" else None
    return spec.name if spec is not None and spec.name else cls.__module__


def step_loss(loss) -> float | None:
    """``w.step(loss)``'s loss as a number: a one-element tensor, a Python number, or None; anything else is a
    ``UsageError`` naming ``w.step`` (never numpy's or torch's words)."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex():
            raise UsageError(f"convcheck.watch: w.step(loss) takes the step's scalar loss; got a tensor of shape "
                             f"{list(loss.shape)} (reduce it first, e.g. loss.mean())")
        return float(loss.detach())
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise UsageError(f"convcheck.watch: w.step(loss) takes the step's loss as a number or a one-element tensor; "
                         f"got {type(loss).__name__} {str(loss)[:40]!r}")
    return float(loss)


def check_optimizer(model: torch.nn.Module, optimizer) -> None:
    """An optimizer the watch can read: a ``torch.optim.Optimizer`` (its step hooks, its param_groups) that
    holds at least one of the model's parameters - one built over another model's (or a copy's) would
    train nothing the watch sees, and the runs would part for no reason a diff can name."""
    if optimizer is None:
        return
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise UsageError(f"convcheck.watch: optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer "
                         "(pass the optimizer whose step() trains the model, or none)")
    mine = {id(p) for p in model.parameters()}
    held = [p for g in groups for p in g["params"]]
    if mine and not any(id(p) in mine for p in held):
        raise UsageError(f"convcheck.watch: the optimizer ({type(optimizer).__name__}, {len(held)} parameters) holds "
                         "none of the model's parameters: build it over model.parameters() after the model is "
                         "final (after .to(device), a copy or torch.compile's original module)")


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (CPU and every accelerator) with ``seed``."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def learning_rates(optimizer) -> list[float]:
    """Each parameter group's learning rate now (a tensor lr read as a number); none without an optimizer."""
    if optimizer is None:
        return []
    return [float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else float(g["lr"].detach())
            for g in optimizer.param_groups if "lr" in g]
