"""``convcheck.compare`` lives here: the whole pipeline behind the CLI, the pytest plugin and the API.

models -> data -> targets -> parity -> train -> env -> diagnose. This module
only wires the stages together; each stage lives in its own module.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from convcheck.capture import disable_inplace
from convcheck.data import Batches, hash_state_dict, load_batches
from convcheck.errors import RunFailed, UsageError
from convcheck.metrics import DEFAULT_TOLERANCES, Tolerances
from convcheck.models import ResolvedModel, check_input_shape, resolve_model
from convcheck.parity import ParityResult, run_parity
from convcheck.targets import JUDGE, Target, default_targets, parse_targets
from convcheck.train import CONVERGED_RULE, OPTIMIZERS, TrainConfig, TrainResult, make_arms, run_training

from convcheck.report.export import SUMMARY_SCHEMA

ModelArg = Union[str, ResolvedModel, nn.Module, Callable[[], nn.Module]]


@dataclass(frozen=True)
class CompareConfig:
    """Everything that defines a comparison run (recorded in the summary)."""

    targets: tuple[Target, Target]
    steps: int = 30
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    envelope: int = 3
    data: str | None = None
    tolerances: Tolerances = DEFAULT_TOLERANCES


@dataclass
class CompareResult:
    """The outcome of one comparison. Truthy when the verdict is ``ok``."""

    model: ResolvedModel
    config: CompareConfig
    parity: ParityResult
    training: TrainResult
    data_source: str
    batch_hashes: tuple[str, ...]
    init_hash: str
    data_stats: dict
    notes: list[str] = field(default_factory=list)
    findings: list = field(default_factory=list)
    fingerprint: object | None = None
    verdict: object | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[Target, Target]:
        return self.config.targets

    def __bool__(self) -> bool:
        if self.verdict is not None:
            return getattr(self.verdict, "category", "ok") == "ok"
        return bool(self.parity) and all(
            v["converged"] for v in self.training.per_target.values())

    def to_summary(self) -> dict:
        from convcheck.report.export import summary_dict

        return summary_dict(self)


def _as_resolved(model: ModelArg, input_shape, num_classes) -> ResolvedModel:
    if isinstance(model, ResolvedModel):
        return model
    if isinstance(model, str):
        return resolve_model(model, input_shape=input_shape, num_classes=num_classes)
    if isinstance(model, nn.Module):
        template = model
        factory = lambda: copy.deepcopy(template)  # noqa: E731
        name = type(model).__name__
    elif callable(model):
        factory, name = model, getattr(model, "__name__", "model")
    else:
        raise UsageError(f"model must be a name, an nn.Module or a factory, not {type(model).__name__}")
    if input_shape is None or num_classes is None:
        raise UsageError(f"model {name!r}: pass input_shape=(C, H, W) and num_classes for a model object")
    return ResolvedModel(name=name, factory=factory, input_shape=tuple(input_shape),
                         num_classes=int(num_classes), source="object")


def initial_state(model: ResolvedModel, seed: int) -> dict[str, torch.Tensor]:
    """The shared initial weights: built once from a seeded CPU generator, kept in float64."""
    torch.manual_seed(seed)
    try:
        m = model.factory()
    except Exception as exc:  # the user's factory: a user error, reported in one line
        raise UsageError(f"model factory {model.name!r} raised {type(exc).__name__}: {exc}") from None
    return {k: (v.detach().to(torch.float64) if v.is_floating_point() else v.detach().clone())
            for k, v in m.state_dict().items()}


def model_builder(model: ResolvedModel, state: dict[str, torch.Tensor]) -> Callable[[Target], nn.Module]:
    """``build(target)``: the model with the shared weights, cast and moved to ``target``."""

    def build(target: Target) -> nn.Module:
        m = model.factory()
        m.load_state_dict(state)
        disable_inplace(m)
        target.place(m)
        for name, p in m.state_dict().items():  # load_state_dict may round float64 values
            if p.is_floating_point():
                p.copy_(state[name].to(p.dtype))
        return m.train()

    return build


def compare(
    model: ModelArg,
    targets: Sequence[Union[str, Target]] | str | None = None,
    *,
    steps: int = 30,
    batch_size: int = 32,
    optimizer: str = "adam",
    lr: float = 1e-3,
    seed: int = 0,
    envelope: int = 3,
    data: str | None = None,
    input_shape: tuple[int, int, int] | None = None,
    num_classes: int | None = None,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
    env_findings: list | None = None,
    fingerprint=None,
    progress: Callable[[str, int, int], None] | None = None,
) -> CompareResult:
    """Run ``model`` on two targets and the float64 judge; return the evidence and the verdict.

    ``model`` is a zoo name (``"lenet"``), ``"package.module:factory"``,
    ``"path/file.py:factory"``, an ``nn.Module`` or a factory. ``targets`` is
    two specs (``"cpu,cuda"`` or ``["cpu", "cuda:tf32"]``); by default
    ``cpu,cuda`` where a GPU is present, else ``cpu,cpu:float64``.
    ``env_findings`` (a list of ``convcheck.env.Finding``) replaces the audit
    of this machine, so a recorded environment can be diagnosed.
    """
    notes: list[str] = []
    if steps < 1:
        raise UsageError(f"steps must be at least 1, got {steps}")
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}")
    if envelope < 0:
        raise UsageError(f"envelope must be 0 or more, got {envelope}")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r} (expected {' or '.join(OPTIMIZERS)})")
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"learning rate must be a positive number, got {lr}")
    pair = _parse_pair(targets, notes)
    for t in pair:
        t.check_available()
    resolved = _as_resolved(model, input_shape, num_classes)
    cfg = CompareConfig(targets=pair, steps=steps, batch_size=batch_size, optimizer=optimizer,
                        lr=lr, seed=seed, envelope=envelope, data=data, tolerances=tolerances)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    state = initial_state(resolved, seed)
    build = model_builder(resolved, state)
    check_input_shape(build(JUDGE), resolved.input_shape, resolved.num_classes)
    batches: Batches = load_batches(data, input_shape=resolved.input_shape,
                                    num_classes=resolved.num_classes, batch_size=batch_size,
                                    num_batches=steps, seed=seed)
    if batches.note:
        notes.append(batches.note)
    timings["setup_s"] = time.perf_counter() - t0

    try:
        t0 = time.perf_counter()
        if progress:
            progress("parity", 0, 1)
        parity = run_parity(build, batches.batches[0], list(pair), tolerances=tolerances, seed=seed)
        if progress:
            progress("parity", 1, 1)
        timings["parity_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        arms = make_arms(list(pair), envelope, seed)
        train_cfg = TrainConfig(steps=steps, optimizer=optimizer, lr=lr, seed=seed)
        training = run_training(
            build, list(batches.batches), arms, train_cfg, tolerances=tolerances,
            progress=(lambda done, total: progress("train", done, total)) if progress else None,
        )
        timings["train_s"] = time.perf_counter() - t0
    except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
        raise RunFailed(f"out of GPU memory: {str(exc).splitlines()[0]} (try a smaller --batch-size)") from None
    except MemoryError:
        raise RunFailed("out of memory (try a smaller --batch-size)") from None

    result = CompareResult(
        model=resolved, config=cfg, parity=parity, training=training,
        data_source=batches.source, batch_hashes=tuple(batches.hashes), init_hash=hash_state_dict(state),
        data_stats=batches.stats(), notes=notes, timings=timings,
    )
    _attach_env_and_verdict(result, env_findings, fingerprint)
    return result


def _parse_pair(targets, notes: list[str]) -> tuple[Target, Target]:
    if targets is None:
        pair, note = default_targets()
        if note:
            notes.append(note)
        return pair[0], pair[1]
    if isinstance(targets, str):
        pair = parse_targets(targets)
    else:
        items = [t if isinstance(t, Target) else Target.parse(str(t)) for t in targets]
        pair = parse_targets(",".join(str(t) for t in items))
    return pair[0], pair[1]


def _attach_env_and_verdict(result: CompareResult, env_findings, fingerprint) -> None:
    """Environment findings (this machine's audit unless injected) and, when available, the verdict."""
    if env_findings is None:
        try:
            from convcheck.env import audit, collect

            fingerprint = fingerprint or collect()
            env_findings = audit(fingerprint)
        except ImportError:  # pragma: no cover - env not built
            env_findings = []
    result.fingerprint = fingerprint
    result.findings = list(env_findings)
    try:
        from convcheck.diagnose import diagnose
    except ImportError:
        return
    result.verdict = diagnose(result)


__all__ = ["CompareConfig", "CompareResult", "SUMMARY_SCHEMA", "compare", "initial_state", "model_builder"]
__all__ += ["CONVERGED_RULE", "TrainConfig", "TrainResult", "JUDGE"]
