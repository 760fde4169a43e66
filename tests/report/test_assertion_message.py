"""``assert_parity``'s message: the verdict's own words and numbers (issue 26)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from convcheck.assertions import failure_message
from convcheck.pipeline import compare
from convcheck.report.summary import training_states


class Blowup(nn.Module):
    """Scales its input past float16's range: an overflow to inf in fp16, finite in float32."""

    def forward(self, x):
        return x * 1e6


def blowup_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Blowup(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def overflow():
    torch.manual_seed(0)
    return compare(blowup_net, "cpu,cpu:fp16", steps=4, batch_size=8, envelope=0,
                   input_shape=(1, 8, 8), num_classes=4, env_findings=[])


def test_message_uses_the_verdicts_words(overflow):
    assert not overflow.ok
    msg = failure_message(overflow)
    v = overflow.verdict
    assert msg.startswith(f"convcheck verdict: {v.category} - {v.headline}")
    for e in v.evidence:
        assert f"evidence: {e}" in msg
    # training said as the verdict says it: 4 steps are too few to judge convergence
    assert "evidence: cpu: trained (convergence not judged)" in msg
    assert "cpu did not converge" not in msg
    assert "(loss - -> -)" not in msg
    assert ">= inf" not in msg
    assert "no bound_factor would pass" in msg


def test_without_a_verdict_training_reads_as_in_the_terminal(overflow, monkeypatch):
    from dataclasses import replace

    overflow = replace(overflow, verdict=None)
    msg = failure_message(overflow)
    assert "cpu: trained, convergence not judged from 4 step(s) (loss " in msg
    assert "cpu:fp16: did not converge (no loss recorded, first non-finite at step 0)" in msg
    assert training_states(overflow)["cpu:fp16"] in msg
