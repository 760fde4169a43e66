"""``model_builder``: every arm's and parity pass's model, a placed copy of one template.

The factory runs once per builder (its random initialisation is most of a build: 0.16 s of
ResNet-18's 0.29 s float32 step), with the caller's random state kept, so building draws no
random numbers. Each build is the runner's ``placed_copy`` of that template: its parameters and
buffers made directly at the target's device and dtype from the shared initial weights (the
values ``place`` and an exact copy of the float64 state gave), or, for a runner with a
``place`` of its own, a deep copy placed by it. A template that cannot be copied is rebuilt by
the factory each time.
"""

from __future__ import annotations

import copy
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
                m = target.runner.placed_copy(template[0], state)
                return (m if m is not None else _placed(copy.deepcopy(template[0]), state, target.runner)).train()
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
