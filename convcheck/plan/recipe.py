"""The user's training recipe: loss, optimizer, learning-rate schedule and gradient clipping.

``build_recipe(config)`` turns the config's strings into callables once, before
any work, so a wrong name is a one-line ``UsageError`` up front:

* loss: cross-entropy on class logits by default; ``FILE.py:fn`` /
  ``package.module:fn`` or a callable, called as ``fn(output, target)`` and
  returning a scalar tensor;
* optimizer: any ``torch.optim`` class by name, case-insensitive (``sgd``,
  ``adamw``, ``rmsprop``...), with ``lr``, ``momentum``, ``nesterov``,
  ``weight_decay``, ``betas``, ``eps`` where the class takes them; or a
  factory ``fn(params) -> optimizer``;
* schedule: ``constant``, ``cosine``, ``step:EVERY:GAMMA``, ``onecycle``, each
  with ``warmup`` linear warm-up steps; or a factory ``fn(optimizer, steps)``;
* ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` before every step.

Every arm gets its own optimizer and schedule from the same recipe.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from convcheck.errors import UsageError
from convcheck.targets.runners import cross_entropy
from convcheck.exit_codes import user_callable_error
from convcheck.plan.user_code import is_user_spec, load_callable, one_line

# convcheck's SGD has always used momentum 0.9 unless told otherwise (--momentum 0 for plain SGD).
SGD_DEFAULT_MOMENTUM = 0.9
SCHEDULES = ("constant", "cosine", "step:EVERY:GAMMA", "onecycle")


@dataclass(frozen=True)
class Recipe:
    loss: Callable
    loss_name: str
    make_optimizer: Callable  # params -> torch.optim.Optimizer
    optimizer_name: str
    make_schedule: Callable  # (optimizer, steps) -> LRScheduler | None
    schedule_name: str
    clip_grad_norm: float | None
    # what it was built from: (the config's recipe fields, task); a spawned process (ddp:cuda:N) gets the
    # recipe as this and builds it again, as the optimizer and schedule factories are closures
    source: tuple | None = field(default=None, compare=False, repr=False)

    def __reduce__(self):
        if self.source is None:  # built by hand: pickled field by field (fails on a closure)
            return (Recipe, tuple(getattr(self, f) for f in RECIPE_ATTRS))
        return (_recipe_again, self.source)


RECIPE_ATTRS = ("loss", "loss_name", "make_optimizer", "optimizer_name", "make_schedule", "schedule_name",
                "clip_grad_norm")
# The config fields build_recipe reads.
RECIPE_FIELDS = ("loss", "optimizer", "lr", "momentum", "nesterov", "weight_decay", "betas", "eps", "schedule",
                 "warmup", "clip_grad_norm")


def build_recipe(cfg, task: str = "classification") -> Recipe:
    loss, loss_name = _loss(cfg.loss, task)
    make_opt, opt_name = _optimizer(cfg)
    make_sched, sched_name = _schedule(cfg)
    source = ({f: getattr(cfg, f) for f in RECIPE_FIELDS}, task)
    return Recipe(loss, loss_name, make_opt, opt_name, make_sched, sched_name, cfg.clip_grad_norm, source)


def check_classes(recipe: Recipe, task: str, num_classes: int | None) -> None:
    """Refuse one class under the built-in cross-entropy: over a single class it is 0 for every input, so
    nothing trains and every arm agrees - a run that would end ``ok`` and mean nothing."""
    if num_classes == 1 and recipe.loss is cross_entropy and task in ("classification", "segmentation"):
        raise UsageError("1 class: cross-entropy over a single class is 0 for every input, so nothing would "
                         "train; give --classes 2 or more (or --loss for a model with one output)")


def _recipe_again(fields: dict, task: str) -> Recipe:
    from types import SimpleNamespace

    return build_recipe(SimpleNamespace(**fields), task)


# --- loss ------------------------------------------------------------------------------------------

def mean_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The regression default: MSE; half-precision values are upcast to float32 first."""
    half = (torch.float16, torch.bfloat16)
    return torch.nn.functional.mse_loss(output.float() if output.dtype in half else output,
                                        target.float() if target.dtype in half else target.to(output.dtype))


def _loss(spec, task: str = "classification"):
    if spec is None:
        if task == "regression":
            return mean_squared_error, "mean squared error"
        return cross_entropy, "cross-entropy" + (" per pixel" if task == "segmentation" else "")
    if callable(spec):
        fn, name = spec, getattr(spec, "__name__", type(spec).__name__)
        return CheckedLoss(fn, name), name
    fn, name = load_callable(str(spec), "loss")
    return CheckedLoss(fn, name, str(spec)), name


class CheckedLoss:
    """The user's loss, its failures and wrong results one-line usage errors. Pickled as its spec when it
    came from one (a file's function cannot be pickled by reference), else as the function."""

    def __init__(self, fn: Callable, name: str, spec: str | None = None):
        self.fn, self.__name__, self.spec = fn, name, spec

    def __reduce__(self):
        return (_loss_again, (self.spec,)) if self.spec else (CheckedLoss, (self.fn, self.__name__))

    def __call__(self, output, target):
        name = self.__name__
        try:
            value = self.fn(output, target)
        except Exception as exc:  # the user's code: a usage error naming it, its file and line (and the step)
            raise user_callable_error(f"loss {name!r}", one_line(exc), exc) from None
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise UsageError(f"loss {name!r} returned {type(value).__name__}"
                             f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}, "
                             "expected a floating-point scalar tensor")
        if value.numel() != 1:
            raise UsageError(f"loss {name!r} returned a tensor of shape {tuple(value.shape)}, expected a scalar "
                             "(average it over the batch)")
        if torch.is_grad_enabled() and not value.requires_grad:
            raise UsageError(f"loss {name!r} returned a tensor with no gradient (detached from the output?)")
        return value.reshape(())


def _loss_again(spec: str) -> CheckedLoss:
    return _loss(spec)[0]


# --- optimizer -------------------------------------------------------------------------------------

# torch.optim classes a plain training step cannot drive.
_NOT_STEPPABLE = {"LBFGS": "needs a closure that re-evaluates the loss: convcheck steps once per batch",
                  "SparseAdam": "takes sparse gradients only"}


def _optimizer_class(name: str):
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    cls = classes.get(name.lower())
    if cls is not None and cls.__name__ in _NOT_STEPPABLE:
        raise UsageError(f"optimizer {cls.__name__} {_NOT_STEPPABLE[cls.__name__]}; pass a factory "
                         "(path/file.py:factory) for another optimizer")
    if cls is None:
        raise UsageError(f"unknown optimizer {name!r}: use a torch.optim name ({', '.join(sorted(classes))}) "
                         "or path/file.py:factory")
    return cls


def _optimizer(cfg):
    spec = cfg.optimizer
    if callable(spec) or is_user_spec(str(spec)):
        factory, name = (spec, getattr(spec, "__name__", "optimizer")) if callable(spec) else \
            load_callable(str(spec), "optimizer factory")
        return _checked_factory(factory, name), name
    cls = _optimizer_class(str(spec))
    kwargs = _optimizer_kwargs(cls, cfg)
    _check_settings(cls, kwargs)
    return (lambda params: cls(params, **kwargs)), cls.__name__


def _check_settings(cls, kwargs: dict) -> None:
    """The settings torch refuses (``--momentum 0 --nesterov``, a negative lr), refused before any work as
    the options they came from, not as a failure of convcheck's when the first arm builds its optimizer."""
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError) as exc:
        settings = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise UsageError(f"optimizer {cls.__name__} refuses these settings ({settings}): {one_line(exc)}") from None


def _optimizer_kwargs(cls, cfg) -> dict:
    accepts = set(inspect.signature(cls.__init__).parameters)
    wanted = {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov or None,
              "weight_decay": cfg.weight_decay or None, "betas": tuple(cfg.betas) if cfg.betas else None,
              "eps": cfg.eps}
    if cls is torch.optim.SGD and cfg.momentum is None:
        wanted["momentum"] = SGD_DEFAULT_MOMENTUM
    given = {k: v for k, v in wanted.items() if v is not None}
    refused = [k for k in given if k not in accepts]
    if refused:
        raise UsageError(f"optimizer {cls.__name__} takes no {', '.join(refused)} "
                         f"(it takes: {', '.join(sorted(accepts - {'self', 'params'}))})")
    return given


def _checked_factory(factory: Callable, name: str) -> Callable:
    def make(params):
        try:
            opt = factory(params)
        except Exception as exc:
            raise UsageError(f"optimizer factory {name!r} raised {one_line(exc)}") from None
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizer factory {name!r} returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    return make


# --- schedule --------------------------------------------------------------------------------------

def _schedule(cfg):
    spec, warmup = cfg.schedule, cfg.warmup
    if callable(spec) or is_user_spec(str(spec)):
        factory, name = (spec, getattr(spec, "__name__", "schedule")) if callable(spec) else \
            load_callable(str(spec), "schedule factory")
        return _checked_schedule_factory(factory, name), name
    main = _builtin_schedule(str(spec))
    name = str(spec) + (f" + {warmup} warm-up steps" if warmup else "")

    def make(opt, steps):
        if warmup >= steps:
            raise UsageError(f"--warmup {warmup} is not shorter than the run ({steps} steps)")
        return _with_warmup(opt, main(opt, steps - warmup), warmup, steps)
    return make, name


def _builtin_schedule(spec: str):
    kind, _, rest = spec.lower().partition(":")
    S = torch.optim.lr_scheduler
    if kind == "constant" and not rest:
        return lambda opt, n: None
    if kind == "cosine" and not rest:
        return lambda opt, n: S.CosineAnnealingLR(opt, T_max=max(1, n))
    if kind == "onecycle" and not rest:
        return lambda opt, n: S.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=max(2, n))
    if kind == "step":
        every, _, gamma = rest.partition(":")
        try:
            every_i, gamma_f = int(every), float(gamma)
        except ValueError:
            every_i, gamma_f = 0, math.nan
        if every_i < 1 or not (math.isfinite(gamma_f) and gamma_f > 0):
            raise UsageError(f"schedule {spec!r}: expected step:EVERY:GAMMA with EVERY >= 1 and GAMMA > 0")
        return lambda opt, n: S.StepLR(opt, step_size=every_i, gamma=gamma_f)
    raise UsageError(f"unknown schedule {spec!r}: use {', '.join(SCHEDULES)} or path/file.py:factory")


def _with_warmup(opt, main, warmup: int, steps: int):
    if not warmup:
        return main
    S = torch.optim.lr_scheduler
    ramp = S.LinearLR(opt, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    if main is None:
        return ramp
    return S.SequentialLR(opt, [ramp, main], milestones=[warmup])


def _checked_schedule_factory(factory: Callable, name: str) -> Callable:
    def make(opt, steps):
        try:
            sched = factory(opt, steps)
        except Exception as exc:
            raise UsageError(f"schedule factory {name!r} raised {one_line(exc)}") from None
        if sched is None:  # a forgotten return: the run would train at a constant lr without saying so
            raise UsageError(f"schedule factory {name!r} returned None; return the scheduler it builds "
                             "(or use --schedule constant)")
        if not callable(getattr(sched, "step", None)):
            raise UsageError(f"schedule factory {name!r} returned {type(sched).__name__}, which has no step()")
        return sched
    return make
