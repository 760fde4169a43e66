"""Whether a target's pass can differ from an identical rerun: which kernels the model runs.

The run-to-run check (``parity.self_difference``) costs one more forward/backward of the
target: a quarter of ResNet-18's parity step on the CPU. PyTorch documents which of its
kernels may give a different result for the same input on the CPU
(``torch.use_deterministic_algorithms``: ``index_put`` with or without accumulation, which
``x[idx]``'s backward uses; ``put_``; ``index_copy``; ``MaxUnpool``); every other aten kernel
on the CPU gives bitwise the same result again at the same thread count. So a CPU target is
not rerun when every operator of the model's forward is an aten kernel off that list and
none has a listed backward (advanced indexing, ``aten.index``, has). Anything else is rerun:
another device (atomics, autotuned algorithms), an operator from another namespace (an
extension's or a custom op, whose kernel nobody here has read), or one on the list.

The operators are those of the judge's forward, seen for free by the dispatch mode that
keeps its record (``snapshots.Snapshots``): every target runs the same model code (a target's
runner adds only deterministic casts and roundings). A ``torch.autograd.Function`` written in
Python has a backward nobody saw run, so its presence in the graph is a rerun too. What this cannot see: model code that
runs other operators at another precision, and nondeterminism *between* kernels, in Python -
code whose order of operations changes run to run (summing a ``set`` of tensors); the rerun
would catch that, the CPU shortcut does not.
"""

from __future__ import annotations

import torch

# aten operators PyTorch documents as nondeterministic on the CPU (use_deterministic_algorithms),
# and forward operators whose backward is one of them (``index``: x[idx]'s backward is
# index_put with accumulation)
CPU_NONDETERMINISTIC = frozenset({
    "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put",
    "put", "put_", "index_copy", "index_copy_", "max_unpool2d", "max_unpool3d",
    "index", "_unsafe_index",
})
_BACKWARD_ONLY = frozenset({"index", "_unsafe_index"})  # deterministic themselves: only a gradient's matters


def operator_of(func, args: tuple):
    """What ``rerun_needed`` reads of one dispatched operator: its overload packet, or None for an
    indexing of a tensor that can have no gradient (the labels' ``target[target != -100]``)."""
    packet = func._overloadpacket
    if packet.__name__ in _BACKWARD_ONLY and not (args and isinstance(args[0], torch.Tensor)
                                                   and args[0].is_floating_point()):
        return None
    return packet


PYTHON_BACKWARD = "a torch.autograd.Function's backward"  # Python no dispatch mode sees run in the forward


def python_backward(loss: torch.Tensor) -> bool:
    """Whether the graph behind ``loss`` holds a ``torch.autograd.Function`` written in Python: its
    backward runs operators the forward never showed (``rerun_needed`` then reruns)."""
    seen, stack = set(), [getattr(loss, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def rerun_needed(ops: set, device: torch.device) -> bool:
    """Whether a rerun of a pass on ``device`` whose model runs ``ops`` (operator overload packets)
    can differ from it: not for a CPU pass of documented-deterministic aten kernels only."""
    if device.type != "cpu" or not ops:
        return True
    return any(op is not None and (getattr(op, "_qualified_op_name", "").split("::")[0] != "aten"
                                   or op.__name__ in CPU_NONDETERMINISTIC) for op in ops)
