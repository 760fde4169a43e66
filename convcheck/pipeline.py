"""``convcheck.compare`` lives here: the whole pipeline behind the CLI, the pytest plugin and the API.

models -> data -> targets/judge -> parity -> train -> env -> diagnose. This
module only wires the stages together; each stage lives in its own module.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np
import torch
import torch.nn as nn

from convcheck import executors
from convcheck.builder import ModelBuilder, model_builder  # noqa: F401 - ModelBuilder re-exported
from convcheck.config import CompareConfig, with_options
from convcheck.data import hash_state_dict
from convcheck.datasets import is_user_data, open_data
from convcheck.errors import RunFailed, UsageError
from convcheck.models import ResolvedModel, check_input_shape, resolve_model
from convcheck.parity import ParityResult, run_parity
from convcheck.recipe import Recipe, build_recipe
from convcheck.recipe_probe import loss_reduction_probe
from convcheck.targets import Target, default_judge, default_targets, parse_judge, parse_targets
from convcheck.train import CONVERGED_RULE, TrainConfig, TrainResult, make_arms, run_training

ModelArg = Union[str, ResolvedModel, nn.Module, Callable[[], nn.Module]]


@dataclass
class CompareResult:
    """The outcome of one comparison. Truthy when the verdict is ``ok``."""

    model: ResolvedModel
    config: CompareConfig  # targets parsed, judge the one used
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
    judge_reason: str = ""
    recipe: Recipe | None = None  # the loss, optimizer and schedule as built
    batches_hash: str = ""  # one SHA-256 over every batch's hash (batch_hashes lists the first 1000)
    loss_batch_ratio: float = float("nan")  # loss(batch) / mean(loss(halves)): ~1 averaged, ~2 summed

    @property
    def targets(self) -> tuple[Target, Target]:
        return self.config.targets

    @property
    def judge(self) -> Target:
        return self.config.judge

    def __bool__(self) -> bool:
        if self.verdict is not None:
            return self.verdict.category == "ok"
        return bool(self.parity) and all(o.converged for o in self.training.outcomes.values())

    def to_summary(self) -> dict:
        from convcheck.report.export import summary_dict

        return summary_dict(self)


def _as_resolved(model: ModelArg, input_shape, num_classes, need_io: bool = True) -> ResolvedModel:
    """The model as a factory plus its input spec; ``need_io=False`` (the user's own data defines the
    inputs) leaves an input shape / class count the model does not declare unknown."""
    if isinstance(model, ResolvedModel):
        return model
    if isinstance(model, str):
        return resolve_model(model, input_shape=input_shape, num_classes=num_classes, infer=need_io)
    if isinstance(model, nn.Module):
        template = model
        factory = lambda: copy.deepcopy(template)  # noqa: E731
        name = type(model).__name__
    elif callable(model):
        factory, name = model, getattr(model, "__name__", "model")
    else:
        raise UsageError(f"model must be a name, an nn.Module or a factory, not {type(model).__name__}")
    if need_io and (input_shape is None or num_classes is None):
        raise UsageError(f"model {name!r}: pass input_shape=(C, H, W) and num_classes for a model object")
    return ResolvedModel(name=name, factory=factory, input_shape=tuple(input_shape) if input_shape else None,
                         num_classes=int(num_classes) if num_classes else None, source="object")


def initial_state(model: ResolvedModel, seed: int) -> dict[str, torch.Tensor]:
    """The shared initial weights: built once from a seeded CPU generator, kept in float64."""
    torch.manual_seed(seed)
    try:
        m = model.factory()
    except Exception as exc:  # the user's factory: a user error, reported in one line
        raise UsageError(f"model factory {model.name!r} raised {type(exc).__name__}: {exc}") from None
    return {k: (v.detach().to(torch.float64) if v.is_floating_point() else v.detach().clone())
            for k, v in m.state_dict().items()}


@contextlib.contextmanager
def _caller_rng_kept():
    """The caller's torch (CPU and CUDA), numpy and Python random states are as they were afterwards."""
    cpu, py, npy = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npy)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def compare(
    model: ModelArg,
    targets=None,
    *,
    config: CompareConfig | None = None,
    input_shape: tuple[int, int, int] | None = None,
    num_classes: int | None = None,
    env_findings: list | None = None,
    fingerprint=None,
    progress: Callable[[str, int, int], None] | None = None,
    **options,
) -> CompareResult:
    """Run ``model`` on two targets and a float64 judge; return the evidence and the verdict.

    ``model`` is a zoo name (``"lenet"``), ``"package.module:factory"``,
    ``"path/file.py:factory"``, an ``nn.Module`` or a factory. ``targets`` is
    two specs (``"cpu,cuda"`` or ``["cpu", "cuda:tf32"]``); by default
    ``cpu,cuda`` where a GPU is present, else ``cpu,cpu:float64``. The rest of
    the run is ``config`` (a ``CompareConfig``) and/or its fields as keywords
    (``steps=10, judge="cpu:float64", bound_factor=4``). ``env_findings`` (a
    list of ``convcheck.env.Finding``) replaces the audit of this machine, so a
    recorded environment can be diagnosed. The caller's random states are left
    as they were.
    """
    if config is not None and not isinstance(config, CompareConfig):
        raise UsageError(f"config must be a convcheck.CompareConfig, not {type(config).__name__}")
    if targets is not None:
        options["targets"] = targets
    cfg = with_options(config or CompareConfig(), **options)
    with _caller_rng_kept(), _guarded(progress, cfg.steps) as stage, executors.released():
        resolved = _checked_model(model, input_shape, num_classes, cfg, env_findings, fingerprint)
        return _run(resolved, cfg, None, None, env_findings, fingerprint, stage)


@contextlib.contextmanager
def _guarded(progress, steps: int):
    """The caller's global flags restored; the user's code failing becomes a one-line UserCodeError
    (file, line, function, stage), the machine's limits a RunFailed; convcheck's bugs pass unchanged.
    Yields the progress callback that remembers the stage reached."""
    from convcheck.failures import RunStage, user_failures
    from convcheck.runners import preserved_global_flags

    if progress is not None and not callable(progress):
        raise UsageError(f"progress must be a callable(stage, done, total), not {type(progress).__name__}")
    stage = RunStage(progress, steps)
    with preserved_global_flags(), user_failures(stage):
        yield stage


def _checked_model(model, input_shape, num_classes, cfg, env_findings, fingerprint) -> ResolvedModel:
    """The model resolved, a factory object's results checked, and the user's own model tried once in
    training mode (``convcheck.preflight``) before anything is measured. With the user's own data the
    inputs come from the data, so the model needs no declared input shape and is tried on real batches."""
    from convcheck.models import checked_factory
    from convcheck.preflight import check_arguments, check_trainable

    check_arguments(input_shape, num_classes, env_findings, fingerprint)
    _resolve_config(cfg, [])  # a target or judge that cannot run here is refused before any model is built
    user_data = is_user_data(cfg.data)
    resolved = _as_resolved(model, input_shape, num_classes, need_io=not user_data)
    if resolved.source == "object":
        resolved = dataclasses.replace(resolved, factory=checked_factory(resolved.factory, resolved.name))
    if resolved.source != "zoo" and not user_data:
        check_trainable(resolved, cfg.batch_size)
    return resolved


def _resolve_config(cfg: CompareConfig, notes: list[str]) -> tuple[CompareConfig, str]:
    """Targets parsed and checked, the judge chosen (or the one asked for) and why."""
    pair = _parse_pair(cfg.targets, notes)
    executors.check_targets(pair)  # the targets fit the way this process was started (torchrun's world)
    for t in pair:
        t.check_available()
    if cfg.judge is not None:
        judge, reason = parse_judge(cfg.judge), "chosen with --judge"
    else:
        judge, reason = default_judge()
    return dataclasses.replace(cfg, targets=pair, judge=judge), reason


def _resolve_recipe(cfg: CompareConfig, task: str) -> tuple[CompareConfig, Recipe]:
    """The loss (the task's default unless given), optimizer and schedule, built and checked before any
    work; a built-in optimizer is recorded by its lower-case torch.optim name."""
    recipe = build_recipe(cfg, task)
    if isinstance(cfg.optimizer, str) and ":" not in cfg.optimizer:
        cfg = dataclasses.replace(cfg, optimizer=recipe.optimizer_name.lower())
    return cfg, recipe


def _run(model, cfg, input_shape, num_classes, env_findings, fingerprint, progress) -> CompareResult:
    notes: list[str] = []
    cfg, judge_reason = _resolve_config(cfg, notes)
    resolved = _as_resolved(model, input_shape, num_classes, need_io=not is_user_data(cfg.data))
    cfg, recipe = _resolve_recipe(cfg, resolved.task)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    state, build, stream = _prepare(resolved, cfg, notes)
    timings["setup_s"] = time.perf_counter() - t0
    try:
        first = stream.first()
        parity = _timed(timings, "parity_s", progress, "parity", lambda: run_parity(
            build, first, list(cfg.targets), tolerances=cfg.tolerances, judge=cfg.judge, seed=cfg.seed,
            loss_fn=recipe.loss, progress=(lambda done, total: progress("parity", done, total)) if progress
            else None))
        if hasattr(progress, "keep"):  # the RunStage: a run stopped in training keeps the parity table
            progress.keep(parity=parity)
        loss_ratio = loss_reduction_probe(build(cfg.judge), cfg.judge.runner, first, recipe.loss)
        arms = make_arms(list(cfg.targets), cfg.envelope, cfg.seed, cfg.judge)
        train_cfg = TrainConfig(steps=cfg.steps, seed=cfg.seed, recipe=recipe)
        training = _timed(timings, "train_s", None, "train", lambda: run_training(
            build, stream, arms, train_cfg, tolerances=cfg.tolerances,
            progress=(lambda done, total: progress("train", done, total)) if progress else None,
            keep=getattr(progress, "keep", None)))
    except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
        raise RunFailed(f"out of GPU memory: {str(exc).splitlines()[0]} (try a smaller --batch-size)") from None
    except MemoryError:
        raise RunFailed("out of memory (try a smaller --batch-size)") from None
    result = CompareResult(
        model=resolved, config=cfg, parity=parity, training=training,
        data_source=stream.source, batch_hashes=stream.hashes, init_hash=hash_state_dict(state),
        data_stats=stream.stats(), notes=notes, timings=timings, judge_reason=judge_reason, recipe=recipe,
        batches_hash=stream.all_hash, loss_batch_ratio=loss_ratio,
    )
    _attach_env_and_verdict(result, env_findings, fingerprint)
    return result


def _prepare(resolved: ResolvedModel, cfg: CompareConfig, notes: list[str]):
    """The model's shared initial weights, ``build(target)`` and the stream of batches."""
    user_data = is_user_data(cfg.data)
    state = initial_state(resolved, cfg.seed)
    build = model_builder(resolved, state)
    build = executors.wrap_builder(build, cfg)  # each executor's settings for its copies (--ddp-sync-bn)
    if not user_data:  # the built-in sources make inputs of the model's declared shape
        check_input_shape(build(cfg.judge), resolved.input_shape, resolved.num_classes, task=resolved.task)
    stream = open_data(cfg.data, input_shape=resolved.input_shape, num_classes=resolved.num_classes,
                       batch_size=cfg.batch_size, steps=cfg.steps, seed=cfg.seed, workers=cfg.workers,
                       task=resolved.task)
    if stream.note:
        notes.append(stream.note)
    return state, build, stream


def _timed(timings: dict, key: str, progress, stage: str, work):
    t0 = time.perf_counter()
    if progress:
        progress(stage, 0, 1)
    out = work()
    if progress:
        progress(stage, 1, 1)
    timings[key] = time.perf_counter() - t0
    return out


def _parse_pair(targets, notes: list[str]) -> tuple[Target, Target]:
    if targets is None:
        pair, note = default_targets()
        if note:
            notes.append(note)
        return pair[0], pair[1]
    if isinstance(targets, str):
        pair = parse_targets(targets)
    elif isinstance(targets, (list, tuple)):
        items = [t if isinstance(t, Target) else Target.parse(str(t)) for t in targets]
        pair = parse_targets(",".join(str(t) for t in items))
    else:
        raise UsageError(f"targets must be 'A,B' or two specs, not {type(targets).__name__}")
    return pair[0], pair[1]


def _attach_env_and_verdict(result: CompareResult, env_findings, fingerprint) -> None:
    """Environment findings (this machine's audit unless injected), then the verdict."""
    from convcheck.diagnose import diagnose
    from convcheck.env import audit, collect

    if env_findings is None:
        fingerprint = fingerprint or collect()
        env_findings = audit(fingerprint)
    result.fingerprint = fingerprint
    result.findings = list(env_findings)
    result.verdict = diagnose(result)


__all__ = ["CONVERGED_RULE", "CompareConfig", "CompareResult", "TrainConfig", "TrainResult", "compare",
           "initial_state", "model_builder"]
