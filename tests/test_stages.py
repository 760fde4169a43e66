"""convcheck.stages: the public stages that compare, record and diff compose, and their guards."""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import convcheck.stages as stages
from convcheck.plan.config import CompareConfig
from convcheck.errors import RunFailed, UsageError, UserCodeError
from convcheck.run_stage import RunStage
from convcheck.pipeline import CompareResult, compare
from convcheck.targets.spec import Target
from convcheck.measure.train import make_arms

RUN = dict(steps=2, batch_size=8, envelope=1)
PAIR = "cpu,cpu:bf16"


class TrainsBadly(nn.Module):
    """Fine in eval mode (the input-shape probe), raises in training mode (every measured step)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        if self.training:
            raise ValueError("no training here")
        return self.fc(x.flatten(1))


def _by_hand(model: str, cfg: CompareConfig) -> CompareResult:
    """compare(), written out with the public stages only."""
    with stages.caller_rng_kept(), stages.guarded(None, cfg.steps) as stage:
        run = stages.plan(model, cfg)
        first = run.data.first()
        parity = stages.measure_parity(run, first, progress=stage)
        ratio = stages.measure_loss_reduction(run, first)
        c = run.config
        training = stages.measure_training(run, make_arms(list(c.targets), c.envelope, c.seed, c.judge),
                                           progress=stage)
        env = stages.audit_environment([])
        return stages.decide_verdict(CompareResult(
            model=run.model, config=c, parity=parity, training=training, data_source=run.data.source,
            batch_hashes=run.data.hashes, init_hash="", data_stats=run.data.stats(), notes=list(run.notes),
            findings=list(env.findings), fingerprint=env.fingerprint, judge_reason=run.judge_reason,
            recipe=run.recipe, batches_hash=run.data.all_hash, loss_batch_ratio=ratio))


def test_the_stages_by_hand_give_compares_tables_and_verdict():
    cfg = CompareConfig(targets=PAIR, **RUN)
    ours = compare("lenet", config=cfg, env_findings=[])
    hand = _by_hand("lenet", cfg)
    assert hand.parity.layers.equals(ours.parity.layers)
    assert hand.training.curves.equals(ours.training.curves)
    assert hand.training.layer_grads.equals(ours.training.layer_grads)
    assert hand.verdict == ours.verdict
    assert hand.config == ours.config and hand.batches_hash == ours.batches_hash
    assert hand.loss_batch_ratio == ours.loss_batch_ratio


def test_compare_resolves_the_config_once(monkeypatch):
    calls = {"parse_targets": 0, "default_judge": 0}

    def counted(name):
        real = getattr(stages, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(stages, name, wrapper)

    counted("parse_targets")
    counted("default_judge")
    compare("lenet", PAIR, steps=1, batch_size=4, envelope=0, env_findings=[])
    assert calls == {"parse_targets": 1, "default_judge": 1}


def test_the_plan_is_immutable_and_complete():
    run = stages.plan("lenet", CompareConfig(targets=PAIR, **RUN))
    assert [str(t) for t in run.config.targets] == ["cpu", "cpu:bf16"]
    assert isinstance(run.config.judge, Target) and run.judge_reason
    assert run.config.optimizer == "adam" and run.recipe.optimizer_name.lower() == "adam"
    assert set(run.initial_state) == set(run.build(run.config.judge).state_dict())
    assert run.data.source == "synthetic" and run.setup_s >= 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.notes = ("changed",)


@pytest.mark.parametrize("needed, targets, expected", [
    (2, PAIR, ["cpu", "cpu:bf16"]),
    (2, [Target.parse("cpu"), "cpu:fp16"], ["cpu", "cpu:fp16"]),
    (1, "cpu:bf16", ["cpu:bf16"]),
    (0, None, []),
])
def test_resolve_takes_as_many_targets_as_the_command_needs(needed, targets, expected):
    run = stages.resolve("lenet", CompareConfig(targets=targets), targets_needed=needed)
    assert [str(t) for t in run.config.targets] == expected
    assert run.config.judge.runner.is_float64


def test_default_targets_leave_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = stages.resolve("lenet", CompareConfig())
    assert [str(t) for t in run.config.targets] == ["cpu", "cpu:emulate-tf32"]
    assert str(run.config.judge) == "cpu:float64"
    assert any("no GPU here" in n for n in run.notes)


@pytest.mark.parametrize("cfg, needed, match", [
    (CompareConfig(targets="cpu"), 2, "exactly two"),
    (CompareConfig(targets="cpu,cpu:fp8"), 2, "'fp8'"),
    (CompareConfig(targets=None), 1, "one target is needed"),
    (CompareConfig(targets=PAIR, judge="cpu"), 2, "not a float64 target"),
])
def test_resolve_refuses_in_one_line(cfg, needed, match):
    with pytest.raises(UsageError, match=match) as info:
        stages.resolve("lenet", cfg, targets_needed=needed)
    assert "\n" not in str(info.value)


def test_a_model_that_cannot_train_is_refused_before_anything_is_measured():
    run = stages.resolve(TrainsBadly, CompareConfig(targets=PAIR, **RUN), input_shape=(1, 4, 4), num_classes=4)
    with pytest.raises(UsageError, match="no training here"):
        stages.check_model_trains(run)


def test_the_users_code_failing_while_measuring_is_one_line():
    cfg = CompareConfig(targets=PAIR, **RUN)
    with pytest.raises(UserCodeError) as info, stages.guarded(None, cfg.steps) as stage:
        run = stages.prepare(stages.resolve(TrainsBadly, cfg, input_shape=(1, 4, 4), num_classes=4))
        stages.measure_parity(run, run.data.first(), progress=stage)
    line = str(info.value)
    assert "\n" not in line and "ValueError: no training here" in line and "TrainsBadly.forward" in line
    assert "parity" in line


def test_a_factory_that_raises_is_one_line_from_prepare():
    def broken():
        raise RuntimeError("no such weights")

    run = stages.resolve(broken, CompareConfig(targets=PAIR, **RUN), input_shape=(1, 4, 4), num_classes=4)
    with pytest.raises(UsageError, match="no such weights"):
        stages.prepare(run)


def test_guarded_refuses_a_progress_that_is_not_callable_and_yields_the_stage():
    with pytest.raises(UsageError, match="progress must be a callable"):
        with stages.guarded(42, 3):
            pass
    seen = []
    with stages.guarded(lambda *a: seen.append(a), 3) as stage:
        assert isinstance(stage, RunStage)
        stage("parity", 0, 1)
    assert seen == [("parity", 0, 1)]


def test_running_out_of_memory_while_measuring_suggests_a_smaller_batch():
    with pytest.raises(RunFailed, match="smaller --batch-size"):
        with stages.out_of_memory_explained():
            raise MemoryError


def test_the_callers_random_states_are_kept():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    before = torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    with stages.caller_rng_kept():
        torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])


def test_evidence_given_is_not_audited_again_and_the_verdict_is_added_by_replace():
    env = stages.audit_environment([])
    assert env.findings == () and env.fingerprint is None
    result = compare("lenet", PAIR, steps=1, batch_size=4, envelope=0, env_findings=[])
    bare = dataclasses.replace(result, verdict=None)
    judged = stages.decide_verdict(bare)
    assert bare.verdict is None and judged.verdict == result.verdict


COMPOSERS = ("pipeline.py", "stages.py", "cli/compare.py", "cli/record.py", "cli/diff.py", "pytest_plugin.py",
             "bundle/record.py", "bundle/diff.py", "bundle/baseline.py")


@pytest.mark.parametrize("path", COMPOSERS)
def test_the_composers_import_no_private_helper_and_bundle_no_cli(path):
    root = Path(stages.__file__).parent
    tree = ast.parse((root / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("convcheck"):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            assert not private, f"{path} imports {private} from {node.module}"
            if path.startswith("bundle/"):
                assert not node.module.startswith("convcheck.cli"), f"{path} imports {node.module}"
