"""A target's pass: its own forward/backward, compared layer by layer with the judge's record.

Each target keeps scalars only: a row per leaf call (propagated, local and
intrinsic error, bound, NaN/Inf counts) and a row per parameter gradient.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn

from convcheck.batch import batch_size_of
from convcheck.capture import LeafCalls, ParentCall, SharedDropoutMasks, is_shared_dropout, own_code_leaf
from convcheck.nested import first_tensor, tensors_in
from convcheck.numerics.metrics import (abs_max, grad_reduction_length, nonfinite_count, reduction_length, rel_l2,
                                        rel_l2_finite)
from convcheck.measure.parity import checks
from convcheck.measure.parity.checks import LocalGrads, check_forward, row_verdict
from convcheck.measure.parity.known import selects
from convcheck.measure.parity.floor import FloorMeter
from convcheck.measure.parity.judge_measures import Judged
from convcheck.measure.parity.local import cast_args, local_forward_backward, local_grads, target_call
from convcheck.measure.parity.modes import TargetModes
from convcheck.measure.parity.own_check import OwnCodeCheck, first_nonfinite_op, own_code_produces
from convcheck.measure.layer_names import own_code_label
from convcheck.measure.parity.own_code import REPLAY_FAILURES, plain_container
from convcheck.targets.runners import Runner
from convcheck.numerics.thresholds import GRAD_ACCUMULATION
from convcheck.numerics.tolerances import Tolerances


class TargetPass:
    """One target's forward/backward against the judge's record ``calls``; rows of scalars."""

    def __init__(self, name: str, runner: Runner, judge: Runner, record, tol: Tolerances,
                 stochastic: list[str], seed: int):
        self.name, self.runner, self.judge = name, runner, judge
        self.calls, self.judge_grads = record
        self.tol, self.stochastic, self.seed = tol, set(stochastic), seed
        self.rows: list[dict] = []
        self.by_key: dict[str, dict] = {}
        self.nonfinite_seen = False  # a NaN/Inf in any leaf call's input or output so far
        self.own_params: dict[str, tuple[int, nn.Module]] = {}  # modules with children and parameters of their own
        self.first_call: dict[str, tuple[int, nn.Module, str, torch.dtype]] = {}
        self.reused: set[str] = set()
        self._counted: dict[int, tuple] = {}  # id -> (weak reference, version, NaN/Inf counts): ``counts``
        self.local_checks: dict[str, dict] = {}  # layer name -> per parameter, its row's local columns
        self.batch_size = 0
        self.module_names: set[str] = set()
        self.masks: SharedDropoutMasks | None = None
        self.floors = FloorMeter.of(runner, judge)
        self.modes = TargetModes()  # measurements outside the target's dispatch modes (``modes``)
        self.rerun_needed = True  # whether ``run`` keeps what a rerun is held against
        self.release = False  # the last target: each judge call's record is dropped once measured (``_drop``)

    def run(self, model: nn.Module, batch, loss_fn) -> tuple[float, list]:
        """Forward and backward; ``(loss, [output, *parameter gradients])`` of this run."""
        x, y = batch
        self.batch_size, self.module_names = batch_size_of(x), {n for n, _ in model.named_modules()}
        self.masks = SharedDropoutMasks(model, self.seed)
        scale = self.runner.parity_loss_scale
        with self.runner.applied():
            with self.masks, LeafCalls(model, self._on_call, self._on_parent, grad_in=self._grad_in):
                out, loss = self.runner.forward_loss(model, x, y, loss_fn)
            self.runner.backward(loss, scale)
            with self.modes.measuring():
                self._grad_rows(model, scale)
        if not self.rerun_needed:  # nothing to hold a rerun against
            return float(loss.detach()), []
        first_run = [t.detach() for t in tensors_in(out, sort_keys=True)] + \
            [p.grad.detach() for p in model.parameters() if p.grad is not None]
        return float(loss.detach()), first_run

    # -- forward rows -----------------------------------------------------------------

    def _row(self, key: str, label: str, inputs, out: torch.Tensor, judged: Judged | None) -> dict:
        nan, inf = self.counts(out)
        return dict(
            target=self.name, order=len(self.rows), kind="forward", layer=key, module=label,
            param="", shape="x".join(map(str, out.shape)), K=0, u=self.runner.unit_roundoff, bound=math.nan,
            propagated=math.nan, local=math.nan, intrinsic=math.nan, floor=math.nan, over_floor=math.nan,
            needed=math.nan, nan=nan, inf=inf,
            input_nonfinite=sum(sum(self.counts(t)) for t in tensors_in(inputs)), grad_out_nonfinite=0,
            grad_in_nonfinite=0,
            ref_absmax=judged.abs_max() if judged is not None else math.nan,
            flagged=False,
        )

    def _add(self, key: str, row: dict, out: torch.Tensor) -> None:
        self.rows.append(row)
        self.by_key[key] = row
        if out.requires_grad:
            out.register_hook(lambda g, row=row: self._grad_out(row, g))

    def _grad_out(self, row: dict, g: torch.Tensor) -> None:
        with self.modes.measuring():
            row["grad_out_nonfinite"] = sum(self.counts(g))

    def _grad_in(self, key: str, g: torch.Tensor) -> None:
        row = self.by_key.get(key)
        if row is not None:
            with self.modes.measuring():
                row["grad_in_nonfinite"] += sum(self.counts(g))

    def _on_call(self, key, name, module, inputs, out):
        with self.modes.measuring():
            self._measure_call(key, name, module, inputs, out)

    def _measure_call(self, key, name, module, inputs, out):
        jc = self.calls.get(key)
        order = len(self.rows)
        measured = jc is not None and tuple(jc.output.shape) == tuple(out.shape) and key not in self.stochastic
        judged = Judged(jc.output) if jc is not None else None
        args, got = self._local_output(name, module, jc, inputs, out.dtype) if measured else (None, None)
        if measured:  # the judge's output read once for every measure of the row (``judged``)
            judged.take((out, got), out.dtype)
        propagated = self._propagated(out, judged) if measured else None
        row = self._row(key, type(module).__name__, inputs, out, judged)
        self.nonfinite_seen |= row["nan"] + row["inf"] + row["input_nonfinite"] > 0
        if row["nan"] + row["inf"] and not row["input_nonfinite"] and own_code_leaf(module):
            self._name_the_leaf_op(key, name, module, inputs, out, row)  # a layer of the user's own code
        if measured:
            row.update(self._forward_errors(module, jc, args, got, judged, propagated, out.dtype))
            self.floors.forget_output()  # (one its floor did not need)
        self._add(key, row, out)
        if jc is not None:
            if name not in self.first_call:
                self.first_call[name] = (order, module, key, out.dtype)
            else:  # called again: its parameter gradient sums every call, a one-call local run can't match it
                self.reused.add(name)

    def _on_parent(self, call: ParentCall) -> None:
        self._measure_parent(call)
        if self.release:
            for child in call.children:
                self._drop(child.key)

    def _drop(self, key: str) -> None:
        """The judge's record of one call, dropped once nothing reads it again: its own row and its
        parent's own-code row are made (a parent's call ends after its children's), and its gradient
        rows need only the scalars taken in its forward row (``local_checks``). The last target's
        pass frees the record as it goes instead of holding all of it until its backward ends."""
        jc = self.calls.get(key)
        if jc is None or (jc.grad_output is not None and jc.name not in self.local_checks):
            return  # (its gradient rows are made from the record after the backward)
        del self.calls[key]

    def _measure_parent(self, call: ParentCall) -> None:
        """A module with children: a row for its own code (``parity.own_code``) when it computes
        anything of its own, or when NaN/Inf first appear in it (naming the op). Under the target's
        modes: the replay of its own code computes as the target does."""
        out, jc = first_tensor(call.output), self.calls.get(call.key)
        if out is None:
            return
        if call.name not in self.own_params and any(True for _ in call.module.parameters(recurse=False)):
            self.own_params[call.name] = (len(self.rows), call.module)
        check, errors = None, None
        if jc is not None and jc.children is not None and call.key not in self.stochastic \
                and not plain_container(call.module) and not jc.passes_on:
            try:
                check = OwnCodeCheck(call, jc, self.calls, self.runner.torch_device)
                errors = check.errors(self.tol, self.floors)
            except REPLAY_FAILURES:  # code that cannot be replayed on recorded values is not measured
                check, errors = None, None
        # the full scan of its inputs and its children's only where a NaN/Inf has been seen
        produced = (self.nonfinite_seen or sum(self.counts(out)) > 0) and own_code_produces(call)
        if errors is None and not produced:
            return
        row = self._row(call.key, own_code_label(type(call.module).__name__), call.inputs, out,
                        Judged(jc.output) if jc is not None else None)
        if jc is not None and tuple(jc.output.shape) == tuple(out.shape):
            row["propagated"] = rel_l2(out, jc.output)
        row.update(errors or {})
        if produced:
            self._name_the_op(call, row, check)
        self._add(call.key, row, out)

    def _name_the_leaf_op(self, key, name, module, inputs, out, row: dict) -> None:
        """A leaf of the user's own code (no children: its forward is all its own) that turns finite
        inputs into NaN/Inf: the op that does, as for a module with children."""
        try:
            found = first_nonfinite_op(ParentCall(key, name, module, tuple(inputs), {}, out))
        except REPLAY_FAILURES:
            return
        if found is not None:
            row["module"] = own_code_label(type(module).__name__, found[1])

    def _name_the_op(self, call: ParentCall, row: dict, check: OwnCodeCheck | None) -> None:
        try:
            found = first_nonfinite_op(call)
        except REPLAY_FAILURES:
            return
        if found is None:
            return
        row["module"] = own_code_label(type(call.module).__name__, found[1])
        if check is not None:
            try:
                row["ref_absmax"] = check.judge_absmax_at(found[0], self.judge)
            except REPLAY_FAILURES:
                pass

    def counts(self, t: torch.Tensor) -> tuple[int, int]:
        """``nonfinite_count(t)``, once per tensor and version: a layer's input is mostly the output
        the row before counted, and a tensor whose error against the judge came out finite has none.
        A view of a counted tensor over the very same elements has its counts (``same_elements``):
        each call's input reaches its row as such a view of the tensor it was given (``LeafCalls``
        watches its gradient through one), and a gradient as one of the gradient of that view."""
        hit = self._hit(t)
        if hit is None and same_elements(t, t._base):
            hit = self._hit(t._base)
        if hit is not None:
            return hit
        found = nonfinite_count(t)
        self._counted[id(t)] = (weakref.ref(t), t._version, found)
        return found

    def _hit(self, t: torch.Tensor) -> tuple[int, int] | None:
        hit = self._counted.get(id(t))
        return hit[2] if hit is not None and hit[0]() is t and hit[1] == t._version else None

    def _propagated(self, out: torch.Tensor, judged: Judged) -> float:
        """The target's output against the judge's; when that shows every value finite, ``out``'s
        NaN/Inf count is known (none) without a pass of its own."""
        err, finite = judged.rel_finite(out)
        if finite:
            self._counted[id(out)] = (weakref.ref(out), out._version, (0, 0))
        return err

    def _local_output(self, name, module, jc, inputs, out_dtype) -> tuple[tuple | None, torch.Tensor | None]:
        """``(args, got)``: the judge's input cast as the target's call received it, and the target's
        copy of the layer on it. ``(None, None)`` for a selection layer: its local error is its floor's
        lower bound, exactly (``known.selects``)."""
        if selects(module) and not checks.MEASURE_ALL:
            return None, None
        args = cast_args(jc, inputs, self.runner.torch_device)
        if is_shared_dropout(module):  # the same mask the target's own call used: nothing of its own
            return args, args[0] * self.masks.last_mask
        return args, self._local_forward(name, module, jc, args, out_dtype)

    def _forward_errors(self, module, jc, args, got, judged: Judged, propagated: float, out_dtype) -> dict:
        k = reduction_length(module, jc.inputs, jc.output)
        row = dict(K=k, u=self.runner.precision.for_module(module).operand.unit_roundoff, propagated=propagated)
        if args is None:  # a selection layer
            lower = self.floors.output_rounding(jc.output, out_dtype, judged)
            return dict(row, local=lower, **row_verdict(self.tol, lower, math.nan, lower))
        if is_shared_dropout(module):
            local = judged.rel(got)
            return dict(row, local=local, flagged=not math.isfinite(local))
        if got is None:
            return row
        return dict(row, **check_forward(self.tol, self.floors, module, jc, args, got, k, judged))

    def _local_forward(self, name, module, jc, args, out_dtype) -> torch.Tensor | None:
        """The target's copy of the layer on ``args``. A layer with parameters, on its first call,
        also makes its local parameter gradients in the same forward (for its gradient rows):
        one forward of the layer instead of two."""
        if name in self.first_call or jc.grad_output is None or not any(True for _ in module.parameters(recurse=False)):
            with self.modes.target():
                return target_call(module, args)
        with self.modes.target():
            both = local_forward_backward(module, jc, self.runner, args)
            if both is None:
                return target_call(module, args)
        # ``local_forward_backward`` ran on ``args`` only where they are ``local_grads``' operands
        self.local_checks[name] = self._local_checks(name, LocalGrads(module, jc, self.runner, self.floors,
                                                                      out_dtype, both[1], args))
        return both[0]

    def _local_checks(self, name: str, local: LocalGrads) -> dict[str, dict]:
        """Per parameter, the local columns of its gradient row, made where the local gradients are
        (they are dropped then: only scalars wait for the backward to give the target's own)."""
        checks = {}
        op = self.runner.precision.for_module(local.module)
        for pname, p in local.module.named_parameters(recurse=False):
            jg = self.judge_grads.get(f"{name}.{pname}" if name in self.module_names else pname)
            if jg is None:
                continue
            k = grad_reduction_length(p, self.batch_size, local.jc.output)
            # Summing K = batch x positions terms: float32 kernels add up to ~0.4 u sqrt(K) beyond the
            # rounding of the operands (thresholds.GRAD_ACCUMULATION), part of the floor.
            accumulation = GRAD_ACCUMULATION * op.accumulate.unit_roundoff * math.sqrt(k)
            checks[pname] = dict(K=k, u=op.operand.unit_roundoff, **local.check(self.tol, pname, jg, accumulation))
        return checks

    # -- gradient rows ------------------------------------------------------------------

    def _grad_rows(self, model: nn.Module, scale: float) -> None:
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        modules = self.module_names
        for name, (order, module, key, out_dtype) in self.first_call.items():
            if key in self.stochastic or name in self.reused:
                continue
            params = dict(module.named_parameters(recurse=False))
            checks = self.local_checks.get(name)
            if checks is None:  # not made in the forward row (autocast's operands): made now
                jc = self.calls.get(key)
                if not params or jc is None or jc.grad_output is None:
                    continue
                with self.modes.target():
                    mine = local_grads(module, jc, self.runner)
                checks = self._local_checks(name, LocalGrads(module, jc, self.runner, self.floors, out_dtype, mine))
            for pname, p in params.items():
                full = f"{name}.{pname}" if name in modules else pname
                g, jg = grads.get(full), self.judge_grads.get(full)
                if g is not None and jg is not None and pname in checks:
                    self.rows.append(self._grad_row(order, name, type(module).__name__, (full, p), _unscaled(g, scale), jg,
                                                    checks[pname]))

        for name, (order, module) in self.own_params.items():
            label = own_code_label(type(module).__name__)
            for pname, p in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name in modules else pname
                g, jg = grads.get(full), self.judge_grads.get(full)
                if g is not None and jg is not None:
                    self.rows.append(self._own_grad_row(order, name, label, full, p, _unscaled(g, scale), jg))

    def _own_grad_row(self, order, name, label, full, p, g, jg) -> dict:
        """A parameter of a module's own code: its gradient against the judge's (propagated error and
        NaN/Inf; no one-layer re-run separates its own part)."""
        propagated, (nan, inf) = _against(g, jg)
        return dict(
            target=self.name, order=order, kind="grad", layer=name, module=label, param=full,
            shape="x".join(map(str, p.shape)), K=0, u=self.runner.unit_roundoff, floor=math.nan, bound=math.nan,
            propagated=propagated, local=math.nan, intrinsic=math.nan, over_floor=math.nan, needed=math.nan,
            nan=nan, inf=inf, input_nonfinite=0, grad_out_nonfinite=0, grad_in_nonfinite=0,
            ref_absmax=abs_max(jg), flagged=False,
        )

    def _grad_row(self, order, name, label, param, g, jg, local: dict) -> dict:
        """A parameter's gradient row: the target's own gradient against the judge's, and ``local``
        (``_local_checks``: K, u and the local columns)."""
        full, p = param
        propagated, (nan, inf) = _against(g, jg)
        row = dict(
            target=self.name, order=order, kind="grad", layer=name, module=label, param=full,
            shape="x".join(map(str, p.shape)), K=0, u=math.nan, floor=math.nan, bound=math.nan,
            propagated=propagated, local=math.nan, intrinsic=math.nan, over_floor=math.nan, needed=math.nan,
            nan=nan, inf=inf, input_nonfinite=0, grad_out_nonfinite=0, grad_in_nonfinite=0,
            ref_absmax=local["ref_absmax"] if "ref_absmax" in local else abs_max(jg), flagged=False,
        )
        row.update(local)
        return row


def _against(g: torch.Tensor, jg: torch.Tensor) -> tuple[float, tuple[int, int]]:
    """``(rel_l2(g, jg), nonfinite_count(g))``; the count is known without a pass of its own where the
    error came out with every value finite (``rel_l2_finite``)."""
    err, finite = rel_l2_finite(g, jg)
    return err, (0, 0) if finite else nonfinite_count(g)


def same_elements(t: torch.Tensor, base: torch.Tensor | None) -> bool:
    """Whether ``t`` (a view of ``base``, whose version it shares) holds exactly ``base``'s elements:
    the same start, dtype and number of elements, both contiguous (``view_as``, a flatten)."""
    return (base is not None and base.dtype == t.dtype and base.data_ptr() == t.data_ptr()
            and base.numel() == t.numel() and base.is_contiguous() and t.is_contiguous())


def _unscaled(g: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of a loss scaled by ``scale``, unscaled (no copy at scale 1)."""
    return g.detach() / scale if scale != 1.0 else g.detach()
