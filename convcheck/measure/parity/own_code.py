"""The own code of a module with children: what its ``forward`` computes besides calling them.

Attention (``bmm``, scaling, ``softmax``), a residual ``out += identity``, ``torch.cat`` or
``F.interpolate`` between child calls, normalisation written by hand around child convs: all of
it runs in the parent's ``forward``. It is measured like a leaf, on the judge's values at every
boundary: a *replay* of the module runs its own ``forward`` for real while each direct child
returns the judge's recorded output for that call (cast as the target's child returned it)
instead of computing. What the own code produces is its module's output *and* every input it
hands a child; each is held against the judge's value there (``points``).

The floor of own code is the same replay in float64 on the values as the target received them,
with the operands of every matmul/convolution it runs rounded to the target's precision for that
op class (TF32, autocast's 16-bit cast), each point rounded to the dtype the target produced.

A point that is a child's replayed output or the module's input passed on unchanged (a
``Sequential``, ``torch.flatten``) is nothing of the module's own and is skipped; a module with
no point of its own (a plain container) gets no row.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from convcheck.capture import hooks_suspended
from convcheck.nested import map_tensors, tensors_in
from convcheck.targets.runners.precision import PrecisionModel, dtype_unit_roundoff, round_to

# --- the replay -----------------------------------------------------------------------------

_REPLAY_CLASSES: dict[type, type] = {}


def _replay_forward(self, *args, **kwargs):
    i = self._replay_next
    if i >= len(self._replay_outputs):
        raise Diverged(f"'{self._replay_name}' called more often than in the recorded run")
    self._replay_next += 1
    self._replay_sink(i, self, args)
    return self._replay_hand_out(self._replay_outputs[i])


def _replay_class(cls: type) -> type:
    if cls not in _REPLAY_CLASSES:
        _REPLAY_CLASSES[cls] = type(f"Replay{cls.__name__}", (cls,), {"forward": _replay_forward})
    return _REPLAY_CLASSES[cls]


_BOOKKEEPING = [0]


@contextlib.contextmanager
def _bookkeeping():
    """The replay's own tensor handling (conversions, fresh copies): not the module's code, so
    ``FirstNonfinite`` does not count it."""
    _BOOKKEEPING[0] += 1
    try:
        yield
    finally:
        _BOOKKEEPING[0] -= 1


class Diverged(Exception):
    """The own code took another path than in the recorded run (nothing to compare)."""


# What a replay may raise on code it cannot re-run on recorded values (it is then not measured):
# another path, an attribute a replayed child lacks, a shape or dtype the code did not expect.
REPLAY_FAILURES = (Diverged, RuntimeError, TypeError, AttributeError, IndexError, KeyError, ValueError)


def _without_hooks(m: nn.Module) -> None:
    for k, v in list(m.__dict__.items()):
        if "hooks" in k and isinstance(v, dict):
            m.__dict__[k] = OrderedDict()


def _shell(module: nn.Module, convert) -> nn.Module:
    """A shallow copy of ``module``: its own parameters and buffers converted, no hooks, children shared."""
    shell = copy.copy(module)
    _without_hooks(shell)
    shell._parameters = {k: None if p is None else convert(p.detach()) for k, p in module._parameters.items()}
    shell._buffers = {k: None if b is None else convert(b) for k, b in module._buffers.items()}
    shell._modules = dict(module._modules)
    return shell


def child_attribute(parent: str, child: str) -> str:
    """A child's attribute name in its parent, from the two module names (the root's children
    are named without a prefix)."""
    return child[len(parent) + 1:] if child.startswith(parent + ".") else child


def plain_container(module: nn.Module) -> bool:
    """A module whose ``forward`` is ``nn.Sequential``'s own: it only chains its children."""
    return type(module).forward is nn.Sequential.forward


class Replay:
    """One run of ``module``'s own code: its direct children hand out ``outputs`` (per attribute,
    in call order: functions making the value to hand out, so only the values in use are held) and
    record what they are handed. ``convert`` maps the module's arguments, parameters and buffers
    to the run's precision and device."""

    def __init__(self, module: nn.Module, outputs: dict[str, list], convert):
        self.convert = convert
        self.fed: list[tuple[str, int, list]] = []  # (child, call index, own values handed to it)
        self._handed: list[tuple[weakref.ref, int]] = []
        self.shell = _shell(module, convert)
        for attr, outs in outputs.items():
            child = module._modules.get(attr)
            if child is None:
                raise Diverged(f"'{attr}' is not a direct child")
            stub = _shell(child, convert)
            stub.__class__ = _replay_class(type(child))
            stub._replay_outputs = outs
            stub._replay_next, stub._replay_name = 0, attr
            stub._replay_sink = self._sink
            stub._replay_hand_out = self._hand_out
            self.shell._modules[attr] = stub

    def _sink(self, i: int, stub, args) -> None:
        # decided now: a value the own code changes in place later was handed over as it is now
        self.fed.append((stub._replay_name, i, self._own(tensors_in(args))))

    def _own(self, tensors: list) -> list:
        return [None if not t.is_floating_point() or self.passed_on(t) else t for t in tensors]

    def _hand_out(self, make):
        with _bookkeeping():
            out = make()
            for t in tensors_in(out):
                self._handed.append((weakref.ref(t), t._version))
        return out

    def __call__(self, args: tuple, kwargs: dict):
        with _bookkeeping():
            args = tuple(map_tensors(a, self._converted) for a in args)
            kwargs = {k: map_tensors(v, self._converted) for k, v in kwargs.items()}
        for t in tensors_in(list(args) + list(kwargs.values())):
            self._handed.append((weakref.ref(t), t._version))
        with hooks_suspended():
            out = self.shell.forward(*args, **kwargs)
        return out

    def _converted(self, t: torch.Tensor) -> torch.Tensor:
        """An argument as the run takes it, never the caller's storage (the code may change it in place)."""
        c = self.convert(t)
        return c.clone() if c.data_ptr() == t.data_ptr() and c.numel() else c

    def passed_on(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a value the own code was handed (or a view of one), unchanged."""
        for ref, version in self._handed:
            h = ref()
            if h is not None and (t is h or t._base is h) and t._version == version:
                return True
        return False


def run_own_code(module: nn.Module, args: tuple, kwargs: dict, children: list[tuple[str, object]],
                 convert=lambda t: t.detach()) -> list[torch.Tensor | None]:
    """Run ``module``'s own code once: ``children`` are ``(attribute, make)`` per child call in call
    order, ``make()`` the value that call hands back (a new tensor: the code may change it in
    place). Returns what it produced: the tensors it fed each child call, then its output; None
    for a value passed on unchanged (nothing of its own). Raises ``Diverged`` when the code takes
    another path."""
    outputs: dict[str, list] = {}
    for attr, make in children:
        outputs.setdefault(attr, []).append(make)
    with _bookkeeping():
        replay = Replay(module, outputs, convert)
    out = replay(args, kwargs)
    if [(a, i) for a, i, _ in replay.fed] != _call_indices([attr for attr, _ in children]):
        raise Diverged("the children were called in another order")
    return [t for _, _, fed in replay.fed for t in fed] + replay._own(tensors_in(out))


def _call_indices(order: list[str]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    out = []
    for attr in order:
        out.append((attr, seen.get(attr, 0)))
        seen[attr] = seen.get(attr, 0) + 1
    return out


def judge_points(children_inputs: list[tuple], output) -> list[torch.Tensor]:
    """The judge's values at the same points: the inputs it fed each child call, then its output."""
    return [t for inputs in children_inputs for t in tensors_in(inputs)] + tensors_in(output)




# --- the floor's rounding and the probe for the first non-finite op --------------------------

_MATMUL = _CONV = None


def _op_classes():
    global _MATMUL, _CONV
    if _MATMUL is None:
        aten = torch.ops.aten
        _MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
        _CONV = {aten.convolution.default}
    return _MATMUL, _CONV


class RoundOperands(TorchDispatchMode):
    """Round the operands of every matmul and convolution to the target's operand precision for
    that op class (in their own float64 dtype): the floor's "exact arithmetic on rounded operands"."""

    def __init__(self, precision: PrecisionModel):
        super().__init__()
        self.precision = precision
        self.rounded = False  # whether a matmul/convolution ran (its operands rounded) under the mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        matmul, conv = _op_classes()
        if func in matmul or func in conv:
            self.rounded = True
            fmt = self.precision.of("matmul" if func in matmul else "conv").operand
            args = tuple(round_to(a, fmt) if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)
        return func(*args, **(kwargs or {}))


def rounds_operands(precision: PrecisionModel, dtype: torch.dtype) -> bool:
    """Whether a matmul/conv at this precision reads its operands coarser than ``dtype`` holds them."""
    u = dtype_unit_roundoff(dtype)
    return precision.matmul.operand.unit_roundoff > u or precision.conv.operand.unit_roundoff > u


class FirstNonfinite(TorchFunctionMode):
    """Watch every torch call: the first whose floating result holds NaN/Inf while its floating
    inputs are finite (``found``: (index among floating results, op name)); with ``at``, the
    largest magnitude of the ``at``-th floating result (``absmax``)."""

    def __init__(self, at: int | None = None):
        super().__init__()
        self.index, self.at = 0, at
        self.found: tuple[int, str] | None = None
        self.absmax = float("nan")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _BOOKKEEPING[0]:
            return out
        results = [t for t in tensors_in(out) if t.is_floating_point()]
        if not results:
            return out
        if self.at is not None and self.index == self.at:
            self.absmax = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in results)
        if self.found is None and not all(_finite(t) for t in results):
            ins = [t for t in tensors_in((list(args), list((kwargs or {}).values()))) if t.is_floating_point()]
            if all(_finite(t) for t in ins):
                self.found = (self.index, op_name(func))
        self.index += 1
        return out


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.detach()).all()) if t.numel() else True


def op_name(func) -> str:
    """``torch.bmm`` -> ``bmm``; ``Tensor.__iadd__`` -> ``add_``; ``Tensor.__mul__`` -> ``mul``."""
    name = getattr(func, "__name__", str(func))
    if name.startswith("__i") and name.endswith("__"):
        return name[3:-2] + "_"
    if name.startswith("__r") and name.endswith("__") and name not in ("__repr__",):
        return name[3:-2]
    return name.strip("_") or name
