"""The stages of a run, public and typed: plan -> measure -> evidence -> verdict.

``pipeline.compare`` (two targets), ``bundle.record.record_run`` (one target), ``bundle.diff.judge_here``
(the judge alone) and the pytest plugin's baselines compose these functions; none of them re-writes the
sequence or reaches into another module's private helpers::

    with caller_rng_kept(), guarded(progress, cfg.steps) as stage:
        run = plan(model, cfg)                       # resolve(...) -> check_model_trains(...) -> prepare(...)
        first = run.data.first()
        parity = measure_parity(run, first, progress=stage)
        training = measure_training(run, make_arms(...), progress=stage)
        env = audit_environment()
        result = decide_verdict(CompareResult(...))
        checked = verify(run, result)                # the verdict's remedies applied and re-run

Each stage returns an immutable value (``ResolvedRun``, ``Plan``, ``Environment``; ``ParityResult`` and
``TrainResult`` come from ``parity`` and ``train``). The guards (``caller_rng_kept``, ``guarded``,
``out_of_memory_explained``) keep the caller's random state and flags and turn failures into the
one-line errors the CLI and the API report. Where a target's work runs is its executor's business
(``convcheck.targets.executors``): the stages call the executors' hooks (``check_targets``, ``wrap_builder``,
``released``) and never name an executor.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

import numpy as np
import torch
import torch.nn as nn

from convcheck.targets import executors
from convcheck.plan.builder import initial_state, model_builder
from convcheck.plan.config import CompareConfig
from convcheck.plan.data_sources import data_input_shape, is_user_data, open_data
from convcheck.errors import RunFailed, UsageError
from convcheck.run_stage import RunStage, user_failures
from convcheck.plan.models import ResolvedModel, check_input_shape, checked_factory, resolve_model
from convcheck.measure.parity import ParityResult, run_parity
from convcheck.plan.preflight import check_trainable
from convcheck.plan.recipe import Recipe, build_recipe, check_classes
from convcheck.measure.loss_probe import loss_reduction_probe
from convcheck.targets.runners import preserved_global_flags
from convcheck.plan.stream import DataStream
from convcheck.plan.threads import ThreadChoice, bare_step, given_choice, measure_choice
from convcheck.targets.spec import Target, default_judge, default_targets, parse_judge, parse_targets
from convcheck.measure.train import TrainConfig, TrainResult, run_training
from convcheck.measure.train.arms import Arm

ModelArg = Union[str, ResolvedModel, nn.Module, Callable[[], nn.Module]]
Progress = Callable[[str, int, int], None]  # (stage, done, total); a RunStage also keeps partial results


# --- guards ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def caller_rng_kept() -> Iterator[None]:
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


@contextlib.contextmanager
def guarded(progress: Progress | None, steps: int) -> Iterator[RunStage]:
    """The caller's global flags restored; the user's code failing becomes a one-line UserCodeError
    (file, line, function, stage), the machine's limits a RunFailed; convcheck's bugs pass unchanged.
    Yields the progress callback that remembers the stage reached."""
    if progress is not None and not callable(progress):
        raise UsageError(f"progress must be a callable(stage, done, total), not {type(progress).__name__}")
    stage = RunStage(progress, steps)
    with preserved_global_flags(), user_failures(stage):
        yield stage


@contextlib.contextmanager
def out_of_memory_explained() -> Iterator[None]:
    """Running out of memory while measuring is a RunFailed that suggests a smaller batch."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
        raise RunFailed(f"out of GPU memory: {str(exc).splitlines()[0]} (try a smaller --batch-size)") from None
    except MemoryError:
        raise RunFailed("out of memory (try a smaller --batch-size)") from None


# --- plan -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResolvedRun:
    """What a run is, decided before any model is built: the config with its targets parsed and checked
    and its judge chosen (and why), the model as a factory plus its input spec, notes for the reader."""

    config: CompareConfig
    judge_reason: str
    model: ResolvedModel
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Everything the measuring stages share: the resolved run, the recipe as built, the shared float64
    initial weights, ``build(target)`` (a placed copy of the model with them) and the stream of batches.
    ``config`` holds the recipe's names as recorded (a built-in optimizer in lower case); ``setup_s``
    is the time making the weights, the builder and the stream took."""

    config: CompareConfig
    judge_reason: str
    model: ResolvedModel
    recipe: Recipe
    initial_state: dict[str, torch.Tensor]
    build: Callable[[Target], nn.Module]
    data: DataStream
    notes: tuple[str, ...] = ()
    setup_s: float = 0.0


def resolve(model: ModelArg, cfg: CompareConfig, *, input_shape=None, num_classes=None,
            targets_needed: int = 2) -> ResolvedRun:
    """The targets (``targets_needed``: 2 for compare, 1 for record, 0 for the judge alone) parsed and
    checked to run here, the judge chosen, then the model resolved; a model object's factory is
    checked on every call. Everything that cannot run here is refused before any model is built."""
    notes: list[str] = []
    targets = _parsed_targets(cfg.targets, targets_needed, notes)
    if targets_needed == 2:
        executors.check_targets(targets)  # the targets fit the way this process was started (torchrun's world)
    for t in targets:
        t.check_available()
    judge, reason = choose_judge(cfg.judge)
    cfg = dataclasses.replace(cfg, targets=targets, judge=judge)
    resolved = _resolved_model(model, input_shape, num_classes, need_io=not is_user_data(cfg.data),
                               data_shape=data_input_shape(cfg.data))
    if resolved.source == "object":
        resolved = dataclasses.replace(resolved, factory=checked_factory(resolved.factory, resolved.name))
    return ResolvedRun(cfg, reason, resolved, tuple(notes))


def choose_judge(spec) -> tuple[Target, str]:
    """The judge asked for (a float64 target that runs here), or this machine's default; and why."""
    if spec is not None:
        return parse_judge(spec), "chosen with --judge"
    return default_judge()


def check_model_trains(run: ResolvedRun) -> None:
    """The user's own model tried once in training mode (``convcheck.plan.preflight``) before anything is
    measured. Zoo models are known to train; with the user's own data the batches come later."""
    if run.model.source != "zoo" and not is_user_data(run.config.data):
        check_trainable(run.model, run.config.batch_size)


def prepare(run: ResolvedRun) -> Plan:
    """The recipe built and checked, the shared initial weights, ``build(target)`` and the data stream."""
    model = run.model
    recipe = build_recipe(run.config, model.task)
    check_classes(recipe, model.task, model.num_classes)
    cfg = run.config
    if isinstance(cfg.optimizer, str) and ":" not in cfg.optimizer:  # recorded by its torch.optim name
        cfg = dataclasses.replace(cfg, optimizer=recipe.optimizer_name.lower())
    t0 = time.perf_counter()
    state = initial_state(model, cfg.seed)
    build = executors.wrap_builder(model_builder(model, state), cfg)  # each executor's settings (--ddp-sync-bn)
    if not is_user_data(cfg.data):  # the built-in sources make inputs of the model's declared shape
        check_input_shape(build(cfg.judge), model.input_shape, model.num_classes, task=model.task)
    stream = open_data(cfg.data, input_shape=model.input_shape, num_classes=model.num_classes,
                       batch_size=cfg.batch_size, steps=cfg.steps, seed=cfg.seed, workers=cfg.workers,
                       task=model.task, loss=recipe.loss)
    notes = run.notes + ((stream.note,) if stream.note else ())
    return Plan(cfg, run.judge_reason, model, recipe, state, build, stream, notes, time.perf_counter() - t0)


def plan(model: ModelArg, cfg: CompareConfig, *, input_shape=None, num_classes=None) -> Plan:
    """A comparison's plan: ``resolve`` (config resolved once), ``check_model_trains``, ``prepare``."""
    run = resolve(model, cfg, input_shape=input_shape, num_classes=num_classes)
    check_model_trains(run)
    return prepare(run)


def _parsed_targets(targets, needed: int, notes: list[str]) -> tuple[Target, ...]:
    if needed == 0:
        return ()
    if needed == 1:
        if targets is None:
            raise UsageError("one target is needed (e.g. --target cuda)")
        return (targets if isinstance(targets, Target) else Target.parse(str(targets)),)
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


def _resolved_model(model: ModelArg, input_shape, num_classes, need_io: bool, data_shape=None) -> ResolvedModel:
    """The model as a factory plus its input spec; ``need_io=False`` (the user's own data defines the
    inputs) leaves an input shape / class count the model does not declare unknown. ``data_shape``: one
    sample's shape as a data file tells it, for a user model that declares none."""
    if isinstance(model, ResolvedModel):
        return model
    if isinstance(model, str):
        return resolve_model(model, input_shape=input_shape, num_classes=num_classes, infer=need_io,
                             data_shape=data_shape)
    if isinstance(model, nn.Module):
        template = model
        factory = lambda: copy.deepcopy(template)  # noqa: E731
        name = type(model).__name__
    elif callable(model):
        factory, name = model, getattr(model, "__name__", "model")
    else:
        raise UsageError(f"model must be a name, an nn.Module or a factory, not {type(model).__name__}")
    input_shape = input_shape or data_shape
    if need_io and (input_shape is None or num_classes is None):
        raise UsageError(f"model {name!r}: pass input_shape=(C, H, W) and num_classes for a model object")
    return ResolvedModel(name=name, factory=factory, input_shape=tuple(input_shape) if input_shape else None,
                         num_classes=int(num_classes) if num_classes else None, source="object")


@contextlib.contextmanager
def threads_given(threads: int | None) -> Iterator[None]:
    """``--threads N`` in force from the start of a run, before the model is built or a batch is made, so that
    nothing the run computes depends on the caller's count; the caller's count is put back afterwards.
    ``None`` changes nothing (the count is measured later, on the first batch: ``threads_chosen``)."""
    caller = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(caller)


@contextlib.contextmanager
def threads_chosen(plan: Plan, batch, targets: Sequence[Target] | None = None) -> Iterator[ThreadChoice]:
    """torch's intra-op threads for the measuring stages, the same for every arm and the judge: the
    user's setting (``--threads``, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, ``torch.set_num_threads``),
    else the faster of 1 and the default, timed once on ``batch`` with a bare step of the judge and of each
    target (``convcheck.plan.threads``). A target whose work runs in other processes keeps the count as it
    is. The caller's count is put back afterwards, however the stages end."""
    cfg = plan.config
    targets = list(cfg.targets if targets is None else targets)
    caller = torch.get_num_threads()
    try:
        choice = given_choice(cfg.threads)
        if choice is None and any(t.runner.executor != "in-process" for t in targets):
            choice = ThreadChoice(caller, "kept: the ranks of a data-parallel target set their own", "kept")
        if choice is None:
            with caller_rng_kept():  # the probe's steps draw no number the measured steps would see
                steps = [bare_step(plan.build, t, batch, plan.recipe) for t in [cfg.judge, *targets]]
                choice = measure_choice(steps, caller)
        torch.set_num_threads(choice.threads)
        yield choice
    finally:
        torch.set_num_threads(caller)


# --- measure --------------------------------------------------------------------------------------

def measure_parity(plan: Plan, batch, targets: Sequence[Target] | None = None, *,
                   progress: Progress | None = None) -> ParityResult:
    """One step of ``targets`` (default: the plan's) against the judge on ``batch`` (the stream's first).
    ``progress`` hears ("parity", done, total); a ``RunStage`` keeps the table for a stopped run."""
    cfg = plan.config
    if progress:
        progress("parity", 0, 1)
    parity = run_parity(plan.build, batch, list(cfg.targets if targets is None else targets),
                        tolerances=cfg.tolerances, judge=cfg.judge, seed=cfg.seed, loss_fn=plan.recipe.loss,
                        progress=(lambda done, total: progress("parity", done, total)) if progress else None,
                        repeat=cfg.repeat)
    if progress:
        progress("parity", 1, 1)
    if hasattr(progress, "keep"):
        progress.keep(parity=parity)
    return parity


def measure_loss_reduction(plan: Plan, batch) -> float:
    """loss(batch) / mean(loss(halves)) of the judge's model: ~1 for an averaged loss, ~2 for a summed one."""
    judge = plan.config.judge
    return loss_reduction_probe(plan.build(judge), judge.runner, batch, plan.recipe.loss)


def measure_weight_decay(plan: Plan) -> dict | None:
    """The optimizer's strongest weight decay per step, read from its own ``param_groups`` as the recipe builds
    it over the judge's model for a factory (its groups included; a named optimizer over one stand-in
    parameter: no model built): ``{optimizer, lr, weight_decay, momentum}`` of the
    group with the largest lr x weight_decay, the lr before any schedule (``initial_lr``: the peak of a
    warm-up). Only where lr x wd is what the weights lose a step: SGD's coupled decay and a decoupled one
    (AdamW, ``decoupled_weight_decay``); an adaptive optimizer's coupled L2 goes through its normalisation and
    is not read (None). None also when the optimizer cannot be built here."""
    named = isinstance(plan.config.optimizer, str) and ":" not in plan.config.optimizer
    try:  # a named optimizer's one group is its settings: built over one stand-in parameter, no model
        params = [torch.nn.Parameter(torch.zeros(1))] if named else plan.build(plan.config.judge).parameters()
        opt = plan.recipe.make_optimizer(params)
    except Exception:  # noqa: BLE001 - the training run reports a factory's failure; this is evidence only
        return None
    plain = isinstance(opt, torch.optim.SGD)
    decoupled = isinstance(opt, torch.optim.AdamW)  # torch < 2.6's AdamW has no decoupled_weight_decay key
    first = opt.param_groups[0] if opt.param_groups else {}
    lr0 = first.get("initial_lr", first.get("lr"))  # group 0's: the training curves record its lr as it ran
    best = None
    for g in opt.param_groups:
        lr, wd = g.get("initial_lr", g.get("lr")), g.get("weight_decay") or 0.0
        if not (plain or decoupled or g.get("decoupled_weight_decay")) or not isinstance(lr, (int, float)) \
                or isinstance(lr, bool) or not wd:
            continue
        if best is None or lr * wd > best["lr"] * best["weight_decay"]:
            best = dict(optimizer=type(opt).__name__, lr=float(lr), weight_decay=float(wd),
                        momentum=float(g.get("momentum") or 0.0) if plain else 0.0,
                        lr0=float(lr0) if isinstance(lr0, (int, float)) else float("nan"))
    return best


def measure_training(plan: Plan, arms: Sequence[Arm], *, progress: Progress | None = None) -> TrainResult:
    """``arms`` trained in lockstep on the plan's stream with its recipe. ``progress`` hears
    ("train", arm-steps done, total); a ``RunStage`` keeps the curves for a stopped run."""
    cfg = plan.config
    result = run_training(plan.build, plan.data, list(arms), TrainConfig(steps=cfg.steps, seed=cfg.seed,
                          recipe=plan.recipe), tolerances=cfg.tolerances,
                          progress=(lambda done, total: progress("train", done, total)) if progress else None,
                          keep=getattr(progress, "keep", None))
    refuse_untrained(result, plan.recipe)
    return result


def refuse_untrained(result: TrainResult, recipe=None) -> None:
    """A loss that is the same number at every step of every arm (a loss that does not depend on the model's
    output: ``(out * 0).sum()``) trains nothing: a usage error naming it, never an ``ok`` verdict."""
    losses = result.curves["loss"] if "loss" in result.curves else None
    if losses is None or len(losses) < 2 or result.curves["step"].nunique() < 2:
        return
    first = float(losses.iloc[0])
    if math.isfinite(first) and bool((losses == first).all()):
        name = getattr(recipe, "loss_name", None)
        raise UsageError(f"the loss{f' {name!r}' if name else ''} is {first:g} at every step on every target: it does "
                         "not depend on the model's output, so nothing trains; check the loss function")


# --- evidence and verdict -------------------------------------------------------------------------

@dataclass(frozen=True)
class Environment:
    """The machine's fingerprint (None when findings were given without one) and its audit findings."""

    fingerprint: object | None
    findings: tuple = ()


def audit_environment(findings=None, fingerprint=None) -> Environment:
    """This machine's fingerprint (or ``fingerprint``) audited, unless ``findings`` are given (a recorded
    environment diagnosed elsewhere)."""
    from convcheck.env import audit, collect

    if findings is None:
        fingerprint = fingerprint or collect()
        findings = audit(fingerprint)
    return Environment(fingerprint, tuple(findings))


def verify(plan: Plan, result, mode: bool | None = None):
    """``result``'s verdict checked by running its remedies: the failing arm re-run (same seed, weights,
    batches and steps) with each fitting action applied (``convcheck.verify``) -> an immutable
    ``Verification``. ``mode``: False runs nothing, None (default) one re-run of one in-process arm at most,
    True every fitting action."""
    from convcheck.verify import verify_verdict

    cfg = plan.config
    training = result.training
    arms = len(training.arms)
    train_s = (getattr(result, "timings", None) or {}).get("train_s", float("nan"))
    return verify_verdict(result.verdict, build=plan.build, data=plan.data, recipe=plan.recipe, steps=cfg.steps,
                          seed=cfg.seed, training=training, targets=cfg.targets, judge=cfg.judge, mode=mode,
                          tolerances=cfg.tolerances, arm_seconds=train_s / max(1, arms),
                          config=cfg)


def decide_verdict(result):
    """``result`` (a ``CompareResult`` with its evidence, no verdict yet) with the verdict of the rules."""
    from convcheck.diagnose import diagnose

    return dataclasses.replace(result, verdict=diagnose(result))
