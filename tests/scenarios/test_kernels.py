"""The run-to-run rerun: skipped for a CPU pass of documented-deterministic kernels, kept (and
finding the difference) for a pass that runs a kernel PyTorch lists as nondeterministic."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck.measure.parity as parity
from convcheck.measure.parity.kernels import rerun_needed
from convcheck.measure.parity.snapshots import Snapshots
from convcheck.pipeline import compare
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target

from .models import racy_scatter_net

T = Target.parse

MNIST_SHAPE = dict(input_shape=(1, 28, 28), num_classes=10)


@torch.library.custom_op("convcheck_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_autograd(lambda ctx, g: g * 2)


class _Twice(nn.Module):
    def forward(self, x):
        return _twice(x)


CPU = torch.device("cpu")


def _ops(forward) -> set:
    """The operators a forward runs, as the judge's record sees them."""
    with Snapshots() as seen:
        forward()
    return seen.ops


def test_stock_cpu_pass_needs_no_rerun_and_other_devices_do():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    ops = _ops(lambda: net(torch.randn(2, 1, 28, 28)).sum())
    assert not rerun_needed(ops, CPU)
    assert rerun_needed(ops, torch.device("cuda"))  # atomics, autotuned algorithms: always rerun
    assert rerun_needed(set(), CPU)  # nothing seen is nothing known
    y = torch.tensor([3, -100, 1])
    assert not rerun_needed(ops | _ops(lambda: y[y != -100]), CPU)  # labels have no gradient: no backward


def test_listed_kernel_or_foreign_operator_needs_a_rerun():
    assert rerun_needed(_ops(lambda: racy_scatter_net()(torch.randn(2, 784))), CPU)  # index_put
    h = nn.Linear(8, 8)(torch.randn(3, 8))
    assert rerun_needed(_ops(lambda: h[:, torch.tensor([0, 0, 1])]), CPU)  # its backward: index_put, accumulating
    assert rerun_needed(_ops(lambda: _Twice()(torch.randn(3))), CPU)  # not an aten operator


def test_lenet_on_the_cpu_is_not_rerun(monkeypatch):
    def no_rerun(*a, **k):
        raise AssertionError("a CPU pass of deterministic kernels was rerun")

    monkeypatch.setattr(parity, "self_difference", no_rerun)
    r = compare("lenet", "cpu,cpu:bf16", steps=2, envelope=0, env_findings=[])
    assert named(r.parity.self_difference) == {"cpu": 0.0, "cpu:bf16": 0.0}


def test_racy_scatter_is_rerun_and_named_nondeterministic():
    r = compare(racy_scatter_net, "cpu,cpu:float64", steps=3, envelope=0, env_findings=[], **MNIST_SHAPE)
    assert r.parity.self_difference[T("cpu")] > 1e-3
    v = r.verdict
    assert v.category == "nondeterminism", v.headline
    assert v.sub_cause == "nondeterministic kernels"
    assert "gives different results for the same input and seed" in v.headline


def test_every_target_with_a_listed_kernel_is_rerun():
    r = compare(racy_scatter_net, "cpu,cpu:bf16", steps=2, envelope=0, env_findings=[], **MNIST_SHAPE)
    assert set(named(r.parity.self_difference)) == {"cpu", "cpu:bf16"}
    assert all(d > 1e-3 for d in r.parity.self_difference.values())


class _Doubled(torch.autograd.Function):
    """A Function written in Python: its backward runs operators no dispatch mode saw in the forward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _DoubledLayer(nn.Module):
    def forward(self, x):
        return _Doubled.apply(x)


def test_a_python_autograd_function_is_rerun(monkeypatch):
    calls = []
    real = parity.self_difference
    monkeypatch.setattr(parity, "self_difference", lambda *a, **k: calls.append(1) or real(*a, **k))
    net = lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 32), _DoubledLayer(), nn.Linear(32, 10))  # noqa: E731
    r = compare(net, "cpu,cpu:float64", steps=2, envelope=0, env_findings=[], **MNIST_SHAPE)
    assert calls and r.parity.self_difference[T("cpu")] == 0.0  # rerun, and the same
