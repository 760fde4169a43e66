"""``assert_parity``'s failure message names each flagged row once: a model whose own code (its forward,
not a child module) overflows is its class's row, ``SoftNet (own code: exp)``, not ``SoftNet (SoftNet ...)``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from convcheck.assertions import assert_parity
from convcheck.pipeline import compare


class SoftNet(nn.Module):
    """A softmax written out by hand in the model's own forward: exp of large scores overflows float16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        e = torch.exp(self.fc(x.flatten(1)) * 40)
        return torch.log(e / e.sum(1, keepdim=True))


def test_a_flagged_row_of_the_models_own_code_is_named_once():
    def net():
        torch.manual_seed(0)
        return SoftNet()

    result = compare(net, "cpu,cpu:fp16", steps=2, batch_size=4, envelope=0, input_shape=(1, 2, 2), num_classes=3)
    with pytest.raises(AssertionError) as err:
        assert_parity(result)
    row = next(line for line in str(err.value).splitlines() if line.startswith("cpu:fp16"))
    assert "SoftNet (own code: exp)" in row and "SoftNet (SoftNet" not in row


def test_the_culprit_comes_first_and_a_broken_arm_is_not_just_converged():
    """New-user trial 3: a hand-rolled one-pass LayerNorm after an offset of 20, under bf16. The message began
    with two cpu rows "below min_error, so not a cause" (so it read as if float32 failed too), and called the
    bf16 arm (loss 51 -> 27, the judge at 0.75) "converged"."""
    from scenarios.verify_models import offset_norm_net

    r = compare(offset_norm_net, "cpu,cpu:bf16", steps=10, input_shape=(1, 8, 8), num_classes=4, env_findings=[],
                verify=False)
    assert r.verdict.target == "cpu:bf16" and r.verdict.layer == "norm", r.verdict.headline
    with pytest.raises(AssertionError) as err:
        assert_parity(r)
    lines = str(err.value).splitlines()
    table = lines[2:lines.index(next(x for x in lines if x.startswith("(")))]
    assert table and all(x.startswith("cpu:bf16 ") for x in table), lines
    assert "flagged row(s) on cpu left out: below min_error 0.001, so not a cause)" in str(err.value)
    bf16 = next(x for x in lines if x.startswith("evidence: cpu:bf16: "))
    assert bf16.startswith("evidence: cpu:bf16: converged by the loss rule but ends "), bf16
    assert "evidence: cpu: converged, loss" in str(err.value)  # an arm that ends with the judge: plain
