"""Module hooks: see every call of every leaf module, its inputs, output and output gradient.

A leaf module called several times in one forward (torchvision's ResNet calls
one ``relu`` module two or three times per block) gets one key per call:
``layer1.0.relu``, ``layer1.0.relu#2``, ...
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from convcheck.nested import first_tensor


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Named modules without children, in registration order (the root if it has none)."""
    leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    return [(n or type(m).__name__, m) for n, m in leaves]


def disable_inplace(model: nn.Module) -> nn.Module:
    """Turn ``inplace=True`` activations off: numerically identical, and hooks see clean tensors."""
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    return model


OnCall = Callable[[str, str, nn.Module, tuple, torch.Tensor], None]

_SUSPENDED = [0]


@contextlib.contextmanager
def hooks_suspended():
    """Inside, convcheck's capture hooks ignore module calls (a private re-run of a module's code
    calls the real modules' hooks only where it reaches a module it does not replace)."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1


def hooks_live() -> bool:
    return _SUSPENDED[0] == 0


@dataclass
class ChildCall:
    """One call of a module's direct child, as its parent saw it."""

    key: str
    name: str  # the child's module name (``layer1.0.conv1``)
    inputs: tuple
    output: object  # the whole output (a tensor, or a tuple/dict holding tensors)


@dataclass
class ParentCall:
    """One finished call of a module with children: its inputs, keyword inputs, output and the
    calls of its direct children in call order (what its own code fed them and got back)."""

    key: str
    name: str
    module: nn.Module
    inputs: tuple
    kwargs: dict
    output: object
    children: list[ChildCall] = field(default_factory=list)


class LeafCalls:
    """Calls ``on_call(key, name, module, inputs, output)`` after every leaf module call.

    With ``on_parent`` it also calls ``on_parent(ParentCall)`` after every call of a module with
    children (the root included), once its children have run; ``keep`` is applied to what a
    parent records of its children's calls, at the time of each call (the judge keeps snapshots:
    the parent's own code may change a child's output in place afterwards). With ``grad_in``,
    ``grad_in(key, gradient)`` receives the gradient with respect to each call's input (its own
    use of the input: the call reads it through a view of its own).

    Use as a context manager; hooks are removed on exit. ``order`` lists the
    keys of leaf calls in call order once the forward has run.
    """

    def __init__(self, model: nn.Module, on_call: OnCall, on_parent: Callable[[ParentCall], None] | None = None,
                 keep: Callable | None = None, grad_in: Callable[[str, torch.Tensor], None] | None = None):
        self.model = model
        self.on_call = on_call
        self.on_parent = on_parent
        self.keep = keep or (lambda obj: obj)
        self.grad_in = grad_in
        self.order: list[str] = []
        self._counts: Counter[str] = Counter()
        self._handles: list = []
        self._stack: list[ParentCall] = []

    def __enter__(self) -> "LeafCalls":
        self._stack.clear()
        leaves = {id(m) for _, m in leaf_modules(self.model)}
        for name, module in named_modules(self.model):
            if self.on_parent is None and self.grad_in is None:
                if id(module) in leaves:
                    self._handles.append(module.register_forward_hook(self._leaf_only(name)))
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit(id(module) in leaves), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _key(self, name: str) -> str:
        self._counts[name] += 1
        n = self._counts[name]
        return name if n == 1 else f"{name}#{n}"

    def _leaf_only(self, name: str):
        def hook(module, inputs, output):
            if not hooks_live():
                return
            key = self._key(name)
            self.order.append(key)
            out = first_tensor(output)
            if out is not None:
                self.on_call(key, name, module, inputs, out)

        return hook

    def _enter(self, name: str):
        def hook(module, args, kwargs):
            if not hooks_live():
                return None
            key = self._key(name)
            if self.grad_in is not None and torch.is_grad_enabled():
                args = tuple(self._watched(key, a) for a in args)
                kwargs = {k: self._watched(key, v) for k, v in kwargs.items()}
            self._stack.append(ParentCall(key, name, module, self.keep(args), self.keep(dict(kwargs)), None))
            return args, kwargs

        return hook

    def _watched(self, key: str, t):
        if not isinstance(t, torch.Tensor) or not t.requires_grad or not t.is_floating_point():
            return t
        view = t.view_as(t)
        view.register_hook(lambda g: self.grad_in(key, g))
        return view

    def _exit(self, leaf: bool):
        def hook(module, args, kwargs, output):
            if not hooks_live() or not self._stack or self._stack[-1].module is not module:
                return
            call = self._stack.pop()
            call.output = output
            if self._stack:
                self._stack[-1].children.append(ChildCall(call.key, call.name, call.inputs, self.keep(output)))
            if leaf:
                self.order.append(call.key)
                out = first_tensor(output)
                if out is not None:
                    self.on_call(call.key, call.name, module, args, out)
            elif self.on_parent is not None:
                self.on_parent(call)

        return hook


def own_code_leaf(module: nn.Module) -> bool:
    """A leaf whose class is not torch's (a hand-written LayerNorm, a gain): its forward is the user's own
    code, replayed like a parent's own code when it makes the first NaN/Inf."""
    return not type(module).__module__.startswith("torch.")


def made_in_own_code(call: ParentCall, finite: Callable[[object], bool]) -> bool:
    """Whether NaN/Inf first appear in ``call``'s own code: its output (or an input it hands a child)
    is non-finite while its inputs and every child's output from finite inputs are finite.
    ``finite(obj)`` says whether every floating tensor in ``obj`` is finite."""
    if finite(call.output) and finite([c.inputs for c in call.children]):
        return False
    if not finite(list(call.inputs) + list(call.kwargs.values())):
        return False
    # a child that turned finite inputs into NaN/Inf (or something inside it) produced them
    return not any(finite(c.inputs) and not finite(c.output) for c in call.children)


def _root_name(model: nn.Module) -> str:
    return type(model).__name__


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module, named as ``leaf_modules`` names them (the root by its class name)."""
    return [(n or _root_name(model), m) for n, m in model.named_modules()]


def module_copy(module: nn.Module) -> nn.Module:
    """An independent copy, so a re-run cannot touch the original's buffers (BatchNorm stats)."""
    return copy.deepcopy(module)


def cast_like(t, like: torch.Tensor | None, device: torch.device):
    """Move ``t`` to ``device`` and, for floating tensors, to ``like``'s dtype."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point() and like is not None and like.is_floating_point():
        return t.to(device=device, dtype=like.dtype)
    return t.to(device=device)


# --- shared dropout masks ---------------------------------------------------------------

SHARED_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


class SharedDropoutMasks:
    """Give every arm the same dropout masks, whatever its device.

    Each device draws from its own random generator, so CPU and GPU dropout
    masks differ even under one seed. Inside this context every
    ``nn.Dropout*`` module's output is recomputed from a mask drawn on the CPU
    from a generator seeded by (seed, call index) and moved to the input's
    device, so masks depend on nothing but the seed and the call.
    Stochastic modules it does not know are found by the parity probe and
    reported, never blamed on numerics.
    """

    def __init__(self, model: nn.Module, seed: int):
        self.model = model
        self.seed = seed
        self._calls = 0
        self._handles: list = []
        self.last_mask: torch.Tensor | None = None  # the scaled mask of the latest call

    def __enter__(self) -> "SharedDropoutMasks":
        for m in self.model.modules():
            if isinstance(m, SHARED_DROPOUT):
                self._handles.append(m.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, module, inputs, output):
        if not module.training or module.p == 0:
            return None
        x = inputs[0]
        self._calls += 1
        keep = self._keep(module, x, torch.Generator().manual_seed(self.seed * 7919 + self._calls))
        mask = keep.to(device=x.device, dtype=x.dtype) / (1.0 - module.p)
        self.last_mask = mask
        return x * mask

    def _keep(self, module, x: torch.Tensor, gen: torch.Generator, rows: int | None = None) -> torch.Tensor:
        """The keep-mask for ``x``, drawn on the CPU for ``rows`` samples (default: x's own batch)."""
        full = (rows if rows is not None else x.shape[0],) + tuple(x.shape[1:])
        # channel dropout: one draw per (sample, channel)
        shape = full if isinstance(module, nn.Dropout) else full[:2] + (1,) * (x.dim() - 2)
        return torch.rand(shape, generator=gen, dtype=torch.float64) >= module.p


def is_shared_dropout(module: nn.Module) -> bool:
    return isinstance(module, SHARED_DROPOUT) and module.training and module.p > 0
