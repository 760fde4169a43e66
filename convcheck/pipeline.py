"""``convcheck.compare`` lives here: the whole pipeline behind the CLI, the pytest plugin and the API.

A comparison is the stages of ``convcheck.stages`` composed: plan (config resolved once, model,
recipe, weights, data) -> measure (parity, training) -> evidence (environment audit) -> verdict.
``record``, ``diff`` and the plugin's baselines compose the same stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from convcheck.targets import executors
from convcheck.plan.builder import ModelBuilder, initial_state, model_builder  # noqa: F401 - re-exported
from convcheck.plan.config import CompareConfig, with_options
from convcheck.plan.seeded_data import hash_state_dict
from convcheck.errors import UsageError
from convcheck.plan.models import ResolvedModel
from convcheck.measure.parity import ParityResult
from convcheck.plan.recipe import Recipe
from convcheck.stages import (ModelArg, audit_environment, caller_rng_kept, decide_verdict, guarded,
                              measure_loss_reduction, measure_parity, measure_training,
                              measure_weight_decay,
                              out_of_memory_explained, plan, threads_chosen, threads_given, verify)
from convcheck.targets.spec import Target
from convcheck.measure.train import CONVERGED_RULE, TrainConfig, TrainResult, make_arms


@dataclass(frozen=True)
class CompareResult:
    """The outcome of one comparison, built once with everything measured (the verdict and the verification
    added by ``dataclasses.replace``). ``ok``: the targets agree. It has no truth value: ``if result`` raises,
    so that no reader has to guess what it would mean."""

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
    # the optimizer's strongest weight decay per step (``stages.measure_weight_decay``); None: none read
    weight_decay: dict | None = None
    verification: object | None = None  # a convcheck.verify.Verification: the verdict's remedies re-run
    threads: object | None = None  # the plan's ThreadChoice (convcheck.plan.threads); None when rebuilt from bundles
    # the two recorded runs a diff compared (``convcheck diff``, ``compare --against``): the reports title it so
    diff_of: tuple[str, str] | None = None

    @property
    def targets(self) -> tuple[Target, Target]:
        return self.config.targets

    @property
    def judge(self) -> Target:
        return self.config.judge

    @property
    def ok(self) -> bool:
        """The targets agree: the verdict's category is ``ok`` (exit 0). Before a verdict is decided: parity
        passed and every arm converged."""
        if self.verdict is not None:
            return self.verdict.category == "ok"
        return bool(self.parity) and all(o.converged for o in self.training.outcomes.values())

    def __bool__(self) -> bool:
        raise TypeError("a CompareResult has no truth value: ask result.ok (the targets agree) or read "
                        "result.verdict")

    def to_summary(self) -> dict:
        from convcheck.report.export import summary_dict

        return summary_dict(self)


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
    from convcheck.plan.preflight import check_arguments

    if config is not None and not isinstance(config, CompareConfig):
        raise UsageError(f"config must be a convcheck.CompareConfig, not {type(config).__name__}")
    if targets is not None:
        options["targets"] = targets
    cfg = with_options(config or CompareConfig(), **options)
    with caller_rng_kept(), threads_given(cfg.threads), guarded(progress, cfg.steps) as stage, \
            executors.released():
        check_arguments(input_shape, num_classes, env_findings, fingerprint)
        run = plan(model, cfg, input_shape=input_shape, num_classes=num_classes)
        cfg = run.config
        timings = {"setup_s": run.setup_s}
        with contextlib.ExitStack() as chosen:  # one thread count for the measures and the verification
            with out_of_memory_explained():
                made_at = torch.get_num_threads()
                first = run.data.first()
                t0 = time.perf_counter()
                threads = chosen.enter_context(threads_chosen(run, first))
                timings["threads_s"] = time.perf_counter() - t0
                if threads.threads != made_at:  # measured: made again at the count every arm trains at, so
                    first = run.data.first()    # user data whose bits follow the count is one batch throughout
                parity = _timed(timings, "parity_s", lambda: measure_parity(run, first, progress=stage))
                loss_ratio = measure_loss_reduction(run, first)
                decay = measure_weight_decay(run)
                arms = make_arms(list(cfg.targets), cfg.envelope, cfg.seed, cfg.judge)
                training = _timed(timings, "train_s", lambda: measure_training(run, arms, progress=stage))
            env = audit_environment(env_findings, fingerprint)
            result = decide_verdict(CompareResult(
                model=run.model, config=cfg, parity=parity, training=training, data_source=run.data.source,
                batch_hashes=run.data.hashes, init_hash=hash_state_dict(run.initial_state),
                data_stats=run.data.stats(), notes=list(run.notes), findings=list(env.findings),
                fingerprint=env.fingerprint, timings=dict(timings), judge_reason=run.judge_reason, recipe=run.recipe,
                batches_hash=run.data.all_hash, loss_batch_ratio=loss_ratio, threads=threads,
                weight_decay=decay,
            ))
            with out_of_memory_explained():
                checked = _timed(timings, "verify_s", lambda: verify(run, result, cfg.verify))
        return dataclasses.replace(result, verification=checked, timings=timings)  # the verification's time added


def _timed(timings: dict[str, float], key: str, work):
    t0 = time.perf_counter()
    out = work()
    timings[key] = time.perf_counter() - t0
    return out


__all__ = ["CONVERGED_RULE", "CompareConfig", "CompareResult", "TrainConfig", "TrainResult", "compare",
           "initial_state", "model_builder"]
