"""Parity's measurements run outside the target's dispatch modes; the target's layer copies inside.

A target's forward and backward may run under dispatch modes: the runner's (``EmulateTF32``
rounds the float32 operands of every matmul and convolution). Parity's hooks run inside that forward and backward, so every operator of every measurement - the
float64 references and floors, the errors, the NaN counts - went through the modes' Python
dispatch too: 2,900 calls and half of cifar_cnn's emulate-tf32 parity step, to change nothing
(the modes touch float32 matmul/conv operands only, and the measurements are float64 or
element-wise). ``measuring`` pops every mode for the measurements; ``target`` pushes the
runner's back while the target's copy of a layer computes, so it computes as the target does.
"""

from __future__ import annotations

import contextlib


class TargetModes:
    """The dispatch modes of one target's pass, popped while parity measures."""

    def __init__(self):
        self._popped: list | None = None

    @contextlib.contextmanager
    def measuring(self):
        """Every dispatch mode popped (none there, nested calls, pre-dispatch modes: as they are)."""
        if self._popped is not None or not _plain_stack():
            yield
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes() as popped:  # innermost first
            self._popped = list(popped)
            try:
                yield
            finally:
                self._popped = None

    @contextlib.contextmanager
    def target(self):
        """Inside ``measuring``: the target's own modes pushed back, in their order."""
        modes = self._popped or []
        if not modes:
            yield
            return
        from torch.utils._python_dispatch import _pop_mode, _push_mode

        for m in reversed(modes):  # outermost first
            _push_mode(m)
        try:
            yield
        finally:
            for _ in modes:
                _pop_mode()


def _plain_stack() -> bool:
    """Whether the dispatch stack holds some modes, all ordinary (no pre-dispatch ones: export, tracing)."""
    try:
        from torch._C import _len_torch_dispatch_stack
        from torch._ops import _len_torch_dispatch_stack_pre_dispatch
    except ImportError:  # pragma: no cover - a torch without them: measure under the modes
        return False
    return _len_torch_dispatch_stack() > 0 and _len_torch_dispatch_stack_pre_dispatch() == 0
