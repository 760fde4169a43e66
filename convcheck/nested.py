"""The one walk over nested tensors: a batch, a call's arguments, a model's output.

Walked: tuples (named tuples too) and lists in their order, dicts by their values; anything else (a number,
a string, None, a dataclass) holds no tensor. Every tensor counts, whatever its dtype; a caller that wants
the floating ones filters them (``t.is_floating_point()``).

A dict's values come in its own order, or with ``sort_keys`` in the order of its keys as strings: what a
batch's hash reads (``batch.batch_hash``, the watch's ``batch_hash``), so that two runs building one dict
in another order hash alike.
"""

from __future__ import annotations

from typing import Callable

import torch


def tensors_in(obj, *, sort_keys: bool = False) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first (a dict's values in its order, or by ``str(key)`` with ``sort_keys``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o, sort_keys=sort_keys)]
    if isinstance(obj, dict):
        values = [obj[k] for k in sorted(obj, key=str)] if sort_keys else obj.values()
        return [t for o in values for t in tensors_in(o, sort_keys=sort_keys)]
    return []


def first_tensor(obj) -> torch.Tensor | None:
    """The first tensor of ``obj`` (``tensors_in``'s order), or None."""
    found = tensors_in(obj)
    return found[0] if found else None


def map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``obj`` with every tensor replaced by ``fn(tensor)`` (tuples, lists and dicts kept; a named tuple comes
    back a plain tuple)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
