"""Targets: a device plus a numeric mode, written as a short spec string.

``cpu``, ``cpu:float64`` (a judge), ``cuda``, ``cuda:1``, ``cuda:tf32``,
``cuda:no-tf32``, ``cuda:amp-fp16``, ``cpu:amp-bf16``, ``cpu:bf16``,
``cpu:fp16``, ``cpu:emulate-tf32``, ``cpu:emulate-fp8-e4m3``, ``cuda:float64``; ``Target.parse(str(t)) == t``.
The modes are the registered runner kinds' (``convcheck targets`` lists them).
Data-parallel targets put ``ddp:`` and the world size in front: ``ddp:cpu:2`` (gloo, 2
processes), ``ddp:cpu:2:bf16``, ``ddp:cuda:4:amp-bf16`` (NCCL, one process per GPU).

A ``Target`` is the spec only; everything a kind of target *does* (flags,
placement, forward/backward, precision model) is its runner,
``target.runner`` (see ``convcheck.targets.runners``). The judge is a float64 target:
``cuda:float64`` where a GPU with fast float64 is present, else ``cpu:float64``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from convcheck.errors import UsageError, did_you_mean
from convcheck.targets.runners import ALIASES, Runner, known_modes, runnable_specs, runner_class
from convcheck.targets.runners.emulation import EmulateTF32, round_to_tf32  # noqa: F401 - re-exported
from convcheck.targets.runners.flags import preserved_global_flags, snapshot_global_flags  # noqa: F401 - re-exported

DEVICES = ("cpu", "cuda", "mps")

# The forms of a spec, as 'compare --help' and 'convcheck targets' show them (README.md's "Targets" says the same;
# tests/test_help_readme.py holds the two together). The modes come from the runner registry.
SPEC_FORM = "DEVICE[:INDEX][:MODE]"
SPEC_EXAMPLES = "cpu, cuda, cuda:1:tf32, cpu:amp-bf16, mps:bf16"
DDP_FORMS = ("ddp:cpu:N[:MODE]", "ddp:cuda:N[:MODE]")
DDP_EXAMPLES = "ddp:cpu:2, ddp:cpu:2:bf16, ddp:cuda:4:amp-bf16"
DDP_DESCRIPTION = ("DistributedDataParallel over N processes (gloo on the cpu, NCCL on N GPUs), each rank running "
                   "DEVICE[:MODE]; any mode but float64")


def data_parallel_here() -> dict[str, bool]:
    """``{form: runs here}`` of each data-parallel form (``DDP_FORMS``)."""
    import torch.distributed as dist

    ok = dist.is_available()
    cuda = ok and torch.cuda.is_available() and dist.is_nccl_available()
    return {DDP_FORMS[0]: ok, DDP_FORMS[1]: bool(cuda)}


@dataclass(frozen=True)
class Target:
    """One arm of a comparison: where the model runs and in which precision."""

    device: str = "cpu"
    index: int | None = None
    mode: str = "float32"
    world: int | None = None  # DistributedDataParallel over this many processes (``ddp:cpu:2``)

    @classmethod
    def parse(cls, spec: str) -> "Target":
        text = spec.strip().lower()
        if not text:
            raise UsageError("empty target spec; expected e.g. 'cpu', 'cuda', 'cuda:tf32'")
        if text.split(":")[0] == "ddp":
            return cls._parse_ddp(spec, text)
        device, *rest = text.split(":")
        if device not in DEVICES:
            near = "cuda" if device == "gpu" else did_you_mean(device, DEVICES, cutoff=0.75)
            hint = f"; did you mean {near!r}?" if near else ""
            raise UsageError(f"target {spec!r}: unknown device {device!r}{hint} (expected one of {', '.join(DEVICES)})")
        index: int | None = None
        mode: str | None = None
        for part in rest:
            if part.isascii() and part.isdigit():
                if index is not None or mode is not None:
                    raise UsageError(f"target {spec!r}: device index {part!r} must come right after the device")
                if device == "cpu":
                    raise UsageError(f"target {spec!r}: the cpu takes no device index")
                index = int(part)
                continue
            name = ALIASES.get(part, part)
            if name not in known_modes():
                near = did_you_mean(part, [*known_modes(), *ALIASES])
                if near:  # a near typo (cpu:bf17): the one mode it is near, not the whole list
                    raise UsageError(f"target {spec!r}: unknown mode {part!r}; did you mean "
                                     f"{':'.join([device, *rest[:rest.index(part)], near])!r}? "
                                     "('convcheck targets' lists every mode)")
                raise UsageError(f"target {spec!r}: unknown mode {part!r} (expected one of "
                                 f"{', '.join(known_modes())})")
            if mode is not None:
                raise UsageError(f"target {spec!r}: more than one mode given")
            mode = name
        mode = mode or "float32"
        runner_class(device, mode, spec)  # a mode this device cannot run is a usage error
        return cls(device=device, index=index, mode=mode)

    @classmethod
    def _parse_ddp(cls, spec: str, text: str) -> "Target":
        """``ddp:DEVICE:N[:MODE]``: the per-rank target ``DEVICE[:MODE]`` on N processes."""
        parts = text.split(":")
        usage = f"target {spec!r}: a data-parallel target is ddp:cpu:N or ddp:cuda:N, then an optional mode"
        if len(parts) < 3 or len(parts) > 4 or parts[1] not in ("cpu", "cuda"):
            raise UsageError(usage)
        if not (parts[2].isascii() and parts[2].isdigit()) or int(parts[2]) < 1:
            raise UsageError(f"{usage} (N, the number of processes, is a whole number >= 1; got {parts[2]!r})")
        if len(parts) == 4 and parts[3].isascii() and parts[3].isdigit():
            raise UsageError(f"target {spec!r}: ddp:cuda:N runs on GPUs 0..N-1; it takes no device index")
        inner_text = ":".join([parts[1]] + parts[3:])
        try:
            inner = cls.parse(inner_text)
        except UsageError as exc:  # said of the spec as given: ddp:cpu:2:bf17, did you mean 'ddp:cpu:2:bf16'?
            said = str(exc).replace(f"target {inner_text!r}", f"target {spec!r}", 1)
            raise UsageError(said.replace(f"did you mean '{parts[1]}:", f"did you mean 'ddp:{parts[1]}:{parts[2]}:",
                                          1)) from None
        if inner.mode == "float64":
            raise UsageError(f"target {spec!r}: the judge (float64) runs on one device, not data-parallel")
        return cls(device=inner.device, index=None, mode=inner.mode, world=int(parts[2]))

    def __str__(self) -> str:
        text = self.device if self.index is None else f"{self.device}:{self.index}"
        if self.world is not None:
            text = f"ddp:{text}:{self.world}"
        return text if self.mode == "float32" else f"{text}:{self.mode}"

    @property
    def per_rank(self) -> "Target":
        """The single-device target each rank of a data-parallel target runs (itself otherwise)."""
        return Target(self.device, self.index, self.mode) if self.world is not None else self

    @functools.cached_property
    def runner(self) -> Runner:
        """The runner of this kind of target (owns flags, placement, forward/backward, precision)."""
        if self.world is not None:
            from convcheck.targets.runners.ddp import DDPRunner

            return DDPRunner(self, self.per_rank.runner)
        return runner_class(self.device, self.mode, str(self))(self)

    # -- the runner's answers, for convenience ------------------------------------------

    @property
    def torch_device(self) -> torch.device:
        return self.runner.torch_device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.runner.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.runner.compute_dtype

    @property
    def unit_roundoff(self) -> float:
        return self.runner.unit_roundoff

    @property
    def ulp(self) -> float:
        return self.runner.ulp

    def describe(self) -> str:
        return f"{self} ({self.runner.describe()})"

    def is_available(self) -> bool:
        return self.runner.unavailable_reason() is None

    def check_available(self) -> None:
        self.runner.check_available()

    def applied(self):
        """Set the global math flags this target needs; restore all of them on exit."""
        return self.runner.applied()

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.runner.place(model)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner.cast_input(x)


CPU_JUDGE = Target("cpu", None, "float64")


def runnable_targets() -> list[str]:
    """Target specs that this machine can run."""
    return runnable_specs()


# Without a GPU, the default pair is what a GPU would change (issue 44): float32 against the TF32 that cuDNN and
# cuBLAS use for convolutions and matmuls on NVIDIA Ampere and later, emulated on the CPU (an upper bound: cuDNN
# keeps some small convolutions in float32). The float64 judge stays cpu:float64.
NO_GPU_NOTE = ("no GPU here: comparing cpu against cpu:emulate-tf32, the TF32 convolutions and matmuls of an NVIDIA "
               "GPU (Ampere or later), emulated; --targets chooses another pair")


def default_targets() -> tuple[list[Target], str | None]:
    """``cpu,cuda`` when a GPU is present; otherwise ``cpu,cpu:emulate-tf32`` and a note saying so (one line)."""
    if torch.cuda.is_available():
        return [Target.parse("cpu"), Target.parse("cuda")], None
    return [Target.parse("cpu"), Target.parse("cpu:emulate-tf32")], NO_GPU_NOTE


def parse_targets(text: str) -> list[Target]:
    specs = [s for s in (p.strip() for p in text.split(",")) if s]
    if len(specs) != 2:
        raise UsageError(f"--targets needs exactly two targets separated by a comma, got {text!r}")
    targets = [Target.parse(s) for s in specs]
    a, b = targets
    if a == b or (a.torch_device == b.torch_device and a.mode == b.mode and a.world == b.world):
        raise UsageError(f"--targets names the same target twice ({targets[0]})")
    return targets


def parse_judge(spec: "str | Target") -> Target:
    """A judge must be a float64 target this machine can run; anything else is a usage error."""
    judge = spec if isinstance(spec, Target) else Target.parse(str(spec))
    if not judge.runner.is_float64:
        raise UsageError(f"judge {str(spec)!r} is not a float64 target; use cpu:float64 or cuda:float64")
    judge.check_available()
    return judge


def default_judge() -> tuple[Target, str]:
    """``cuda:float64`` when a GPU with fast float64 is present, else ``cpu:float64``; and why."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        gpu = Target("cuda", None, "float64")
        name = _gpu_name(gpu)
        if gpu.runner.fast:
            return gpu, f"{name} has fast float64 (half its float32 rate)"
        return CPU_JUDGE, f"{name} has slow float64 (1/32 to 1/64 of its float32 rate): judging on the CPU"
    return CPU_JUDGE, "no GPU here"


def _gpu_name(t: Target) -> str:
    try:
        return torch.cuda.get_device_name(t.torch_device)
    except Exception:  # noqa: BLE001 - a probe, never raise
        return "the GPU"
