"""The judge's pass: every leaf call's input, output and output gradient, kept in float64."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from convcheck.capture import LeafCalls, ParentCall, SharedDropoutMasks
from convcheck.measure.parity.kernels import PYTHON_BACKWARD, python_backward
from convcheck.measure.parity.snapshots import Snapshots
from convcheck.nested import first_tensor, map_tensors, tensors_in
from convcheck.targets.runners import Runner
from convcheck.seeding import seed_all


@dataclass
class JudgeCall:
    name: str
    module: str
    inputs: tuple
    output: torch.Tensor
    grad_output: torch.Tensor | None = None
    full: object = None  # the whole output as the call returned it (set from its parent's record)
    kwargs: dict = field(default_factory=dict)
    children: list[str] | None = None  # a module with children: its children's call keys, in order
    passes_on: bool = False  # a module with children whose own code only hands values on (``passes_on``)


def run_judge(model: nn.Module, batch, judge: Runner, seed: int, loss_fn, ops: set | None = None):
    """``(calls by key, call order, parameter gradients, loss)`` of the judge's forward/backward;
    ``ops`` receives the operators its forward ran."""
    x, y = batch
    calls: dict[str, JudgeCall] = {}
    snap = Snapshots()  # views, copied only before something writes to them (``snapshots``)

    def on_call(key, name, module, inputs, out):
        rec = JudgeCall(name, type(module).__name__, tuple(snap(t) for t in inputs), snap(out))
        calls[key] = rec
        if out.requires_grad and _has_parameters(module):  # only a layer's parameter gradients read it
            out.register_hook(lambda g, rec=rec: setattr(rec, "grad_output", g.detach()))

    def on_parent(call: ParentCall):
        # a module with children: what its own code was given and gave back (parity.own_code)
        out = first_tensor(call.output)
        if out is None:
            return
        full = keep(call.output)
        calls[call.key] = JudgeCall(call.name, type(call.module).__name__, call.inputs, snap(out),
                                    full=full, kwargs=call.kwargs, children=[c.key for c in call.children],
                                    passes_on=passes_on(call, full))
        for c in call.children:
            if c.key in calls:
                calls[c.key].full = c.output

    keep = lambda obj: map_tensors(obj, snap)  # noqa: E731
    with judge.applied():
        with snap, SharedDropoutMasks(model, seed), LeafCalls(model, on_call, on_parent, keep=keep) as lc:
            _, loss = judge.forward_loss(model, x, y, loss_fn)
        snap.clear()
        if ops is not None:
            ops.update(snap.ops)
            if python_backward(loss):
                ops.add(PYTHON_BACKWARD)
        judge.backward(loss)
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}  # the model is dropped
    return calls, lc.order, grads, float(loss.detach())


def passes_on(call: ParentCall, output) -> bool:
    """Whether a module's own code, in the judge's call, only handed values on: every floating tensor
    it fed a child, and its ``output``, is the very record of one it was given or a child gave back.
    Records are snapshots (one per tensor and version): a value changed in place, or any new
    tensor, a view included, is another record. Such code produces nothing of its own (its replay
    would find no point: ``own_code``), so no target replays it."""
    handed = {id(t) for t in tensors_in([call.inputs, call.kwargs])}
    for child in call.children:
        if any(t.is_floating_point() and id(t) not in handed for t in tensors_in(child.inputs)):
            return False
        handed.update(id(t) for t in tensors_in(child.output))
    return all(id(t) in handed for t in tensors_in(output) if t.is_floating_point())


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (``torch.equal`` says a NaN differs from itself,
    which made every layer producing NaN look stochastic)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def stochastic_layers(model: nn.Module, x, calls: dict, judge: Runner, seed: int) -> list[str]:
    """Re-run the judge's forward under another random seed (same shared masks): a layer
    whose output moves while its input does not draws random numbers of its own."""
    found: list[str] = []
    moved: set[str] = set()  # calls whose output differs from the judge's record

    def on_call(key, name, module, inputs, out, children=()):
        jc = calls.get(key)
        if jc is None or tuple(jc.output.shape) != tuple(out.shape) or _identical(out.detach(), jc.output):
            return
        moved.add(key)
        same_in = all(_identical(a, b) for a, b in zip(tensors_in(inputs), tensors_in(jc.inputs)))
        # a module with children: its own code draws when none of its children's outputs moved
        if same_in and not any(c.key in moved for c in children):
            found.append(key)

    def on_parent(call: ParentCall):
        out = first_tensor(call.output)
        if out is not None:
            on_call(call.key, call.name, call.module, call.inputs, out, call.children)

    seed_all(seed + 7777)
    with judge.applied(), torch.no_grad():
        with SharedDropoutMasks(model, seed), LeafCalls(model, on_call, on_parent):
            judge.forward(model, x)
    return found
