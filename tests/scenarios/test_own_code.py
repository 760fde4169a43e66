"""Code inside modules with children (issue 15): attention, residual adds, a model's own forward."""

from __future__ import annotations

import pytest

from convcheck.pipeline import compare

from .models import attention_net, attention_overflow_net, lossy_residual_net

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


@pytest.mark.parametrize("target", ["cpu", "cpu:bf16", "cpu:fp16", "cpu:emulate-tf32", "cpu:amp-bf16"])
def test_a_healthy_resnet_has_own_code_rows_and_none_flagged(target):
    from convcheck.parity import run_parity
    from convcheck.targets import Target
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
