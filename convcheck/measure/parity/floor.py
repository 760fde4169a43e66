"""A layer's measured floor: the error the best implementation at the target's precision makes.

The floor of one leaf call is the layer computed in float64 on its input *and*
parameters rounded to the target's operand precision (its precision model,
per op class: TF32 operands for a TF32 conv/matmul, bf16/fp16 for cast and
autocast targets, float32 otherwise; an element-wise op keeps its operands in
the dtype it received them in), its result rounded to the dtype the target's
own call returned, held against the judge's output. That error
accounts for the layer's conditioning on this very input with no formula:
an ill-conditioned layer has a large floor, a well-conditioned one a small
one. Where the target sums in a format coarser than float32, a matmul/conv
also gets the accumulation term ``u_accumulate * sqrt(K) * |terms| / |result|``.

A leaf of the user's own code may still run matmuls/convolutions inside its
forward (``torch.einsum`` dispatches ``bmm``): under a
precision that reads their operands coarser than the layer's inputs (TF32,
autocast) its float64 copy runs under ``own_code.RoundOperands``, as a module's own
code does, so every such op's operands are rounded where they are made
(``rounds_in_code``); a call that runs none computes exactly the unrounded copy.

Every float64 tensor here is built by the judge's runner (``reference``,
``reference_module``), on the judge's device; rounding uses
``runners.precision.round_to`` to the op class's format (``convcheck.numerics.formats``).
"""

from __future__ import annotations

import math
import torch
import torch.nn as nn

from convcheck.capture import own_code_leaf
from convcheck.measure.parity.own_code import RoundOperands, rounds_operands
from convcheck.nested import tensors_in
from convcheck.numerics.metrics import rel_l2, rounding_error
from convcheck.targets.runners import Runner
from convcheck.numerics.formats import FLOAT32
from convcheck.numerics.thresholds import FLOOR_ABSOLUTE, SUM_LANES
from convcheck.targets.runners.precision import (
    OpPrecision,
    PrecisionModel,
    dtype_format,
    dtype_unit_roundoff,
    op_class,
    round_to,
)


def reference_call(ref: nn.Module, args: tuple, judge: Runner) -> torch.Tensor | None:
    """``ref`` (a float64 copy built by the judge) on ``args`` as float64 references; autocast off
    (the hooks run inside the target's forward, which may be autocast)."""
    ref_args = tuple(judge.reference(a) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad(), torch.autocast(judge.torch_device.type, enabled=False):
        out = tensors_in(ref(*ref_args))
    return out[0] if out else None


def reference_grads(ref: nn.Module, args: tuple, grad_output: torch.Tensor, judge: Runner) -> dict[str, torch.Tensor]:
    """Parameter gradients of ``ref`` (float64, built by the judge) for ``args`` and ``grad_output``."""
    return reference_forward_backward(ref, args, grad_output, judge)[1]


def reference_forward_backward(ref: nn.Module, args: tuple, grad_output: torch.Tensor,
                               judge: Runner) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(output, parameter gradients)`` of ``ref`` on ``args``: ``reference_grads`` with the output of
    its forward (the value ``reference_call`` gives: the same kernels, autograd only records)."""
    ref_args = tuple(judge.reference(a) if isinstance(a, torch.Tensor) else a for a in args)
    for p in ref.parameters():
        p.grad = None
    with torch.enable_grad(), torch.autocast(judge.torch_device.type, enabled=False):
        out = tensors_in(ref(*ref_args))[0]
        out.backward(judge.reference(grad_output))
    return out.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


class FloorMeter:
    """Measures floors for one target: its precision model (operands rounded to each op class's
    format, range included where the format has a dtype: float16's, FP8's), on the judge."""

    def __init__(self, precision: PrecisionModel, judge: Runner):
        self.precision, self.judge = precision, judge
        # (target's layer, op precision, its float64 copy with rounded parameters): a matmul/conv's
        # parameters do not change within a pass, and its two floors come one after the other
        self._last_rounded: tuple | None = None
        # (layer, op precision, args, output): the float64 output on rounded operands that the
        # gradients' floor computed on its way (``grads``), the forward's floor itself (``forward``)
        self._last_out: tuple | None = None
        # the last ``forward`` of a ``rounds_in_code`` call that rounded nothing: its unrounded output
        self.unrounded: torch.Tensor | None = None

    @classmethod
    def of(cls, runner: Runner, judge: Runner) -> "FloorMeter":
        return cls(runner.precision, judge)

    def output_rounding(self, judge_out: torch.Tensor, out_dtype: torch.dtype, judged=None) -> float:
        """The judge's result rounded to ``out_dtype``, vs itself: a lower bound of any floor with that
        output dtype (no value in that dtype is closer to the judge's than its nearest one), free.
        ``judged``: ``judge_out``'s ``parity.judged.Judged``, which may have measured it already."""
        if judge_out.is_floating_point() and dtype_unit_roundoff(out_dtype) > dtype_unit_roundoff(judge_out.dtype):
            # round_to's values (cast back to float64)
            return judged.rounding(out_dtype) if judged is not None else rounding_error(judge_out, out_dtype)
        return rel_l2(round_to(judge_out, dtype_format(out_dtype)), judge_out)

    def rounds(self, module: nn.Module, args: tuple) -> bool:
        """Whether the floor rounds any operand beyond what the target's call received. Only a
        matmul/conv reads its operands in a format of its own (TF32, autocast's 16-bit cast); an
        element-wise op computes on what it is given (autocast runs normalisation, softmax and
        the like in float32 on a float32 input), so its floor keeps its operands as they came."""
        if op_class(module) == "elementwise":
            return False
        op = self.precision.for_module(module)
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + list(module.parameters()) + list(module.buffers())
        u = op.operand.unit_roundoff
        return any(t.is_floating_point() and u > dtype_unit_roundoff(t.dtype) for t in tensors)

    def rounds_in_code(self, module: nn.Module, args: tuple) -> bool:
        """Whether a leaf of the user's own code (``capture.own_code_leaf``, of no matmul/conv class)
        has its float64 copy run under ``RoundOperands``: the precision reads a matmul/conv's
        operands coarser than the finest floating input or parameter it holds (TF32 on float32,
        autocast), so any matmul its forward runs (``einsum``'s ``bmm``) rounds them, as the
        target's own dispatch does. Torch's own leaves are left out: one may run another kernel
        in float32 than in float64 (a CPU LSTM: ``mkldnn_rnn_layer``, which no TF32 emulation
        rounds, against ``mm`` in float64)."""
        if op_class(module) != "elementwise" or not own_code_leaf(module):
            return False
        dtypes = [t.dtype for t in (*args, *module.parameters(), *module.buffers())
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return bool(dtypes) and rounds_operands(self.precision, min(dtypes, key=dtype_unit_roundoff))

    def forward(self, module: nn.Module, ref: nn.Module, args: tuple, judge_out: torch.Tensor,
                reference_out: torch.Tensor | None, out_dtype: torch.dtype) -> float:
        """The measured floor of a forward: ``ref`` (the layer's float64 copy, parameters as the
        target holds them) on operand-rounded ``args`` (as the target's call received them),
        rounded to ``out_dtype``, vs ``judge_out``. ``reference_out`` (``ref`` on ``args``
        unrounded) is reused when the rounding changes nothing (float32, a cast target).
        A call that ``rounds_in_code`` runs under ``RoundOperands`` (``reference_out`` unused);
        ``unrounded`` then holds its output where it rounded nothing (no matmul ran)."""
        self.unrounded = None
        if self.rounds_in_code(module, args):
            out = self._taken_output(module, args)
            if out is None:
                mode = RoundOperands(self.precision)
                with mode:
                    out = reference_call(ref, args, self.judge)
                self.unrounded = out if not mode.rounded else None
            if out is None:
                return math.nan
            return rel_l2(round_to(out, dtype_format(out_dtype)), judge_out)
        out = self._taken_output(module, args) if self.rounds(module, args) else reference_out
        if out is None:
            out = reference_call(*self._rounded(module, ref, args), self.judge)
        if out is None:
            return math.nan
        return rel_l2(round_to(out, dtype_format(out_dtype)), judge_out)

    def rounds_grads(self, module: nn.Module, args: tuple, grad_output: torch.Tensor) -> bool:
        """Whether a gradient's floor rounds any operand (the output gradient too) beyond the target's."""
        op = self.precision.for_module(module)
        return self.rounds(module, args) or self.rounds_in_code(module, args) or (op_class(module) != "elementwise"
                                             and op.operand.unit_roundoff > dtype_unit_roundoff(grad_output.dtype))

    def grads(self, module: nn.Module, ref: nn.Module, args: tuple, grad_output: torch.Tensor,
              grad_dtype: torch.dtype, reference: dict[str, torch.Tensor] | None = None,
              keep_output: bool = False) -> dict[str, torch.Tensor]:
        """The best parameter gradients at this precision: ``ref`` fed operand-rounded ``args``,
        ``grad_output`` and parameters, each gradient rounded to ``grad_dtype``. Where the rounding
        changes nothing (``rounds_grads`` is False) ``reference``, the float64 gradients on the
        unrounded operands, is rounded instead (and must be given). ``keep_output``: the forward
        floor of this call comes next (its forward row): the float64 output is kept for it."""
        if self.rounds_in_code(module, args):
            # the backward's matmuls too: the mode sees autograd's ops (their operands rounded there)
            with RoundOperands(self.precision):
                out, reference = reference_forward_backward(ref, args, grad_output, self.judge)
            op = self.precision.for_module(module)
            self._last_out = (module, op, args, out) if keep_output else None
        elif self.rounds_grads(module, args, grad_output):
            op = self.precision.for_module(module)
            g = round_to(self.judge.reference(grad_output), op.operand)
            out, reference = reference_forward_backward(*self._rounded(module, ref, args), g, self.judge)
            # the forward's floor of the same call is this output, rounded (``forward``): kept for it
            self._last_out = (module, op, args, out) if keep_output and self.rounds(module, args) else None
        fmt = dtype_format(grad_dtype)
        return {n: round_to(t, fmt) for n, t in reference.items()}

    def accumulation(self, module: nn.Module, judge_inputs: tuple, judge_out: torch.Tensor, k: int) -> float:
        """``u_accumulate * sqrt(K) * |terms| / |result|`` for a matmul/conv that sums in a format
        coarser than float32; for float32 sums only the cancellation beyond random signs', ``u * sqrt(K) *
        (|terms| / |result| - sqrt(K))`` (random signs' sqrt(K) is inside the absolute term, as the healthy zoo
        measured; 16 terms of 0.1 falling to 1e-3 are not: issue 48, an LBFGS forecaster's head replayed at every
        closure evaluation); 0 for elementwise ops."""
        op = self.precision.for_module(module)
        if op_class(module) == "elementwise":
            if k <= 1 or not isinstance(module, NORMALIZATIONS) or not judge_inputs \
                    or not isinstance(judge_inputs[0], torch.Tensor):
                return 0.0
            # a normalization's mean and variance are sums of K terms, in float32 at least whatever the format
            # (torch's kernels accumulate the half types in float32): their rounding error grows with K and with
            # how far the values sit from their mean (``normalization_spread``). A kernel summing them in SUM_LANES
            # accumulators (the CPU's channels_last BatchNorm: 100x the contiguous kernel's error on 16x32x64x64)
            # is still a float32 implementation; the part of its error FLOOR_ABSOLUTE does not cover is added.
            u = min(op.accumulate.unit_roundoff, FLOAT32.unit_roundoff)
            lanes = u * math.sqrt(k / SUM_LANES) * normalization_spread(module, self.judge.reference(judge_inputs[0]))
            return max(0.0, lanes - FLOOR_ABSOLUTE)
        ratio = magnitude_ratio(module, judge_inputs, judge_out, self.judge)
        if op.accumulate.unit_roundoff <= FLOAT32.unit_roundoff:
            ratio = max(ratio - math.sqrt(max(1, k)), 0.0)
        return op.accumulate.unit_roundoff * math.sqrt(max(1, k)) * ratio

    # -- rounding -----------------------------------------------------------------------------

    def _rounded(self, module: nn.Module, ref: nn.Module, args: tuple) -> tuple[nn.Module, tuple]:
        """``(ref, args)`` with operands rounded to the op's precision (unchanged when none needs it)."""
        if not self.rounds(module, args):
            return ref, args
        op = self.precision.for_module(module)
        last = self._last_rounded  # a layer's forward floor and then its gradients' floor: one rounding
        if last is None or last[0] is not module or last[1] != op:
            last = self._last_rounded = (module, op, self._rounded_module(ref, op))
        return last[2], self._rounded_args(args, op)

    def forget_output(self) -> None:
        """Drop a kept output its forward floor did not take (a row settled without it)."""
        self._last_out = None

    def _taken_output(self, module: nn.Module, args: tuple) -> torch.Tensor | None:
        """The float64 output on rounded operands that ``grads`` computed for this very call (same
        layer, precision and argument tensors), handed over once; None otherwise."""
        hit, self._last_out = self._last_out, None
        if hit is None or hit[0] is not module or hit[1] != self.precision.for_module(module):
            return None
        same = len(hit[2]) == len(args) and all(a is b for a, b in zip(hit[2], args))
        return hit[3] if same else None

    def _rounded_args(self, args: tuple, op: OpPrecision) -> tuple:
        out = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a = round_to(self.judge.reference(a), op.operand)
            out.append(a)
        return tuple(out)

    def _rounded_module(self, ref: nn.Module, op: OpPrecision) -> nn.Module:
        """A float64 copy of ``ref`` with every floating parameter and buffer rounded."""
        copy = self.judge.reference_module(ref)
        with torch.no_grad():
            for t in (*copy.parameters(), *copy.buffers()):
                if t.is_floating_point():
                    t.copy_(round_to(t, op.operand))
        return copy


NORMALIZATIONS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                  nn.RMSNorm)


def normalization_spread(module: nn.Module, x: torch.Tensor) -> float:
    """How far a normalization's input sits from the mean it subtracts, as its error grows: per group of values
    normalized together, ``sqrt(E[x**2] / (var + eps))`` - 1 for values centred on zero, 10 for a mean ten times
    their spread (the mean's rounding error, u * sqrt(K) * rms(x), is that many of the std it is divided by) -
    combined as their root mean square over the groups; 1 for RMSNorm, which subtracts no mean."""
    if isinstance(module, nn.RMSNorm) or x.dim() == 0 or x.numel() == 0:
        return 1.0
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        groups = x.transpose(0, 1).reshape(x.shape[1], -1) if x.dim() > 1 else x.reshape(1, -1)
    elif isinstance(module, nn.LayerNorm):
        groups = x.reshape(-1, math.prod(module.normalized_shape))
    elif isinstance(module, nn.GroupNorm):
        groups = x.reshape(x.shape[0] * module.num_groups, -1)
    else:  # instance norm: each sample's channel
        groups = x.reshape(x.shape[0] * x.shape[1], -1) if x.dim() > 2 else x.reshape(x.shape[0], -1)
    groups = groups.double()
    var = groups.var(dim=1, unbiased=False)
    square = groups.square().mean(dim=1)
    eps = float(getattr(module, "eps", 0.0) or 0.0)
    ratio = square / (var + eps)
    ratio = ratio[torch.isfinite(ratio)]
    return math.sqrt(float(ratio.mean())) if ratio.numel() else 1.0


def magnitude_ratio(module: nn.Module, judge_inputs: tuple, judge_out: torch.Tensor, judge: Runner) -> float:
    """``|terms| / |result|`` of a matmul/conv: the layer on |input| with |parameters|, over its output
    (the growth of a sum's rounding error relative to the sum; 1 without cancellation)."""
    ref = judge.reference_module(module)
    with torch.no_grad():
        for p in ref.parameters():
            p.abs_()
    absolute = tuple(a.abs() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in judge_inputs)
    terms = reference_call(ref, absolute, judge)
    if terms is None:
        return 1.0
    den = float(torch.linalg.vector_norm(judge.reference(judge_out)))
    num = float(torch.linalg.vector_norm(terms))
    return num / den if den > 0 else math.inf
