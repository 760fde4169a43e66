"""A loss written as a function (``F.cross_entropy(model(x), y)``) seen as a loss module is.

A loss module's call is met by the process-wide hooks (``attach._post``: ``Watch.made_elsewhere``): its class and
settings go into the recipe's ``criteria`` and what it was given besides the model's output - the targets, the
labels - is hashed per step (``target_sha256``). A loss called as a function of ``torch.nn.functional`` passes no
hook, so a label mapping or a ``label_smoothing=`` given to the function was seen only as "a different loss" at
step 0. While a watch is open, the functions of ``torch.nn.functional`` that take a target (``LOSSES``) are
replaced by a wrapper that calls the function unchanged and, for a call made outside any module's forward (a loss
module's own call of the function is its module's, already recorded; a model computing its loss inside its
forward has its labels among its inputs, hashed with the batch), hands each open watch the call
(``Watch.functional_loss``): the settings as the module of that loss would keep them (``CrossEntropyLoss``, its
``reduction``, ``ignore_index``, ``label_smoothing`` with their defaults, a class weight) and its target hashed as a
module's is. So ``nn.CrossEntropyLoss()(out, y)`` and ``F.cross_entropy(out, y)`` record the same recipe.

Invisible to the script: the wrapper carries the function's name, module and signature (``functools.wraps``), so
``pickle`` stores a reference to ``torch.nn.functional.cross_entropy`` as without the watch; the originals are put
back when the last watch closes; under ``torch.compile`` tracing (or ``torch.export``, ``torch.jit.trace``) the
wrapper calls the function and nothing else. A name imported before the block
(``from torch.nn.functional import cross_entropy``) keeps the original and is not seen.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

# the functions of torch.nn.functional that compare an input with a target, and the loss module of each
LOSSES = {
    "cross_entropy": "CrossEntropyLoss", "nll_loss": "NLLLoss", "binary_cross_entropy": "BCELoss",
    "binary_cross_entropy_with_logits": "BCEWithLogitsLoss", "mse_loss": "MSELoss", "l1_loss": "L1Loss",
    "smooth_l1_loss": "SmoothL1Loss", "huber_loss": "HuberLoss", "kl_div": "KLDivLoss",
    "poisson_nll_loss": "PoissonNLLLoss", "gaussian_nll_loss": "GaussianNLLLoss",
    "soft_margin_loss": "SoftMarginLoss", "multilabel_soft_margin_loss": "MultiLabelSoftMarginLoss",
    "multilabel_margin_loss": "MultiLabelMarginLoss", "multi_margin_loss": "MultiMarginLoss",
    "hinge_embedding_loss": "HingeEmbeddingLoss", "cosine_embedding_loss": "CosineEmbeddingLoss",
    "margin_ranking_loss": "MarginRankingLoss",
}
# settings a module does not keep: deprecated switches folded into ``reduction``
_NOT_KEPT = {"size_average", "reduce"}
MAX_TARGETS_PER_STEP = 64  # the targets hashed per step (a loss called per time step is called thousands of times)
_MAX_WEIGHT = 16  # a class weight kept by value up to this many entries (as ``recipe.criterion_of``)
_ORIGINALS: dict[str, object] = {}
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or _exporting() or bool(torch._C._get_tracing_state())


def _wrap(name: str, fn, route):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def loss(*args, **kwargs):
        if not _tracing():
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # the function will say what is wrong with the call
                bound = None
            if bound is not None:
                route(name, bound)
        return fn(*args, **kwargs)

    loss.__wrapped_by_convcheck__ = True
    return loss


def install(route) -> None:
    """Replace the loss functions of ``torch.nn.functional`` by wrappers handing each call to ``route(name,
    bound_arguments)``; once, however many watches open."""
    if _ORIGINALS:
        return
    for name in LOSSES:
        fn = getattr(F, name, None)
        if fn is None or getattr(fn, "__wrapped_by_convcheck__", False):
            continue
        _ORIGINALS[name] = fn
        setattr(F, name, _wrap(name, fn, route))


def uninstall() -> None:
    """Put the original functions back (the last watch closed)."""
    for name, fn in _ORIGINALS.items():
        setattr(F, name, fn)
    _ORIGINALS.clear()


def criterion(name: str, bound: inspect.BoundArguments) -> tuple[dict, list]:
    """``({"class", "settings"}, tensors)``: the call as the loss module's recipe entry (``recipe.criterion_of``:
    the class, its settings with the function's defaults) and what it was given besides its first argument (the
    model's output): the target, and for a two-input loss the second input."""
    bound.apply_defaults()
    settings, given = {}, []
    for i, (key, value) in enumerate(bound.arguments.items()):
        if i == 0:
            continue
        if isinstance(value, torch.Tensor):
            if key == "weight" or key == "pos_weight":
                n = value.numel()
                settings[key] = ([round(float(x), 6) for x in value.detach().reshape(-1).tolist()]
                                 if n <= _MAX_WEIGHT else f"{n} values")
            else:
                given.append(value)
        elif key not in _NOT_KEPT and isinstance(value, (bool, int, float, str)):
            settings[key] = value
    return {"class": LOSSES[name], "settings": settings}, given
