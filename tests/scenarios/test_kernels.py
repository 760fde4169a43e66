"""The run-to-run rerun: skipped for a CPU pass of documented-deterministic kernels, kept (and
finding the difference) for a pass that runs a kernel PyTorch lists as nondeterministic."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck.parity as parity
from convcheck.parity.kernels import KernelsSeen
from convcheck.pipeline import compare

from .models import racy_scatter_net

MNIST_SHAPE = dict(input_shape=(1, 28, 28), num_classes=10)


@torch.library.custom_op("convcheck_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_autograd(lambda ctx, g: g * 2)


class _Twice(nn.Module):
    def forward(self, x):
        return _twice(x)


def _seen(model: nn.Module, x: torch.Tensor) -> KernelsSeen:
    with KernelsSeen() as seen:
        model(x).sum().backward()
    return seen


def test_stock_cpu_pass_needs_no_rerun_and_other_devices_do():
    seen = _seen(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10)),
                 torch.randn(2, 1, 28, 28))
    assert not seen.rerun_needed(torch.device("cpu"))
    assert seen.rerun_needed(torch.device("cuda"))  # atomics, autotuned algorithms: always rerun
    assert KernelsSeen().rerun_needed(torch.device("cpu"))  # nothing seen is nothing known


def test_listed_kernel_or_foreign_operator_needs_a_rerun():
    x = torch.randn(2, 784)
    assert _seen(racy_scatter_net(), x).rerun_needed(torch.device("cpu"))  # index_put
    gather = nn.Sequential(nn.Linear(8, 8))
    seen = KernelsSeen()
    with seen:
        h = gather(torch.randn(3, 8))
        h[:, torch.tensor([0, 0, 1])].sum().backward()  # x[idx]'s backward: index_put with accumulation
    assert seen.rerun_needed(torch.device("cpu"))
    assert _seen(_Twice(), torch.randn(3, requires_grad=True)).rerun_needed(torch.device("cpu"))  # not aten


def test_lenet_on_the_cpu_is_not_rerun(monkeypatch):
    def no_rerun(*a, **k):
        raise AssertionError("a CPU pass of deterministic kernels was rerun")

    monkeypatch.setattr(parity, "self_difference", no_rerun)
    r = compare("lenet", "cpu,cpu:bf16", steps=2, envelope=0, env_findings=[])
    assert r.parity.self_difference == {"cpu": 0.0, "cpu:bf16": 0.0}


def test_racy_scatter_is_rerun_and_named_nondeterministic():
    r = compare(racy_scatter_net, "cpu,cpu:float64", steps=3, envelope=0, env_findings=[], **MNIST_SHAPE)
    assert r.parity.self_difference["cpu"] > 1e-3
    v = r.verdict
    assert v.category == "nondeterminism", v.headline
    assert v.sub_cause == "nondeterministic kernels"
    assert "gives different results for the same input and seed" in v.headline


def test_every_target_with_a_listed_kernel_is_rerun():
    r = compare(racy_scatter_net, "cpu,cpu:bf16", steps=2, envelope=0, env_findings=[], **MNIST_SHAPE)
    assert set(r.parity.self_difference) == {"cpu", "cpu:bf16"}
    assert all(d > 1e-3 for d in r.parity.self_difference.values())
