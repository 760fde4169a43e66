"""Keeping part of a run in float32, as the ``float32-module`` and ``loss-float32`` actions apply it: one module's
parameters and arithmetic inside a lower-precision model (``keep_in_float32``, and the code a user pastes:
``float32_snippet``), the loss on the output cast to float32 (``float32_loss``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from convcheck.nested import map_tensors, tensors_in
from convcheck.targets.spec import Target


def float32_snippet(modules) -> str:
    """Ready to paste: the modules kept in float32 inside a lower-precision model (autocast or a cast
    model) - what ``keep_in_float32`` does to the re-run's model."""
    names = "(" + ", ".join(repr(m) for m in modules) + ("," if len(modules) == 1 else "") + ")"
    return f"""import torch

def keep_in_float32(model, names={names}):
    \"\"\"Run these modules in float32 (autocast off, weights and inputs float32); the other
    modules of a cast model get their inputs back in their own dtype.\"\"\"
    kept = [model.get_submodule(n) for n in names]
    for module in kept:
        module.float()
        forward = module.forward

        def run(*args, _forward=forward, **kwargs):
            args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            with torch.autocast(args[0].device.type, enabled=False):
                return _forward(*args, **kwargs)
        module.forward = run
    inside = {{id(m) for k in kept for m in k.modules()}}
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if id(module) not in inside and own and own[0].dtype != torch.float32:
            module.register_forward_pre_hook(
                lambda m, args, _d=own[0].dtype: tuple(a.to(_d) if torch.is_tensor(a)
                                                       and a.dtype == torch.float32 else a for a in args))
    return model

# model = keep_in_float32(model)  # after model.half() (or under autocast), before building the optimizer
"""


def keep_in_float32(model: nn.Module, names, target: Target) -> nn.Module:
    """``model`` with the modules ``names`` in float32: their parameters, their inputs (cast), their
    arithmetic (autocast off around them); their float32 outputs flow on, and every other module holding
    lower-precision parameters of its own gets its float32 inputs cast back to its dtype (a pre-hook). So
    two kept modules in a row pass float32 between them (an overflow between them stays in range)."""
    kept = [model.get_submodule(n) for n in names]
    device = target.device
    for module in kept:
        module.float()
        forward = module.forward

        def run(*args, _forward=forward, **kwargs):
            args = tuple(_to32(a) for a in args)
            kwargs = {k: _to32(v) for k, v in kwargs.items()}
            with torch.autocast(device, enabled=False):
                return _forward(*args, **kwargs)
        module.forward = run
    inside = {id(m) for k in kept for m in k.modules()}
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if id(module) not in inside and own and own[0].dtype in (torch.float16, torch.bfloat16):
            module.register_forward_pre_hook(_back_to(own[0].dtype))
    return model


def _back_to(dtype: torch.dtype):
    def hook(module, args):
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.dtype == torch.float32 else a for a in args)
    return hook


def _to32(v):
    return v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float64 else v


# --- which actions fit a verdict ------------------------------------------------------------------


def float32_loss(loss):
    """``loss`` on the model's output and the targets with every 16-bit floating tensor cast to float32 (a tuple or
    dict output too; a float16 target beside a float32 output would fail in the backward), autocast off inside it.
    A float32 or float64 tensor is passed as it is: the judge's loss and a float32 target's are unchanged."""
    def up(t):
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    def loss_in_float32(out, y):
        first = next(iter(tensors_in(out)), None)
        device = first.device.type if first is not None else "cpu"
        with torch.autocast(device_type=device, enabled=False):
            return loss(map_tensors(out, up), map_tensors(y, up))
    loss_in_float32.__name__ = getattr(loss, "__name__", "loss")
    return loss_in_float32
