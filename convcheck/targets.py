"""Targets: a device plus a numeric mode, written as a short spec string.

``cpu``, ``cpu:float64`` (the judge), ``cuda``, ``cuda:1``, ``cuda:tf32``,
``cuda:no-tf32``, ``cuda:amp-fp16``, ``cpu:amp-bf16``, ``cpu:bf16``,
``cpu:fp16``, ``cpu:emulate-tf32``; ``Target.parse(str(t)) == t``.

Applying a target (``with target.applied():``) sets the global flags it needs
and restores every one of them afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from convcheck.errors import TargetUnavailable, UsageError

DEVICES = ("cpu", "cuda", "mps")

# mode -> (parameter dtype, compute dtype, unit roundoff of the working precision)
# Unit roundoffs: FACTS.md ("Unit roundoff u: float64 2^-53, float32 2^-24,
# TF32 2^-11, float16 2^-11, bfloat16 2^-8").
_MODES: dict[str, tuple[torch.dtype, torch.dtype, float]] = {
    "float32": (torch.float32, torch.float32, 2.0**-24),
    "float64": (torch.float64, torch.float64, 2.0**-53),
    "tf32": (torch.float32, torch.float32, 2.0**-11),
    "no-tf32": (torch.float32, torch.float32, 2.0**-24),
    "emulate-tf32": (torch.float32, torch.float32, 2.0**-11),
    "amp-fp16": (torch.float32, torch.float16, 2.0**-11),
    "amp-bf16": (torch.float32, torch.bfloat16, 2.0**-8),
    "fp16": (torch.float16, torch.float16, 2.0**-11),
    "bf16": (torch.bfloat16, torch.bfloat16, 2.0**-8),
}

_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64", "f64": "float64",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "amp": "amp-fp16",
}

_DESCRIPTIONS = {
    "float32": "float32",
    "float64": "float64",
    "tf32": "float32, TF32 forced on for matmul and conv",
    "no-tf32": "float32, TF32 forced off",
    "emulate-tf32": "float32, matmul/conv inputs rounded to TF32 (10-bit mantissa)",
    "amp-fp16": "autocast float16 + GradScaler",
    "amp-bf16": "autocast bfloat16",
    "fp16": "whole model in float16",
    "bf16": "whole model in bfloat16",
}

_CUDA_ONLY_MODES = {"tf32", "no-tf32", "amp-fp16"}


@dataclass(frozen=True)
class Target:
    """One side of a comparison: where the model runs and in which precision."""

    device: str = "cpu"
    index: int | None = None
    mode: str = "float32"

    # -- spec strings ---------------------------------------------------------

    @classmethod
    def parse(cls, spec: str) -> "Target":
        text = spec.strip().lower()
        if not text:
            raise UsageError("empty target spec; expected e.g. 'cpu', 'cuda', 'cuda:tf32'")
        parts = text.split(":")
        device = parts[0]
        if device not in DEVICES:
            raise UsageError(
                f"target {spec!r}: unknown device {device!r} (expected one of {', '.join(DEVICES)})"
            )
        index: int | None = None
        mode = "float32"
        seen_mode = False
        for part in parts[1:]:
            if part.isascii() and part.isdigit():
                if index is not None or seen_mode:
                    raise UsageError(f"target {spec!r}: device index {part!r} must come right after the device")
                if device == "cpu":
                    raise UsageError(f"target {spec!r}: the cpu takes no device index")
                index = int(part)
                continue
            name = _ALIASES.get(part, part)
            if name not in _MODES:
                raise UsageError(
                    f"target {spec!r}: unknown mode {part!r} (expected one of {', '.join(_MODES)})"
                )
            if seen_mode:
                raise UsageError(f"target {spec!r}: more than one mode given")
            mode, seen_mode = name, True
        if device != "cuda" and mode in _CUDA_ONLY_MODES:
            raise UsageError(f"target {spec!r}: mode {mode!r} exists only on cuda")
        if device == "cuda" and mode == "emulate-tf32":
            raise UsageError(f"target {spec!r}: emulate-tf32 is for the cpu; on a GPU use cuda:tf32")
        return cls(device=device, index=index, mode=mode)

    def __str__(self) -> str:
        text = self.device if self.index is None else f"{self.device}:{self.index}"
        return text if self.mode == "float32" else f"{text}:{self.mode}"

    # -- numeric properties -----------------------------------------------------

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the weights and of the inputs fed to the model."""
        return _MODES[self.mode][0]

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the matmuls and convolutions work in (autocast's dtype for AMP)."""
        return _MODES[self.mode][1]

    @property
    def unit_roundoff(self) -> float:
        """Unit roundoff u of the working precision (used for error bounds)."""
        if self.mode == "float32" and self.device in ("cuda",):
            # Plain "cuda" keeps the stack's default flags: cuDNN convs use TF32
            # by default on Ampere and newer (FACTS.md, TF32 defaults).
            return 2.0**-11 if _cuda_tf32_possible(self) else 2.0**-24
        return _MODES[self.mode][2]

    @property
    def ulp(self) -> float:
        """Relative size of one ulp of the working precision (2u): the envelope's nudge."""
        return 2.0 * self.unit_roundoff

    @property
    def is_judge(self) -> bool:
        return self.device == "cpu" and self.mode == "float64"

    @property
    def is_amp(self) -> bool:
        return self.mode.startswith("amp-")

    @property
    def uses_grad_scaler(self) -> bool:
        return self.mode == "amp-fp16"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(self.device, self.index if self.index is not None else 0)

    def describe(self) -> str:
        return f"{self} ({self.torch_device}, {_DESCRIPTIONS[self.mode]})"

    # -- availability -------------------------------------------------------------

    def is_available(self) -> bool:
        if self.device == "cpu":
            return True
        if self.device == "mps":
            backend = getattr(torch.backends, "mps", None)
            return bool(backend and backend.is_available()) and self.mode not in ("float64",)
        if not torch.cuda.is_available():
            return False
        return (self.index or 0) < torch.cuda.device_count()

    def check_available(self) -> None:
        if not self.is_available():
            here = ", ".join(runnable_targets())
            reason = {
                "cuda": "no CUDA GPU is visible to torch" if not torch.cuda.is_available()
                else f"only {torch.cuda.device_count()} CUDA device(s) visible",
                "mps": "no Apple MPS device",
            }.get(self.device, "not available")
            raise TargetUnavailable(f"target {self} cannot run here ({reason}); targets that can: {here}")

    # -- applying ---------------------------------------------------------------------

    @contextlib.contextmanager
    def applied(self):
        """Set the global math flags this target needs; restore all of them on exit."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(preserved_global_flags())
            if self.mode == "tf32":
                _set_tf32(True)
            elif self.mode == "no-tf32":
                _set_tf32(False)
            elif self.mode == "emulate-tf32":
                stack.enter_context(EmulateTF32())
            yield self

    def autocast(self):
        """The autocast context for the forward pass (a no-op unless the mode is AMP)."""
        if not self.is_amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.compute_dtype)

    def place(self, model: "torch.nn.Module") -> "torch.nn.Module":
        """Move and cast a model (floating parameters and buffers) to this target, in place."""
        return model.to(device=self.torch_device, dtype=self.param_dtype)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch made once on the CPU, cast and moved for this target."""
        if x.is_floating_point():
            return x.to(device=self.torch_device, dtype=self.param_dtype)
        return x.to(device=self.torch_device)

    def make_grad_scaler(self):
        """A GradScaler for fp16 AMP (default settings), else None."""
        if not self.uses_grad_scaler:
            return None
        try:
            return torch.amp.GradScaler(self.device)
        except (AttributeError, TypeError):  # torch < 2.3
            return torch.cuda.amp.GradScaler()


JUDGE = Target("cpu", None, "float64")


def _cuda_tf32_possible(target: Target) -> bool:
    try:
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(target.torch_device)
        return major >= 8
    except Exception:  # noqa: BLE001 - a probe, never raise
        return False


def runnable_targets() -> list[str]:
    """Target specs that this machine can run."""
    specs = ["cpu", "cpu:float64", "cpu:bf16", "cpu:fp16", "cpu:amp-bf16", "cpu:emulate-tf32"]
    if torch.cuda.is_available():
        specs += ["cuda", "cuda:tf32", "cuda:no-tf32", "cuda:amp-fp16", "cuda:amp-bf16", "cuda:bf16", "cuda:fp16"]
        specs += [f"cuda:{i}" for i in range(1, torch.cuda.device_count())]
    if Target("mps").is_available():
        specs += ["mps", "mps:fp16"]
    return specs


def default_targets() -> tuple[list[Target], str | None]:
    """``cpu,cuda`` when a GPU is present; otherwise ``cpu,cpu:float64`` and a note saying so."""
    if torch.cuda.is_available():
        return [Target.parse("cpu"), Target.parse("cuda")], None
    return (
        [Target.parse("cpu"), Target.parse("cpu:float64")],
        "no GPU here: comparing cpu against cpu:float64 (pass --targets to choose, e.g. cpu,cpu:emulate-tf32)",
    )


def parse_targets(text: str) -> list[Target]:
    specs = [s for s in (p.strip() for p in text.split(",")) if s]
    if len(specs) != 2:
        raise UsageError(f"--targets needs exactly two targets separated by a comma, got {text!r}")
    targets = [Target.parse(s) for s in specs]
    a, b = targets
    if a == b or (a.torch_device == b.torch_device and a.mode == b.mode):
        raise UsageError(f"--targets names the same target twice ({targets[0]})")
    return targets


# --- global flags ----------------------------------------------------------------------

def _set_tf32(on: bool) -> None:
    # Old API only: mixing it with the new fp32_precision API can make the old
    # getters raise (FACTS.md, TF32 defaults); the snapshot below restores both.
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def _flag_accessors():
    """(name, getter, setter) for every global flag a target or a run may touch."""
    b = torch.backends

    def attr(obj, name):
        return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))

    items = [
        ("cuda.matmul.allow_tf32", *attr(b.cuda.matmul, "allow_tf32")),
        ("cudnn.allow_tf32", *attr(b.cudnn, "allow_tf32")),
        ("cudnn.benchmark", *attr(b.cudnn, "benchmark")),
        ("cudnn.deterministic", *attr(b.cudnn, "deterministic")),
        ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("grad_enabled", torch.is_grad_enabled, torch.set_grad_enabled),
        (
            "deterministic_algorithms",
            lambda: (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
    ]
    for name in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        if hasattr(b.cuda.matmul, name):
            items.append((f"cuda.matmul.{name}", *attr(b.cuda.matmul, name)))
    # The newer TF32 API (torch >= 2.9): setting allow_tf32 also moves these.
    for label, obj in (("cuda.matmul", b.cuda.matmul), ("cudnn.conv", getattr(b.cudnn, "conv", None)),
                       ("cudnn.rnn", getattr(b.cudnn, "rnn", None)), ("backends", b)):
        if obj is not None and hasattr(obj, "fp32_precision"):
            items.append((f"{label}.fp32_precision", *attr(obj, "fp32_precision")))
    return items


def snapshot_global_flags() -> dict[str, object]:
    """Every global flag convcheck may touch, read defensively (a getter that raises reads as None)."""
    out: dict[str, object] = {}
    for name, get, _ in _flag_accessors():
        try:
            out[name] = get()
        except Exception:  # noqa: BLE001 - mixed old/new TF32 APIs can make getters raise
            out[name] = None
    return out


@contextlib.contextmanager
def preserved_global_flags():
    """Restore every global flag (and the CPU RNG state) on exit, whatever happened inside."""
    before = snapshot_global_flags()
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        for name, get, set_ in _flag_accessors():  # old API first, the newer fp32_precision last
            value = before.get(name)
            if value is None:
                continue
            try:
                if get() == value:  # untouched: setters can be costly (use_deterministic_algorithms)
                    continue
            except Exception:  # noqa: BLE001 - an unreadable flag is restored below
                pass
            try:
                set_(value)
            except Exception:  # noqa: BLE001 - best effort; never mask the real error
                pass
        torch.random.set_rng_state(rng)


# --- TF32 emulation on the CPU ---------------------------------------------------------

def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round float32 values to TF32 (10 explicit mantissa bits), to nearest, ties to even.

    TF32 tensor cores read float32 operands with their mantissa cut to 10 bits
    and accumulate in float32; rounding the operands reproduces that on a CPU.
    """
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    finite = torch.isfinite(t)
    return torch.where(finite, rounded.view(torch.float32), t)


_TF32_OPS = None


def _tf32_ops():
    global _TF32_OPS
    if _TF32_OPS is None:
        aten = torch.ops.aten
        _TF32_OPS = {
            aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default, aten.convolution_backward.default,
        }
    return _TF32_OPS


class EmulateTF32(torch.utils._python_dispatch.TorchDispatchMode):
    """Round the float32 operands of every matmul and convolution to TF32, forward and backward.

    A dispatch mode sees the aten ops autograd runs for the backward pass too,
    so weight and input gradients are emulated like the forward.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _tf32_ops():
            args = tuple(round_to_tf32(a) if isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **kwargs)
