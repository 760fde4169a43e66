"""What the watch hashes of each batch the model receives: its exact bytes (``batch_hash``) and, for a model cast to
a 16-bit format, the batch rounded to it (``rounded_hashes``), so that ``diff`` can tell the same data from
different data."""

from __future__ import annotations

import hashlib

import torch

from convcheck.nested import tensors_in
from convcheck.watch.layouts import describe, dense, parts


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """Every tensor of a call, in the order its hash reads them (a dict's by its keys: ``nested.tensors_in``)."""
    return tensors_in(args, sort_keys=True) + tensors_in(kwargs, sort_keys=True)


def _pieces(ts) -> list[tuple[str, torch.Tensor]]:
    """What a hash reads of ``ts``: a dense tensor as it is (its label ""), any other (a sparse adjacency, a nested
    tensor: ``layouts.py``) as its parts, each labelled with what it is a part of (``sparse_coo(20, 20)/values``),
    so its layout, size and every index and value count."""
    out = []
    for t in ts:
        if dense(t):
            out.append(("", t))
        else:
            whole = describe(t)
            out += [(f"{whole}/{name}", p) for name, p in parts(t)] or [(whole, None)]
    return out


def _memory(t: torch.Tensor):
    """The storage ``t`` lives in (its address), None for a tensor without one of its own."""
    return t.untyped_storage().data_ptr() if t.numel() and dense(t) else None


def data_tensors(args, kwargs, made=()) -> list[torch.Tensor]:
    """The tensors of a call that are *data*: every tensor of ``args`` and ``kwargs`` but those the process made
    with the model - one with an autograd history (a generator's fakes, an earlier output), or one sharing
    memory with an output of the model's previous call (``made``, held alive until now: a recurrent state
    carried over with ``.detach()``). Those differ between two runs whenever the runs' numerics do; they are
    not "different data"."""
    ptrs = {_memory(t) for t in made} - {None}
    return [t for t in _tensors(args, kwargs) if t.grad_fn is None and _memory(t) not in ptrs]


def batch_hash(args, kwargs) -> str:
    """SHA-256 over the dtype, shape and bytes of every tensor the model's forward received. The bytes
    are hashed in place (a buffer over the tensor's memory: no copy) when it is a contiguous CPU tensor."""
    h = hashlib.sha256()
    for label, t in _pieces(_tensors(args, kwargs)):
        if t is None:  # nothing readable in it (a meta tensor): what it is
            h.update(label.encode())
            continue
        c = t.detach().to("cpu").contiguous()
        h.update(f"{label}{c.dtype}{tuple(c.shape)}".encode())
        if c.numel():
            h.update(memoryview(c.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


ROUNDED = ("bfloat16", "float16", "float32")  # the formats a cast model's batch is also hashed in (float32: a float64 twin)
ROUNDED_SAMPLE = 1 << 18  # the most elements of one floating tensor ``rounded_hashes`` reads


def rounded_hashes(args, kwargs) -> dict[str, str] | None:
    """``{"bfloat16": sha, "float16": sha, "float32": sha}``: SHA-256 of the batch with every floating tensor rounded to
    that format (its dtype hashed as "float"; other tensors as ``batch_hash`` does), so that a model cast
    to bfloat16 or float16 (or a float64 twin of a float32 run), fed ``x.to(dtype)``, is seen to receive the same data as a float32 run of it.
    A floating tensor of more than ``ROUNDED_SAMPLE`` elements is read at that many evenly spaced ones
    (its shape hashed whole): another shuffle, seed or augmentation changes nearly every element, and
    runs of one dtype are still compared element by element by ``batch_hash``; an ImageNet batch of 64
    costs a copy of 0.5 MB, not 19 MB, off a GPU. None when the batch holds no floating tensor (the
    exact hash says it all)."""
    pieces = [(label, t.detach()) for label, t in _pieces(_tensors(args, kwargs)) if t is not None]
    if not any(t.is_floating_point() for _, t in pieces):
        return None
    read = [_sample(t) if t.is_floating_point() else t for _, t in pieces]
    out = {}
    for fmt in ROUNDED:
        dtype, h = getattr(torch, fmt), hashlib.sha256()
        for (label, t), r in zip(pieces, read):
            c = (r.to(dtype) if t.is_floating_point() else r).to("cpu").contiguous()
            h.update(f"{label}{'float' if t.is_floating_point() else c.dtype}{tuple(t.shape)}".encode())
            if c.numel():
                h.update(memoryview(c.view(-1).view(torch.uint8).numpy()))
        out[fmt] = h.hexdigest()
    return out


def _sample(t: torch.Tensor) -> torch.Tensor:
    """``t``, or at most ``ROUNDED_SAMPLE`` evenly spaced elements of it, flattened (the same ones for
    every tensor of its size)."""
    n = t.numel()
    if n <= ROUNDED_SAMPLE:
        return t
    return t.reshape(-1)[::-(-n // ROUNDED_SAMPLE)]
