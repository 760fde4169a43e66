"""Resolve what the user passed as ``--model`` into a factory and its input spec.

Three forms are accepted:

- a zoo name (``lenet``, ``resnet50``; see ``reference_models``);
- ``package.module:factory``, imported with importlib;
- ``path/to/file.py:factory``, loaded from that file.

A factory is any callable taking no arguments that returns an ``nn.Module``
(a function or the model class itself). The input shape (C, H, W) and the
number of classes come, in this order, from ``--input-shape`` / ``--classes``,
the zoo spec, ``input_shape`` / ``num_classes`` attributes on the factory or the
built model, and finally from the model itself: classes from the last
``nn.Linear``, channels from the first ``nn.Conv2d`` and the spatial size from
the one conventional image size the model accepts.

Every failure the user can fix is a one-line ``UsageError``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from convcheck.errors import ConvcheckError, UsageError, did_you_mean
from convcheck.plan.user_code import attribute, import_module, load_file, one_line

# Square image sizes tried, smallest first, when a model does not declare its
# input: MNIST, CIFAR, 64px, STL-10, ImageNet.
CANDIDATE_SIZES = (28, 32, 64, 96, 224)

_FORMS = "a zoo name, package.module:factory or path/to/file.py:factory"


@dataclass(frozen=True)
class ResolvedModel:
    name: str                           # short name for reports and folder names
    factory: Callable[[], nn.Module]    # builds a fresh model (default dtype, CPU)
    input_shape: tuple[int, int, int] | None  # C, H, W of one sample (None: the user's data defines it)
    num_classes: int | None
    source: str                         # "zoo", "module" or "file"
    spec: str = ""                      # the --model text as given (record it to rebuild)
    task: str = "classification"        # classification | segmentation | regression (zoo models say)

    def __reduce__(self):
        """A user model from a file or module crosses to a spawned process (``ddp:cuda:N``) as its spec
        (a file's factory cannot be pickled by reference) and is resolved again there."""
        if self.source in ("file", "module") and self.spec:
            return (_resolved_again, (self.spec, self.input_shape, self.num_classes, self.task, self.name))
        return (ResolvedModel, (self.name, self.factory, self.input_shape, self.num_classes, self.source,
                                self.spec, self.task))


def _resolved_again(spec: str, input_shape, num_classes, task: str, name: str) -> "ResolvedModel":
    resolved = resolve_model(spec, input_shape=input_shape, num_classes=num_classes, infer=False)
    return dataclasses.replace(resolved, task=task, name=name)


def resolve_model(name: str, input_shape: tuple[int, int, int] | None = None,
                  num_classes: int | None = None, infer: bool = True,
                  data_shape: tuple[int, int, int] | None = None) -> ResolvedModel:
    """Resolve a zoo name, ``package.module:factory`` or ``path/to/file.py:factory``.

    ``input_shape`` and ``num_classes`` (from ``--input-shape`` / ``--classes``)
    override whatever the model declares. A user factory is called once here
    (without disturbing the global RNG) to check it and to infer what was not
    given (``infer=False``: the user's data defines the inputs, so what a user model does not
    declare stays None). ``data_shape``: one sample's shape as the data files tell it (``--data npz:``),
    used for a user model that declares none, before trying sizes. Call ``check_input_shape`` on a built
    model to confirm the spec.
    """
    if input_shape is not None:
        input_shape = _as_shape(input_shape, f"input shape for model {name!r}")
    if num_classes is not None:
        try:
            num_classes = _positive_int(num_classes)
        except (TypeError, ValueError):
            raise UsageError(f"number of classes must be a positive integer, got {num_classes!r}") from None
    if ":" not in name:
        return _resolve_zoo(name, input_shape, num_classes)
    return _resolve_user(name, input_shape, num_classes, infer, data_shape)


def parse_input_shape(text: str) -> tuple[int, int, int]:
    """``"3,32,32"`` (or ``"3x32x32"``) -> ``(3, 32, 32)``."""
    parts = [p.strip() for p in text.replace("x", ",").replace("X", ",").split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"input shape {text!r} is not three positive integers C,H,W (e.g. 3,32,32)")
    return shape


def check_input_shape(model: nn.Module, input_shape: tuple[int, ...], num_classes: int,
                      *, name: str | None = None, task: str = "classification") -> None:
    """Run one float64 forward on a zero batch of 2; raise ``UsageError`` unless it gives (2, num_classes).

    Works on a float64 copy in eval mode, so the model itself (its dtype,
    BatchNorm statistics, training flag) is left as it was.
    """
    from convcheck.targets.runners import preserved_global_flags

    name = name or type(model).__name__
    with preserved_global_flags():  # flags the user's forward sets during the probe do not leak out
        probe = copy.deepcopy(model).to(torch.float64)
        problem = _forward_problem(probe, input_shape, num_classes, torch.float64, task)
        if problem and task == "classification" and num_classes:
            try:
                out = _forward(probe, input_shape, torch.float64)
            except Exception:  # noqa: BLE001 - the input shape's problem, said below
                out = None
            if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == 2 and out.shape[1] != num_classes:
                k = out.shape[1]  # the input fits; the class count asked for does not
                raise UsageError(f"model {name!r} outputs {k} {_classes(k)} but {num_classes} were asked for "
                                 f"(--classes / num_classes): pass {k}, or leave it out to use the model's own")
    if problem:
        raise UsageError(f"model {name!r} rejects input shape {_shape_text(input_shape)}: {problem}")


# --- zoo -----------------------------------------------------------------------

def _resolve_zoo(name: str, input_shape, num_classes) -> ResolvedModel:
    from reference_models import UnknownModelError, get_spec, list_models

    try:
        spec = get_spec(name)
    except UnknownModelError as exc:
        near = did_you_mean(name, list_models())  # a near typo (resnet19) offered first
        said = str(exc).replace("; known models:", f"; did you mean {near!r}? Known models:", 1) if near else exc
        raise UsageError(f"{said}; for your own model pass package.module:factory "
                         f"or path/to/file.py:factory") from None
    factory = spec.factory
    if num_classes is not None and num_classes != spec.num_classes:
        factory = functools.partial(spec.factory, num_classes=num_classes)
    return ResolvedModel(name=spec.name, factory=factory,
                         input_shape=input_shape or spec.input_shape,
                         num_classes=num_classes or spec.num_classes,
                         source="zoo", spec=name, task=spec.task)


# --- user models -------------------------------------------------------------------

def _resolve_user(spec: str, input_shape, num_classes, infer: bool = True, data_shape=None) -> ResolvedModel:
    location, _, attr = spec.rpartition(":")
    if not location or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise UsageError(f"model {spec!r} is not {_FORMS}")
    # User code may draw random numbers when imported or built; the caller's
    # seeded generator must not notice.
    with torch.random.fork_rng(devices=[]):
        return _resolve_user_code(spec, location, attr, input_shape, num_classes, infer, data_shape)


def _resolve_user_code(spec: str, location: str, attr: str, input_shape, num_classes,
                       infer: bool = True, data_shape=None) -> ResolvedModel:
    if location.endswith(".py") or "/" in location or "\\" in location:
        module, source, short = load_file(location, "model"), "file", Path(location).stem
        where = f"file {location!r}"
    elif all(p.isidentifier() for p in location.split(".")):
        module, source, short = import_module(location, "model"), "module", location.rpartition(".")[2]
        where = f"module {location!r}"
    else:
        raise UsageError(f"model {spec!r} is not {_FORMS}")

    raw = _lookup(module, attr, where)
    factory = functools.partial(_build, raw, spec)
    model = factory().eval()

    asked = num_classes  # --classes (num_classes= in the API): checked against what the model outputs
    if num_classes is None:
        num_classes = _declared(raw, model, "num_classes", spec)
    if num_classes is None and infer:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        num_classes = linears[-1].out_features if linears else None
    if input_shape is None:
        input_shape = _declared(raw, model, "input_shape", spec)
    if input_shape is None and data_shape is not None and not _forward_problem(model, data_shape, None,
                                                                                torch.get_default_dtype()):
        input_shape = data_shape  # the file's sample shape, where the model takes it (else sizes are tried and
        # the file's reader says what does not fit: a channels-last x)
    if not infer:
        if asked is not None and input_shape is not None:
            _check_classes_asked(model, input_shape, asked, spec)
        return ResolvedModel(name=f"{short}.{attr}", factory=factory, input_shape=input_shape,
                             num_classes=num_classes, source=source, spec=spec)
    if input_shape is None:
        try:
            input_shape = _infer_input_shape(model, num_classes, spec)
        except UsageError:
            if asked is None:
                raise
            # perhaps no size gives `asked` classes because the model outputs another count: say that
            input_shape = _infer_input_shape(model, None, spec)
    if asked is not None:
        _check_classes_asked(model, input_shape, asked, spec)
    if num_classes is None:
        num_classes = _infer_num_classes(model, input_shape, spec)
    return ResolvedModel(name=f"{short}.{attr}", factory=factory, input_shape=input_shape,
                         num_classes=num_classes, source=source, spec=spec)


def _lookup(module, attr: str, where: str):
    obj = attribute(module, attr, where, "factory")
    if isinstance(obj, nn.Module):
        raise UsageError(f"{attr!r} in {where} is a model instance, not a factory; "
                         f"point at a function or class that builds it")
    if not callable(obj):
        raise UsageError(f"{attr!r} in {where} is a {type(obj).__name__}, not a callable factory")
    return obj


def checked_factory(raw: Callable, name: str) -> Callable[[], nn.Module]:
    """``raw`` wrapped so that a call returning anything but an ``nn.Module`` raises a ``UsageError``
    naming ``name``; what ``raw`` raises passes unchanged (the caller reports where it happened)."""
    return functools.partial(_module_or_error, raw, name)


def _module_or_error(raw: Callable, name: str) -> nn.Module:
    model = raw()
    if not isinstance(model, nn.Module):
        raise UsageError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _build(raw: Callable, spec: str) -> nn.Module:
    """Call a user factory; its failures and wrong return types become UsageErrors."""
    from convcheck.exit_codes import resource_reason

    try:
        model = raw()
    except Exception as exc:
        if isinstance(exc, ConvcheckError) or resource_reason(exc):
            raise  # already one line, or the machine's limit (exit 3), not the factory's fault
        raise UsageError(f"model factory {spec!r} raised {one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"model factory {spec!r} returned {type(model).__name__}, "
                         f"not a torch.nn.Module")
    return model


def _declared(raw, model: nn.Module, attr: str, spec: str):
    """``input_shape`` / ``num_classes`` declared on the factory or the built model, validated."""
    for owner in (raw, model):
        value = getattr(owner, attr, None)
        if value is None or callable(value):
            continue
        if attr == "input_shape":
            return _as_shape(value, f"input_shape declared by model {spec!r}")
        try:
            return _positive_int(value)
        except (TypeError, ValueError):
            raise UsageError(f"num_classes declared by model {spec!r} is {value!r}, "
                             f"not a positive integer; pass --classes") from None
    return None


def _infer_input_shape(model: nn.Module, num_classes: int | None, spec: str) -> tuple[int, int, int]:
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise UsageError(f"cannot tell the input shape of model {spec!r} (no Conv2d layer); "
                         f"pass --input-shape C,H,W")
    channels = convs[0].in_channels
    fits = []
    for size in CANDIDATE_SIZES:
        shape = (channels, size, size)
        if not _forward_problem(model, shape, num_classes, torch.get_default_dtype()):
            fits.append(shape)
        if len(fits) == 2:
            break
    if len(fits) == 1:
        return fits[0]
    if fits:
        why = f"it accepts both {_shape_text(fits[0])} and {_shape_text(fits[1])}"
    else:
        why = "it accepts none of " + ", ".join(_shape_text((channels, s, s)) for s in CANDIDATE_SIZES)
    raise UsageError(f"cannot tell the input size of model {spec!r} ({why}); pass --input-shape C,H,W")


def _check_classes_asked(model: nn.Module, input_shape, asked: int, spec: str) -> None:
    """``UsageError`` when the model's logits on ``input_shape`` have another class count than ``--classes``.
    A forward that fails, or an output that is not (2, k) logits, is left to the checks that follow."""
    try:
        out = _forward(model, input_shape, torch.get_default_dtype())
    except Exception:
        return
    if isinstance(out, torch.Tensor) and out.ndim in (2, 4) and out.shape[0] == 2 and out.shape[1] != asked:
        outputs = out.shape[1]
        raise UsageError(f"model {spec!r} outputs {outputs} {_classes(outputs)} but --classes says {asked}: "
                         f"pass --classes {outputs}, or leave it out to use the model's own")


def _classes(n: int) -> str:
    return "class" if n == 1 else "classes"


def _infer_num_classes(model: nn.Module, input_shape, spec: str) -> int:
    out = _forward(model, input_shape, torch.get_default_dtype())
    if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == 2:
        return out.shape[1]
    raise UsageError(f"cannot tell the number of classes of model {spec!r}; pass --classes")


# --- helpers -------------------------------------------------------------------------

def _forward(model: nn.Module, input_shape, dtype: torch.dtype):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(torch.zeros((2, *input_shape), dtype=dtype))
    finally:
        model.train(was_training)


def _forward_problem(model: nn.Module, input_shape, num_classes: int | None,
                     dtype: torch.dtype, task: str = "classification") -> str | None:
    """Why a zero batch of 2 does not give logits of shape (2, num_classes); None if it does."""
    try:
        out = _forward(model, input_shape, dtype)
    except Exception as exc:
        # torch reports shape mismatches as RuntimeError; its text says it all.
        return one_line(exc, with_type=not isinstance(exc, RuntimeError))
    if not isinstance(out, torch.Tensor):
        return f"output is a {type(out).__name__}, not a tensor"
    if out.ndim == 4 and task == "segmentation" and out.shape[0] == 2 and \
            (num_classes is None or out.shape[1] == num_classes):
        return None  # per-pixel class logits
    if out.ndim != 2 or out.shape[0] != 2 or (num_classes is not None and out.shape[1] != num_classes):
        expected = f"(2, {num_classes})" if num_classes is not None else "(2, classes)"
        if task == "segmentation":
            expected = f"(2, {num_classes if num_classes is not None else 'classes'}, H, W)"
        return f"output has shape {tuple(out.shape)}, expected {expected}"
    return None


def _as_shape(value, what: str) -> tuple[int, int, int]:
    try:
        shape = tuple(_positive_int(d) for d in value)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 3:
        raise UsageError(f"{what} is {value!r}, not three positive integers C,H,W")
    return shape


def _positive_int(value) -> int:
    if isinstance(value, bool) or operator.index(value) < 1:
        raise ValueError(value)
    return operator.index(value)


def _shape_text(shape) -> str:
    return "x".join(str(d) for d in shape)
