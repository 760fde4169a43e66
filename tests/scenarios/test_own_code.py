"""Code inside modules with children (issue 15): attention, residual adds, a model's own forward."""

from __future__ import annotations

import pytest

from convcheck.pipeline import compare
from convcheck.targets.spec import Target

from .models import attention_net, attention_overflow_net, lossy_residual_net

T = Target.parse

MNIST_SHAPE = dict(input_shape=(1, 28, 28), num_classes=10)


def test_attention_overflowing_float16_is_named_with_its_op():
    r = compare(attention_overflow_net, "cpu,cpu:fp16", steps=3, envelope=0, env_findings=[], **MNIST_SHAPE)
    v = r.verdict
    assert v.category == "numerics", v.headline
    assert v.layer == "attn", v.headline  # not 'head', whose gradient the NaN reaches last
    assert v.headline.startswith("float16 overflow in bmm in 'attn' (its own code) on cpu:fp16"), v.headline
    assert any(rem.startswith("bmm in 'attn' overflows float16") for rem in v.remedies), v.remedies
    row = r.parity.layers.query("target == 'cpu:fp16' and layer == 'attn'").iloc[0]
    assert row["module"] == "NaiveAttention (own code: bmm)"
    assert row["ref_absmax"] > 65504  # the judge's energies, where the op overflows


def test_attention_in_range_has_an_own_code_row_that_passes():
    r = compare(attention_net, "cpu,cpu:bf16", steps=3, envelope=0, env_findings=[], **MNIST_SHAPE)
    t = r.parity.layers
    own = t[(t["target"] == "cpu:bf16") & (t["layer"] == "attn")].iloc[0]
    assert own["module"] == "NaiveAttention (own code)"
    assert own["local"] > 0 and not own["flagged"]
    assert r.verdict.category != "layer", r.verdict.headline


def test_a_residual_add_that_loses_bf16_digits_is_flagged_as_its_own_code():
    r = compare(lossy_residual_net, "cpu,cpu:bf16", steps=3, envelope=0, batch_size=16, env_findings=[],
                **MNIST_SHAPE)
    v = r.verdict
    assert v.category == "layer", v.headline
    assert v.layer == "3", v.headline  # the OffsetResidual block, index 3 in the Sequential
    assert "'3' (OffsetResidual (own code))" in v.headline
    flagged = r.parity.flagged("cpu:bf16")
    assert set(flagged["layer"]) == {"3"}, flagged[["layer", "module"]]  # its convs and BatchNorms are fine
    assert flagged.iloc[0]["intrinsic"] > 10 * flagged.iloc[0]["floor"]


def test_the_same_residual_written_plainly_is_not_flagged(monkeypatch):
    from . import models

    monkeypatch.setattr(models.OffsetResidual, "forward", _plain_forward)
    r = compare(lossy_residual_net, "cpu,cpu:bf16", steps=3, envelope=0, batch_size=16, env_findings=[],
                **MNIST_SHAPE)
    t = r.parity.layers
    own = t[(t["target"] == "cpu:bf16") & (t["layer"] == "3")]
    assert len(own) == 1 and not own.iloc[0]["flagged"]
    assert not r.parity.flagged("cpu:bf16")["layer"].tolist()


def _plain_forward(self, x):
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    out += x
    return self.relu(out)


@pytest.mark.parametrize("target", ["cpu", "cpu:bf16", pytest.param("cpu:fp16", marks=pytest.mark.slow),  # ~4 s
                                    pytest.param("cpu:emulate-tf32", marks=pytest.mark.slow), "cpu:amp-bf16"])
def test_a_healthy_resnet_has_own_code_rows_and_none_flagged(target):
    from convcheck.measure.parity import run_parity
    from convcheck.targets.spec import Target
    from reference_models import get_model as build_reference

    import torch

    model = build_reference("resnet18", num_classes=10)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def build(t):
        m = build_reference("resnet18", num_classes=10)
        m.load_state_dict(state)
        t.runner.place(m)
        return m.train()

    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 3, 32, 32, generator=gen, dtype=torch.float64), torch.randint(0, 10, (8,), generator=gen))
    r = run_parity(build, batch, [Target.parse(target)])
    t = r.layers
    own = t[t["module"].str.contains("own code")]
    # every BasicBlock's ``out += identity`` is measured; the containers (layer1..4) have nothing of their own
    assert sorted(own["layer"]) == sorted(f"layer{i}.{j}" for i in range(1, 5) for j in range(2))
    assert not t["flagged"].any(), t[t["flagged"]][["layer", "module", "local", "intrinsic", "floor"]]


def test_a_nan_first_made_by_own_code_during_training_is_named_by_its_module():
    """Training (not the parity step): the attention's energies overflow only once the gain has grown."""
    from .models import AttentionNet

    class Growing(AttentionNet):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            self.encoder[2].gain = 1.0 if self.calls <= 3 else 400.0  # step 3 on: past float16's range
            return super().forward(x)

    # plain SGD: Adam's eps (1e-8) is 0 in float16 and turns zero gradients into NaN weights on its own
    r = compare(Growing, "cpu,cpu:fp16", steps=6, envelope=0, env_findings=[], optimizer="sgd", lr=0.01,
                **MNIST_SHAPE)
    step, layer = r.training.nonfinite_producer[r.training.arm_of(T("cpu:fp16"))]
    assert layer == "attn" and step >= 1, (step, layer)
    assert r.training.nonfinite_producer[r.training.arm_of(T("cpu"))] is None


def test_parameters_of_own_code_get_gradient_rows_and_training_norms():
    import torch
    import torch.nn as nn

    class LayerScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.gamma = nn.Parameter(torch.full((16,), 0.1))

        def forward(self, x):
            return x + self.gamma * self.fc(x)

    def net():
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), LayerScale(), nn.Linear(16, 10))

    r = compare(net, "cpu,cpu:bf16", steps=2, envelope=0, env_findings=[], **MNIST_SHAPE)
    t = r.parity.layers
    gamma = t[(t["kind"] == "grad") & (t["param"] == "2.gamma")]
    assert set(gamma["target"]) == {"cpu", "cpu:bf16"}
    assert (gamma["module"] == "LayerScale (own code)").all() and (gamma["propagated"] > 0).all()
    assert "2" in set(r.training.layer_grads["layer"]), sorted(set(r.training.layer_grads["layer"]))
