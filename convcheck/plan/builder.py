"""``initial_state`` and ``model_builder`` / ``ModelBuilder``: every arm's and parity pass's model, a placed
copy of one template holding the shared initial weights.

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
from convcheck.errors import UsageError
from convcheck.plan.models import ResolvedModel
from convcheck.targets.runners import Runner
from convcheck.targets.spec import Target


def initial_state(model: ResolvedModel, seed: int) -> dict[str, torch.Tensor]:
    """The shared initial weights: built once from a seeded CPU generator, kept in float64."""
    torch.manual_seed(seed)
    try:
        m = model.factory()
    except Exception as exc:  # the user's factory: a user error, reported in one line
        raise UsageError(f"model factory {model.name!r} raised {type(exc).__name__}: {exc}") from None
    return {k: (v.detach().to(torch.float64) if v.is_floating_point() else v.detach().clone())
            for k, v in m.state_dict().items()}


class ModelBuilder:
    """``build(target)``: the model with the shared weights, placed by the target's runner.

    A class, not a closure: a data-parallel target whose ranks are spawned (``ddp:cuda:N``) gets it
    pickled - the model by its spec where it has one (``ResolvedModel.__reduce__``) and the weights,
    never the template, which each process makes for itself."""

    def __init__(self, model: ResolvedModel, state: dict[str, torch.Tensor]):
        self.model, self.state = model, state
        with torch.random.fork_rng(devices=[]):
            self.template: nn.Module | None = _loaded(model.factory(), state)  # None: cannot be copied

    def __getstate__(self) -> dict:
        return {"model": self.model, "state": self.state}

    def __setstate__(self, d: dict) -> None:
        self.__init__(d["model"], d["state"])

    def __call__(self, target: Target) -> nn.Module:
        if self.template is not None:
            try:
                m = target.runner.placed_copy(self.template, self.state)
                if m is None:
                    m = _placed(copy.deepcopy(self.template), self.state, target.runner)
                return m.train()
            except Exception:  # noqa: BLE001 - a module that cannot be copied is rebuilt instead
                self.template = None
        return _placed(_loaded(self.model.factory(), self.state), self.state, target.runner).train()


def model_builder(model: ResolvedModel, state: dict[str, torch.Tensor]) -> Callable[[Target], nn.Module]:
    """``build(target)``: the model with the shared weights, placed by the target's runner."""
    return ModelBuilder(model, state)


def _loaded(m: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    m.load_state_dict(state)
    return disable_inplace(m)


def _placed(m: nn.Module, state: dict[str, torch.Tensor], runner: Runner) -> nn.Module:
    runner.place(m)
    for name, p in m.state_dict().items():  # load_state_dict may round float64 values
        if p.is_floating_point():
            p.copy_(state[name].to(p.dtype))
    return m
