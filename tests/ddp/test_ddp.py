"""Data-parallel targets (issue 12): spec grammar, gloo ranks on the CPU, parity, diagnostics, shutdown.

The tests that start processes use a tiny model, 2 ranks and 2-3 steps (about a second each)."""

from __future__ import annotations

import os
import signal
import time

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.plan.config import CompareConfig
from convcheck.ddp.diagnostics import batchnorm_per_rank, loss_scale
from convcheck.ddp.evidence import RankMeasures
from convcheck.ddp.rules import ddp_setup
from convcheck.diagnose import Evidence
from convcheck.targets.executors import executor_for
from convcheck.errors import ConvcheckError, RunFailed, TargetUnavailable, UsageError
from convcheck.plan.recipe import build_recipe
from convcheck.targets.spec import CPU_JUDGE, Target, parse_targets
from convcheck.measure.train import TrainConfig, lower_precision, make_arms, run_training
from convcheck.measure.train.arms import Arm
from convcheck.measure.train.result import TrainResult

T = Target.parse


def ddp_findings(training, arm: str = "ddp:cpu:2") -> list:
    """The findings the arm's executor (the rank pool) hands the diagnosis."""
    return list(executor_for(T(arm)).findings(training, arm))


pytestmark = pytest.mark.usefixtures("no_orphans")  # conftest: no rank process is left behind


# -- spec grammar (no processes) ---------------------------------------------------------------

@pytest.mark.parametrize("spec,world,mode", [
    ("ddp:cpu:2", 2, "float32"), ("ddp:cpu:2:bf16", 2, "bf16"), ("ddp:cpu:4:amp-bf16", 4, "amp-bf16"),
    ("ddp:cuda:2", 2, "float32"), ("ddp:cuda:8:amp-bf16", 8, "amp-bf16"), ("DDP:CPU:3:fp32", 3, "float32"),
])
def test_ddp_spec_round_trip(spec, world, mode):
    t = T(spec)
    assert (t.world, t.mode, t.index) == (world, mode, None)
    assert T(str(t)) == t
    assert str(t).startswith("ddp:")
    assert t.per_rank == Target(t.device, None, t.mode)
    assert t.runner.world == world and t.runner.precision == t.per_rank.runner.precision


def test_existing_specs_unchanged():
    for spec in ("cpu", "cpu:float64", "cpu:bf16", "cuda:1:tf32", "cpu:amp-bf16"):
        t = T(spec)
        assert t.world is None and str(t) == spec and T(str(t)) == t


@pytest.mark.parametrize("spec", ["ddp", "ddp:cpu", "ddp:cpu:0", "ddp:cpu:x", "ddp:mps:2", "ddp:cpu:2:float64",
                                  "ddp:cpu:2:bf16:tf32", "ddp:cuda:1:2"])
def test_bad_ddp_specs_are_usage_errors(spec):
    with pytest.raises(UsageError):
        T(spec)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
def test_ddp_cuda_needs_that_many_gpus():
    with pytest.raises(TargetUnavailable) as err:
        T("ddp:cuda:2").check_available()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"ddp:cuda:2 needs 2 CUDA GPUs, {torch.cuda.device_count()} visible" in msg


def test_ddp_pairs_and_envelope_reference():
    a, b = parse_targets("cpu,ddp:cpu:2")
    assert b.world == 2 and str(b.runner.describe()).startswith("DistributedDataParallel, 2 processes over gloo")
    assert lower_precision([a, b]) == a and lower_precision([b, a]) == a  # the single device's envelope
    assert lower_precision([T("ddp:cpu:2:bf16"), a]) == T("ddp:cpu:2:bf16")  # precision still decides
    with pytest.raises(UsageError):
        parse_targets("ddp:cpu:2,ddp:cpu:2")


# -- tiny models -------------------------------------------------------------------------------

def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _bn_net(sync: bool = False):
    bn = nn.SyncBatchNorm(16) if sync else nn.BatchNorm1d(16)
    return nn.Sequential(nn.Linear(8, 16), bn, nn.ReLU(), nn.Linear(16, 3))


def _builder(factory):
    torch.manual_seed(0)
    state = {k: v.double() if v.is_floating_point() else v for k, v in factory().state_dict().items()}

    def build(t):
        m = factory()
        m.load_state_dict(state)
        t.runner.place(m)
        for k, p in m.state_dict().items():
            if p.is_floating_point():
                p.copy_(state[k].to(p.dtype))
        return m.train()
    return build


def _batches(n, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _train(factory, targets="cpu,ddp:cpu:2", steps=3, batch=8, envelope=0, **recipe):
    arms = make_arms(parse_targets(targets), envelope, 0, CPU_JUDGE)
    cfg = TrainConfig(steps=steps, recipe=build_recipe(CompareConfig(**recipe)) if recipe else None)
    return run_training(_builder(factory), _batches(steps, batch), arms, cfg)


def _last(result, arm, col):
    c = result.curves
    return float(c[c["arm"] == arm][col].iloc[-1])


# -- runs on 2 gloo ranks ---------------------------------------------------------------------

def test_ddp_matches_single_device_with_shared_dropout():
    r = _train(_mlp, steps=3)
    c = r.curves
    one, ddp = c[c["arm"] == "cpu"].reset_index(), c[c["arm"] == "ddp:cpu:2"].reset_index()
    assert len(ddp) == 3
    assert (abs(one["loss"] - ddp["loss"]) <= 1e-6 * abs(one["loss"])).all()  # reduction order only
    assert (abs(one["grad_norm"] - ddp["grad_norm"]) <= 1e-5 * one["grad_norm"]).all()
    assert _last(r, "ddp:cpu:2", "dist_other") < 1e-6
    assert r.outcomes[T("ddp:cpu:2")].converged == r.outcomes[T("cpu")].converged
    assert ddp_findings(r) == []


def test_batchnorm_per_rank_is_found_and_sync_batchnorm_matches():
    # global batch 4 on 2 ranks: per-rank batch 2
    # SGD: Adam turns the bias before the BatchNorm (gradient zero up to roundoff) into +-lr steps
    r = _train(_bn_net, steps=2, batch=4, optimizer="sgd", lr=0.1)
    assert _last(r, "ddp:cpu:2", "dist_other") > 1e-3
    found = batchnorm_per_rank(r, "ddp:cpu:2")
    assert found is not None and found.layers == ("1",)
    assert (found.category, found.sub_cause) == ("setup", "ddp")
    assert "SyncBatchNorm.convert_sync_batchnorm" in found.remedy
    assert [f.kind for f in ddp_findings(r)] == ["batchnorm_per_rank"]

    synced = _train(lambda: _bn_net(sync=True), steps=2, batch=4, optimizer="sgd", lr=0.1)  # SyncBatchNorm (gloo: convcheck's twin)
    assert _last(synced, "ddp:cpu:2", "dist_other") < 1e-5
    assert abs(_last(synced, "ddp:cpu:2", "loss") - _last(synced, "cpu", "loss")) < 1e-5
    assert ddp_findings(synced) == []


def test_summed_loss_is_off_by_the_world_size():
    def summed(out, y):
        return F.cross_entropy(out, y, reduction="sum")
    r = _train(_mlp, steps=2, loss=summed, optimizer="sgd", lr=0.01)
    found = loss_scale(r, "ddp:cpu:2")
    assert found is not None and "1/2" in found.summary and "summed" in found.summary
    assert ddp_findings(r)[0].kind == "loss_scale"


def test_a_failing_rank_is_one_line_naming_it():
    def fails_on_rank_1(out, y):
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("boom on this rank")
        return F.cross_entropy(out, y)
    with pytest.raises(ConvcheckError) as err:  # the user's loss raised: the same class as on one device
        _train(_mlp, steps=2, loss=fails_on_rank_1)
    assert err.value.exit_code == 2
    msg = str(err.value)
    assert "\n" not in msg and "rank 1 of 2" in msg and "boom on this rank" in msg and "training step 1" in msg


def test_a_killed_rank_ends_the_run_and_nothing_is_left_behind(no_orphans):
    _children = no_orphans
    from convcheck.ddp.arm import DDPArmState

    arm = Arm("ddp:cpu:2", T("ddp:cpu:2"), "target")
    state = DDPArmState(arm, _builder(_mlp), 3, build_recipe(CompareConfig()))
    try:
        pids = [p.pid for p in state.pool.procs]
        assert len(pids) == 2 and all(p in _children() for p in pids)
        x, y = _batches(1)[0]
        state.step(x, y, 0, 0)
        os.kill(pids[1], signal.SIGKILL)
        state.step_index = 1  # as run_training sets it
        with pytest.raises(RunFailed, match=r"rank 1 of 2 was killed by signal 9 during training step 2"):
            state.step(x, y, 1, 1)
    finally:
        state.close()
    assert not set(pids) & set(_children())


def test_ctrl_c_in_the_parent_stops_every_rank(monkeypatch):
    from convcheck.ddp.rank_pool import RankPool

    def interrupted(self, cmd, *args, what=""):
        raise KeyboardInterrupt
    monkeypatch.setattr(RankPool, "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _train(_mlp, steps=2)


def test_a_batch_that_does_not_split_is_a_usage_error():
    with pytest.raises(UsageError, match="global batch of 7 does not split evenly over 2 ranks"):
        _train(_mlp, steps=1, batch=7)


# -- diagnostics on hand-built evidence (no processes) ------------------------------------------

def _evidence(ddp_grad=1.0, one_grad=1.0, bn=None, world=2):
    arms = make_arms([T("cpu"), T(f"ddp:cpu:{world}")], 0, 0, CPU_JUDGE)
    rows = [dict(arm=a.name, role=a.role, target=str(a.target), step=0, loss=1.0,
                 grad_norm=ddp_grad if a.target.world else one_grad, dist_judge=0.0, dist_ref=float("nan"),
                 dist_other=0.1) for a in arms]
    return TrainResult(curves=pd.DataFrame(rows), layer_grads=pd.DataFrame(), activations=pd.DataFrame(),
                       arms=arms, config=TrainConfig(),
                       arm_evidence={arms[1]: RankMeasures(batchnorm=bn or [])})


def test_loss_scale_detector_on_hand_built_evidence():
    assert loss_scale(_evidence(0.5, 1.0), "ddp:cpu:2").summary.startswith("the loss scale on ddp:cpu:2 is off by "
                                                                           "the world size (1/2)")
    assert "(4)" in loss_scale(_evidence(4.0, 1.0, world=4), "ddp:cpu:4").summary
    assert loss_scale(_evidence(1.0, 1.0), "ddp:cpu:2") is None
    assert loss_scale(_evidence(0.7, 1.0), "ddp:cpu:2") is None


def test_batchnorm_detector_on_hand_built_evidence():
    quiet = [{"bn1": (1e-7, 2e-7)}]
    assert batchnorm_per_rank(_evidence(bn=quiet), "ddp:cpu:2") is None
    loud = [{"bn1": (0.8, 0.3), "bn2": (1e-7, 1e-7)}, {"bn1": (0.9, 0.2), "layer.bn3": (0.1, 0.0)}]
    f = batchnorm_per_rank(_evidence(bn=loud), "ddp:cpu:2")
    assert f.layers == ("bn1", "layer.bn3")
    assert "'bn1', 'layer.bn3'" in f.summary and "0.9 global std" in f.evidence[0]


def test_parity_rows_compare_the_averaged_gradient_with_the_judge():
    from convcheck.measure.parity import run_parity

    batch = _batches(1)[0]
    p = run_parity(_builder(_mlp), batch, parse_targets("cpu,ddp:cpu:2"), judge=CPU_JUDGE)
    rows = p.layers[p.layers["target"] == "ddp:cpu:2"]
    assert set(rows["param"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert (rows["propagated"] < rows["bound"]).all() and (rows["propagated"] < 1e-5).all()
    assert abs(p.losses[T("ddp:cpu:2")] - p.losses[T("cpu")]) < 1e-6
    # the report names a gradient row by its parameter, with no empty "()" for the module it has none of
    import io
    import types

    from rich.console import Console

    from convcheck.report.text import _layers

    buf = io.StringIO()
    _layers(Console(file=buf, width=200), types.SimpleNamespace(parity=p))
    table = buf.getvalue()
    assert "0.weight" in table and "0.weight ()" not in table and "()" not in table.replace("(Linear)", "")


def _ddp_verdict(training, arm: str = "ddp:cpu:2"):
    """Rule V009 on the findings of ``arm`` alone (no envelope: every finding counts)."""
    return ddp_setup(Evidence(executor_findings=tuple(ddp_findings(training, arm))))


def test_ddp_verdict_is_setup_ddp_naming_the_layer():
    assert _ddp_verdict(_evidence()) is None
    loud = [{"features.1": (0.8, 0.3)}]
    v = _ddp_verdict(_evidence(0.5, 1.0, bn=loud))
    assert (v.category, v.sub_cause, v.target) == ("setup", "ddp", "ddp:cpu:2")
    assert v.symptoms == ["loss_scale", "batchnorm_per_rank"]
    assert any("BatchNorm layers 'features.1'" in e for e in v.evidence)
    assert len(v.remedies) == 2 and "SyncBatchNorm.convert_sync_batchnorm" in v.remedies[1]
    v = _ddp_verdict(_evidence(bn=loud))
    assert v.layer == "features.1" and "SyncBatchNorm.convert_sync_batchnorm" in v.remedies[0]


def _conv_bn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 4))


@pytest.mark.slow
@pytest.mark.parametrize("sync", [False, True])
def test_scenario_batchnorm_at_per_rank_batch_2_on_4_ranks(sync):
    """Issue 12: a BatchNorm model at global batch 8 on ddp:cpu:4 leaves the single-device envelope and the
    findings name the BatchNorm with the SyncBatchNorm remedy; with --ddp-sync-bn it is ok."""
    import convcheck

    r = convcheck.compare(_conv_bn, input_shape=(3, 8, 8), num_classes=4, targets="cpu,ddp:cpu:4", batch_size=8,
                          steps=6, optimizer="sgd", lr=0.05, ddp_sync_bn=sync)
    v = _ddp_verdict(r.training, "ddp:cpu:4")
    if sync:
        assert r.verdict.category == "ok" and v is None
    else:
        assert (v.category, v.sub_cause, v.layer) == ("setup", "ddp", "1")
        assert (r.verdict.category, r.verdict.sub_cause, r.verdict.layer) == ("setup", "ddp", "1")
        assert "BatchNorm layers '1'" in r.verdict.headline
        assert "SyncBatchNorm.convert_sync_batchnorm" in r.verdict.remedies[0]


@pytest.mark.slow
def test_scenario_summed_loss_is_a_loss_scale_verdict():
    import convcheck

    def summed(out, y):
        return F.cross_entropy(out, y, reduction="sum")
    def conv():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))
    r = convcheck.compare(conv, input_shape=(3, 8, 8), num_classes=4, targets="cpu,ddp:cpu:2", batch_size=8,
                          steps=15, envelope=1, optimizer="sgd", lr=0.002, loss=summed)
    assert (r.verdict.category, r.verdict.sub_cause) == ("setup", "ddp")
    assert "off by the world size (1/2)" in r.verdict.headline


@pytest.mark.slow
def test_cli_cifar_cnn_on_two_ranks(tmp_path):
    """Issue 12's first check; cifar_cnn has BatchNorm, so without --ddp-sync-bn the per-rank batch of 16
    normalises differently (found and named); with it, ddp:cpu:2 stays inside the envelope."""
    from convcheck.cli.main import main

    code = main(["compare", "--model", "cifar_cnn", "--targets", "cpu,ddp:cpu:2", "--steps", "20",
                 "--ddp-sync-bn", "--out", str(tmp_path)])
    assert code == 0


def test_numeric_modes_compose_and_envelope_runs_of_a_ddp_target():
    # ddp:cpu:2:bf16 is the lower-precision target: its envelope runs are data-parallel arms too
    r = _train(_mlp, targets="cpu,ddp:cpu:2:bf16", steps=2, envelope=1)
    c = r.curves
    assert set(c["arm"]) == {"cpu", "ddp:cpu:2:bf16", "cpu:float64", "ddp:cpu:2:bf16~1"}
    assert r.lower_precision == T("ddp:cpu:2:bf16")
    bf16 = c[c["arm"] == "ddp:cpu:2:bf16"]["loss"].to_numpy()
    one = c[c["arm"] == "cpu"]["loss"].to_numpy()
    assert abs(bf16 - one).max() < 0.05 and abs(bf16 - one).max() > 0  # bf16 rounding, same training
    assert (c[c["arm"] == "ddp:cpu:2:bf16~1"]["dist_ref"] > 0).all()


@pytest.mark.slow  # ~5 s: a rank really waits out the collective timeout
def test_a_stuck_rank_ends_the_run_within_the_collective_timeout(monkeypatch):
    monkeypatch.setenv("CONVCHECK_DDP_TIMEOUT", "2")

    def stuck_on_rank_1(out, y):
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(30)
        return F.cross_entropy(out, y)
    with pytest.raises(RunFailed) as err:
        _train(_mlp, steps=1, loss=stuck_on_rank_1)
    msg = str(err.value)
    assert "\n" not in msg and "rank 0 of 2 failed during training step 1" in msg
    assert "rank 1 had not finished the step" in msg


def test_the_mirror_gets_rank_0s_parameters_every_step_and_its_buffers_with_the_last():
    from convcheck.ddp.arm import DDPArmState

    arm = Arm("ddp:cpu:2", T("ddp:cpu:2"), "target")
    state = DDPArmState(arm, _builder(_bn_net), 2, build_recipe(CompareConfig(optimizer="sgd", lr=0.1)))
    try:
        first = {n: p.detach().clone() for n, p in state.model.named_parameters()}
        x, y = _batches(1)[0]
        state.step(x, y, 0, 0)
        assert all(not torch.equal(first[n], p) for n, p in state.model.named_parameters()
                   if n in ("0.weight", "3.weight", "3.bias"))  # 0.bias: no gradient before a BatchNorm
        assert torch.equal(state.model[1].running_mean, torch.zeros(16))  # buffers: not shipped yet
        state.step_index = 1
        state.step(x, y, 1, 1)
        assert not torch.equal(state.model[1].running_mean, torch.zeros(16))  # the last step brings them
    finally:
        state.close()
