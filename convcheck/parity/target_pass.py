"""A target's pass: its own forward/backward, compared layer by layer with the judge's record.

Each target keeps scalars only: a row per leaf call (propagated, local and
intrinsic error, bound, NaN/Inf counts) and a row per parameter gradient.
"""

from __future__ import annotations

import math

import torch.nn as nn

from convcheck.batch import batch_size_of, tensors_of
from convcheck.capture import LeafCalls, SharedDropoutMasks, is_shared_dropout, tensors_in
from convcheck.metrics import expected_bound, grad_reduction_length, nonfinite_count, reduction_length, rel_l2
from convcheck.parity.local import grad_terms_norm, intrinsic_forward, local_forward, local_grads
from convcheck.runners import Runner
from convcheck.tolerances import Tolerances


class TargetPass:
    """One target's forward/backward against the judge's record ``calls``; rows of scalars."""

    def __init__(self, name: str, runner: Runner, judge: Runner, record, tol: Tolerances,
                 stochastic: list[str], seed: int):
        self.name, self.runner, self.judge = name, runner, judge
        self.calls, self.judge_grads = record
        self.tol, self.stochastic, self.seed = tol, set(stochastic), seed
        self.rows: list[dict] = []
        self.first_call: dict[str, tuple[int, nn.Module, str]] = {}
        self.reused: set[str] = set()
        self.masks: SharedDropoutMasks | None = None

    def run(self, model: nn.Module, batch, loss_fn) -> tuple[float, list]:
        """Forward and backward; ``(loss, [output, *parameter gradients])`` of this run."""
        x, y = batch
        self.masks = SharedDropoutMasks(model, self.seed)
        scale = self.runner.parity_loss_scale
        with self.runner.applied():
            with self.masks, LeafCalls(model, self._on_call):
                out, loss = self.runner.forward_loss(model, x, y, loss_fn)
            self.runner.backward(loss, scale)
            self._grad_rows(model, batch_size_of(x), scale)
        first_run = [t.detach() for t in tensors_of(out)] + [p.grad.detach() for p in model.parameters()
                                                             if p.grad is not None]
        return float(loss.detach()), first_run

    # -- forward rows -----------------------------------------------------------------

    def _on_call(self, key, name, module, inputs, out):
        jc = self.calls.get(key)
        order = len(self.rows)
        nan, inf = nonfinite_count(out)
        row = dict(
            target=self.name, order=order, kind="forward", layer=key, module=type(module).__name__,
            param="", shape="x".join(map(str, out.shape)), K=0, u=self.runner.unit_roundoff, bound=math.nan,
            propagated=math.nan, local=math.nan, intrinsic=math.nan, needed=math.nan, nan=nan, inf=inf,
            input_nonfinite=sum(sum(nonfinite_count(t)) for t in tensors_in(inputs)), grad_out_nonfinite=0,
            ref_absmax=float(jc.output.abs().max()) if jc is not None and jc.output.numel() else math.nan,
            flagged=False,
        )
        if jc is not None and tuple(jc.output.shape) == tuple(out.shape) and key not in self.stochastic:
            row.update(self._forward_errors(module, jc, inputs, out))
        self.rows.append(row)
        if jc is not None:
            if name not in self.first_call:
                self.first_call[name] = (order, module, key)
            else:  # called again: its parameter gradient sums every call, a one-call local run can't match it
                self.reused.add(name)
        if out.requires_grad:
            out.register_hook(lambda g, row=row: row.__setitem__("grad_out_nonfinite", sum(nonfinite_count(g))))

    def _forward_errors(self, module, jc, inputs, out) -> dict:
        tol, device = self.tol, self.runner.torch_device
        k = reduction_length(module, jc.inputs, jc.output)
        bound = expected_bound(self.runner.unit_roundoff, k)
        mask = self.masks.last_mask if is_shared_dropout(module) else None
        local = local_forward(module, jc, inputs, device, mask)
        flagged = tol.is_flagged(local, bound)
        intrinsic = math.nan
        if flagged and mask is None:
            # Is it the layer's arithmetic, or only its input's rounding amplified by an
            # ill-conditioned layer (BatchNorm over two values)? Held against the same
            # layer in float64 on the input as the target received it.
            intrinsic = intrinsic_forward(module, jc, inputs, device, self.judge)
            flagged = tol.is_flagged(intrinsic, bound)
        return dict(K=k, bound=bound, propagated=rel_l2(out, jc.output), local=local, intrinsic=intrinsic,
                    needed=tol.needed(local, bound), flagged=flagged)

    # -- gradient rows ------------------------------------------------------------------

    def _grad_rows(self, model: nn.Module, batch_size: int, scale: float) -> None:
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        modules = dict(model.named_modules())
        for name, (order, module, key) in self.first_call.items():
            if key in self.stochastic or name in self.reused:
                continue
            params = dict(module.named_parameters(recurse=False))
            jc = self.calls[key]
            if not params or jc.grad_output is None:
                continue
            mine = local_grads(module, jc, self.runner)
            for pname, p in params.items():
                full = f"{name}.{pname}" if name in modules else pname
                g, jg = grads.get(full), self.judge_grads.get(full)
                if g is not None and jg is not None:
                    self.rows.append(self._grad_row(order, name, module, jc, (full, pname, p),
                                                    g.detach() / scale, jg, mine.get(pname), batch_size))

    def _grad_row(self, order, name, module, jc, param, g, jg, lg, batch_size) -> dict:
        tol = self.tol
        full, pname, p = param
        k = grad_reduction_length(p, batch_size, jc.output)
        bound = expected_bound(self.runner.unit_roundoff, k)
        local = rel_l2(lg, jg) if lg is not None else math.nan
        if math.isfinite(local) and tol.is_flagged(local, bound):
            # A gradient that cancels to ~0 in exact arithmetic (the bias of a layer
            # feeding a training-mode BatchNorm) has no meaningful relative error:
            # measure it against the size of the terms it sums, as u*sqrt(K) assumes.
            terms = grad_terms_norm(module, jc, self.judge).get(pname)
            if terms:
                local = rel_l2(lg, jg, floor=terms)
        nan, inf = nonfinite_count(g)
        return dict(
            target=self.name, order=order, kind="grad", layer=name, module=jc.module,
            param=full, shape="x".join(map(str, p.shape)), K=k, u=self.runner.unit_roundoff, bound=bound,
            propagated=rel_l2(g, jg), local=local, intrinsic=math.nan, needed=tol.needed(local, bound),
            nan=nan, inf=inf, input_nonfinite=0, grad_out_nonfinite=0, ref_absmax=float(jg.abs().max()),
            flagged=tol.is_flagged(local, bound) if not math.isnan(local) else False,
        )
