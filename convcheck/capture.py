"""Module hooks: see every call of every leaf module, its inputs, output and output gradient.

A leaf module called several times in one forward (torchvision's ResNet calls
one ``relu`` module two or three times per block) gets one key per call:
``layer1.0.relu``, ``layer1.0.relu#2``, ...
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn


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


def tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def first_tensor(obj) -> torch.Tensor | None:
    found = tensors_in(obj)
    return found[0] if found else None


OnCall = Callable[[str, str, nn.Module, tuple, torch.Tensor], None]


class LeafCalls:
    """Calls ``on_call(key, name, module, inputs, output)`` after every leaf module call.

    Use as a context manager; hooks are removed on exit. ``order`` lists the
    keys in call order once the forward has run.
    """

    def __init__(self, model: nn.Module, on_call: OnCall):
        self.model = model
        self.on_call = on_call
        self.order: list[str] = []
        self._counts: Counter[str] = Counter()
        self._handles: list = []

    def __enter__(self) -> "LeafCalls":
        for name, module in leaf_modules(self.model):
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output):
            self._counts[name] += 1
            n = self._counts[name]
            key = name if n == 1 else f"{name}#{n}"
            self.order.append(key)
            out = first_tensor(output)
            if out is not None:
                self.on_call(key, name, module, inputs, out)

        return hook


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
