"""A snapshot step: every leaf layer's floating inputs and outputs, the parameters (as the step's
forward saw them) and their gradients (before the optimizer used them), held until the step ends and
then written as one ``snapshots/step_NNNNN.npz``. Copies are taken on the CPU; nothing is changed."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch


STORED = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
          torch.float16: torch.float32}


def _copy(t: torch.Tensor) -> tuple[np.ndarray, str] | None:
    if t.dtype not in STORED:
        return None
    return t.detach().to("cpu", dtype=STORED[t.dtype]).contiguous().numpy().copy(), str(t.dtype)[6:]


class SnapshotTaker:
    """Collects one step's arrays; ``write`` saves them and returns the index entry."""

    def __init__(self, names: dict, partial: str | None = None):
        self.arrays: dict[str, tuple[np.ndarray, str]] = {}
        self.calls: dict[str, int] = {}
        self.params = False
        self.grads = False
        self.partial = partial

    def _put(self, key: str, t: torch.Tensor) -> None:
        got = _copy(t)
        if got is not None:
            self.arrays[key] = got

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
        return sum(a.nbytes for a, _ in self.arrays.values())

    def write(self, folder, step: int) -> dict:
        keys = sorted(self.arrays)
        rel = f"snapshots/step_{step:05d}.npz"
        path = folder / f"step_{step:05d}.npz"
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        try:  # streamed to the file (no second copy in memory), renamed into place
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **{f"a{i:05d}": self.arrays[k][0] for i, k in enumerate(keys)})
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        data_len = path.stat().st_size
        entry = {"step": step, "file": rel, "bytes": data_len, "partial": self.partial,
                 "arrays": [{"key": k, "shape": list(self.arrays[k][0].shape), "dtype": self.arrays[k][1]}
                            for k in keys]}
        self.arrays.clear()
        return entry
