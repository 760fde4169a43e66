"""Which kernels a target's pass ran: whether an identical rerun can differ from it.

The run-to-run check (``parity.self_difference``) costs one more forward/backward of the
target: a quarter of ResNet-18's parity step on the CPU. PyTorch documents which of its
kernels may give a different result for the same input on the CPU
(``torch.use_deterministic_algorithms``: ``index_put`` with or without accumulation, which
``x[idx]``'s backward uses; ``put_``; ``index_copy``; ``MaxUnpool``); every other aten kernel
on the CPU gives bitwise the same result again at the same thread count. So a CPU pass whose
every operator is an aten kernel off that list is not rerun. Anything else is: another
device (atomics, autotuned algorithms), an operator from another namespace (an extension's
or a custom op, whose kernel nobody here has read), or one on the list.

What the kernel list cannot see is nondeterminism *between* kernels, in Python: code whose
order of operations changes run to run (summing a ``set`` of tensors, threads) - the
rerun would catch it; the CPU shortcut does not.

``KernelsSeen`` is a dispatch mode over the target's own forward and backward; the
measurements parity makes in its hooks run with it popped (``paused``), so neither their
operators nor the mode's per-operator cost are counted.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators PyTorch documents as nondeterministic on the CPU (use_deterministic_algorithms)
CPU_NONDETERMINISTIC = frozenset({
    "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put",
    "put", "put_", "index_copy", "index_copy_", "max_unpool2d", "max_unpool3d",
})


class KernelsSeen(TorchDispatchMode):
    """Records every operator dispatched inside it (``ops``: overload packets)."""

    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self):
        """The mode popped while parity measures (only when it is the innermost mode)."""
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
        except ImportError:  # pragma: no cover - a torch without them: count the measurements too
            yield
            return
        if _get_current_dispatch_mode() is not self:
            yield
            return
        with _pop_mode_temporarily():
            yield

    def rerun_needed(self, device: torch.device) -> bool:
        """Whether a rerun of the same pass can differ: not for a CPU pass of documented-deterministic
        aten kernels only."""
        if device.type != "cpu" or not self.ops:
            return True
        return any(getattr(op, "_qualified_op_name", "").split("::")[0] != "aten"
                   or op.__name__ in CPU_NONDETERMINISTIC for op in self.ops)
