"""convcheck.diagnose.detectors.recipe: which part of the user's recipe a failing judge implicates."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn as nn

import convcheck.diagnose.detectors.recipe as R
from convcheck.measure.loss_probe import loss_reduction_probe, norm_layers
from convcheck.targets.runners import cross_entropy
from convcheck.targets.spec import Target


def _curves(loss, lr, clipped=None, grad_norm=None, arm="cpu:float64"):
    n = len(loss)
    return pd.DataFrame(dict(arm=[arm] * n, step=range(n), loss=loss, lr=lr,
                             clipped=clipped or [False] * n, grad_norm=grad_norm or [1.0] * n))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("reduction, expected", [("mean", 1.0), ("sum", 2.0)])
def test_loss_reduction_probe(reduction, expected):
    judge = Target.parse("cpu:float64").runner
    model = judge.place(_mlp())
    ratio = loss_reduction_probe(model, judge, _batch(),
                                   lambda o, t: nn.functional.cross_entropy(o, t, reduction=reduction))
    assert ratio == pytest.approx(expected, rel=1e-9)
    assert model.training  # put back in training mode
    assert math.isnan(loss_reduction_probe(model, judge, _batch(1), cross_entropy))


def test_loss_summed_fires_only_near_two():
    assert R.loss_summed(2.0, "j").name == R.LOSS_SUMMED
    assert R.loss_summed(1.0, "j") is None and R.loss_summed(math.nan, "j") is None


def test_divergence_right_after_warmup_blames_the_schedule():
    lr = [0.025, 0.05, 0.075, 0.1, 0.1, 0.1]
    loss = [2.3, 2.1, 1.9, 1.8, math.nan, math.nan]
    s = R.schedule_divergence(_curves(loss, lr), "cpu:float64", warmup=3)
    assert s.name == R.SCHEDULE_DIVERGENCE and s.step == 4 and "1 step(s) after warm-up ends at step 3" in s.evidence
    during = R.schedule_divergence(_curves([2.3, 9.0, math.nan, math.nan, math.nan, math.nan], lr), "cpu:float64",
                                   warmup=3)
    assert "during the 3-step warm-up" in during.evidence


def test_divergence_at_a_step_jump_blames_the_schedule():
    lr = [0.01, 0.01, 0.01, 0.2, 0.2, 0.2]
    loss = [2.3, 2.2, 2.1, 2.0, 9.0, math.inf]
    s = R.schedule_divergence(_curves(loss, lr), "cpu:float64", warmup=0)
    assert s is not None and "jumps to 0.2" in s.evidence


def test_divergence_far_from_any_change_is_not_the_schedule():
    assert R.schedule_divergence(_curves([2.3, 2.2, 2.1, 2.0, 9.0, math.inf], [0.1] * 6), "cpu:float64", 0) is None
    assert R.schedule_divergence(_curves([2.3, 2.2, 2.0, 1.9], [0.01, 0.02, 0.03, 0.04]), "cpu:float64", 3) is None


def test_clipping_that_acts_on_every_step_without_convergence():
    c = _curves([2.3] * 5, [0.1] * 5, clipped=[True] * 5, grad_norm=[4.0] * 5)
    s = R.clipping_too_tight(c, "cpu:float64", clip=0.01, converged=False)
    assert s.name == R.CLIPPING_TOO_TIGHT and "clipped 100% of the steps" in s.evidence and "400x" in s.evidence
    assert R.clipping_too_tight(c, "cpu:float64", clip=0.01, converged=True) is None
    assert R.clipping_too_tight(c, "cpu:float64", clip=None, converged=False) is None


def test_weight_decay_on_norms():
    norms = norm_layers(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4)))
    assert norms == ["1", "2"]
    s = R.decay_on_norms(norms, 5e-4, "sgd", "cpu:float64")
    assert s.name == R.DECAY_ON_NORMS and "2 normalisation layer(s) (1, 2)" in s.evidence
    assert R.decay_on_norms(norms, 0.0, "sgd", "j") is None
    assert R.decay_on_norms([], 5e-4, "sgd", "j") is None
    assert R.decay_on_norms(norms, 5e-4, "opt.py:factory", "j") is None


def test_labels_out_of_range_for_the_output_are_a_usage_error():
    from convcheck.errors import UsageError

    with pytest.raises(UsageError, match=r"labels span 0\.\.5 but the model outputs 3 classes"):
        cross_entropy(torch.zeros(2, 3), torch.tensor([0, 5]))
    assert float(cross_entropy(torch.zeros(2, 3), torch.tensor([-100, 2]))) == pytest.approx(math.log(3))


# --- the setup verdict names the part of the recipe (real runs) ----------------------------------

def _mlp4():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


SMALL = dict(input_shape=(1, 4, 4), num_classes=4, envelope=0, env_findings=[], batch_size=64)


def test_a_summed_loss_is_named_when_the_judge_diverges():
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=8, optimizer="sgd", lr=0.5,
                loss=lambda o, t: nn.functional.cross_entropy(o.float(), t, reduction="sum"), **SMALL)
    v = r.verdict
    assert v.category == "setup" and v.sub_cause == R.LOSS_SUMMED, (v.headline, v.evidence)
    assert "loss summed over the batch" in v.headline and "average the loss" in v.remedies[0]


def test_the_same_run_averaged_is_not_blamed_on_the_loss():
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=8, optimizer="sgd", lr=0.5, **SMALL)
    assert r.verdict.sub_cause != R.LOSS_SUMMED


def test_clipping_too_tight_is_named():
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=8, optimizer="sgd", lr=0.05, clip_grad_norm=1e-4, **SMALL)
    v = r.verdict
    assert v.category == "setup" and v.sub_cause == R.CLIPPING_TOO_TIGHT, (v.headline, v.evidence)


def test_a_divergence_during_warmup_is_blamed_on_the_schedule():
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=10, optimizer="sgd", lr=20.0, warmup=4, **SMALL)
    v = r.verdict
    assert v.category == "setup" and v.sub_cause == R.SCHEDULE_DIVERGENCE, (v.headline, v.evidence)
    assert any("warm-up" in e for e in v.evidence) and "warm up for longer" in v.remedies[0]


# --- weight decay too strong (a new user's --weight-decay 10 was blamed as a loss plateau) ---------------

def test_decay_too_strong_fires_far_above_common_recipes():
    strong = R.decay_too_strong(dict(optimizer="SGD", lr=0.05, weight_decay=10.0, momentum=0.9), "j")
    assert strong.name == R.DECAY_TOO_STRONG and strong.value == pytest.approx(0.5)
    assert "lr x weight_decay = 0.5" in strong.evidence
    # ResNet-50's SGD 0.1 x 1e-4 and torch's AdamW defaults are nowhere near it
    assert R.decay_too_strong(dict(optimizer="SGD", lr=0.1, weight_decay=1e-4), "j") is None
    assert R.decay_too_strong(dict(optimizer="AdamW", lr=1e-3, weight_decay=1e-2), "j") is None
    assert R.decay_too_strong(None, "j") is None


def _groups_of(factory):
    from types import SimpleNamespace

    from convcheck.stages import measure_weight_decay

    plan = SimpleNamespace(recipe=SimpleNamespace(make_optimizer=factory), build=lambda t: _mlp(),
                           config=SimpleNamespace(judge=Target.parse("cpu:float64"), optimizer=factory))
    return measure_weight_decay(plan)


def test_the_optimizers_own_groups_give_lr_and_weight_decay():
    def two_groups(params):  # decay on matrices only, as users write it; the strongest group is read
        params = list(params)
        return torch.optim.SGD([{"params": [p for p in params if p.ndim > 1], "weight_decay": 10.0},
                                {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "lr": 0.5}],
                               lr=0.05, momentum=0.9)
    assert _groups_of(two_groups) == dict(optimizer="SGD", lr=0.05, weight_decay=10.0, momentum=0.9, lr0=0.05)
    adamw = _groups_of(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=5.0))  # decoupled: lr x wd
    assert adamw["optimizer"] == "AdamW" and adamw["lr"] * adamw["weight_decay"] == pytest.approx(0.05)
    # Adam's coupled L2 goes through its normalisation: lr x wd is not what the weights lose
    assert _groups_of(lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=5.0)) is None


def make_wd10(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=10.0)


@pytest.mark.parametrize("optimizer", [dict(optimizer="sgd", lr=0.05, weight_decay=10.0),
                                       dict(optimizer=make_wd10)])
def test_a_weight_decay_of_10_is_named_not_a_plateau(optimizer):
    from convcheck.pipeline import compare
    from convcheck.verify import VERIFIED

    r = compare(_mlp4, "cpu,cpu:bf16", steps=30, **optimizer, **SMALL)
    v = r.verdict
    assert v.category == "setup" and v.sub_cause == R.DECAY_TOO_STRONG, (v.headline, v.evidence)
    assert "weight decay too strong" in v.headline
    assert v.remedies[0].startswith("lower the weight decay until lr x weight_decay")
    assert not any("raise the learning rate" in x for x in v.remedies)
    assert r.verification.status == VERIFIED, r.verification
    assert "weight decay lowered to 0.0001" in r.verification.line


def test_a_common_weight_decay_is_not_blamed():
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=30, optimizer="sgd", lr=0.05, weight_decay=5e-4, **SMALL)
    assert r.verdict.sub_cause != R.DECAY_TOO_STRONG and r.weight_decay["weight_decay"] == 5e-4


def test_the_weight_decay_is_held_to_the_lr_the_schedule_ran_not_the_one_it_was_built_with():
    """Review: lr 1.0 x wd 0.01 built, but a LambdaLR of 1e-4 ran lr 1e-4 every step (lr x wd = 1e-6): the judge's
    plateau is the low lr's, and was called 'weight decay too strong'."""
    from convcheck.pipeline import compare

    r = compare(_mlp4, "cpu,cpu:bf16", steps=30, optimizer="sgd", lr=1.0, weight_decay=0.01,
                schedule=lambda opt, n: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-4), **SMALL)
    assert r.verdict.sub_cause != R.DECAY_TOO_STRONG, r.verdict.headline
    assert not any(R.DECAY_TOO_STRONG in e for e in r.verdict.evidence)


def test_adamws_decay_is_read_as_decoupled_from_its_class():
    """Review: torch < 2.6's AdamW groups have no 'decoupled_weight_decay' key; the class says it."""
    class OldAdamW(torch.optim.AdamW):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            for g in self.param_groups:
                g.pop("decoupled_weight_decay", None)

    found = _groups_of(lambda p: OldAdamW(p, lr=0.01, weight_decay=5.0))
    assert found is not None and found["lr"] * found["weight_decay"] == pytest.approx(0.05)
