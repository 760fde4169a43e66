"""convcheck.measure.train: lockstep training on every arm, the perturbation envelope, convergence."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import initial_state, model_builder
from convcheck.plan.seeded_data import load_batches
from convcheck.numerics.metrics import Tolerances
from convcheck.plan.models import resolve_model
from convcheck.measure.table_schema import named
from convcheck.targets.spec import CPU_JUDGE as JUDGE, Target, snapshot_global_flags
from convcheck.plan.config import CompareConfig
from convcheck.plan.recipe import build_recipe
from convcheck.measure.train import (
    TrainConfig,
    converged,
    lower_precision,
    make_arms,
    perturb_,
    run_training,
)

T = Target.parse


def _recipe(**kw):
    return build_recipe(CompareConfig(**kw))
CORE_COLUMNS = {"arm", "role", "target", "step", "loss", "grad_norm", "dist_judge", "dist_ref",
                "nonfinite_loss", "nonfinite_grad", "loss_scale", "skipped", "update_ratio"}


def _setup(name="lenet", steps=8, batch_size=16, seed=0):
    model = resolve_model(name)
    build = model_builder(model, initial_state(model, seed))
    batches = load_batches(None, input_shape=model.input_shape, num_classes=model.num_classes,
                           batch_size=batch_size, num_batches=steps, seed=seed)
    return build, list(batches.batches)


@pytest.fixture(scope="module")
def lenet_run():
    """LeNet on synthetic data, cpu vs cpu:emulate-tf32, the judge and one envelope run of emulated TF32."""
    steps = 8
    build, batches = _setup(steps=steps)
    arms = make_arms([T("cpu"), T("cpu:emulate-tf32")], envelope=1, seed=0, judge=JUDGE)
    before = snapshot_global_flags()
    result = run_training(build, batches, arms, TrainConfig(steps=steps, recipe=_recipe(optimizer="adam", lr=3e-3)))
    after = snapshot_global_flags()
    return result, before, after


# --- curves -----------------------------------------------------------------------------

def test_one_row_per_arm_per_step(lenet_run):
    r, *_ = lenet_run
    c = r.curves
    assert CORE_COLUMNS <= set(c.columns)
    names = [a.name for a in r.arms]
    assert names == ["cpu", "cpu:emulate-tf32", "cpu:float64", "cpu:emulate-tf32~1"]
    assert len(c) == 8 * len(names)
    for name in names:
        assert list(r.arm_curve(name)["step"]) == list(range(8))
    roles = dict(zip(c["arm"], c["role"]))
    assert roles == {"cpu": "target", "cpu:emulate-tf32": "target", "cpu:float64": "judge", "cpu:emulate-tf32~1": "envelope"}
    assert dict(zip(c["arm"], c["target"]))["cpu:emulate-tf32~1"] == "cpu:emulate-tf32"


def test_loss_falls_on_every_arm(lenet_run):
    r, *_ = lenet_run
    for arm in r.arms:
        loss = list(r.arm_curve(arm.name)["loss"])
        assert all(math.isfinite(v) for v in loss)
        assert sum(loss[-3:]) / 3 < 0.9 * loss[0], (arm.name, loss)
    assert set(named(r.outcomes)) == {"cpu", "cpu:emulate-tf32", "cpu:float64"}  # envelope runs are not targets
    for name, info in r.outcomes.items():
        assert info.converged is True, name
        assert info.first_nonfinite_step is None
        assert info.final_loss < info.first_loss
        assert info.skipped_steps == 0


def test_all_arms_start_from_the_same_weights_and_batch(lenet_run):
    r, *_ = lenet_run
    first = r.curves[r.curves["step"] == 0].set_index("arm")["loss"]
    assert first["cpu"] == pytest.approx(first["cpu:float64"], rel=1e-6)
    assert first["cpu:emulate-tf32"] == pytest.approx(first["cpu:float64"], rel=2e-2)


def test_distance_to_the_judge(lenet_run):
    r, *_ = lenet_run
    cpu = r.arm_curve("cpu")["dist_judge"]
    tf32 = r.arm_curve("cpu:emulate-tf32")["dist_judge"]
    assert (r.arm_curve("cpu:float64")["dist_judge"] == 0).all()
    assert cpu.max() < 1e-5 and cpu.iloc[-1] > 0
    assert tf32.min() > 1e-4
    assert (tf32.values > 100 * cpu.values).all()
    assert r.outcomes[T("cpu")].final_dist_judge == pytest.approx(cpu.iloc[-1])


def test_envelope_run_measures_distance_to_its_reference(lenet_run):
    r, *_ = lenet_run
    env = r.arm_curve("cpu:emulate-tf32~1")["dist_ref"]
    assert env.map(math.isfinite).all() and (env > 0).all()
    assert r.arm_curve("cpu")["dist_ref"].isna().all()
    # an envelope run is the null model of its target: its distance to the judge is not measured
    assert r.arm_curve("cpu:emulate-tf32~1")["dist_judge"].isna().all()


def test_scalars_only_per_step(lenet_run):
    r, *_ = lenet_run
    grads = r.layer_grads
    assert set(grads["layer"]) == {"conv1", "conv2", "fc1", "fc2", "fc3"}
    # per-layer rows for the targets and the judge (what the verdict reads); an envelope run keeps its curve
    assert set(grads["arm"]) == {"cpu", "cpu:emulate-tf32", "cpu:float64"}
    assert len(grads) == 8 * 3 * 5
    assert set(r.activations["arm"]) == {"cpu:float64"}  # the training-problem detectors read the judge's
    assert len(r.activations) == 8 * 4  # LeNet's four ReLUs, every step
    assert (grads["grad_norm"] > 0).all()
    c = r.curves
    assert (c["grad_norm"] > 0).all() and c["grad_norm"].map(math.isfinite).all()
    assert not c["nonfinite_loss"].any() and not c["nonfinite_grad"].any()
    assert c["loss_scale"].isna().all()  # no GradScaler without fp16 AMP


def test_training_leaves_global_flags_alone(lenet_run):
    _, before, after = lenet_run
    assert before == after


# --- the convergence rule ---------------------------------------------------------------------

def test_converged_rule():
    assert not converged([])
    assert converged([2.3, 2.0, 1.5, 1.0, 1.0, 1.0])
    assert not converged([2.3, 2.3, 2.2, 2.25, 2.2, 2.2])
    # the mean of the last three losses counts, not the last alone
    assert not converged([2.0, 2.0, 2.0, 2.0, 2.0, 1.7])
    assert converged([2.0, 2.0, 2.0, 1.0, 1.0, 2.5])
    # any non-finite loss fails, even if recovered
    assert not converged([2.3, math.nan, 1.0, 1.0, 1.0])
    assert not converged([2.3, 1.0, 1.0, math.inf])
    # fewer than four steps: the last loss against the first
    assert converged([2.0, 1.7])
    assert not converged([2.0, 1.9])
    assert not converged([2.0])
    # strict threshold at ratio x first loss
    assert not converged([1.0, 0.9])
    assert converged([1.0, 0.89])
    assert converged([1.0, 0.95], Tolerances(converged_loss_ratio=0.96))


# --- a learning rate that blows up -----------------------------------------------------------

def test_absurd_learning_rate_gives_a_first_nonfinite_step_not_an_exception():
    build, batches = _setup(steps=3, batch_size=4)
    arms = make_arms([T("cpu"), JUDGE], envelope=0, seed=0, judge=JUDGE)
    assert [a.name for a in arms] == ["cpu", "cpu:float64"]
    r = run_training(build, batches, arms, TrainConfig(steps=3, recipe=_recipe(optimizer="sgd", lr=1e8)))
    assert len(r.curves) == 3 * 2  # every step is still recorded
    info = r.outcomes[T("cpu")]
    step = info.first_nonfinite_step
    assert isinstance(step, int) and 0 <= step < 3, info
    assert info.converged is False
    for name, info in named(r.outcomes).items():
        c = r.arm_curve(name)
        bad = c["nonfinite_loss"] | c["nonfinite_grad"]
        step = info.first_nonfinite_step
        if step is None:  # the float64 judge may survive what overflows float32
            assert not bad.any()
        else:
            assert not bad[c["step"] < step].any() and bad[c["step"] == step].all()


def test_the_judge_trains_in_float64_throughout():
    import torch.nn.functional as F

    build, batches = _setup(steps=1, batch_size=8)
    r = run_training(build, batches, make_arms([T("cpu"), JUDGE], 0, 0, JUDGE), TrainConfig(steps=1))
    x, y = batches[0]
    model = build(JUDGE)
    with torch.no_grad():
        expected = float(F.cross_entropy(model(x.double()), y))
    got = float(r.arm_curve("cpu:float64")["loss"].iloc[0])
    assert got == pytest.approx(expected, rel=1e-13, abs=0)


# --- perturbation ------------------------------------------------------------------------------

def _perturbed(dtype, ulp, seed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10)).to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    perturb_(model, ulp, seed)
    return before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("spec", ["cpu", "cpu:bf16", "cpu:fp16"])
def test_perturb_moves_every_weight_by_about_one_ulp(spec):
    t = T(spec)
    before, after = _perturbed(t.param_dtype, t.ulp, seed=1)
    b = torch.cat([p.flatten() for p in before]).double()
    a = torch.cat([p.flatten() for p in after]).double()
    nz = b != 0
    rel = (a - b)[nz] / b[nz]
    assert (rel != 0).all()                          # every weight moved
    assert rel.abs().max() <= 2 * t.ulp               # by at most two ulps (rounding of p * (1 +- ulp))
    assert rel.abs().median() == pytest.approx(t.ulp, rel=0.5)
    frac_up = float((rel > 0).double().mean())
    assert 0.4 < frac_up < 0.6                       # random directions


def test_perturb_is_seeded():
    _, a1 = _perturbed(torch.float32, 2.0**-23, seed=1)
    _, a2 = _perturbed(torch.float32, 2.0**-23, seed=1)
    _, a3 = _perturbed(torch.float32, 2.0**-23, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a1, a2))
    assert not all(torch.equal(x, y) for x, y in zip(a1, a3))


def test_make_arms_and_lower_precision():
    assert str(lower_precision([T("cpu"), T("cpu:bf16")])) == "cpu:bf16"
    assert str(lower_precision([T("cpu:bf16"), T("cpu")])) == "cpu:bf16"
    assert str(lower_precision([T("cpu"), T("cpu:float64")])) == "cpu"
    assert str(lower_precision([T("cpu:emulate-tf32"), T("cpu")])) == "cpu:emulate-tf32"
    arms = make_arms([T("cpu"), T("cpu:emulate-tf32")], envelope=3, seed=5, judge=JUDGE)
    env = [a for a in arms if a.role == "envelope"]
    assert [a.name for a in env] == ["cpu:emulate-tf32~1", "cpu:emulate-tf32~2", "cpu:emulate-tf32~3"]
    assert all(a.reference == "cpu:emulate-tf32" for a in env)
    assert len({a.perturb_seed for a in env}) == 3
    assert [a.role for a in make_arms([T("cpu"), T("cpu:bf16")], 0, 0, JUDGE)] == ["target", "target", "judge"]


def test_unknown_optimizer_is_refused():
    from convcheck.errors import UsageError

    with pytest.raises(UsageError, match="unknown optimizer 'lbfgz'"):
        _recipe(optimizer="lbfgz")


def test_data_that_runs_out_is_a_usage_error():
    from convcheck.errors import UsageError

    build, batches = _setup(steps=2, batch_size=2)
    with pytest.raises(UsageError, match="ran out after 2 batches; 3 steps need 3"):
        run_training(build, list(batches)[:2], make_arms([T("cpu"), JUDGE], 0, 0, JUDGE), TrainConfig(steps=3))


@pytest.mark.parametrize("targets", [["cpu"], ["cpu", "cpu:bf16", "cpu:fp16"]])
def test_make_arms_takes_exactly_two_targets(targets):
    """One target (with an envelope it had no partner to pick the lower precision from: an IndexError)."""
    with pytest.raises(ValueError, match="takes the two targets"):
        make_arms([T(t) for t in targets], envelope=1, seed=0, judge=JUDGE)
