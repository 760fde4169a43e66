"""One-step parity: per-layer forward and per-parameter gradient errors against the judge.

For every leaf-module call the table holds the *propagated* error (the
target's own forward vs the judge) and the *local* error (the judge's input,
cast to the target, through the target's copy of the layer, vs the judge's
output), the expected bound for that layer's precision and reduction length,
NaN/Inf counts, and whether the layer is flagged. The same for every
parameter's gradient: the target's own gradient vs the judge's, and the
gradient the target's copy of the layer computes from the judge's input and
output gradient.

Memory: only the judge's per-layer tensors are held in full; each target is
compared layer by layer while it runs and keeps scalars only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.capture import (
    LeafCalls,
    SharedDropoutMasks,
    cast_like,
    is_shared_dropout,
    module_copy,
    tensors_in,
)
from convcheck.metrics import (
    DEFAULT_TOLERANCES,
    Tolerances,
    expected_bound,
    grad_reduction_length,
    nonfinite_count,
    reduction_length,
    rel_l2,
)
from convcheck.targets import JUDGE, Target

COLUMNS = [
    "target", "order", "kind", "layer", "module", "param", "shape", "K", "u", "bound",
    "propagated", "local", "intrinsic", "needed", "nan", "inf", "input_nonfinite", "grad_out_nonfinite",
    "ref_absmax", "flagged",
]

ModelBuilder = Callable[[Target], nn.Module]


@dataclass
class _JudgeCall:
    name: str
    module: str
    inputs: tuple
    output: torch.Tensor
    grad_output: torch.Tensor | None = None


@dataclass
class ParityResult:
    """Per-layer parity of every target against the judge. Truthy when nothing is flagged."""

    layers: pd.DataFrame
    first_flagged: dict[str, str | None]
    tolerances: Tolerances
    judge_loss: float
    losses: dict[str, float] = field(default_factory=dict)
    # Leaf modules whose output changes with the random seed although their
    # input does not: stochastic layers that masks are not shared for.
    stochastic_layers: list[str] = field(default_factory=list)
    # Per target: largest relative difference between two identical runs
    # (same seed, same input) of its forward/backward - nondeterministic kernels.
    self_difference: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return not bool(self.layers["flagged"].any()) if len(self.layers) else True

    def flagged(self, target: str | None = None) -> pd.DataFrame:
        t = self.layers[self.layers["flagged"]]
        return t if target is None else t[t["target"] == target]

    def needed_bound_factor(self) -> float:
        """The smallest ``bound_factor`` under which no layer above ``min_error`` would be flagged."""
        t = self.layers
        t = t[t["local"] > self.tolerances.min_error]
        return float(t["needed"].max()) if len(t) else 0.0


def _loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float() if output.dtype in (torch.float16, torch.bfloat16) else output, y)


def _no_hooks(m: nn.Module) -> nn.Module:
    for sub in m.modules():
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()
        sub._backward_hooks.clear()
    return m


def _run_judge(build: ModelBuilder, x, y, judge: Target, seed: int):
    model = build(judge)
    calls: dict[str, _JudgeCall] = {}
    # Snapshots, not views: code between modules may change a recorded tensor in place
    # (ResNet's ``out += identity`` on the last BatchNorm's output). One snapshot per
    # tensor and version, so a layer's input shares the previous layer's output copy.
    snaps: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def snap(t):
        if not isinstance(t, torch.Tensor):
            return t
        hit = snaps.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        copy = t.detach().clone()
        snaps[id(t)] = (t, t._version, copy)
        return copy

    def on_call(key, name, module, inputs, out):
        rec = _JudgeCall(name, type(module).__name__, tuple(snap(t) for t in inputs), snap(out))
        calls[key] = rec
        if out.requires_grad:
            out.register_hook(lambda g, rec=rec: setattr(rec, "grad_output", g.detach()))

    with judge.applied():
        with SharedDropoutMasks(model, seed), LeafCalls(model, on_call) as lc:
            out = model(judge.cast_input(x))
            loss = _loss(out, judge.cast_input(y))
        snaps.clear()
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return calls, lc.order, grads, float(loss.detach())


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (``torch.equal`` says a NaN differs from itself,
    which made every layer producing NaN look stochastic)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _stochastic_layers(build: ModelBuilder, x, calls: dict, judge: Target, seed: int) -> list[str]:
    """Re-run the judge's forward under another random seed (same shared masks): a layer
    whose output moves while its input does not draws random numbers of its own."""
    model = build(judge)
    found: list[str] = []

    def on_call(key, name, module, inputs, out):
        jc = calls.get(key)
        if jc is None or tuple(jc.output.shape) != tuple(out.shape):
            return
        same_in = all(_identical(a, b) for a, b in zip(tensors_in(inputs), tensors_in(jc.inputs)))
        if same_in and not _identical(out.detach(), jc.output):
            found.append(key)

    torch.manual_seed(seed + 7777)
    with judge.applied(), torch.no_grad():
        with SharedDropoutMasks(model, seed), LeafCalls(model, on_call):
            model(judge.cast_input(x))
    return found


def _self_difference(build: ModelBuilder, target: Target, x, y, mask_seed: int, rng_seed: int,
                     first_run: list) -> float:
    """Largest relative difference of logits and gradients between the target's parity run
    and one identical rerun (same weights, input, seed and loss scale)."""
    torch.manual_seed(rng_seed)  # as before the parity run: building the model draws numbers too
    model = build(target)
    scale = 2.0**16 if target.uses_grad_scaler else 1.0
    with target.applied():
        with SharedDropoutMasks(model, mask_seed), target.autocast():
            out = model(target.cast_input(x))
            loss = _loss(out, target.cast_input(y))
        (loss * scale).backward()
    second = [out.detach()] + [p.grad.detach() for p in model.parameters() if p.grad is not None]
    worst = 0.0
    for a, b in zip(first_run, second):
        if not torch.equal(a, b):
            d = rel_l2(a, b)
            worst = max(worst, d if math.isfinite(d) else math.inf)
    return worst


def run_parity(
    build: ModelBuilder,
    batch: tuple[torch.Tensor, torch.Tensor],
    targets: list[Target],
    *,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
    judge: Target = JUDGE,
    seed: int = 0,
) -> ParityResult:
    """One forward/backward step of every target against the judge.

    ``build(target)`` returns the model with the shared initial weights, cast
    and moved to ``target``, in training mode.
    """
    x, y = batch
    torch.manual_seed(seed)
    calls, order, judge_grads, judge_loss = _run_judge(build, x, y, judge, seed)
    stochastic = _stochastic_layers(build, x, calls, judge, seed)
    rows: list[dict] = []
    first: dict[str, str | None] = {}
    losses: dict[str, float] = {}
    selfdiff: dict[str, float] = {}
    for i, target in enumerate(targets):
        if target == judge:
            continue
        # Each device has its own random stream: a target's unshared random draws differ
        # from the judge's, as they would on another device.
        torch.manual_seed(seed + 1 + i)
        t_rows, loss, first_run = _run_target(build, target, x, y, calls, judge_grads, tolerances, seed, stochastic)
        rows.extend(t_rows)
        losses[str(target)] = loss
        first[str(target)] = _first_flagged(t_rows)
        selfdiff[str(target)] = _self_difference(build, target, x, y, seed, seed + 1 + i, first_run)
    table = pd.DataFrame(rows, columns=COLUMNS)
    return ParityResult(table, first, tolerances, judge_loss, losses, stochastic, selfdiff)


def _first_flagged(rows: list[dict]) -> str | None:
    fwd = [r for r in rows if r["kind"] == "forward" and r["flagged"]]
    if fwd:
        return min(fwd, key=lambda r: r["order"])["layer"]
    grad = [r for r in rows if r["kind"] == "grad" and r["flagged"]]
    if grad:  # backward runs output -> input: the last layer in forward order comes first
        return max(grad, key=lambda r: r["order"])["layer"]
    return None


def _run_target(build, target, x, y, calls, judge_grads, tol, seed, stochastic):
    model = build(target)
    device = target.torch_device
    u = target.unit_roundoff
    rows: list[dict] = []
    by_key: dict[str, dict] = {}
    first_call: dict[str, tuple[int, nn.Module, tuple]] = {}
    scale = 2.0**16 if target.uses_grad_scaler else 1.0
    masks = SharedDropoutMasks(model, seed)
    reused: set[str] = set()

    def on_call(key, name, module, inputs, out):
        jc = calls.get(key)
        order = len(by_key)
        nan, inf = nonfinite_count(out)
        in_bad = sum(sum(nonfinite_count(t)) for t in tensors_in(inputs))
        row = dict(
            target=str(target), order=order, kind="forward", layer=key, module=type(module).__name__,
            param="", shape="x".join(map(str, out.shape)), K=0, u=u, bound=math.nan,
            propagated=math.nan, local=math.nan, intrinsic=math.nan, needed=math.nan, nan=nan, inf=inf,
            input_nonfinite=in_bad, grad_out_nonfinite=0,
            ref_absmax=float(jc.output.abs().max()) if jc is not None and jc.output.numel() else math.nan,
            flagged=False,
        )
        if jc is not None and tuple(jc.output.shape) == tuple(out.shape) and key not in stochastic:
            k = reduction_length(module, jc.inputs, jc.output)
            bound = expected_bound(u, k)
            mask = masks.last_mask if is_shared_dropout(module) else None
            local = _local_forward(module, jc, inputs, device, mask)
            flagged = tol.is_flagged(local, bound)
            intrinsic = math.nan
            if flagged and mask is None:
                # Is it the layer's arithmetic, or only its input's rounding amplified by an
                # ill-conditioned layer (BatchNorm over two values)? Held against the same
                # layer in float64 on the input as the target received it.
                intrinsic = _intrinsic_forward(module, jc, inputs, device)
                flagged = tol.is_flagged(intrinsic, bound)
            row.update(K=k, bound=bound, propagated=rel_l2(out, jc.output), local=local, intrinsic=intrinsic,
                       needed=tol.needed(local, bound), flagged=flagged)
        rows.append(row)
        by_key[key] = row
        if jc is not None:
            if name not in first_call:
                first_call[name] = (order, module, key)
            else:  # called again: its parameter gradient sums every call, a one-call local run can't match it
                reused.add(name)
        if out.requires_grad:
            out.register_hook(lambda g, row=row: row.__setitem__("grad_out_nonfinite", sum(nonfinite_count(g))))

    with target.applied():
        with masks, LeafCalls(model, on_call):
            with target.autocast():
                out = model(target.cast_input(x))
                loss = _loss(out, target.cast_input(y))
        (loss * scale).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        modules = dict(model.named_modules())
        for name, (order, module, key) in first_call.items():
            if key in stochastic or name in reused:
                continue
            params = dict(module.named_parameters(recurse=False))
            jc = calls[key]
            if not params or jc.grad_output is None:
                continue
            local_grads = _local_grads(module, jc, target, device, scale)
            for pname, p in params.items():
                full = f"{name}.{pname}" if name in modules else pname
                g, jg = grads.get(full), judge_grads.get(full)
                if g is None or jg is None:
                    continue
                g = g.detach().double() / scale
                k = grad_reduction_length(p, x.shape[0], jc.output)
                bound = expected_bound(u, k)
                lg = local_grads.get(pname)
                local = rel_l2(lg, jg) if lg is not None else math.nan
                if math.isfinite(local) and tol.is_flagged(local, bound):
                    # A gradient that cancels to ~0 in exact arithmetic (the bias of a layer
                    # feeding a training-mode BatchNorm) has no meaningful relative error:
                    # measure it against the size of the terms it sums, as u*sqrt(K) assumes.
                    terms = _grad_terms_norm(module, jc).get(pname)
                    if terms:
                        local = rel_l2(lg, jg, floor=terms)
                nan, inf = nonfinite_count(g)
                rows.append(dict(
                    target=str(target), order=order, kind="grad", layer=name, module=jc.module,
                    param=full, shape="x".join(map(str, p.shape)), K=k, u=u, bound=bound,
                    propagated=rel_l2(g, jg), local=local, needed=tol.needed(local, bound),
                    nan=nan, inf=inf, input_nonfinite=0, grad_out_nonfinite=0, ref_absmax=float(jg.abs().max()),
                    flagged=tol.is_flagged(local, bound) if not math.isnan(local) else False,
                ))
    first_run = [out.detach()] + [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return rows, float(loss.detach()), first_run


def _local_forward(module: nn.Module, jc: _JudgeCall, actual_inputs: tuple, device, mask=None) -> float:
    """The judge's input through the target's copy of this layer, vs the judge's output."""
    copy = _no_hooks(module_copy(module))
    args = tuple(cast_like(j, a if isinstance(a, torch.Tensor) else None, device)
                 for j, a in zip(jc.inputs, actual_inputs))
    if mask is not None:  # a shared-mask dropout: the same mask the target's own call used
        return rel_l2(args[0] * mask, jc.output)
    with torch.no_grad():
        out = copy(*args)
    got = tensors_in(out)
    return rel_l2(got[0], jc.output) if got else math.nan


def _intrinsic_forward(module: nn.Module, jc: _JudgeCall, actual_inputs: tuple, device) -> float:
    """The target's layer on the judge's input cast to the target, vs a float64 copy of the
    same layer on that same cast input: the error of the layer's own arithmetic."""
    copy = _no_hooks(module_copy(module))
    args = tuple(cast_like(j, a if isinstance(a, torch.Tensor) else None, device)
                 for j, a in zip(jc.inputs, actual_inputs))
    ref = _no_hooks(module_copy(module)).to(device="cpu", dtype=torch.float64)
    ref_args = tuple(a.to("cpu", torch.float64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
    with torch.no_grad():
        got = tensors_in(copy(*args))
        with torch.autocast("cpu", enabled=False):
            want = tensors_in(ref(*ref_args))
    return rel_l2(got[0], want[0]) if got and want else math.nan


def _grad_terms_norm(module: nn.Module, jc: _JudgeCall) -> dict[str, float]:
    """Per parameter, the norm of the gradient summed from absolute values, in float64:
    |grad_output| (and, for Linear/Conv, |input|) through a float64 copy of the layer.
    For a bias and a Linear/Conv weight this is exactly sum|terms|."""
    copy = _no_hooks(module_copy(module)).to(device="cpu", dtype=torch.float64)
    absolute = isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))
    args = tuple((t.abs() if absolute else t).to("cpu", torch.float64).requires_grad_(False)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in jc.inputs)
    with torch.enable_grad():
        out = tensors_in(copy(*args))[0]
    out.backward(jc.grad_output.to("cpu", torch.float64).abs())
    return {n: float(p.grad.abs().norm()) for n, p in copy.named_parameters() if p.grad is not None}


def _local_grads(module: nn.Module, jc: _JudgeCall, target: Target, device, scale: float) -> dict:
    """Parameter gradients of the target's copy of this layer, fed the judge's input and output gradient."""
    copy = _no_hooks(module_copy(module))
    for p in copy.parameters():
        p.grad = None
    args = tuple(cast_like(j, j if isinstance(j, torch.Tensor) else None, device) for j in jc.inputs)
    args = tuple(a.to(target.param_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    with torch.enable_grad(), target.autocast():
        out = tensors_in(copy(*args))[0]
    out.backward(jc.grad_output.to(device=device, dtype=out.dtype) * scale)
    return {n: p.grad.detach().double() / scale for n, p in copy.named_parameters() if p.grad is not None}
