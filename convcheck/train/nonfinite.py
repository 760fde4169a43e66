"""The first call of a training run that turns finite inputs into NaN/Inf: a leaf module, or the
own code of a module with children (its output, or an input it hands a child, is the first
non-finite value while its inputs and the outputs of its children are finite)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from convcheck.capture import LeafCalls, ParentCall, first_tensor, made_in_own_code, tensors_in


def all_finite(t: torch.Tensor) -> bool:
    """One reduction instead of an elementwise isfinite: a NaN/Inf anywhere makes the sum non-finite.
    The sum in the tensor's own dtype first (10x faster than a float64 one): finite, every element
    is; otherwise the float64 sum decides (a 16/32-bit sum can overflow on finite values)."""
    if not t.is_floating_point():
        return True
    t = t.detach()
    return math.isfinite(float(t.sum())) or math.isfinite(float(t.sum(dtype=torch.float64)))


def _finite(obj) -> bool:
    return all(all_finite(t) for t in tensors_in(obj))


class FirstProducer:
    """Watches every module call while gradients are on (training forwards, not probes);
    ``found`` is ``(step index, module name)`` of the first producer, once."""

    def __init__(self, model: nn.Module):
        self.found: tuple[int, str] | None = None
        # the producer's own weights were already NaN/Inf: an optimizer step made them so
        self.weights = False
        self.step_index = 0
        self._dirty = False
        self._calls = LeafCalls(model, self._leaf, self._parent)
        self._calls.__enter__()

    def next_step(self, index: int) -> None:
        self.step_index = index
        self._calls.order.clear()  # keys are not needed across steps: nothing grows with the run
        self._calls._counts.clear()

    def close(self) -> None:
        self._calls.__exit__(None, None, None)

    def _watching(self) -> bool:
        return self.found is None and torch.is_grad_enabled()

    def _leaf(self, key, name, module, inputs, out) -> None:
        if self._watching() and not all_finite(out):
            self._dirty = True  # a NaN/Inf reached a leaf: the parents around it look closer
            if _finite(inputs):
                self._blame(name, module)

    def _parent(self, call: ParentCall) -> None:
        if not self._watching():
            return
        out = first_tensor(call.output)
        if not self._dirty and (out is None or all_finite(out)):
            return  # nothing non-finite anywhere yet: one reduction of the output, no more
        if made_in_own_code(call, _finite):  # else a child produced them, and its own hook named it
            self._blame(call.name, call.module)

    def _blame(self, name: str, module: nn.Module) -> None:
        self.found = (self.step_index, name)
        self.weights = not all(all_finite(p) for p in module.parameters(recurse=False))
