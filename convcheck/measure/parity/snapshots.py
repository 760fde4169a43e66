"""The judge's record of every call's tensors: views while they stay unchanged, copies once written.

Code between modules may change a recorded tensor in place (ResNet's ``out += identity`` on the
last BatchNorm's output), so the record cannot simply keep the tensors the forward made. Cloning
every one (as parity did) doubled the judge's activations at the peak of its pass: the record
and autograd's saved tensors are mostly the same values. ``Snapshots`` keeps a detached view of
each tensor instead and watches, with a dispatch mode over the judge's forward, every operator
that writes to a tensor (its schema says so: ``add_``, ``copy_``, an ``out=``): a recorded
tensor sharing storage with one about to be written is copied first, so the record holds the
value it had when recorded. One record per tensor and version, so a layer's input is the
previous layer's output record. The mode also notes every operator the forward runs
(``ops``: ``kernels`` decides from them whether a target needs a rerun).

What a dispatch mode cannot see is a write that bypasses PyTorch's operators (through a NumPy
array sharing the memory, say): the value recorded is then the one written.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from convcheck.measure.parity.kernels import operator_of
from convcheck.nested import tensors_in


class Snapshots(TorchDispatchMode):
    """``snap(t)``: ``t``'s value now, kept as a view until something writes to its memory."""

    def __init__(self):
        super().__init__()
        self._seen: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._views: dict[int, list[torch.Tensor]] = {}  # storage address -> records viewing it
        self.ops: set = set()  # every operator the forward ran (``kernels.rerun_needed`` reads them)

    def __call__(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        hit = self._seen.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        view = t.detach()
        self._seen[id(t)] = (t, t._version, view)
        if view.layout == torch.strided and view.numel():
            self._views.setdefault(_address(view), []).append(view)
        return view

    def clear(self) -> None:
        """Stop watching (the forward is over: nothing more is recorded or written)."""
        self._seen.clear()
        self._views.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.add(operator_of(func, args))
        if self._views and func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in tensors_in(value, sort_keys=True):
                        self._copy_out(t)
        return func(*args, **kwargs)

    def _copy_out(self, written: torch.Tensor) -> None:
        if written.layout != torch.strided:
            return
        for view in self._views.pop(_address(written), ()):
            view.data = view.clone()  # the record's own memory now; no version bump, no autograd


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
