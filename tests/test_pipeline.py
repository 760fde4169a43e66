"""convcheck.compare (convcheck/pipeline.py): the whole pipeline through the Python API, and its summary."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import CompareConfig, CompareResult, compare
from convcheck.errors import TargetUnavailable, UsageError
from convcheck.plan.models import resolve_model
from convcheck.measure.parity import ParityResult
from convcheck.report.export import SUMMARY_SCHEMA, summary_dict
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target, snapshot_global_flags
from convcheck.measure.train import TrainResult

T = Target.parse

SHA256 = re.compile(r"^[0-9a-f]{64}$")
FAST = dict(steps=3, batch_size=8, envelope=0)


@pytest.fixture(scope="module")
def lenet_run():
    """One real run (this machine's env audit included), with the flags seen around it."""
    before = (snapshot_global_flags(), torch.get_default_dtype())
    calls = []
    result = compare("lenet", "cpu,cpu:emulate-tf32", steps=4, batch_size=8, envelope=1,
                     progress=lambda *a: calls.append(a))
    after = (snapshot_global_flags(), torch.get_default_dtype())
    return result, before, after, calls


def test_result_fields(lenet_run):
    r, *_ = lenet_run
    assert isinstance(r, CompareResult)
    assert isinstance(r.config, CompareConfig)
    assert [str(t) for t in r.targets] == ["cpu", "cpu:emulate-tf32"]
    assert r.model.name == "lenet" and r.model.input_shape == (1, 28, 28) and r.model.num_classes == 10
    assert r.config.steps == 4 and r.config.batch_size == 8 and r.config.envelope == 1
    assert isinstance(r.parity, ParityResult) and isinstance(r.training, TrainResult)
    assert named(r.parity.first_flagged) == {"cpu": None, "cpu:emulate-tf32": None}
    assert set(named(r.training.outcomes)) == {"cpu", "cpu:emulate-tf32", "cpu:float64"}
    assert len(r.training.curves) == 4 * 4  # two targets, the judge, one envelope run
    assert r.data_source == "synthetic"
    assert set(r.timings) >= {"setup_s", "parity_s", "train_s"}
    assert r.fingerprint is not None  # this machine was audited
    assert isinstance(r.findings, list)
    if r.verdict is not None:
        assert r.ok == (r.verdict.category == "ok")


def test_hashes_are_recorded(lenet_run):
    r, *_ = lenet_run
    assert SHA256.match(r.init_hash)
    assert len(r.batch_hashes) == 4 and all(SHA256.match(h) for h in r.batch_hashes)
    assert len(set(r.batch_hashes)) == 4


def test_hashes_are_stable_across_runs_and_follow_the_seed(lenet_run):
    r, *_ = lenet_run
    again = compare("lenet", "cpu,cpu:float64", steps=2, batch_size=8, envelope=0, env_findings=[])
    assert again.init_hash == r.init_hash
    assert again.batch_hashes == r.batch_hashes[:2]
    other = compare("lenet", "cpu,cpu:float64", steps=2, batch_size=8, envelope=0, seed=1, env_findings=[])
    assert other.init_hash != r.init_hash
    assert other.batch_hashes[0] != r.batch_hashes[0]


def test_torch_global_state_is_unchanged_after_a_run(lenet_run):
    _, before, after, _ = lenet_run
    assert after == before


def test_flags_the_user_set_survive_a_run():
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    try:
        before = snapshot_global_flags()
        compare("lenet", "cpu,cpu:emulate-tf32", steps=1, batch_size=2, envelope=0, env_findings=[])
        assert snapshot_global_flags() == before
    finally:
        torch.backends.cudnn.benchmark = False
        torch.set_float32_matmul_precision("highest")


def test_progress_is_reported(lenet_run):
    *_, calls = lenet_run
    assert ("parity", 0, 1) in calls and ("parity", 1, 1) in calls
    train = [c for c in calls if c[0] == "train"]
    assert train[-1] == ("train", 16, 16)
    assert [c[1] for c in train] == sorted(c[1] for c in train)


def test_summary_schema(lenet_run):
    r, *_ = lenet_run
    s = r.to_summary()
    assert s == summary_dict(r)
    json.dumps(s, allow_nan=False)  # plain JSON: no NaN, no objects
    assert s["schema"] == SUMMARY_SCHEMA == "convcheck.summary/2"
    assert s["model"]["name"] == "lenet"
    assert s["targets"] == ["cpu", "cpu:emulate-tf32"]
    assert s["judge"] == "cpu:float64"
    assert s["seed"] == 0
    assert s["initial_weights_sha256"] == r.init_hash
    assert s["data"]["batch_sha256"] == list(r.batch_hashes)
    layers = s["parity"]["layers"]
    assert isinstance(layers, list) and len(layers) == len(r.parity.layers)
    assert {"target", "layer", "local", "propagated", "bound", "flagged", "nan", "inf"} <= set(layers[0])
    assert s["parity"]["first_flagged_layer"] == {"cpu": None, "cpu:emulate-tf32": None}
    per = s["training"]["per_target"]
    for t in ("cpu", "cpu:emulate-tf32", "cpu:float64"):
        assert isinstance(per[t]["converged"], bool)
        assert per[t]["first_nonfinite_step"] is None
    assert "converged" in s["training"]["converged_rule"]
    assert len(s["training"]["loss"]["cpu"]) == 4
    assert s["config"]["tolerances"]["bound_factor"] == r.config.tolerances.bound_factor


def test_default_targets_without_a_gpu_come_with_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = compare("lenet", steps=1, batch_size=2, envelope=0, env_findings=[])
    assert [str(t) for t in r.targets] == ["cpu", "cpu:emulate-tf32"]  # what a GPU's TF32 would do
    assert any("no GPU" in n and "cpu:emulate-tf32" in n for n in r.notes)
    assert str(r.config.judge) == "cpu:float64"
    assert set(named(r.training.outcomes)) == {"cpu", "cpu:emulate-tf32", "cpu:float64"}
    assert r.to_summary()["notes"] == r.notes


def test_targets_as_a_list_of_specs_or_targets():
    r = compare("lenet", [Target.parse("cpu"), "cpu:bf16"], steps=1, batch_size=2, envelope=0, env_findings=[])
    assert [str(t) for t in r.targets] == ["cpu", "cpu:bf16"]


# --- models given as objects -------------------------------------------------------------------

class NaiveNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


def offset_net():
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), NaiveNorm(), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        net[1].bias.fill_(30.0)
    return net


def test_a_factory_and_a_module_instance():
    r = compare(offset_net, "cpu,cpu:bf16", input_shape=(1, 8, 8), num_classes=4, env_findings=[], **FAST)
    assert r.model.name == "offset_net" and r.model.source == "object"
    # float32 loses ~1e-4 in the naive norm: flagged, but a note (below min_error); bf16 loses everything
    assert named(r.parity.first_flagged) == {"cpu": "2", "cpu:bf16": "2"}
    assert not r.ok and r.verdict.target == "cpu:bf16"
    s = r.to_summary()
    assert s["parity"]["first_flagged_layer"]["cpu:bf16"] == "2"
    r2 = compare(offset_net(), "cpu,cpu:bf16", input_shape=(1, 8, 8), num_classes=4, env_findings=[], **FAST)
    assert r2.model.name == "Sequential"
    assert r2.parity.first_flagged == r.parity.first_flagged


def test_a_model_object_needs_its_input_shape():
    with pytest.raises(UsageError, match="input_shape"):
        compare(offset_net, "cpu,cpu:bf16", env_findings=[], **FAST)


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_a_model_that_produces_nan_is_a_result():
    def nan_net():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), Sqrt(), nn.Linear(8, 4))

    r = compare(nan_net, "cpu,cpu:bf16", input_shape=(1, 8, 8), num_classes=4, env_findings=[], **FAST)
    assert not r.ok
    for name in ("cpu", "cpu:bf16", "cpu:float64"):
        assert r.training.outcomes[T(name)].first_nonfinite_step == 0
        assert r.training.outcomes[T(name)].converged is False
    s = r.to_summary()
    json.dumps(s, allow_nan=False)
    assert s["training"]["per_target"]["cpu"]["first_nonfinite_step"] == 0
    assert s["training"]["per_target"]["cpu"]["first_loss"] is None  # NaN becomes null
    assert any(row["nan"] > 0 for row in s["parity"]["layers"])


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps"),
    (dict(batch_size=0), "batch size"),
    (dict(envelope=-1), "envelope"),
    (dict(optimizer="lbfgs"), "optimizer"),
    (dict(lr=0.0), "learning rate"),
    (dict(lr=math.nan), "learning rate"),
    (dict(targets="cpu"), "exactly two"),
    (dict(targets="cpu,cpu:fp8"), "'fp8'"),
    (dict(data="npz:/nonexistent/data.npz"), "data.npz"),
    (dict(data="imagenet:/x"), "unknown data source"),
])
def test_bad_arguments_are_usage_errors(kwargs, match):
    args = dict(targets="cpu,cpu:float64", steps=1, batch_size=2, envelope=0, env_findings=[])
    args.update(kwargs)
    with pytest.raises(UsageError, match=re.escape(match) if "'" in match else match):
        compare("lenet", **args)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UsageError) as info:
        compare("lenet6", "cpu,cpu:float64", steps=1, env_findings=[])
    for name in ("lenet", "cifar_cnn", "resnet18", "resnet34", "resnet50"):
        assert name in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_target_this_machine_cannot_run():
    built = []

    def factory():
        built.append(1)
        return offset_net()

    with pytest.raises(TargetUnavailable, match="cpu:emulate-tf32"):
        compare(factory, "cpu,cuda", input_shape=(1, 8, 8), num_classes=4, env_findings=[], **FAST)
    assert built == []  # refused before any model is built


def test_a_factory_that_raises_is_a_usage_error():
    def broken():
        raise RuntimeError("no such weights")

    with pytest.raises(UsageError, match="no such weights"):
        compare(broken, "cpu,cpu:float64", input_shape=(1, 8, 8), num_classes=4, env_findings=[], **FAST)


def test_an_input_shape_the_model_rejects():
    with pytest.raises(UsageError, match="rejects input shape"):
        compare(offset_net, "cpu,cpu:float64", input_shape=(3, 8, 8), num_classes=4, env_findings=[], **FAST)


# --- ImageNet scale ------------------------------------------------------------------------------

@pytest.mark.slow
def test_resnet50_one_parity_step_and_two_training_steps():
    before = snapshot_global_flags()
    r = compare("resnet50", "cpu,cpu:float64", steps=2, batch_size=2, envelope=0, env_findings=[])
    assert snapshot_global_flags() == before
    assert named(r.parity.first_flagged) == {"cpu": None}
    fwd = r.parity.layers[r.parity.layers["kind"] == "forward"]
    grads = r.parity.layers[r.parity.layers["kind"] == "grad"]
    assert "layer1.0.relu#3" in set(fwd["layer"])
    assert len(grads) == len(list(resolve_model("resnet50").factory().parameters()))
    assert fwd["local"].max() < 1e-5
    assert grads["propagated"].map(math.isfinite).all()
    assert len(r.training.curves) == 2 * 2
    for info in r.training.outcomes.values():
        assert info.first_nonfinite_step is None
    assert math.isfinite(r.training.outcomes[T("cpu")].final_dist_judge)
