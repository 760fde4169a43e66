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
from typing import Callable

import torch

from convcheck.errors import UsageError

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


def map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``obj`` with every tensor replaced by ``fn(tensor)`` (tuples, lists and dicts kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in a stable order (dict keys sorted)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in tensors_of(obj[k])]
    return []


def call_model(model, inputs):
    """``model(x)``, ``model(*inputs)`` or ``model(**inputs)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_size_of(inputs) -> int:
    found = tensors_of(inputs)
    return int(found[0].shape[0]) if found and found[0].dim() > 0 else 1


def batch_hash(inputs, target) -> str:
    """SHA-256 over the bytes of every tensor of the batch (inputs, then target), on the CPU."""
    h = hashlib.sha256()
    for t in tensors_of(inputs) + tensors_of(target):
        t = t.detach().cpu().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.to(torch.uint8)
        h.update(memoryview(t.numpy()).cast("B"))
    return h.hexdigest()


def check_tensors(inputs, target, where: str) -> None:
    """Every tensor of a batch on the CPU; at least one input tensor."""
    if not tensors_of(inputs):
        raise UsageError(f"{where} yielded a batch whose inputs hold no tensor")
    for t in tensors_of(inputs) + tensors_of(target):
        if t.device.type != "cpu":
            raise UsageError(f"{where} yielded a tensor on {t.device}; make batches on the CPU "
                             "(convcheck moves them to each target)")
