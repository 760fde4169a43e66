"""The runner interface: everything that differs between kinds of target, in one place.

A ``Runner`` wraps one parsed target. It owns availability, description,
placing weights and batches, forward + loss + backward (AMP loss scaling
included), the optimizer step, setting and restoring the global flags it
needs, and its precision model. Callers (parity, train, the judge) never
branch on a mode string: they ask the runner.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
from typing import Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.batch import call_model
from convcheck.errors import TargetUnavailable, UsageError
from convcheck.nested import map_tensors, tensors_in
from convcheck.numerics.formats import TF32, coarsest
from convcheck.targets.runners.flags import preserved_global_flags
from convcheck.targets.runners.precision import PrecisionModel
from convcheck.targets.runners.registry import runnable_specs

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The loss scale of parity's one fixed-scale step for runners with a GradScaler
# (GradScaler's default initial scale, 2^16).
PARITY_LOSS_SCALE = 2.0**16
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: such labels are skipped, not out of range


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy on class logits (per pixel for (N, C, H, W) logits); half-precision
    logits are upcast first. Labels outside the model's classes are a usage error, not a crash."""
    if not isinstance(output, torch.Tensor) or output.dim() < 2:
        raise UsageError(f"the default loss (cross-entropy) needs class logits of shape (N, classes, ...), got "
                         f"{type(output).__name__ if not isinstance(output, torch.Tensor) else tuple(output.shape)}; "
                         "pass your loss with --loss FILE.py:fn")
    labels = target[target != IGNORE_INDEX] if isinstance(target, torch.Tensor) and \
        not target.is_floating_point() else None
    if labels is not None and labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= output.shape[1]:
            raise UsageError(f"labels span {lo}..{hi} but the model outputs {output.shape[1]} classes "
                             f"(0..{output.shape[1] - 1}): labels out of range for the output")
    if output.dtype in (torch.float16, torch.bfloat16):
        output = output.float()
    return F.cross_entropy(output, target)


class Runner:
    """One kind of target. Subclasses set ``modes``/``devices`` and override what differs."""

    modes: ClassVar[tuple[str, ...]] = ()
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps")
    descriptions: ClassVar[dict[str, str]] = {}
    # (parameter dtype, compute dtype) per mode
    dtypes: ClassVar[dict[str, tuple[torch.dtype, torch.dtype]]] = {}
    # where its work runs: the name of a registered executor (``convcheck.targets.executors``)
    executor: ClassVar[str] = "in-process"

    def __init__(self, target):
        self.target = target  # a convcheck.targets.spec.Target (the spec); runners never import it

    # -- spec and description -------------------------------------------------------

    @classmethod
    def runnable_here(cls) -> list[str]:
        """Specs of this kind that this machine can run (for error messages and listings)."""
        return []

    @classmethod
    def wrong_device_message(cls, mode: str, device: str) -> str:
        return f"mode {mode!r} exists only on {' and '.join(cls.devices)}"

    def describe(self) -> str:
        """Device and precision in words, e.g. ``cuda:0, autocast float16 + GradScaler``."""
        return f"{self.torch_device}, {self.descriptions[self.target.mode]}"

    # -- numerics -----------------------------------------------------------------------

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the weights and of the inputs fed to the model."""
        return self.dtypes[self.target.mode][0]

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the matmuls and convolutions work in (autocast's dtype for AMP)."""
        return self.dtypes[self.target.mode][1]

    @property
    def precision(self) -> PrecisionModel:
        raise NotImplementedError

    @property
    def unit_roundoff(self) -> float:
        """The unit roundoff of the precision the run works in (``PrecisionModel.working``)."""
        return self.precision.working.unit_roundoff

    @property
    def ulp(self) -> float:
        """Relative size of one ulp of the working precision (2u): the envelope's nudge."""
        return 2.0 * self.unit_roundoff

    @property
    def is_float64(self) -> bool:
        """A float64 run: the only kind that may judge."""
        return False

    @property
    def half_storage(self) -> bool:
        """Weights stored in a 16-bit format (small updates can be lost in them)."""
        return self.param_dtype.itemsize == 2

    @property
    def half_compute(self) -> bool:
        """Matmuls/convs in a 16-bit format (gradients can underflow)."""
        return self.compute_dtype.itemsize == 2

    @property
    def mixed_precision(self) -> bool:
        """16-bit compute over float32 weights (autocast)."""
        return self.half_compute and not self.half_storage

    @property
    def tf32_like(self) -> bool:
        """Matmul/conv operands rounded to TF32, however they round (the remedy is to turn TF32 off)."""
        p = self.precision
        return coarsest((p.matmul.operand, p.conv.operand)).same_values(TF32) and not self.half_compute

    # -- availability -------------------------------------------------------------------

    @property
    def torch_device(self) -> torch.device:
        t = self.target
        if t.device == "cpu":
            return torch.device("cpu")
        return torch.device(t.device, t.index if t.index is not None else 0)

    def unavailable_reason(self) -> str | None:
        """Why this machine cannot run the target, or None when it can."""
        t = self.target
        if t.device == "cpu":
            return None
        if t.device == "mps":
            backend = getattr(torch.backends, "mps", None)
            return None if backend is not None and backend.is_available() else "no Apple MPS device"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible to torch"
        if (t.index or 0) >= torch.cuda.device_count():
            return f"only {torch.cuda.device_count()} CUDA device(s) visible"
        return None

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise TargetUnavailable(f"target {self.target} cannot run here ({reason}); "
                                    f"targets that can: {', '.join(runnable_specs())}")

    # -- flags --------------------------------------------------------------------------

    def _enter(self, stack: contextlib.ExitStack) -> None:
        """Set this kind's global flags / modes (restored by ``applied``)."""

    @contextlib.contextmanager
    def applied(self):
        """Set the global math flags this target needs; restore all of them on exit."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(preserved_global_flags())
            self._enter(stack)
            yield self

    def autocast(self):
        """The autocast context for the forward pass (a no-op unless the kind is AMP)."""
        return contextlib.nullcontext()

    # -- placing ------------------------------------------------------------------------

    def place(self, model: nn.Module) -> nn.Module:
        """Move and cast a model (floating parameters and buffers) to this target, in place."""
        return model.to(device=self.torch_device, dtype=self.param_dtype)

    def placed_copy(self, template: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module | None:
        """A copy of ``template`` as ``place`` leaves it, every parameter and buffer made directly at
        this target's device and dtype from ``state`` (the float64 initial weights by name): one
        tensor made per tensor instead of a copy, a cast and an exact copy. None where ``place`` is
        a kind's own, or for a complex tensor: the caller copies and places instead."""
        tensors = list(itertools.chain(template.parameters(), template.buffers()))
        if type(self).place is not Runner.place or any(
                t.is_complex() or type(t) not in (nn.Parameter, torch.Tensor) for t in tensors):
            return None
        device, dtype = self.torch_device, self.param_dtype
        names = {id(t): n for n, t in template.state_dict(keep_vars=True).items()}
        memo: dict = {}
        for t in tensors:  # deepcopy takes these from its memo instead of copying the template's
            src = state[names[id(t)]] if id(t) in names else t.detach()
            new = src.to(device=device, dtype=dtype) if src.is_floating_point() else src.to(device=device)
            new = new.clone() if new is src else new
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        _fresh_empty_containers(template, memo)
        return copy.deepcopy(template, memo)

    def cast_input(self, x):
        """A batch made once on the CPU (a tensor, or a tuple/list/dict of them), cast and moved for this
        target: floating tensors to its parameter dtype, the others only moved."""
        def cast(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point():
                return t.to(device=self.torch_device, dtype=self.param_dtype)
            return t.to(device=self.torch_device)
        return map_tensors(x, cast)

    def forward(self, model: nn.Module, inputs):
        """The model on ``inputs`` cast for this target (``model(x)``, ``model(*xs)`` or ``model(**kw)``),
        under the kind's autocast."""
        with self.autocast():
            return call_model(model, self.cast_input(inputs))

    # -- forward, loss, backward, step --------------------------------------------------

    @property
    def parity_loss_scale(self) -> float:
        """The fixed loss scale of parity's single step (1 unless the kind scales its loss)."""
        return 1.0

    def make_grad_scaler(self):
        """The GradScaler a training loop of this kind uses, or None."""
        return None

    def forward_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = cross_entropy):
        """``(output, loss)``: the batch cast for this target, forward and loss under its precision rules."""
        with self.autocast():
            out = call_model(model, self.cast_input(x))
            loss = loss_fn(out, self.cast_input(y))
        return out, loss

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        (loss * scale if scale != 1.0 else loss).backward()

    def train_backward(self, loss: torch.Tensor, optimizer, scaler) -> None:
        """Backward of a training step; with a GradScaler, scaled and then unscaled in the optimizer."""
        if scaler is None:
            loss.backward()
            return
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, scaler) -> tuple[float, bool]:
        """Step (a non-finite step is a result too: it poisons the weights as it would);
        ``(loss scale after the step or NaN, whether the step was skipped)``."""
        if scaler is None:
            optimizer.step()
            return float("nan"), False
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        after = scaler.get_scale()
        return after, after < before

    def local_backward(self, module: nn.Module, args: tuple, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter gradients of ``module`` (a private copy on this target) for ``args`` and the
        given output gradient, at this kind's parity loss scale, returned unscaled."""
        return Runner.local_forward_backward(self, module, args, grad_output)[1]

    def local_forward_backward(self, module: nn.Module, args: tuple,
                               grad_output: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(output, parameter gradients)`` of ``module`` on ``args`` (``local_backward``), the output
        from the same forward: parity's forward row reads it instead of running the layer again."""
        scale = self.parity_loss_scale
        for p in module.parameters():
            p.grad = None
        with torch.enable_grad(), self.autocast():
            outs = tensors_in(module(*args))
        if not outs:
            return None, {}
        out = outs[0]
        if out.requires_grad:  # a layer whose parameters are all frozen has no gradient to give
            g = grad_output.to(device=out.device, dtype=out.dtype)
            out.backward(g * scale if scale != 1.0 else g)
        return out.detach(), {n: p.grad.detach() / scale if scale != 1.0 else p.grad.detach()
                              for n, p in module.named_parameters() if p.grad is not None}


_EMPTY_KINDS = (dict, collections.OrderedDict, set, list)


def _fresh_empty_containers(template: nn.Module, memo: dict) -> None:
    """Give ``deepcopy`` each module's empty hook dictionaries (a dozen per module) and other empty
    plain containers as fresh empty ones: what it would make of them, without its per-object
    protocol (half of a copy's time on ResNet-18: 4.8 -> 2.7 ms)."""
    for sub in template.modules():
        for v in sub.__dict__.values():
            if type(v) in _EMPTY_KINDS and not v:
                memo[id(v)] = type(v)()

