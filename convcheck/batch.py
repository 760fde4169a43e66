"""What a batch is: ``(inputs, target)``, where inputs and target may be a tensor, a tuple or a dict.

A data source may yield:

* ``(inputs, target)``: ``inputs`` a tensor (``model(x)``), a tuple/list
  (``model(*inputs)``) or a dict (``model(**inputs)``); ``target`` whatever the
  loss takes;
* a longer tuple ``(x1, x2, ..., target)``: ``model(x1, x2, ...)``;
* a dict with a ``target`` (or ``y``, ``label``, ``labels``) key: the other keys
  are the model's keyword inputs;
* a bare tensor: ``model(x)``, and the loss gets ``x`` as its target
  (reconstruction).

The loss always sees exactly what the model returned.
"""

from __future__ import annotations

import hashlib
import math

import torch

from convcheck.errors import UsageError
from convcheck.nested import tensors_in

TARGET_KEYS = ("target", "y", "label", "labels")


def split_batch(item, where: str = "the data") -> tuple[object, object]:
    """``(inputs, target)`` of one item a data source yielded."""
    if isinstance(item, torch.Tensor):
        return item, item
    if isinstance(item, dict):
        key = next((k for k in TARGET_KEYS if k in item), None)
        if key is None:
            raise UsageError(f"{where} yielded a dict without a target key ({', '.join(TARGET_KEYS)}): "
                             f"keys {', '.join(map(str, item))}")
        inputs = {k: v for k, v in item.items() if k != key}
        return inputs, item[key]
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        inputs = item[0] if len(item) == 2 else tuple(item[:-1])
        return inputs, item[-1]
    raise UsageError(f"{where} yielded {type(item).__name__}"
                     f"{' of length ' + str(len(item)) if isinstance(item, (tuple, list)) else ''}: expected "
                     "(inputs, target), a dict with a 'target' key, or a tensor")


def call_model(model, inputs):
    """``model(x)``, ``model(*inputs)`` or ``model(**inputs)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_size_of(inputs) -> int:
    found = tensors_in(inputs, sort_keys=True)
    return int(found[0].shape[0]) if found and found[0].dim() > 0 else 1


def batch_hash(inputs, target) -> str:
    """SHA-256 over the bytes of every tensor of the batch (inputs, then target), on the CPU."""
    h = hashlib.sha256()
    for t in tensors_in(inputs, sort_keys=True) + tensors_in(target, sort_keys=True):
        t = t.detach().cpu().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.to(torch.uint8)
        h.update(memoryview(t.numpy()).cast("B"))
    return h.hexdigest()


def check_tensors(inputs, target, where: str) -> None:
    """Every tensor of a batch on the CPU; at least one input tensor."""
    if not tensors_in(inputs, sort_keys=True):
        raise UsageError(f"{where} yielded a batch whose inputs hold no tensor")
    for t in tensors_in(inputs, sort_keys=True) + tensors_in(target, sort_keys=True):
        if t.device.type != "cpu":
            raise UsageError(f"{where} yielded a tensor on {t.device}; make batches on the CPU "
                             "(convcheck moves them to each target)")


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {str(obj.dtype).replace('torch.', '')} tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)) and obj:
        kinds = sorted({type(o).__name__ for o in obj})
        return f"a {type(obj).__name__} of {'/'.join(kinds)}"
    return f"a {type(obj).__name__}"


# an input value whose square overflows float32 (sqrt(3.4028235e38)): past it no float32 model computes with it
SQUARE_OVERFLOWS_FLOAT32 = math.sqrt(torch.finfo(torch.float32).max)


def check_batch(inputs, target, where: str, step: int = 0, *, class_labels: bool = False,
                num_classes: int | None = None, input_shape=None) -> None:
    """A batch checked at the edge, before any model or loss sees it: one ``UsageError`` naming the batch
    and the field, instead of torch's error deep inside a step (or a crash in convcheck's own code).

    Always: the inputs hold samples (not an empty batch), and every tensor of the batch (inputs and target)
    holds the same number of samples. ``input_shape`` (C, H, W) given: a single input tensor's samples have it.
    ``class_labels`` (the default cross-entropy loss on a classification model): the target is a tensor of
    integer class indices of shape (N,), or float class probabilities of shape (N, classes); indices inside
    ``0..num_classes-1`` (or -100, ignored)."""
    name = f"batch {step} of {where}"
    xs = tensors_in(inputs, sort_keys=True)
    lead = [t for t in xs if t.dim() > 0]
    if lead and int(lead[0].shape[0]) == 0:
        raise UsageError(f"{name} is empty: its inputs hold 0 samples (shape {tuple(lead[0].shape)})")
    sizes = {int(t.shape[0]) for t in lead}
    if len(sizes) > 1:
        raise UsageError(f"{name}: its input tensors hold different numbers of samples ({sorted(sizes)})")
    n = sizes.pop() if sizes else None
    ys = [t for t in tensors_in(target, sort_keys=True) if t.dim() > 0]
    if n is not None and target is not inputs:
        for t in ys:
            if int(t.shape[0]) != n:
                raise UsageError(f"{name}: the inputs hold {n} samples but the target {int(t.shape[0])} "
                                 f"(target shape {tuple(t.shape)})")
    if input_shape is not None and isinstance(inputs, torch.Tensor) and inputs.dim() == len(input_shape) + 1:
        if tuple(inputs.shape[1:]) != tuple(input_shape):
            got, want = "x".join(map(str, inputs.shape[1:])), "x".join(map(str, input_shape))
            raise UsageError(f"{name}: the inputs are samples of {got} but the model takes {want}")
    for t in xs:
        if t.is_floating_point() and t.numel():
            top = float(t.detach().abs().amax())
            if math.isfinite(top) and top > SQUARE_OVERFLOWS_FLOAT32:
                raise UsageError(f"{name}: its inputs reach {top:.3g}, past {SQUARE_OVERFLOWS_FLOAT32:.3g} (the "
                                 "square root of float32's largest): their squares - a variance, a norm - are Inf "
                                 "in float32 on any device; normalise the inputs")
    if not class_labels:
        return
    hint = "the default loss (cross-entropy) takes class indices; pass your loss with --loss FILE.py:fn"
    if target is inputs and isinstance(inputs, torch.Tensor):
        raise UsageError(f"{name} is a bare tensor (no labels): {hint} or yield (inputs, labels)")
    if not isinstance(target, torch.Tensor):
        raise UsageError(f"{name}: the target is {_describe(target)}, not a tensor of class indices; {hint}")
    if target.is_floating_point():
        if target.dim() == 2 and (num_classes is None or target.shape[1] == num_classes):
            return  # class probabilities (N, classes): cross-entropy takes them
        raise UsageError(f"{name}: the target is {_describe(target)}; {hint} (int64 labels of shape (N,)) "
                         "or class probabilities of shape (N, classes)")
    if target.dtype == torch.bool or target.is_complex():
        raise UsageError(f"{name}: the target is {_describe(target)}, not class indices; {hint}")
    if target.dim() == 2:
        raise UsageError(f"{name}: the target is {_describe(target)}, not one class index per sample (shape "
                         f"(N,)); {hint}")
    labels = target[target != -100]
    if num_classes is not None and labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            raise UsageError(f"{name}: the target's labels span {lo}..{hi}, outside 0..{num_classes - 1} for "
                             f"{num_classes} classes")
