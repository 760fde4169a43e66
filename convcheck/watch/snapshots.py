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
# a layer's non-floating tensor arguments (position ids, indices, masks), stored as they are (issue 43)
EXACT = {torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
         torch.bool: "bool"}
MAX_SPEC_DEPTH = 8  # nesting of a call's recorded arguments (``arg_spec``)
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
        self.specs: dict[str, dict] = {}  # "layer/k" -> the call's arguments as made (``arg_spec``)
        self.versions: dict[int, int] = {}  # each parameter's version when the snapshot took it
        self.stale: list[str] = []  # "layer/k": calls made after their parameters changed (an LBFGS closure, a GAN)
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

    def _put_exact(self, key: str, t: torch.Tensor) -> None:
        """A non-floating tensor argument, stored in its own dtype (no rounding: it is an index or a mask)."""
        size = t.numel() * t.element_size()
        if self.over is not None:
            self.over += size
            return
        if self.budget is not None and file_bound(self.held + size, len(self.arrays) + 1) > self.budget:
            self.over = self.held + size
            self.drop()
            return
        a = t.detach().to("cpu").contiguous().clone().numpy()
        self.arrays[key] = (a, EXACT[t.dtype])
        self.held += a.nbytes

    def take_call(self, layer: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], args=None,
                  kwargs=None, module=None) -> None:
        """One leaf call: its floating inputs (``in/``) and outputs (``out/``); with ``args``/``kwargs`` (the call
        as made), anything else it was given - integer or bool tensors (``arg/``), numbers, None, tuples, nested
        structures, keyword arguments - as ``arg_spec`` in the index (``specs``), so the judge replays the call as
        it was made."""
        k = self.calls.get(layer, 0)
        self.calls[layer] = k + 1
        if module is not None and self.params and any(
                self.versions.get(id(p), p._version) != p._version for p in module.parameters(recurse=False)):
            self.stale.append(f"{layer}/{k}")  # its weights are not the snapshot's: the judge leaves the call out
        for i, t in enumerate(inputs):
            self._put(f"in/{layer}/{k}/{i}", t)
        for i, t in enumerate(outputs):
            self._put(f"out/{layer}/{k}/{i}", t)
        if args is not None:
            spec = arg_spec(args, kwargs or {})
            if not spec["plain"]:
                for j, t in enumerate(spec.pop("exact")):
                    self._put_exact(f"arg/{layer}/{k}/{j}", t)
                spec.pop("plain")
                self.specs[f"{layer}/{k}"] = spec

    def take_params(self, params) -> None:
        self.params = True
        for n, p in params:
            self.versions[id(p)] = p._version
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
        self.specs.clear()
        self.stale.clear()
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
        if self.specs:
            entry["calls"] = dict(self.specs)
        if self.stale:
            entry["stale_calls"] = list(self.stale)
        self.drop()
        return entry


def arg_spec(args, kwargs: dict) -> dict:
    """A call's arguments as JSON: ``{"args": [...], "kwargs": {...}, "plain", "exact"}``. Each floating tensor
    is ``{"in": i}`` (the i-th floating tensor, in the order ``producers.floats`` lists them: ``in/layer/k/i``),
    a non-floating one ``{"arg": j, "dtype"}`` (``arg/layer/k/j``, kept in ``exact``), a number, string, bool or
    None ``{"v": value}`` (a non-finite float as its text), a tuple/list/dict ``{"tuple"|"list"|"dict": ...}``, a
    dtype or device by name; anything else ``{"opaque": its type}`` (the replay says it cannot rebuild it).
    ``plain``: the call took its floating tensors only, positionally (no spec needed)."""
    counts = {"in": 0}
    exact: list = []

    def enc(o, depth: int):
        if isinstance(o, torch.Tensor):
            if o.dtype in STORED:
                counts["in"] += 1
                return {"in": counts["in"] - 1}
            if o.dtype in EXACT:
                exact.append(o)
                return {"arg": len(exact) - 1, "dtype": EXACT[o.dtype]}
            return {"opaque": f"a {str(o.dtype)[6:]} tensor"}
        if o is None or isinstance(o, (bool, int, str)):
            return {"v": o}
        if isinstance(o, float):
            return {"v": o} if o == o and abs(o) != float("inf") else {"float": repr(o)}
        if isinstance(o, torch.dtype):
            return {"dtype": str(o)[6:]}
        if isinstance(o, torch.device):
            return {"device": str(o)}
        if depth >= MAX_SPEC_DEPTH:
            return {"opaque": "a structure nested deeper than recorded"}
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return {"tuple": [enc(x, depth + 1) for x in o]}
        if isinstance(o, list):
            return {"list": [enc(x, depth + 1) for x in o]}
        if isinstance(o, dict) and all(isinstance(k, str) for k in o):
            return {"dict": {k: enc(v, depth + 1) for k, v in o.items()}}
        return {"opaque": type(o).__name__[:60]}

    spec_args = [enc(a, 0) for a in args]
    spec_kwargs = {str(k): enc(v, 0) for k, v in kwargs.items()}
    plain = not spec_kwargs and all(set(a) == {"in"} for a in spec_args)
    return {"args": spec_args, "kwargs": spec_kwargs, "plain": plain, "exact": exact}
