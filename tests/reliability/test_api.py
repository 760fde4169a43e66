"""``convcheck.compare()`` from Python: every failure of the user's code or arguments is a one-line
``ConvcheckError``; the machine's limits are ``RunFailed``; Ctrl-C stays ``KeyboardInterrupt``;
global flags and random states are as the caller left them."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.errors import ConvcheckError, RunFailed, UsageError, UserCodeError
from convcheck.targets.runners import snapshot_global_flags
from tests.reliability.conftest import BAD_MODELS

SMALL = dict(input_shape=(1, 4, 4), num_classes=3, steps=1, batch_size=2, envelope=0, judge="cpu:float64",
             env_findings=[])


def _bad_models():
    """A fresh copy of bad_models.py (its counters start at zero)."""
    spec = importlib.util.spec_from_file_location("bad_models_fresh", BAD_MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare(model, **options):
    return convcheck.compare(model, **{"targets": "cpu,cpu:bf16", **SMALL, **options})


USER_FAILURES = [
    ("returns_42", {}, UsageError, "returned int"),
    ("returns_none", {}, UsageError, "returned NoneType"),
    ("raises", {}, UsageError, "the weights file is missing"),
    ("needs_an_argument", {}, UsageError, "missing 1 required positional argument"),
    ("raises_on_second_build", {}, ConvcheckError, "only one model per process"),
    ("raises_at_step_3", {"steps": 5}, UserCodeError, "during training step 3 of 5"),
    ("no_parameters", {}, UsageError, "no parameters"),
    ("frozen", {}, UsageError, "frozen"),
    ("integer_output", {}, UsageError, "int64 output"),
    ("detached_output", {}, UsageError, "does not depend on any trainable parameter"),
    ("batchnorm1d", {"batch_size": 1}, UsageError, "Expected more than 1 value per channel"),
    ("wrong_shape", {}, UsageError, "rejects input shape"),
]


@pytest.mark.parametrize("name, options, error, text", USER_FAILURES, ids=[u[0] for u in USER_FAILURES])
def test_the_users_model_failing_is_one_line(name, options, error, text):
    factory = getattr(_bad_models(), name)
    with pytest.raises(error) as info:
        _compare(factory, **options)
    message = str(info.value)
    assert text in message and "\n" not in message


def test_a_model_instance_that_cannot_train():
    with pytest.raises(UsageError, match="no parameters"):
        _compare(_bad_models().no_parameters())


def test_the_line_names_the_file_line_and_function():
    with pytest.raises(UserCodeError) as info:
        _compare(_bad_models().raises_at_step_3, steps=5)
    message = str(info.value)
    assert "FailsAtStep3.forward (" in message and "bad_models.py:" in message
    assert isinstance(info.value.__cause__, ValueError)  # the original, with its traceback, for debugging


BAD_ARGUMENTS = [
    ({"seed": 1.5}, "seed"), ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": True}, "seed"),
    ({"steps": True}, "steps"), ({"steps": 0}, "steps"), ({"steps": 2.0}, "steps"), ({"batch_size": "8"}, "batch"),
    ({"envelope": -1}, "envelope"), ({"lr": float("nan")}, "learning rate"), ({"lr": "fast"}, "learning rate"),
    ({"bound_factor": float("nan")}, "bound_factor"), ({"min_error": -1}, "min_error"),
    ({"input_shape": (1, "a", 3)}, "input_shape"), ({"input_shape": (1, 4)}, "input_shape"),
    ({"input_shape": 7}, "input_shape"), ({"num_classes": 2.5}, "num_classes"), ({"num_classes": 0}, "num_classes"),
    ({"progress": 3}, "progress"), ({"env_findings": 42}, "env_findings"), ({"fingerprint": "gpu"}, "fingerprint"),
    ({"config": {"steps": 1}}, "config"), ({"no_such_option": 1}, "no_such_option"),
    ({"targets": 42}, "targets"), ({"judge": "cpu"}, "float64"), ({"data": 42}, "data"),
]


@pytest.mark.parametrize("options, text", BAD_ARGUMENTS, ids=[f"{next(iter(o))}={next(iter(o.values()))!r}"
                                                              for o, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_usage_errors(options, text):
    with pytest.raises(ConvcheckError, match=text):
        _compare(_bad_models().good, **options)


def test_tolerances_refuse_nan():
    with pytest.raises(UsageError, match="bound_factor"):
        convcheck.Tolerances(bound_factor=float("nan"))


def test_out_of_memory_is_run_failed_and_ctrl_c_stays_an_interrupt():
    models = _bad_models()
    with pytest.raises(RunFailed, match="out of memory: .*DefaultCPUAllocator"):
        _compare(models.out_of_memory_at_step_3, steps=5)
    with pytest.raises(RunFailed, match="out of memory"):
        _compare(models.memory_error_at_step_3, steps=5)
    with pytest.raises(KeyboardInterrupt):
        _compare(models.interrupted_at_step_3, steps=5)


def test_flags_the_model_changes_are_restored():
    before = snapshot_global_flags()
    rng = torch.random.get_rng_state()
    _compare(_bad_models().flag_changer)
    assert snapshot_global_flags() == before
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_flags_are_restored_after_a_failure_too():
    before = snapshot_global_flags()

    class ChangesThenFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 3)

        def forward(self, x):
            torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic
            if self.training:
                raise ValueError("after changing a flag")
            return self.fc(x.flatten(1))

    with pytest.raises(UsageError, match="after changing a flag"):
        _compare(ChangesThenFails)
    assert snapshot_global_flags() == before


def test_the_shape_probe_restores_flags():
    from convcheck.plan.models import check_input_shape

    before = snapshot_global_flags()
    check_input_shape(_bad_models().flag_changer(), (1, 4, 4), 3)
    assert snapshot_global_flags() == before


def test_a_bug_in_convcheck_is_not_disguised(monkeypatch):
    """A failure whose innermost non-library frame is convcheck's own passes unchanged (no UsageError)."""
    import operator

    import convcheck.diagnose as diagnose

    monkeypatch.setattr(diagnose, "diagnose", operator.itemgetter("x"))
    with pytest.raises(TypeError):
        _compare(_bad_models().good)
