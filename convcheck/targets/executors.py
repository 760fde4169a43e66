"""Executors: *where* a target's work runs, behind one interface (in this process, or a pool of ranks).

A runner (``convcheck.targets.runners``) says *how* a kind of target computes; its
executor says where: ``Runner.executor`` names one, and the executor of that
name runs the target's parity step (``parity``), builds its training arm
(``training_arm``) and turns what the arm gathered into verdict-ready findings
(``findings``). ``Executor`` itself is the in-process executor: it runs the
step the generic code hands it (``ParityStep.here``, ``ArmJob.here``) and adds
no findings. An executor that runs elsewhere registers itself (``register``)
from a module listed in ``PLUGINS``, which the registry imports by name the
first time it is asked: the dependency points from the plugin down to this
module, never back up.

Process-level hooks a kind of target may need (each a no-op here):
``before_threads`` (before torch loads: the spec strings as given),
``serve`` (this process serves another's run instead of comparing),
``check_targets`` (the targets fit the way this process was started),
``release`` (the end of a comparison, however it ends) and ``wrap_builder``
(the user's settings for this kind's model copies).

Torch-free, so that ``cli`` can call ``before_threads`` before torch loads.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

IN_PROCESS = "in-process"

# Modules that register an executor when imported (a kind of target that runs outside this process).
PLUGINS = ("convcheck.ddp.executor",)


@dataclass(frozen=True)
class TargetParity:
    """One target's part of the parity table, as its executor measured it."""

    loss: float
    rows: list  # parity rows (``parity.result.COLUMNS``)
    # the logits and gradients of this pass, when a rerun must measure its run-to-run difference
    rerun_against: list | None = None
    self_difference: float | None = None  # known without a rerun (0.0: documented-deterministic kernels)


@dataclass(frozen=True)
class ParityStep:
    """One target's parity step as the generic layer hands it to an executor: the judge's gradients and
    what any executor needs to run the step itself, and ``here(target)``, parity's own pass in this process."""

    build: Callable
    batch: tuple
    judge_grads: Mapping[str, Any]
    loss_fn: Callable
    seed: int
    here: Callable[[Any], TargetParity]


@dataclass(frozen=True)
class ArmJob:
    """One training arm as ``run_training`` hands it to an executor; ``here(arm)`` builds it in this process.
    Whatever an executor returns steps like ``train.arm_state.ArmState`` (``arm``, ``model``, ``step``,
    ``step_index``, ``producer``, ``close``) and has ``evidence``: None, or what the arm gathered for its
    executor's ``findings`` (kept opaque in ``TrainResult.arm_evidence``)."""

    build: Callable
    steps: int
    recipe: Any
    here: Callable[[Any], Any]


class Finding(Protocol):
    """What an executor's ``findings`` return, as the generic rules read them (``Evidence.executor_findings``;
    the executor's own rules read the rest of its findings)."""

    kind: str
    arm: str
    summary: str

    @property
    def explains(self) -> tuple[str, ...]: ...  # symptom kinds (``convcheck.diagnose.detectors.training``) it accounts for


class Executor:
    """Runs a target's work in this process: the in-process executor, and the base of every other."""

    name = IN_PROCESS
    reads_judge_record = True  # whether its parity step reads the judge's per-call record (``ParityStep.here``)

    def parity(self, target, step: ParityStep) -> TargetParity:
        return step.here(target)

    def training_arm(self, arm, job: ArmJob):
        return job.here(arm)

    def findings(self, training, arm: str, parity=None) -> tuple[Finding, ...]:
        """Verdict-ready findings about ``arm`` (a target of this executor) from ``training`` and the
        one-step ``parity`` result (its rows of this target)."""
        return ()

    # -- process-level hooks ----------------------------------------------------------------

    def before_threads(self, specs: list[str]) -> None:
        """Called with the target specs as given, before torch loads (environment variables torch reads)."""

    def serve(self, config) -> int | None:
        """An exit code when this process serves another's run instead of comparing, else None."""
        return None

    def check_targets(self, targets) -> None:
        """A ``UsageError`` when the targets cannot run the way this process was started."""

    def release(self) -> None:
        """The comparison has ended (however it ended)."""

    def wrap_builder(self, build, config):
        """``build`` with the user's settings for this executor's model copies (``config``'s fields)."""
        return build


_REGISTERED: dict[str, Executor] = {IN_PROCESS: Executor()}
_loaded = False


def register(executor: Executor) -> Executor:
    """Make ``executor`` the one of its ``name`` (a plugin calls it when imported)."""
    _REGISTERED[executor.name] = executor
    return executor


def load_plugins() -> None:
    """Import every module of ``PLUGINS`` once (each registers its executor, and may register verdict rules)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in PLUGINS:
            importlib.import_module(module)


def executors() -> list[Executor]:
    """Every registered executor, the in-process one first."""
    load_plugins()
    return list(_REGISTERED.values())


def executor_for(target) -> Executor:
    """The executor of ``target``'s kind (``target.runner.executor``)."""
    name = target.runner.executor
    if name not in _REGISTERED:
        load_plugins()
    try:
        return _REGISTERED[name]
    except KeyError:
        raise LookupError(f"target {target}: no executor {name!r} is registered") from None


def before_threads(specs) -> None:
    """Every executor's ``before_threads`` with the target specs (a comma-separated string or a list)."""
    if isinstance(specs, str):
        specs = specs.split(",")
    elif not isinstance(specs, (list, tuple)):
        specs = ()  # a value of another kind (targets = 5 in a project file): the config's validation names it
    listed = [str(s).strip().lower() for s in specs if str(s).strip()]
    for ex in executors():
        ex.before_threads(listed)


def serve(config) -> int | None:
    """The exit code of the first executor that serves another's run from this process, else None."""
    for ex in executors():
        code = ex.serve(config)
        if code is not None:
            return code
    return None


def check_targets(targets) -> None:
    for ex in executors():
        ex.check_targets(targets)


def wrap_builder(build, config):
    for ex in executors():
        build = ex.wrap_builder(build, config)
    return build


@contextlib.contextmanager
def released():
    """Every executor's ``release`` when the block ends, however it ends."""
    try:
        yield
    finally:
        for ex in executors():
            ex.release()
