"""Parity's NaN/Inf counts of activations and their gradients, each tensor counted once (issue 28).

A call's input reaches its row as a view of the tensor the call before returned, and a gradient as a
view of the gradient of that view; parity counts each tensor once and takes a view over the very same
elements from that count. These scenarios hold the counts against plain torch on the same model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from convcheck.pipeline import initial_state, model_builder
from convcheck.plan.models import ResolvedModel
from convcheck.measure.parity import run_parity
from convcheck.targets.spec import Target

T = Target.parse


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def _relu_sqrt_net():
    # sqrt of ReLU's zeros: a finite forward whose backward is Inf at every zero, masked again by ReLU
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), Sqrt(), nn.Linear(16, 4))


def _model(factory) -> ResolvedModel:
    return ResolvedModel(name=factory.__name__, factory=factory, input_shape=(1, 8, 8), num_classes=4,
                         source="object")


def _batch(n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, 1, 8, 8), generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _plain_counts(build, batch) -> int:
    """Non-finite values of the gradient with respect to ReLU's output, by plain torch on the target's model."""
    model = build(T("cpu"))
    x, y = batch
    h = model[2](model[1](model[0](x)))
    h.retain_grad()
    nn.functional.cross_entropy(model[4](model[3](h)), y).backward()
    return int((~torch.isfinite(h.grad)).sum())


def test_gradient_counts_of_a_view_and_its_base_are_each_their_own():
    model = _model(_relu_sqrt_net)
    build = model_builder(model, initial_state(model, 0))
    batch = _batch()
    expected = _plain_counts(build, batch)
    assert expected > 0  # the scenario really has Inf gradients

    r = run_parity(build, batch, [T("cpu")], seed=0)
    fwd = r.layers[(r.layers["target"] == "cpu") & (r.layers["kind"] == "forward")].set_index("layer")
    # the forward is finite everywhere: inputs (views of the row before's output) count none
    assert (fwd["nan"] == 0).all() and (fwd["inf"] == 0).all() and (fwd["input_nonfinite"] == 0).all()
    # the Inf gradient is the one with respect to ReLU's output, that is sqrt's input
    assert fwd.loc["2", "grad_out_nonfinite"] == expected
    assert fwd.loc["3", "grad_in_nonfinite"] == expected
    # ReLU masks it: its own input gradient and everything before it are finite
    assert fwd.loc["2", "grad_in_nonfinite"] == 0
    assert fwd.loc["1", "grad_out_nonfinite"] == 0 and fwd.loc["1", "grad_in_nonfinite"] == 0
    assert fwd.loc["4", "grad_out_nonfinite"] == 0
    grads = r.layers[(r.layers["target"] == "cpu") & (r.layers["kind"] == "grad")]
    # fc1's gradients come through ReLU's mask: finite, counted as such without a pass of their own
    assert (grads["nan"] == 0).all() and (grads["inf"] == 0).all()


def test_nan_in_the_forward_is_counted_in_the_next_rows_input():
    def net():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Sqrt(), nn.Linear(16, 4))

    model = _model(net)
    build = model_builder(model, initial_state(model, 0))
    batch = _batch()
    m = build(T("cpu"))
    nans = int(torch.isnan(torch.sqrt(m[1](m[0](batch[0])))).sum())
    assert nans > 0
    r = run_parity(build, batch, [T("cpu")], seed=0)
    fwd = r.layers[(r.layers["target"] == "cpu") & (r.layers["kind"] == "forward")].set_index("layer")
    assert fwd.loc["2", "nan"] == nans and fwd.loc["3", "input_nonfinite"] == nans
    assert fwd.loc["1", "nan"] == 0 and fwd.loc["2", "input_nonfinite"] == 0
    grads = r.layers[(r.layers["target"] == "cpu") & (r.layers["kind"] == "grad")]
    assert grads["nan"].sum() > 0
