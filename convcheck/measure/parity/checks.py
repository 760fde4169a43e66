"""Holding one row (a layer's forward, a parameter's gradient) against its floor.

A row is flagged when its local error *and* its own arithmetic's error (``intrinsic``) are
above ``bound_factor x floor + FLOOR_ABSOLUTE``, or when its result is destroyed although its
floor is not (``Tolerances.is_flagged``). The work is done cheapest first:

1. the local error (the target's copy of the layer on the judge's input, as before);
2. against a free lower bound of the floor, the rounding of the judge's own result to the
   dtype the target returns it in (no implementation in that dtype can be closer): a row that
   passes against it passes against its floor, and no float64 re-run is made;
3. only otherwise the measured floor (``floor.FloorMeter``) and, where the local error is above
   its bound, the intrinsic error; the accumulation term only for a row still flagged.

For a row settled at step 2 the ``floor`` column holds that lower bound and ``intrinsic`` is NaN.
``MEASURE_ALL`` (set by ``benchmarks/floors.py`` to calibrate the rule, never by parity) measures
the floor and the intrinsic error of every row.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from convcheck.numerics.metrics import rel_l2
from convcheck.measure.parity.floor import FloorMeter, reference_call, reference_grads
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.judge_measures import Judged
from convcheck.measure.parity.local import grad_terms_norm, local_grads, reference_copy
from convcheck.targets.runners import Runner
from convcheck.targets.runners.precision import dtype_unit_roundoff, op_class
from convcheck.numerics.thresholds import DESTROYED_ERROR
from convcheck.numerics.tolerances import Tolerances

MEASURE_ALL = False


@contextlib.contextmanager
def measuring_all():
    """Measure every row's floor and intrinsic error inside (calibration and the sweep's noise)."""
    global MEASURE_ALL
    before, MEASURE_ALL = MEASURE_ALL, True
    try:
        yield
    finally:
        MEASURE_ALL = before


def row_verdict(tol: Tolerances, local: float, intrinsic: float, floor: float) -> dict:
    """The floor columns of a row: floor, bound, over_floor (own error / floor), needed, flagged."""
    own = intrinsic if not math.isnan(intrinsic) else local
    over = own / floor if floor > 0 else (math.inf if own > 0 else 0.0)
    flagged = tol.is_flagged(local, floor) and (math.isnan(intrinsic) or tol.is_flagged(intrinsic, floor))
    needed = min(tol.needed(e, floor) for e in (local, intrinsic) if not math.isnan(e))
    return dict(floor=floor, bound=tol.bound(floor), over_floor=over, needed=needed, flagged=flagged)


def check_forward(tol: Tolerances, meter: FloorMeter, module: nn.Module, jc: JudgeCall, args: tuple,
                  got: torch.Tensor, k: int, judged: Judged | None = None) -> dict:
    """The forward row of one call: ``got`` is the target's copy of ``module`` on ``args`` (the
    judge's input cast as the target's call received it); ``judged``: the judge's output's measures."""
    judge = meter.judge
    judged = judged or Judged(jc.output)
    local = judged.rel(got)
    lower = meter.output_rounding(jc.output, got.dtype, judged)
    if not MEASURE_ALL and not tol.is_flagged(local, lower):
        return dict(local=local, **row_verdict(tol, local, math.nan, lower))
    ref = reference_copy(module, judge)
    # the layer's own arithmetic is judged against its float64 copy on the input as the target got it
    in_code = meter.rounds_in_code(module, args)  # matmuls inside the layer's code: rounded there
    want = reference_call(ref, args, judge) if not (in_code or meter.rounds(module, args)) else None
    floor = meter.forward(module, ref, args, jc.output, want, got.dtype)
    if in_code:
        want = meter.unrounded  # the floor's own run where no matmul ran in it
    if want is None and (MEASURE_ALL or tol.is_flagged(local, floor)):
        want = reference_call(ref, args, judge)
    intrinsic = rel_l2(got, want) if want is not None else math.nan
    if row_verdict(tol, local, intrinsic, floor)["flagged"]:
        floor += meter.accumulation(module, jc.inputs, jc.output, k)  # only raises the floor
    return dict(local=local, intrinsic=intrinsic, **row_verdict(tol, local, intrinsic, floor))


class LocalGrads:
    """One layer's parameter gradients fed the judge's input and output gradient: the target's (at
    its precision), and on demand the float64 copy's on the same cast operands and the floor's."""

    def __init__(self, module: nn.Module, jc: JudgeCall, runner: Runner, meter: FloorMeter, out_dtype,
                 mine: dict[str, torch.Tensor] | None = None, args: tuple | None = None):
        self.module, self.jc, self.runner, self.meter = module, jc, runner, meter
        # ``mine``: the target's local gradients where the forward row already made them (``target_pass``)
        self.mine = mine if mine is not None else local_grads(module, jc, runner)
        # a matmul/conv forms its gradients in its own output dtype (autocast's 16-bit format)
        dtypes = (runner.param_dtype, out_dtype) if op_class(module) != "elementwise" else (runner.param_dtype,)
        self.grad_dtype = max(dtypes, key=dtype_unit_roundoff)
        self.out_dtype = out_dtype
        # ``args``: the judge's inputs as ``local_grads`` casts them, where the forward row made them
        # (its floor then reuses what this one's rounds and computes: ``FloorMeter``)
        self._args: tuple | None = args
        self._in_forward_row = args is not None
        self._g: torch.Tensor | None = None
        self._ref: nn.Module | None = None
        self._want: dict | None = None
        self._best: dict | None = None

    @property
    def args(self) -> tuple:
        """The judge's inputs cast as ``local_grads`` casts them (made only for a float64 measurement)."""
        if self._args is None:
            self._args = tuple(self.runner.cast_input(j) if isinstance(j, torch.Tensor) else j for j in self.jc.inputs)
        return self._args

    @property
    def g(self) -> torch.Tensor:
        """The judge's output gradient as ``local_backward`` feeds it."""
        if self._g is None:
            self._g = self.jc.grad_output.to(device=self.runner.torch_device, dtype=self.out_dtype)
        return self._g

    def ref(self) -> nn.Module:
        if self._ref is None:
            self._ref = reference_copy(self.module, self.meter.judge)
        return self._ref

    def want(self) -> dict:
        """The float64 copy's gradients on the same cast operands (for the intrinsic error), once."""
        if self._want is None:
            self._want = reference_grads(self.ref(), self.args, self.g, self.meter.judge)
        return self._want

    def best(self) -> dict:
        """The floor's gradients, once (from ``want`` where the rounding changes nothing)."""
        if self._best is None:
            meter = self.meter
            shared = None if meter.rounds_grads(self.module, self.args, self.g) else self.want()
            self._best = meter.grads(self.module, self.ref(), self.args, self.g, self.grad_dtype, shared,
                                     keep_output=self._in_forward_row)
        return self._best

    def check(self, tol: Tolerances, pname: str, jg: torch.Tensor, accumulation: float) -> dict:
        """The row of one parameter: cheap first, then the float64 gradients. A gradient that
        cancels to ~0 in exact arithmetic (the bias of a layer feeding a training-mode BatchNorm)
        has no meaningful relative error: where the error is that of a lost result, or the row is
        still flagged, it is measured against the size of the terms it sums instead."""
        mine = self.mine.get(pname)
        if mine is None:
            return dict(local=math.nan)
        judged = Judged(jg).take((mine,), self.grad_dtype)  # one pass over the judge's gradient
        local = judged.rel(mine)
        terms = self._terms(pname) if not local < DESTROYED_ERROR else 0.0
        if terms:
            local = judged.rel(mine, floor=terms)
        lower = self.meter.output_rounding(jg, self.grad_dtype, judged) + accumulation
        if not MEASURE_ALL and not tol.is_flagged(local, lower):
            return dict(local=local, ref_absmax=judged.abs_max(), **row_verdict(tol, local, math.nan, lower))
        errors = self._errors(tol, pname, jg, accumulation, terms)
        if not terms and row_verdict(tol, **errors)["flagged"] and math.isfinite(errors["intrinsic"]):
            terms = self._terms(pname)
            if terms:
                errors = self._errors(tol, pname, jg, accumulation, terms)
        return dict(local=errors["local"], intrinsic=errors["intrinsic"], ref_absmax=judged.abs_max(),
                    **row_verdict(tol, **errors))

    def _terms(self, pname: str) -> float:
        return grad_terms_norm(self.module, self.jc, self.meter.judge).get(pname) or 0.0

    def _errors(self, tol: Tolerances, pname: str, jg, accumulation: float, terms: float = 0.0) -> dict[str, float]:
        """Local, floor (plus ``accumulation``) and, where the local error is above its bound,
        intrinsic; relative to the judge's gradient, or to ``terms`` where that is larger."""
        mine, best = self.mine[pname], self.best().get(pname)
        local = rel_l2(mine, jg, floor=terms)
        if best is None:
            return dict(local=local, intrinsic=math.nan, floor=math.nan)
        floor = rel_l2(best, jg, floor=terms) + accumulation
        intrinsic = math.nan
        if MEASURE_ALL or tol.is_flagged(local, floor):
            want = self.want().get(pname)
            intrinsic = rel_l2(mine, want, floor=terms) if want is not None else math.nan
        return dict(local=local, intrinsic=intrinsic, floor=floor)
