"""Tasks beyond classification: the U-Net (per-pixel cross-entropy) and tabular regression (MSE)."""

from __future__ import annotations

import pytest
import torch

from convcheck.plan.data_sources import open_data
from convcheck.pipeline import compare
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target
from reference_models import get_model, get_spec

T = Target.parse


def test_zoo_declares_tasks():
    assert get_spec("unet").task == "segmentation" and get_spec("mlp_regression").task == "regression"
    assert get_spec("lenet").task == "classification"
    assert get_model("unet")(torch.zeros(2, 1, 64, 64)).shape == (2, 3, 64, 64)
    assert get_model("mlp_regression")(torch.zeros(2, 16)).shape == (2, 1)


def test_synthetic_segmentation_masks_are_learnable_and_use_every_class():
    stream = open_data(None, input_shape=(1, 64, 64), num_classes=3, batch_size=4, steps=2, seed=0,
                       task="segmentation")
    x, y = stream.first()
    assert x.shape == (4, 1, 64, 64) and x.dtype == torch.float64
    assert y.shape == (4, 64, 64) and y.dtype == torch.int64 and set(y.unique().tolist()) == {0, 1, 2}
    # the image level carries the class: pixels of class 2 are brighter than those of class 0
    assert x[:, 0][y == 2].mean() > x[:, 0][y == 0].mean() + 1.0


def test_synthetic_regression_targets_follow_the_features():
    stream = open_data(None, input_shape=(16,), num_classes=1, batch_size=256, steps=1, seed=0, task="regression")
    x, y = stream.first()
    assert x.shape == (256, 16) and y.shape == (256, 1) and y.dtype == torch.float64
    fit = torch.linalg.lstsq(torch.cat([x, torch.ones(256, 1, dtype=x.dtype)], 1), y).solution
    resid = y - torch.cat([x, torch.ones(256, 1, dtype=x.dtype)], 1) @ fit
    assert float(resid.var()) < 0.5 * float(y.var())  # mostly linear: learnable


def test_unet_compare_runs_per_pixel_cross_entropy():
    r = compare("unet", "cpu,cpu:bf16", steps=3, batch_size=2, envelope=0, env_findings=[])
    assert r.recipe.loss_name == "cross-entropy per pixel"
    assert r.model.task == "segmentation"
    layers = set(r.parity.layers["layer"])
    assert {"down1.conv1", "up2", "head"} <= layers
    assert named(r.parity.first_flagged) == {"cpu": None, "cpu:bf16": None}


def test_mlp_regression_trains_with_mse_on_both_arms():
    r = compare("mlp_regression", "cpu,cpu:bf16", steps=30, envelope=0, env_findings=[])
    assert r.recipe.loss_name == "mean squared error"
    assert r.verdict.category == "ok", r.verdict.headline
    for arm in ("cpu", "cpu:bf16", "cpu:float64"):
        o = r.training.outcomes[T(arm)]
        assert o.final_loss < 0.7 * o.first_loss, (arm, o)


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["cpu,cpu:bf16"])  # cpu:float64 and cpu:amp-bf16 measured ok by hand (CI time)
def test_unet_converges_with_verdict_ok(targets):
    r = compare("unet", targets, steps=30, env_findings=[])
    assert r.verdict.category == "ok", (r.verdict.headline, r.verdict.evidence)
    assert all(o.converged for o in r.training.outcomes.values())
