"""Local measurements of one layer: the judge's input through the target's copy of the layer.

Every float64 reference here is built by the judge's runner (``reference``,
``reference_module``), on the judge's device.
"""

from __future__ import annotations

import copy as pycopy

import torch
import torch.nn as nn

from convcheck.capture import cast_like, module_copy
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.known import stock_type
from convcheck.nested import tensors_in
from convcheck.targets.runners import Runner


def private_copy(m: nn.Module) -> nn.Module:
    """An independent copy without hooks (a re-run must not touch the original or fire its hooks).

    A stock layer (``known.stock_type``) gets a light copy: its own parameter objects over the
    same storage (nothing writes a parameter in a forward or backward; gradients go to the
    copy's own) and its own buffers (BatchNorm writes its running statistics)."""
    if not stock_type(m):
        return _hookless(module_copy(m))
    copy = _hookless(pycopy.copy(m))
    params = {n: None if p is None else nn.Parameter(p.detach(), requires_grad=p.requires_grad)
              for n, p in m._parameters.items()}
    buffers = {n: None if b is None else b.clone() for n, b in m._buffers.items()}
    copy.__dict__.update(_parameters=params, _buffers=buffers, _modules={})
    return copy


def reference_copy(m: nn.Module, judge: Runner) -> nn.Module:
    """The judge's independent float64 copy of ``m``, without hooks (one copy, not two)."""
    return _hookless(judge.reference_module(m))


def _hookless(copy: nn.Module) -> nn.Module:
    for sub in copy.modules():
        sub._forward_hooks = type(sub._forward_hooks)()  # new dicts: a light copy shares the original's
        sub._forward_pre_hooks = type(sub._forward_pre_hooks)()
        sub._backward_hooks = type(sub._backward_hooks)()
    return copy


def cast_args(jc: JudgeCall, actual_inputs: tuple, device) -> tuple:
    """The judge's inputs, cast to the dtypes the target's own call received."""
    return tuple(cast_like(j, a if isinstance(a, torch.Tensor) else None, device)
                 for j, a in zip(jc.inputs, actual_inputs))


def target_call(module: nn.Module, args: tuple) -> torch.Tensor | None:
    """The target's copy of this layer on ``args`` (under whatever mode the target's forward is in),
    with autograd on as in the target's own forward: a layer whose forward takes another path without
    it (``nn.MultiheadAttention``'s fast path, a checkpointed block) computes as the target did."""
    with torch.enable_grad():
        got = tensors_in(private_copy(module)(*args))
    return got[0].detach() if got else None


def local_forward_backward(module: nn.Module, jc: JudgeCall, target: Runner,
                           args: tuple) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]] | None:
    """``target_call`` and ``local_grads`` from one forward of one private copy: the output on ``args``
    (the judge's inputs cast as the target's call received them) and the parameter gradients for the
    judge's output gradient. None where the two would not see the same operands (an input the target
    received in another dtype than ``local_grads`` casts it to: autocast) or the runner makes its
    local gradients its own way."""
    if type(target).local_backward is not Runner.local_backward or type(target).cast_input is not Runner.cast_input:
        return None
    for a, j in zip(args, jc.inputs):  # cast_input's dtype and device for each, or not the same operands
        if isinstance(j, torch.Tensor) and (
                a.device != target.torch_device
                or a.dtype != (target.param_dtype if j.is_floating_point() else j.dtype)):
            return None
    return target.local_forward_backward(private_copy(module), args, jc.grad_output)


def grad_terms_norm(module: nn.Module, jc: JudgeCall, judge: Runner) -> dict[str, float]:
    """Per parameter, the norm of the gradient summed from absolute values, in float64 on the judge:
    |grad_output| (and, for Linear/Conv, |input|) through a float64 copy of the layer.
    For a bias and a Linear/Conv weight this is exactly sum|terms|."""
    copy = reference_copy(module, judge)
    absolute = isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))
    args = tuple(judge.reference(t.abs() if absolute else t) if isinstance(t, torch.Tensor)
                 and t.is_floating_point() else t for t in jc.inputs)
    with torch.enable_grad():
        out = tensors_in(copy(*args))[0]
    out.backward(judge.reference(jc.grad_output).abs())
    return {n: float(p.grad.abs().norm()) for n, p in copy.named_parameters() if p.grad is not None}


def local_grads(module: nn.Module, jc: JudgeCall, target: Runner) -> dict[str, torch.Tensor]:
    """Parameter gradients of the target's copy of this layer, fed the judge's input and output gradient."""
    args = tuple(target.cast_input(j) if isinstance(j, torch.Tensor) else j for j in jc.inputs)
    return target.local_backward(private_copy(module), args, jc.grad_output)
