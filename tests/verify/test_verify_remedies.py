"""Issue 24: each remedy kind verifies on a real model that has its problem, and the action does what the
remedy says - the modules kept in float32 are the ones the judge's magnitudes call for (an overflowing
output stays in float32 until it fits again; an ill-conditioned layer's input is made in float32), and a
re-run that goes NaN/Inf again names what did it.

What a CPU cannot show: nondeterministic kernels (PyTorch's CPU kernels are deterministic; its documented
nondeterministic ones are CUDA's), so the deterministic action has no scenario here."""

from __future__ import annotations

import math

import pytest

from convcheck.assertions import failure_message
from convcheck.pipeline import compare
from convcheck.verify import NOT_VERIFIED, VERIFIED
from convcheck.verify.actions import _feeding, _until_in_range

from scenarios import models as M
from scenarios.verify_models import bn_mlp, loud_mlp, shifted_linear_net

MNIST = dict(input_shape=(1, 28, 28), num_classes=10, env_findings=[])


def test_an_overflowing_output_stays_in_float32_until_it_fits_and_adams_eps_is_found_by_the_rerun():
    """overflow_net: '3' (x 1e5) outputs 2.1e5 > 65504 on cpu:fp16; '4' (x 1e-5) brings it back. Kept in
    float32: '3' and '4'. Under Adam the re-run then goes NaN at step 1: Adam's eps 1e-8 is 0 in float16 and
    the optimizer step makes weights NaN (a second cause, named); with the eps raised too it trains."""
    r = compare(M.overflow_net, "cpu,cpu:fp16", steps=5, envelope=0, verify=True, **MNIST)
    assert r.verdict.layer == "3" and r.verdict.target == "cpu:fp16", r.verdict.headline
    first, second = r.verification.attempts[:2]
    assert first.kind == "float32-module" and not first.verified
    assert first.text.startswith("with '3', '4' in float32 (the judge's values stay above float16's 65504 from "
                                 "'3' until '4')")
    assert first.line.endswith("cpu:fp16 still goes NaN/Inf at step 1: the optimizer step (Adam, eps 1e-08) made "
                               "the weights of '1' NaN/Inf"), first.line
    assert second.kind == "float32-module+eps" and second.verified, second.line
    assert "and the optimizer's eps raised to 0.0001 (its 1e-08 is 0 in float16)" in second.text
    assert r.verification.status == VERIFIED
    assert "keep_in_float32" in second.snippet and "eps=0.0001" in second.snippet


def test_overflow_under_sgd_verifies_by_default():
    r = compare(M.overflow_net, "cpu,cpu:fp16", steps=5, envelope=0, optimizer="sgd", lr=0.05, **MNIST)
    v = r.verification
    assert v.status == VERIFIED, v.line
    assert v.line.startswith("verified: with '3', '4' in float32 ("), v.line
    assert "tracks the judge" in v.line


def test_by_default_the_second_cause_is_named_and_left_to_verify():
    r = compare(M.overflow_net, "cpu,cpu:fp16", steps=5, envelope=0, **MNIST)
    v = r.verification
    assert v.status == NOT_VERIFIED and len(v.attempts) == 1
    assert "made the weights of '1' NaN/Inf" in v.line
    assert "and the optimizer's eps raised to 0.0001" in v.line and "--verify tries them" in v.line


def test_attention_overflow_kept_in_float32_verifies_with_the_eps_adams_float16_needs():
    """What made 'attn' in float32 fail before: not the module wrapped (the bmm in its own code is in
    float32 then, and its output fits float16) but Adam's eps, 0 in float16: the step after the first makes
    the head's weights NaN. Both together track the judge."""
    r = compare(M.attention_overflow_net, "cpu,cpu:fp16", steps=3, envelope=0, batch_size=16, verify=True, **MNIST)
    assert r.verdict.layer == "attn", r.verdict.headline
    first = r.verification.attempts[0]
    assert first.text == "with 'attn' in float32"
    assert first.line.endswith("the optimizer step (Adam, eps 1e-08) made the weights of 'head.1' NaN/Inf")
    ok = r.verification.verified
    assert ok is not None and ok.kind == "float32-module+eps" and "tracks the judge" in ok.line, r.verification.line


def test_an_ill_conditioned_layer_keeps_the_modules_making_its_input_in_float32():
    """offset_center_net: '2' (Center) cannot be computed from a bfloat16 input near 1000; '1' (Offset) makes
    that input. Both in float32 track the judge ('2' alone ended 49% off)."""
    r = compare(M.offset_center_net, "cpu,cpu:bf16", steps=10, envelope=0, batch_size=16, **MNIST)
    assert r.verdict.sub_cause == "ill-conditioned layer" and r.verdict.layer == "2", r.verdict.headline
    v = r.verification
    assert v.status == VERIFIED, v.line
    assert v.line.startswith("verified: with '1', '2' in float32 ('2' and the modules making its input: '1'), "
                             "cpu:bf16 converges"), v.line


def test_the_neighbours_follow_the_judges_magnitudes():
    # (name, the judge's largest output, own-code op magnitude)
    calls = [("0", 4.0, False), ("1", 2.0e5, False), ("2", 3.0e5, False), ("3", 2.0, False), ("4", 1.0, False)]
    assert _until_in_range(calls, "1", 65504.0) == ("2", "3")
    assert _until_in_range(calls, "3", 65504.0) == ()  # its output fits
    assert _until_in_range(calls[:3], "1", 65504.0) == ("2",)  # still beyond at the model's end
    assert _until_in_range([("a", 9e4, True), ("b", 2.0, False)], "a", 65504.0) == ()  # an op inside it
    # an ill-conditioned layer: its producer, then back while the values stay 8x above its result
    feed = [("0", 3.0, False), ("1", 1000.0, False), ("2", 900.0, False), ("3", 4.0, False)]
    assert _feeding(feed, "3") == ("1", "2")
    assert _feeding([("0", 3.0, False), ("1", 4.0, False)], "1") == ("0",)
    # the children of a module with children are inside it, not its producers
    assert _feeding([("c", 1.0, False), ("attn.q", 500.0, False), ("attn", 4.0, True)], "attn") == ("c",)


def test_clipping_gradients_verifies_where_the_judge_diverges():
    r = compare(loud_mlp, "cpu,cpu:bf16", steps=10, envelope=0, batch_size=16, optimizer="sgd", lr=0.1,
                verify=True, **MNIST)
    assert r.verdict.category == "setup", r.verdict.headline
    v = r.verification
    # the remedies list the lower learning rate first (tried first; 10x lower is still too high here)
    assert [(a.kind, a.verified) for a in v.attempts] == [("lower-lr", False), ("clip-gradients", True)]
    assert v.status == VERIFIED and v.line.startswith("verified: with gradients clipped to norm 1, the float64 "
                                                      "judge converges"), v.line


def test_tf32_off_verifies_where_tf32_hurts_training():
    """A shift trick that TF32 (emulated on the CPU) cannot hold: the layer's own error is 1.8 and training
    ends far above the judge; the same arm without TF32 tracks the judge."""
    r = compare(shifted_linear_net, "cpu,cpu:emulate-tf32", steps=10, envelope=0, batch_size=16, optimizer="sgd",
                lr=0.05, **MNIST)
    assert r.verdict.target == "cpu:emulate-tf32" and r.verdict.layer == "1", r.verdict.headline
    assert r.training.outcomes[r.config.targets[1]].final_loss > 3 * r.training.outcomes[r.config.judge].final_loss
    v = r.verification
    assert v.status == VERIFIED and v.line.startswith("verified: with TF32 off (cpu), cpu:emulate-tf32 "), v.line
    assert "tracks the judge" in v.line


@pytest.mark.usefixtures("no_orphans")
def test_sync_batchnorm_verifies_the_per_rank_batchnorm_verdict():
    r = compare(bn_mlp, "cpu,ddp:cpu:2", input_shape=(3, 8, 8), num_classes=4, batch_size=4, steps=8,
                optimizer="sgd", lr=0.05, verify=True, env_findings=[])
    assert (r.verdict.category, r.verdict.sub_cause) == ("setup", "ddp"), r.verdict.headline
    assert "batchnorm_per_rank" in r.verdict.symptoms
    ddp, judge = (r.training.outcomes[t].final_loss for t in (r.config.targets[1], r.config.judge))
    assert ddp > 1.2 * judge  # the per-rank statistics change the outcome
    v = r.verification
    assert [a.kind for a in v.attempts] == ["sync-batchnorm"]
    assert v.status == VERIFIED and v.line.startswith("verified: with SyncBatchNorm (--ddp-sync-bn), ddp:cpu:2 "
                                                      "converges"), v.line
    assert "convert_sync_batchnorm" in v.attempts[0].snippet


def test_by_default_a_data_parallel_rerun_is_left_to_verify():
    r = compare(bn_mlp, "cpu,ddp:cpu:2", input_shape=(3, 8, 8), num_classes=4, batch_size=4, steps=8,
                optimizer="sgd", lr=0.05, env_findings=[])
    assert r.verdict.target == "ddp:cpu:2", r.verdict.headline
    v = r.verification
    assert v.status == "skipped" and v.attempts == () and "--verify runs it" in v.reason
    assert v.untried == ("with SyncBatchNorm (--ddp-sync-bn)",)
    assert "remedies not verified: re-running ddp:cpu:2 costs 2 processes" in failure_message(r)


def _naive_focal(output, target, gamma=2.0):
    """A focal loss as it is often written from the paper: softmax, then log of the probabilities, in the
    model's own dtype (float16 rounds a small p to exactly 0: log(0) = -inf)."""
    import torch
    import torch.nn.functional as F

    p = torch.softmax(output, dim=1)
    onehot = F.one_hot(target, output.shape[1]).to(p.dtype)
    return (-(onehot * (1 - p) ** gamma * torch.log(p)).sum(1)).mean()


def _warm_cnn():
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
            self.head = nn.Linear(16 * 16, 10)

        def forward(self, x):
            return self.head(self.features(x).flatten(1)) * 25.0  # sharpened logits

    return Net()


@pytest.mark.slow  # 20 steps of a CNN on three arms and the re-run: ~8 s
def test_a_loss_whose_own_log_overflows_in_float16_verifies_computed_in_float32():
    """New-user trial 5: 'compute the loss function in float32' was remedied but never tried ('none of them is
    one convcheck can apply')."""
    r = compare(_warm_cnn, "cpu,cpu:fp16", loss=_naive_focal, optimizer="sgd", lr=0.002, steps=20,
                input_shape=(1, 28, 28), num_classes=10, env_findings=[])
    assert r.verdict.category == "numerics" and "loss function" in r.verdict.headline, r.verdict.headline
    assert r.verification.status == VERIFIED, r.verification.line
    assert r.verification.line.startswith("verified: with the loss computed in float32, cpu:fp16 converges")


def test_the_float32_loss_casts_every_16_bit_tensor_of_output_and_target_and_leaves_others_alone():
    """Review: a float16 target beside a float32 output failed in the backward (huber), and a tuple output was
    left in float16."""
    import torch
    import torch.nn.functional as F

    from convcheck.verify.actions import float32_loss

    out = torch.randn(4, 3, dtype=torch.float16, requires_grad=True)
    y = torch.randn(4, 3).half()
    loss = float32_loss(F.huber_loss)(out, y)
    assert loss.dtype == torch.float32
    loss.backward()
    assert out.grad is not None and out.grad.dtype == torch.float16
    pair = float32_loss(lambda o, t: o[0].sum() + o[1].sum())((out.detach(), out.detach().bfloat16()), None)
    assert pair.dtype == torch.float32
    judge = torch.randn(4, 3, dtype=torch.float64)
    assert float32_loss(lambda o, t: o.sum())(judge, None).dtype == torch.float64  # the judge's stays float64


def test_a_loss_in_float32_that_then_fails_in_adams_float16_step_is_followed_by_the_eps():
    """Issue 34: the loss computed in float32 fixed the loss, and the re-run then failed in the optimizer step
    (Adam's eps 1e-8 is 0 in float16): the same action with the eps raised is the next remedy, never "no other
    remedy convcheck can apply". A format that holds the eps (bfloat16) gets none."""
    import dataclasses

    import torch

    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe
    from convcheck.targets.spec import Target
    from convcheck.verify.actions import Action
    from convcheck.verify.result import Attempt
    from convcheck.verify.run import _second_cause

    recipe = build_recipe(CompareConfig(optimizer="adam"), "classification")
    first = Action("loss-float32", "with the loss computed in float32", loss_float32=True)
    failed = Attempt("loss-float32", first.text, "", "cpu:fp16", False, "", (), False, math.nan, 0.1, 1.0,
                     cause="the optimizer step (Adam, eps 1e-08) makes the weights of 'fc' NaN/Inf", by_optimizer=True)
    follow = _second_cause(first, failed, recipe, Target.parse("cpu:fp16"))
    assert follow is not None and follow.eps == 1e-4 and follow.loss_float32
    assert follow.text == ("with the loss computed in float32 and the optimizer's eps raised to 0.0001 (its 1e-08 "
                           "is 0 in float16)")
    assert _second_cause(first, failed, recipe, Target.parse("cpu:bf16")) is None
    assert _second_cause(first, dataclasses.replace(failed, by_optimizer=False), recipe,
                         Target.parse("cpu:fp16")) is None
    assert torch.finfo(torch.float16).tiny > 1e-8  # the reason: below float16's smallest normal number
