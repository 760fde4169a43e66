"""A compiled model under ``convcheck.watch``: what it is, and hooks that dynamo never traces.

``torch.compile(model)`` returns an ``OptimizedModule`` wrapping the model; ``model.compile()`` compiles
the model's own ``_call_impl``. Either way dynamo traces the module's call *with its hooks*: a hook that
reads the watch's state crashed the trace (a module reached twice through the hook's ``self``) or made
it recompile for every tensor rank it met. Here:

- the root's hooks (the batch hash, the model's output, the step's end) are kept out of every trace
  with ``torch.compiler.disable``: they run eagerly at the compiled graph's edges, one break before and
  one after it, never inside;
- a leaf's hook returns at once while dynamo traces it (``torch.compiler.is_compiling``), so the
  compiled graph holds nothing of the watch, and the leaves inside it are not seen: the compiled graph
  hides the layer boundaries, and the watch records what it can see from outside (the batch, the
  model's output and the gradient into it, every parameter's gradient, the loss) and says so.
"""

from __future__ import annotations

import torch

HIDDEN = ("compiled (torch.compile): the layer boundaries are inside the compiled graph; recorded what is seen "
          "outside it: the batch, the model's output and the gradient into it, every parameter's gradient, the loss")


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, str | None]:
    """``(watched, outer, how)``: the module whose layers and parameters are watched, the module whose
    root hooks run outside any compiled graph (the ``OptimizedModule`` wrapper itself when one is
    given: its own call is eager), and how it was compiled (None when it was not, so far as is known)."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, model, "torch.compile(model)"
    if getattr(model, "_compiled_call_impl", None) is not None:
        return model, model, "model.compile()"
    return model, model, None


def parallel(model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """``(inner, wrapper)``: the model inside a ``DataParallel`` / ``DistributedDataParallel`` (its class name the
    wrapper; the user's layer names are the inner model's, without ``module.``), or the model itself and None.
    The wrapper's own call carries the root hooks: it sees the whole batch and the gathered output."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and any(c.__name__ in ("DataParallel", "DistributedDataParallel")
                                                  for c in type(model).__mro__):
        return inner, type(model).__name__
    return model, None


def tracing() -> bool:
    """Whether dynamo is tracing the code calling this (a hook met inside a compiled region)."""
    return torch.compiler.is_compiling()


def outside_graphs(fn):
    """``fn`` as a hook dynamo never traces: a compiled region breaks around it and runs it eagerly
    (and calls it as it is when nothing is compiled)."""
    return torch.compiler.disable(fn, recursive=True)


def fallback_random() -> bool | None:
    """``torch._inductor.config.fallback_random``: True makes inductor's random layers draw eager's numbers
    (None when inductor was never imported: nothing was compiled with it so far)."""
    import sys

    inductor = sys.modules.get("torch._inductor.config")
    return None if inductor is None else bool(getattr(inductor, "fallback_random", False))
