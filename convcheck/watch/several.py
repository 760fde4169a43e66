"""Several models and optimizers in one watch (issue 45): ``convcheck.watch(models={"G": G, "D": D},
optimizers=[opt_g, opt_d], out=...)``, a GAN's loop watched in one block.

The models are watched as the children of one ``Models`` container (never called; nothing is added to the models
themselves): their layers are named ``G.fc1``, ``D.fc1``..., their parameters ``G.fc1.weight``..., and each
model's own call is a root (its batch hashed, its output the loss's start). The optimizers are read through
``Optimizers``, a view whose ``param_groups`` are all of theirs in order (the learning rates and settings the
run records), named by their classes joined with ``+``. A step ends when every optimizer has stepped (or at
``w.step``); each optimizer's pre-step reads the gradient norms of the parameters it holds, so the
discriminator's norms are its own backward's, not the generator's added to them."""

from __future__ import annotations

import torch

from convcheck.errors import UsageError


class Models(torch.nn.Module):
    """The watched models as one module's children (named as given). In training mode while any of them is."""

    def __init__(self, models: dict):
        super().__init__()
        for name, m in models.items():
            self.add_module(name, m)

    @property
    def training(self) -> bool:  # the models' own modes; ``train()``/``eval()`` on the container are theirs
        return any(m.training for m in self._modules.values()) if "_modules" in self.__dict__ else True

    @training.setter
    def training(self, value) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise TypeError("convcheck.watch's Models container is not called: call each model")


class Optimizers:
    """Several optimizers read as one: all their parameter groups, in order."""

    def __init__(self, optimizers: list):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def defaults(self) -> dict:
        return dict(self.optimizers[0].defaults) if self.optimizers else {}

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}


def _named(models) -> dict:
    if isinstance(models, dict):
        named = dict(models)
    elif isinstance(models, (list, tuple)):
        classes = [type(m).__name__ for m in models]
        named = {(c if classes.count(c) == 1 else f"{c}{i}"): m for i, (c, m) in enumerate(zip(classes, models))}
    else:
        raise UsageError(f"convcheck.watch: models={models!r:.60} is not a list or dict of torch.nn.Module")
    for name, m in named.items():
        if not isinstance(name, str) or not name or "." in name:
            raise UsageError(f"convcheck.watch: models name {name!r:.40} is not a name without dots")
        if not isinstance(m, torch.nn.Module):
            raise UsageError(f"convcheck.watch: models[{name!r}] is a {type(m).__name__}, not a torch.nn.Module")
    if len({id(m) for m in named.values()}) != len(named):
        raise UsageError("convcheck.watch: the same model given twice in models=")
    return named


def gather(model, optimizer, models, optimizers):
    """``(model, optimizer, optimizers)`` the watch records: ``model`` itself or a ``Models`` of ``models``, the one
    optimizer or an ``Optimizers`` view of several, and the real optimizers whose steps end a step."""
    if models is not None and model is not None:
        raise UsageError("convcheck.watch: give model or models=, not both")
    if optimizers is not None and optimizer is not None:
        raise UsageError("convcheck.watch: give optimizer or optimizers=, not both")
    if models is not None:
        named = _named(models)
        model = next(iter(named.values())) if len(named) == 1 else type(
            "+".join(type(m).__name__ for m in named.values()), (Models,), {"__module__": __name__})(named)
    if optimizers is not None:
        if not isinstance(optimizers, (list, tuple)) or not optimizers:
            raise UsageError(f"convcheck.watch: optimizers={optimizers!r:.60} is not a non-empty list of optimizers")
        real = list(optimizers)
        optimizer = real[0] if len(real) == 1 else type(
            "+".join(type(o).__name__ for o in real), (Optimizers,), {"__module__": __name__})(real)
        return model, optimizer, real
    return model, optimizer, [optimizer] if optimizer is not None else []


def roots(model) -> list:
    """The modules whose own calls are the run's roots: each model of a ``Models``, else the model."""
    return list(model.children()) if isinstance(model, Models) else [model]


def held(optimizer) -> set[int]:
    """The ids of the parameters ``optimizer`` holds."""
    return {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ())}
