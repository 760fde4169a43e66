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
