"""Before any measurement: can the user's model train at all? Each "no" is a one-line ``UsageError``.

A model with no parameters, with every parameter frozen, whose output is an
integer tensor or detached from its parameters, or whose training-mode forward
fails on a batch of the run's size (``BatchNorm1d`` with a batch of 1) would
otherwise fail deep inside a training step with torch's own traceback. One
float32 forward and backward on a tiny seeded batch, on the CPU, finds all of
them first. The caller's random state and global flags are left as they were.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn as nn

from convcheck.errors import ConvcheckError, UsageError
from convcheck.exit_codes import first_line, innermost_layer, resource_reason, user_code_error
from convcheck.plan.models import ResolvedModel, check_input_shape


def check_arguments(input_shape, num_classes, env_findings, fingerprint) -> None:
    """``compare()``'s own arguments (besides the config, which validates itself): right type and range."""
    if input_shape is not None:
        dims = list(input_shape) if isinstance(input_shape, (tuple, list)) else None
        if dims is None or len(dims) != 3 or not all(_positive_int(d) for d in dims):
            raise UsageError(f"input_shape must be three positive integers (C, H, W), got {input_shape!r}")
    if num_classes is not None and not _positive_int(num_classes):
        raise UsageError(f"num_classes must be a positive integer, got {num_classes!r}")
    if env_findings is not None and not isinstance(env_findings, (list, tuple)):
        raise UsageError(f"env_findings must be a list of convcheck.env findings, not {type(env_findings).__name__}")
    if fingerprint is not None:
        from convcheck.env import Fingerprint

        if not isinstance(fingerprint, Fingerprint):
            raise UsageError(f"fingerprint must be a convcheck.env.Fingerprint, not {type(fingerprint).__name__}")


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 < value < 2**31


def check_trainable(model: ResolvedModel, batch_size: int) -> None:
    """Build ``model`` once and try one training-mode forward and backward; ``UsageError`` if it cannot train."""
    from convcheck.targets.runners import preserved_global_flags

    with preserved_global_flags(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = _build(model)
        if not isinstance(m, nn.Module):
            raise UsageError(f"model factory {model.name!r} returned {type(m).__name__}, not a torch.nn.Module")
        check_input_shape(m, model.input_shape, model.num_classes, name=model.name)
        _check_parameters(m, model.name)
        _check_step(m, model, min(int(batch_size), 2))


def _build(model: ResolvedModel) -> nn.Module:
    """Call the factory; whatever it raises (a factory that needs arguments included) names the factory."""
    try:
        return model.factory()
    except Exception as exc:
        if isinstance(exc, ConvcheckError) or resource_reason(exc):
            raise
        what = f"{type(exc).__name__}: {first_line(exc)}" if first_line(exc) else type(exc).__name__
        raise UsageError(f"model factory {model.name!r} raised {what}") from exc


def _check_parameters(m: nn.Module, name: str) -> None:
    params = list(m.parameters())
    if not params:
        raise UsageError(f"model {name!r} has no parameters: there is nothing to train or compare")
    if not any(p.requires_grad for p in params):
        raise UsageError(f"all {len(params)} parameters of model {name!r} are frozen (requires_grad=False): "
                         "there is nothing to train")


def _check_step(m: nn.Module, model: ResolvedModel, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), torch.get_default_dtype())
    x = torch.randn((n, *model.input_shape), generator=g).to(dtype)
    m.train()
    doing = f"a training-mode forward on a batch of {n}"
    try:
        out = m(x)
    except Exception as exc:
        if resource_reason(exc):
            raise
        raise _failed(exc, model.name, doing, m) from exc
    if not isinstance(out, torch.Tensor):
        raise UsageError(f"model {model.name!r} returns a {type(out).__name__} in training mode, not a tensor")
    if not out.is_floating_point():
        raise UsageError(f"model {model.name!r} returns {str(out.dtype).replace('torch.', '')} output; "
                         "convcheck trains on floating-point logits")
    if not out.requires_grad:
        raise UsageError(f"the output of model {model.name!r} does not depend on any trainable parameter "
                         "(detached, or computed under torch.no_grad()?)")
    try:
        out.float().sum().backward()
    except Exception as exc:
        if resource_reason(exc):
            raise
        raise _failed(exc, model.name, "the backward pass of " + doing, m) from exc


def _failed(exc: Exception, name: str, doing: str, root: nn.Module) -> UsageError:
    """The one-line error for the user's model failing, naming their code's line where it can, else
    the layer (a torch module inside their model) that raised."""
    located = user_code_error(exc, doing)
    if located is not None:
        return located
    what = f"{type(exc).__name__}: {first_line(exc)}" if first_line(exc) else type(exc).__name__
    layer = innermost_layer(exc, root)
    return UsageError(f"model {name!r} fails {doing}{f' in layer {layer}' if layer else ''}: {what}")
