"""Tensors that are not one block of strided memory, as the watch reads them.

The watch hashes, measures and copies a tensor through its memory (``data_ptr``, ``untyped_storage``,
``.view(torch.uint8).numpy()``): a sparse adjacency passed to a graph network's forward (``to_sparse()``,
``torch.sparse_coo_tensor``, CSR), a nested tensor, a quantized or a meta tensor, or a wrapper subclass (one with
its own ``__torch_dispatch__``: no storage of its own) has none of that, and each of those calls raised inside the
watch's hooks - stopping the user's loop (a GCN trained fine without the watch).

``dense``: whether the watch may read ``t`` as it reads every tensor (the fast path: a plain tensor, or a subclass
keeping torch's own dispatch, strided). For the others:

- ``parts``: the dense tensors that say what ``t`` holds, for a batch's hash - a sparse COO tensor's indices and
  values once coalesced (two runs building it in another order hash alike), a compressed one's compressed
  indices, plain indices and values, a nested tensor's components, a quantized one's integers and its scales and
  zero points, a wrapper subclass's inner tensors (``__tensor_flatten__``); a meta tensor holds none;
- ``stand_in``: the dense floating tensor a layer's statistics and NaN/Inf checks read in its place (the values;
  a nested tensor's components flattened end to end), detached, marked with ``STANDS_FOR`` so a snapshot does
  not keep it as the argument it is not (``snapshots.py``: the call's argument recorded as opaque, the reason in
  the entry's ``not_stored``); None when nothing can be read (a meta tensor).

Neither raises: a tensor whose parts cannot be read (a layout torch adds later) has none.
"""

from __future__ import annotations

import torch

STANDS_FOR = "_convcheck_stands_for"  # set on a stand-in (the watch's own tensor): what it is read for
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__
_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
               torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}
_own_dispatch: dict[type, bool] = {}  # a subclass -> whether it has a __torch_dispatch__ of its own


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is strided memory of its own: what the watch's hashes, statistics and snapshots read."""
    return (t.layout is _STRIDED and not (t.is_nested or t.is_meta or t.is_quantized)
            and (type(t) in _PLAIN or not _dispatches(type(t))))


def _dispatches(cls: type) -> bool:
    own = _own_dispatch.get(cls)
    if own is None:
        own = _own_dispatch[cls] = getattr(cls, "__torch_dispatch__", _DEFAULT_DISPATCH) is not _DEFAULT_DISPATCH
    return own


def kind(t: torch.Tensor) -> str:
    """What ``t`` is, in words: ``sparse_coo``, ``sparse_csr``, ``nested``, ``quantized``, ``meta``, or a subclass."""
    if type(t) not in _PLAIN and _dispatches(type(t)):
        return f"{type(t).__name__[:40]} (a tensor subclass)"
    if t.is_nested:
        return "nested"
    if t.is_quantized:
        return "quantized"
    if t.is_meta:
        return "meta"
    return str(t.layout).replace("torch.", "")


def describe(t: torch.Tensor) -> str:
    """``kind`` with, where it has one, the shape: what a hash reads before the parts (each hashed with its dtype)."""
    if t.is_nested:  # a ragged shape names its ragged size by a counter of the process (j1, j2...): each
        return kind(t)  # component's own shape is hashed with it
    try:
        shape = tuple(t.shape)
    except Exception:  # noqa: BLE001 - a shape torch cannot give
        shape = ()
    return f"{kind(t)}{shape}"


def parts(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The dense tensors that say what ``t`` holds, each with its name (``indices``, ``values``, ...); [] when none
    can be read."""
    try:
        found = _parts(t.detach(), 0)
    except Exception:  # noqa: BLE001 - a layout not known here: nothing read, never the user's loop's failure
        return []
    return [(name, p) for name, p in found if dense(p)]


def _parts(t: torch.Tensor, depth: int) -> list[tuple[str, torch.Tensor]]:
    if dense(t):
        return [("", t)]
    if depth > 4 or t.is_meta:
        return []
    if type(t) not in _PLAIN and _dispatches(type(t)):
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return []
        return [(f"{name}.{sub}".rstrip("."), p) for name in flatten()[0]
                for sub, p in _parts(getattr(t, name), depth + 1)]
    if t.layout is torch.sparse_coo:
        c = t.coalesce()
        return [("indices", c.indices()), ("values", c.values())]
    if t.layout in _COMPRESSED:
        first, second = _COMPRESSED[t.layout]
        return [(first, getattr(t, first)()), (second, getattr(t, second)()), ("values", t.values())]
    if t.is_nested:
        return [(str(i), c) for i, c in enumerate(t.unbind())]
    if t.is_quantized:
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            scale = torch.tensor([t.q_scale(), float(t.q_zero_point())], dtype=torch.float64)
        else:
            scale = torch.cat([t.q_per_channel_scales().double(), t.q_per_channel_zero_points().double()])
        return [("int_repr", t.int_repr()), ("scale", scale)]
    return []


def stand_in(t: torch.Tensor) -> torch.Tensor | None:
    """The dense floating tensor read in place of a non-dense floating ``t`` (its values), marked ``STANDS_FOR``;
    None when none can be read."""
    values = [p for _, p in parts(t) if p.is_floating_point()]
    if not values:
        return None
    try:  # a tensor object of the watch's own (a view, or a copy of a nested tensor's components)
        v = values[0].detach() if len(values) == 1 else torch.cat([p.reshape(-1) for p in values])
        setattr(v, STANDS_FOR, kind(t))
    except Exception:  # noqa: BLE001 - as ``parts``
        return None
    return v


def stands_for(t: torch.Tensor) -> str | None:
    """What a stand-in was read for (``kind`` of the tensor it stands for), None for any other tensor."""
    return getattr(t, STANDS_FOR, None)
