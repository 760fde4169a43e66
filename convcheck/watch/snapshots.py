"""A snapshot step: every leaf layer's floating inputs and outputs, the parameters (as the step's
forward saw them) and their gradients (before the optimizer used them), held until the step ends and
then written as one ``snapshots/step_NNNNN.npz``. Copies are taken on the CPU; nothing is changed.

Cost (issue 25: a snapshot step <= 3x a bare step, memory bounded by the snapshot): a tensor seen
twice at the same version (a layer's output is the next layer's input; an in-place ReLU's input is its
output) is copied and written once, the other keys naming it (``same_as`` in the index); each array is
copied once (to float32 for half types, else a plain copy) and written from its own memory into the
archive. The taker holds at most ``budget`` bytes: past it, it drops what it holds and only counts, so
the step is skipped with its size (``over``), never half-written and never held whole in memory."""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
import zipfile

import numpy as np
import torch

STORED = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
          torch.float16: torch.float32}
MEMBER_SLACK = 512  # an .npz member's zip headers and .npy header: a bound, so the cap is never passed
FILE_SLACK = 4096


def _copy(t: torch.Tensor) -> tuple[np.ndarray, str] | None:
    if t.dtype not in STORED:
        return None
    src = t.detach()
    c = src.to("cpu", dtype=STORED[t.dtype]).contiguous()
    if c.data_ptr() == src.data_ptr():  # the same memory: the value may still change, so copy it once
        c = c.clone()
    return c.numpy(), str(t.dtype)[6:]


def _identity(t: torch.Tensor) -> tuple:
    """Which tensor memory and which state of it: the same key means the same values."""
    return (t.device.type, t.data_ptr(), t._version, t.dtype, tuple(t.shape), tuple(t.stride()))


def file_bound(nbytes: int, members: int) -> int:
    """The most an ``.npz`` of ``members`` arrays holding ``nbytes`` in all can take on disk."""
    return nbytes + MEMBER_SLACK * members + FILE_SLACK


def file_sha256(path) -> str:
    """The SHA-256 of a written file, read back in 1 MiB pieces (``diff`` checks it: a changed snapshot is
    refused, never diagnosed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


class SnapshotTaker:
    """Collects one step's arrays; ``write`` saves them and returns the index entry."""

    def __init__(self, names: dict, partial: str | None = None, budget: int | None = None):
        self.arrays: dict[str, tuple[np.ndarray, str]] = {}
        self.same_as: dict[str, str] = {}
        self.seen: dict[tuple, tuple] = {}  # identity -> (first key, a weak reference to the tensor:
        # once it is gone, its memory may hold another tensor with the same identity, so no match)
        self.calls: dict[str, int] = {}
        self.params = False
        self.grads = False
        self.partial = partial
        self.budget = budget
        self.held = 0  # bytes of the arrays held
        self.over: int | None = None  # past the budget: the bytes the snapshot would have taken

    def _put(self, key: str, t: torch.Tensor) -> None:
        if t.dtype not in STORED:
            return
        ident = _identity(t)
        first = self.seen.get(ident)
        if first is not None and first[1]() is not None:
            self.same_as[key] = first[0]
            return
        self.seen[ident] = (key, weakref.ref(t))
        size = t.numel() * (8 if STORED[t.dtype] == torch.float64 else 4)
        if self.over is not None:
            self.over += size
            return
        if self.budget is not None and file_bound(self.held + size, len(self.arrays) + 1) > self.budget:
            self.over = self.held + size
            self.drop()  # let go of it now: memory stays bounded by the budget
            return
        got = _copy(t)
        self.arrays[key] = got
        self.held += got[0].nbytes

    def take_call(self, layer: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        k = self.calls.get(layer, 0)
        self.calls[layer] = k + 1
        for i, t in enumerate(inputs):
            self._put(f"in/{layer}/{k}/{i}", t)
        for i, t in enumerate(outputs):
            self._put(f"out/{layer}/{k}/{i}", t)

    def take_params(self, params) -> None:
        self.params = True
        for n, p in params:
            self._put(f"param/{n}", p)

    def take_grads(self, params) -> None:
        self.grads = True
        for n, p in params:
            if p.grad is not None:
                self._put(f"grad/{n}", p.grad)

    def nbytes(self) -> int:
        """What the file will take at most (or, past the budget, what it would have taken)."""
        if self.over is not None:
            return file_bound(self.over, len(self.seen))
        return file_bound(self.held, len(self.arrays))

    def drop(self) -> None:
        self.arrays.clear()
        self.held = 0

    def write(self, folder, step: int) -> dict:
        keys = sorted(self.arrays)
        member = {k: f"a{i:05d}" for i, k in enumerate(keys)}
        rel = f"snapshots/step_{step:05d}.npz"
        path = folder / f"step_{step:05d}.npz"
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        try:  # each array written from its own memory (no chunked copies), renamed into place when whole
            with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                for k in keys:
                    a = self.arrays[k][0]
                    with z.open(member[k] + ".npy", "w", force_zip64=True) as m:
                        np.lib.format.write_array_header_1_0(m, np.lib.format.header_data_from_array_1_0(a))
                        if a.nbytes:
                            m.write(memoryview(a.reshape(-1)).cast("B"))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        arrays = [{"key": k, "shape": list(self.arrays[k][0].shape), "dtype": self.arrays[k][1]} for k in keys]
        for k, first in sorted(self.same_as.items()):
            if first in self.arrays:
                arrays.append({"key": k, "shape": list(self.arrays[first][0].shape),
                               "dtype": self.arrays[first][1], "same_as": first})
        entry = {"step": step, "file": rel, "bytes": path.stat().st_size, "sha256": file_sha256(path),
                 "partial": self.partial, "arrays": arrays}
        self.drop()
        return entry
