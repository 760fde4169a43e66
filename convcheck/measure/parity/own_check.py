"""Holding a module's own code against the judge: the rows of modules with children.

``own_code`` replays the code; here every point it produces (each input it hands a child, its
output) is held against the judge's value there, cheapest first as for leaves (``checks``): the
free lower bound of the floor (the judge's value rounded to the dtype the target produced it in),
then, only where a point is above that, the measured floor and the intrinsic error. The row
reports its worst point.
"""

from __future__ import annotations

import functools
import math

import torch

from convcheck.capture import ParentCall, cast_like, made_in_own_code
from convcheck.nested import map_tensors, tensors_in
from convcheck.numerics.metrics import rel_l2
from convcheck.measure.parity import checks
from convcheck.measure.parity.checks import row_verdict
from convcheck.measure.parity.floor import FloorMeter
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.own_code import (
    FirstNonfinite,
    RoundOperands,
    Diverged,
    child_attribute,
    judge_points,
    rounds_operands,
    run_own_code,
)
from convcheck.targets.runners.precision import dtype_format, dtype_unit_roundoff, round_to
from convcheck.numerics.tolerances import Tolerances


def cast_struct(judge, like, device):
    """The judge's value (a tensor, tuple, list or dict of them) cast as ``like`` holds it."""
    if isinstance(judge, torch.Tensor):
        return cast_like(judge, like if isinstance(like, torch.Tensor) else None, device)
    if isinstance(judge, (tuple, list)) and isinstance(like, (tuple, list)) and len(judge) == len(like):
        return type(judge)(cast_struct(j, a, device) for j, a in zip(judge, like))
    if isinstance(judge, dict) and isinstance(like, dict):
        return {k: cast_struct(v, like.get(k), device) for k, v in judge.items()}
    return judge


class OwnCodeCheck:
    """One call of a module with children, on the judge's values at its boundaries."""

    def __init__(self, call: ParentCall, jc: JudgeCall, calls: dict, device):
        if jc.children != [c.key for c in call.children] or any(calls[c.key].full is None for c in call.children):
            raise Diverged("the children were called differently from the judge's run")
        self.module = call.module
        self.args = tuple(cast_struct(j, a, device) for j, a in zip(jc.inputs, call.inputs))
        self.kwargs = {k: cast_struct(v, call.kwargs.get(k), device) for k, v in jc.kwargs.items()}
        # per child call: the judge's output and how the target's call returned it (dtypes)
        self.recorded = [(child_attribute(call.name, c.name), calls[c.key].full, _dtypes(c.output))
                         for c in call.children]
        self.device = device
        self.want = judge_points([calls[c.key].inputs for c in call.children], jc.full)
        self.jc = jc

    def children(self, then=None) -> list:
        """``(attribute, make)`` per child call: the judge's output cast as the target's call returned
        it, then mapped by ``then`` (to float64 for the references)."""
        def make(judge, like):
            value = cast_struct(judge, like, self.device)
            return value if then is None else map_tensors(value, then)
        return [(attr, functools.partial(make, judge, like)) for attr, judge, like in self.recorded]

    def errors(self, tol: Tolerances, meter: FloorMeter) -> dict | None:
        """The row's error columns (its worst point), or None when nothing in it is its own."""
        with torch.no_grad():
            got = run_own_code(self.module, self.args, self.kwargs, self.children())
        if len(got) != len(self.want):
            raise Diverged("another number of values than in the judge's run")
        points = [(i, g, self.want[i]) for i, g in enumerate(got) if g is not None]
        if not points or any(tuple(g.shape) != tuple(w.shape) for _, g, w in points):
            return None
        rows = []
        for i, g, w in points:
            local = rel_l2(g, w)
            rows.append((i, dict(local=local, intrinsic=math.nan,
                                 **row_verdict(tol, local, math.nan, meter.output_rounding(w, g.dtype)))))
        if checks.MEASURE_ALL or any(r["flagged"] for _, r in rows):
            rows = self._measured(tol, meter, points)
        return _worst([r for _, r in rows])

    def _measured(self, tol: Tolerances, meter: FloorMeter, points) -> list:
        """Each point against its measured floor, with the intrinsic error (float64 on the same values)."""
        judge = meter.judge
        best = self._reference(judge, RoundOperands(meter.precision)
                               if rounds_operands(meter.precision, _dtype(points)) else None)
        exact = best if not rounds_operands(meter.precision, _dtype(points)) else self._reference(judge, None)
        out = []
        for i, g, w in points:
            local = rel_l2(g, w)
            floor = rel_l2(round_to(best[i], dtype_format(g.dtype)), w) if best[i] is not None \
                else math.nan
            intrinsic = rel_l2(g, exact[i]) if exact[i] is not None else math.nan
            out.append((i, dict(local=local, intrinsic=intrinsic, **row_verdict(tol, local, intrinsic, floor))))
        return out

    def _reference(self, judge, mode) -> list:
        with torch.no_grad(), torch.autocast(judge.torch_device.type, enabled=False):
            children = self.children(then=judge.reference)
            if mode is None:
                return run_own_code(self.module, self.args, self.kwargs, children, judge.reference)
            with mode:
                return run_own_code(self.module, self.args, self.kwargs, children, judge.reference)

    def judge_absmax_at(self, index: int, judge) -> float:
        """The judge's largest magnitude at the ``index``-th floating result of the own code."""
        children = [(attr, functools.partial(_fresh, judge_out)) for attr, judge_out, _ in self.recorded]
        probe = FirstNonfinite(at=index)
        with torch.no_grad(), torch.autocast(judge.torch_device.type, enabled=False), probe:
            run_own_code(self.module, self.jc.inputs, self.jc.kwargs, children, judge.reference)
        return probe.absmax


def _fresh(value):
    """A copy of a recorded value to hand out (the code may change it in place)."""
    return map_tensors(value, lambda t: t.detach().clone())


def _dtypes(out):
    """What a call returned, kept as empty tensors of its dtypes (a cast needs no more)."""
    return map_tensors(out, lambda t: t.new_empty(0))


def first_nonfinite_op(call: ParentCall) -> tuple[int, str] | None:
    """The first op of ``call``'s own code that turns finite values into NaN/Inf, replayed on the
    target's own values (under whatever mode the target's forward is in)."""
    children = [(child_attribute(call.name, c.name), functools.partial(_fresh, c.output)) for c in call.children]
    probe = FirstNonfinite()
    with torch.no_grad(), probe:
        run_own_code(call.module, call.inputs, call.kwargs, children)
    return probe.found


def own_code_produces(call: ParentCall) -> bool:
    """Whether NaN/Inf first appear in ``call``'s own code (``capture.made_in_own_code``)."""
    return made_in_own_code(call, _all_finite)


def _all_finite(obj) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors_in(obj)
               if t.is_floating_point() and t.numel())


def _dtype(points) -> torch.dtype:
    return min((g.dtype for _, g, _ in points), key=dtype_unit_roundoff)


def _worst(rows: list[dict]) -> dict:
    """Flagged first, then the largest ``needed`` (how far above its floor's bound)."""
    def rank(r):
        needed = r["needed"] if not math.isnan(r["needed"]) else -1.0
        return (bool(r["flagged"]), needed)
    return max(rows, key=rank)
