"""Cheap exact forms of training's per-step statistics.

Every function here returns bit for bit what the plain expression in its docstring returns
(``tests/test_cheap_paths.py`` holds each against it); only the passes and allocations differ:

* a float64 copy of a float32 tensor made into a buffer that is reused (``Scratch``) costs about
  half a fresh one - a fresh 10-90 MB tensor is new memory the kernel faults in page by page -
  and the reduction that follows reads it from cache;
* a comparison written straight into a float32 buffer is vectorised, one into a bool tensor
  and then ``.float()`` is not (5x slower on a LeNet activation);
* ``torch.manual_seed`` queues a lazy seed (with a formatted stack) for every accelerator
  kind even where none exists: 0.3 ms per call, once per arm per step.

A reduction is only as exact as its order: each shortcut is taken for a contiguous tensor only
(its buffer holds the values in the same order), and the plain expression runs otherwise.
"""

from __future__ import annotations

import torch

_F64 = torch.float64
ALONE = 1 << 16  # a tensor this large has its float64 copy made in a reused buffer (and is a group of its own)
GROUP = 1 << 18  # most elements a group of smaller tensors holds (one copy, one subtraction, one norm call)


class Scratch:
    """Reusable flat buffers, one per (device, dtype, slot), grown to the largest request."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def like(self, t: torch.Tensor, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """A contiguous buffer shaped like ``t`` (its values are whatever was there)."""
        return self.flat(t.numel(), dtype, t.device, slot).view(t.shape)

    def flat(self, n: int, dtype: torch.dtype, device, slot: int = 0) -> torch.Tensor:
        """A 1-D buffer of ``n`` elements."""
        key = (torch.device(device), dtype, slot)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def drop(self, slot) -> None:
        """Let go of every buffer of ``slot`` (one needed only while the arms are built)."""
        self._bufs = {k: v for k, v in self._bufs.items() if k[2] != slot}


def norm64(t: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``torch.linalg.vector_norm(t, dtype=torch.float64)`` (which casts ``t`` to a new float64
    tensor first); for a large float32/16 tensor the float64 copy is made into ``scratch``."""
    if t.dtype == _F64 or t.numel() < ALONE or not t.is_floating_point() or t.is_complex() or not t.is_contiguous():
        return torch.linalg.vector_norm(t, dtype=_F64)
    return torch.linalg.vector_norm(scratch.like(t, _F64).copy_(t))


def zero_count(t: torch.Tensor, scratch: Scratch) -> int:
    """``t.numel() - int(torch.count_nonzero(t))``. For a large tensor: ``count_nonzero`` branches per
    element (10x slower on a tensor that is half zeros); an equality written into a float buffer and
    summed counts the same - every partial sum is an integer, exact in float32 up to 2**24 elements
    (float64 above)."""
    n = t.numel()
    if n < ALONE or not t.is_floating_point() or t.is_complex() or n >= 2 ** 53:
        return n - int(torch.count_nonzero(t))
    small = n <= 2 ** 24
    buf = scratch.like(t, torch.float32 if small else _F64, slot=2 if small else 1)
    return int(torch.eq(t, 0, out=buf).sum())


def fraction_le_zero(out: torch.Tensor, scratch: Scratch) -> float:
    """``float((out <= 0).float().mean())``, the comparison written into a reused float32 buffer."""
    if not out.is_contiguous():
        return float((out <= 0).float().mean())
    return float(torch.le(out, 0, out=scratch.like(out, torch.float32, slot=2)).mean())


def fraction_abs_above(x: torch.Tensor, limit: float, scratch: Scratch) -> float:
    """``float((x.abs() > limit).float().mean())``, the comparison written into a reused buffer."""
    a = x.abs()
    if not a.is_contiguous():
        return float((a > limit).float().mean())
    return float(torch.gt(a, limit, out=scratch.like(a, torch.float32, slot=2)).mean())


def seed_generators(seed: int) -> None:
    """``torch.manual_seed(seed)``; where no accelerator is available, only the CPU generator's
    (the accelerators' lazy seeds could never run there, and queueing them costs a stack trace each)."""
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


# --- float64 copies of many tensors, group by group ------------------------------------



def groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive indices of ``tensors``: each large one alone, the small ones together up to ``GROUP``
    elements. A LeNet's ten parameters make one group; a ResNet's large convolutions one each."""
    out: list[list[int]] = []
    total = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n >= ALONE or not out or total + n > GROUP or out[-1] and tensors[out[-1][-1]].numel() >= ALONE:
            out.append([i])
            total = n
        else:
            out[-1].append(i)
            total += n
    return out


def flat64(tensors: list[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensors`` cast to float64, one after the other in ``buf`` (1-D, their total size);
    a single float64 tensor is its own flat view."""
    if len(tensors) == 1 and tensors[0].dtype == _F64:
        return tensors[0].reshape(-1)
    torch._foreach_copy_(list(buf.split([t.numel() for t in tensors])), [t.reshape(-1) for t in tensors])
    return buf


def view_norms(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``torch.linalg.vector_norm`` of each consecutive piece of ``flat``: a contiguous piece reduces as the
    tensor it was copied from does (the same values in the same order). One call for all of them on the
    CPU, where ``_foreach_norm`` runs ``vector_norm`` on each (elsewhere it fuses them: one call each)."""
    pieces = flat.split(sizes)
    if flat.device.type == "cpu":
        return list(torch._foreach_norm(pieces, 2))
    return [torch.linalg.vector_norm(v) for v in pieces]


def norms_and_zeros(tensors: list[torch.Tensor], scratch: Scratch, zeros: bool = True):
    """``([float(vector_norm(t, dtype=float64)) ...], [t.numel() - count_nonzero(t) ...])`` (``None``
    without ``zeros``), one tensor at a time: for small tensors the plain calls are the cheapest
    (a fresh small copy is cheap, and a grouped copy, norm and count cost more than they save)."""
    norms = [float(norm64(t, scratch)) for t in tensors]
    return norms, [zero_count(t, scratch) for t in tensors] if zeros else None
