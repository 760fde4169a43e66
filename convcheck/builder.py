"""``model_builder``: every arm's and parity pass's model, a placed copy of one template.

The factory runs once per builder (its random initialisation is most of a build: 0.16 s of
ResNet-18's 0.29 s float32 step), with the caller's random state kept, so building draws no
random numbers. Each build copies that template with its parameters and buffers made directly
at the target's device and dtype from the shared initial weights (the values ``place`` and an
exact copy of the float64 state gave). A runner with a ``place`` of its own, or a template
with complex tensors, gets a plain copy placed by its runner; a template that cannot be copied
is rebuilt by the factory each time.
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
import torch.nn as nn

from convcheck.capture import disable_inplace
from convcheck.models import ResolvedModel
from convcheck.runners import Runner
from convcheck.targets import Target


def model_builder(model: ResolvedModel, state: dict[str, torch.Tensor]) -> Callable[[Target], nn.Module]:
    """``build(target)``: the model with the shared weights, placed by the target's runner."""
    with torch.random.fork_rng(devices=[]):
        template = [_loaded(model.factory(), state)]  # [None] once it cannot be copied

    def build(target: Target) -> nn.Module:
        if template[0] is not None:
            try:
                return _copy(template[0], state, target.runner).train()
            except Exception:  # noqa: BLE001 - a module that cannot be copied is rebuilt instead
                template[0] = None
        return _placed(_loaded(model.factory(), state), state, target.runner).train()

    return build


def _loaded(m: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    m.load_state_dict(state)
    return disable_inplace(m)


def _placed(m: nn.Module, state: dict[str, torch.Tensor], runner: Runner) -> nn.Module:
    runner.place(m)
    for name, p in m.state_dict().items():  # load_state_dict may round float64 values
        if p.is_floating_point():
            p.copy_(state[name].to(p.dtype))
    return m


def _copy(template: nn.Module, state: dict[str, torch.Tensor], runner: Runner) -> nn.Module:
    tensors = list(itertools.chain(template.parameters(), template.buffers()))
    if type(runner).place is not Runner.place or any(t.is_complex() or type(t) not in (nn.Parameter, torch.Tensor)
                                                     for t in tensors):
        return _placed(copy.deepcopy(template), state, runner)
    device, dtype = runner.torch_device, runner.param_dtype
    names = {id(t): n for n, t in template.state_dict(keep_vars=True).items()}
    memo: dict = {}
    for t in tensors:  # deepcopy takes these from its memo instead of copying the template's
        src = state[names[id(t)]] if id(t) in names else t.detach()
        new = src.to(device=device, dtype=dtype) if src.is_floating_point() else src.to(device=device)
        new = new.clone() if new is src else new
        memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(template, memo)
