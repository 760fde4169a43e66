"""The float64 magnitude of the op that made the first NaN/Inf: the largest value it reaches when the same
op runs in float64 on the same operands - and infinite when even float64 cannot hold it, so that the
evidence never says 'stays finite' of an exp that overflows float64 too."""

from __future__ import annotations

import contextlib
import math

import torch

from convcheck.measure.train.nonfinite import loss_op


def naive_log_sum_exp_ce(logits, target):
    lse = torch.log(torch.exp(logits).sum(dim=1))
    return (lse - logits.gather(1, target[:, None]).squeeze(1)).mean()


def test_an_exp_beyond_float64_has_an_infinite_magnitude():
    y = torch.tensor([0, 1])
    fp16_scale = torch.tensor([[12.0, 0.0], [0.0, 11.0]])  # exp(12) = 1.6e5 > 65504, finite in float64
    got = loss_op(naive_log_sum_exp_ce, fp16_scale.half(), y, contextlib.nullcontext)
    assert got["op"] == "exp" and math.isclose(got["magnitude"], math.exp(12), rel_tol=1e-3)
    judge_scale = torch.tensor([[960.0, 0.0], [0.0, 5.0]], dtype=torch.float64)  # exp(960) > 1.8e308
    got = loss_op(naive_log_sum_exp_ce, judge_scale, y, contextlib.nullcontext)
    assert got["op"] == "exp" and got["magnitude"] == math.inf
