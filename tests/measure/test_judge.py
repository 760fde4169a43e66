"""The configurable judge: --judge / judge= / convcheck_judge, its default, and that it is used everywhere."""

from __future__ import annotations

import json
import os
import random
import traceback

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import convcheck
import convcheck.stages as stages
from convcheck.cli.main import main
from convcheck.errors import TargetUnavailable, UsageError
from convcheck.pipeline import compare
from convcheck.targets.runners.float64 import Float64Runner
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target, default_judge, parse_judge

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
FAST = dict(steps=2, batch_size=4, envelope=1)


# --- choosing the judge ---------------------------------------------------------------------------------

def test_a_judge_must_be_float64():
    with pytest.raises(UsageError, match="not a float64 target"):
        parse_judge("cpu")
    with pytest.raises(UsageError, match="not a float64 target"):
        parse_judge("cpu:bf16")
    assert parse_judge("cpu:float64") == Target.parse("cpu:float64")
    assert parse_judge("CPU:fp64") == Target.parse("cpu:float64")


@no_gpu
def test_a_gpu_judge_without_a_gpu_is_unavailable():
    with pytest.raises(TargetUnavailable, match="cuda:float64 cannot run here"):
        parse_judge("cuda:float64")


def test_default_judge_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    judge, why = default_judge()
    assert str(judge) == "cpu:float64" and why == "no GPU here"


@pytest.mark.parametrize("capability, expected", [((9, 0), "cuda:float64"), ((8, 0), "cuda:float64"),
                                                  ((8, 6), "cpu:float64"), ((12, 0), "cpu:float64")])
def test_default_judge_with_a_gpu(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    judge, why = default_judge()
    assert str(judge) == expected
    assert "NVIDIA Test GPU" in why and ("fast float64" if expected == "cuda:float64" else "slow float64") in why


# --- the CLI ----------------------------------------------------------------------------------------------

def test_cli_judge_cpu_float64_is_recorded(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["compare", "--model", "lenet", "--judge", "cpu:float64", "--steps", "2", "--batch-size", "4",
                 "--envelope", "0", "--out", str(out)])
    assert code in (0, 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["judge"] == "cpu:float64"
    assert summary["judge_reason"] == "chosen with --judge"
    assert "judge cpu:float64: chosen with --judge" in capsys.readouterr().out
    assert "judge cpu:float64 (chosen with --judge)" in (out / "report.html").read_text()


@no_gpu
def test_cli_gpu_judge_without_a_gpu_is_one_line_exit_2(capsys, tmp_path):
    code = main(["compare", "--model", "lenet", "--judge", "cuda:float64", "--no-save"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("convcheck: error: target cuda:float64 cannot run here") and err.count("\n") == 1


@pytest.mark.parametrize("spec, words", [("cpu", "not a float64 target"), ("cpu:amp-bf16", "not a float64 target"),
                                         ("gpu:float64", "unknown device")])
def test_cli_judge_that_cannot_judge_is_one_line_exit_2(capsys, spec, words):
    code = main(["compare", "--model", "lenet", "--judge", spec, "--no-save"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


# --- a judge given as cuda:float64 is used for every float64 reference -------------------------------------

class _Float64Conversions(TorchDispatchMode):
    """Records every conversion of a non-float64 tensor to float64 made outside the runners
    (which own every placement, the judge's included) and the metrics (which compare in the
    reference's dtype on the reference's device)."""

    # convcheck's own files by the package's real location, never by a folder name: a clone in a folder named
    # convcheck holds torch under convcheck/.venv/ (issue 44)
    PACKAGE = os.path.join(os.path.dirname(os.path.abspath(convcheck.__file__)), "")
    ALLOWED = (os.path.join(PACKAGE, "targets", "runners", ""), os.path.join(PACKAGE, "numerics", "metrics.py"))

    def __init__(self):
        super().__init__()
        self.outside: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float64
                and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.float64):
            # the convcheck code nearest the conversion made it
            mine = [f for f in traceback.extract_stack() if os.path.abspath(f.filename).startswith(self.PACKAGE)]
            if not mine or not os.path.abspath(mine[-1].filename).startswith(self.ALLOWED):
                self.outside.append(f"{mine[-1].filename}:{mine[-1].lineno}" if mine else "outside convcheck")
        return func(*args, **kwargs)


def test_the_conversion_detector_can_fail():
    from convcheck.numerics.metrics import rel_l2

    with _Float64Conversions() as seen:
        torch.ones(2).double()
        rel_l2(torch.ones(2), torch.ones(2, dtype=torch.float64))  # allowed: in the reference's dtype
    assert seen.outside == ["outside convcheck"]


class _NaiveNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


def _offset_net():
    """Its NaiveNorm loses every digit in bfloat16 (flagged: the intrinsic float64 copy runs), and a
    Linear feeding a BatchNorm has a bias gradient that cancels (the float64 terms norm runs)."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), _NaiveNorm(), nn.Linear(32, 16), nn.BatchNorm1d(16),
                        nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[1].bias.fill_(30.0)
    return net


def test_a_gpu_judge_builds_every_float64_reference(monkeypatch):
    """Mock a GPU judge (cuda:float64 that runs where the CPU is): no code path may build a float64
    copy of its own; every reference goes through the judge's runner, which lands it on the GPU."""
    monkeypatch.setattr(Float64Runner, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(Float64Runner, "torch_device", property(lambda self: torch.device("cpu")))
    used = {"reference": 0, "reference_module": 0, "place": 0}
    for name in used:
        original = getattr(Float64Runner, name)

        def spy(self, *a, _name=name, _original=original, **k):
            assert str(self.target) == "cuda:float64", f"{_name} used on {self.target}"
            used[_name] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(Float64Runner, name, spy)
    detector = _Float64Conversions()
    for stage in ("run_parity", "run_training"):
        original = getattr(stages, stage)

        def watched(*a, _original=original, **k):
            with detector:
                return _original(*a, **k)
        monkeypatch.setattr(stages, stage, watched)
    r = compare(_offset_net, "cpu,cpu:bf16", judge="cuda:float64", input_shape=(1, 8, 8), num_classes=4,
                steps=2, batch_size=8, envelope=1, env_findings=[])
    assert str(r.judge) == "cuda:float64" and r.to_summary()["judge"] == "cuda:float64"
    assert detector.outside == []
    assert used["place"] >= 3  # parity's judge, the stochastic probe, the judge's training arm
    assert used["reference_module"] >= 1 and used["reference"] >= 1  # intrinsic / terms-norm references
    assert r.parity.layers["intrinsic"].notna().any()
    assert set(named(r.training.outcomes)) == {"cpu", "cpu:bf16", "cuda:float64"}


# --- the caller's random state ---------------------------------------------------------------------------

@pytest.mark.parametrize("fails", [False, True])
def test_compare_leaves_the_callers_random_states_alone(fails):
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(7)
    torch_state, np_state, py_state = torch.random.get_rng_state(), np.random.get_state(), random.getstate()

    def factory():
        if fails:
            torch.randn(3)
            raise RuntimeError("broken model")
        return nn.Sequential(nn.Flatten(), nn.Linear(16, 2))

    if fails:
        with pytest.raises(UsageError):
            compare(factory, "cpu,cpu:bf16", input_shape=(1, 4, 4), num_classes=2, seed=5, **FAST)
    else:
        compare(factory, "cpu,cpu:bf16", input_shape=(1, 4, 4), num_classes=2, seed=5, env_findings=[], **FAST)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == np_state[0] and (after[1] == np_state[1]).all() and after[2:] == np_state[2:]
    assert random.getstate() == py_state
