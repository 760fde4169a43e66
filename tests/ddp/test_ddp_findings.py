"""Data-parallel setups that really have the problem (issue 12, item 3), through ``convcheck.compare``:
buffers not broadcast, ranks that see the same samples, random draws the shared masks do not cover.
Each asserts what the user reads: verdict category / sub-cause, the layer named, the evidence line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.ddp.diagnostics import buffers_not_broadcast, dropout_per_rank, same_data

pytestmark = pytest.mark.usefixtures("no_orphans")  # conftest: no rank process is left behind


class RunningCenter(nn.Module):
    """Subtracts a running mean of its input, kept in a buffer and updated by every training forward
    (as BatchNorm's running statistics are, but used in training too)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("center", torch.zeros(n))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.center.mul_(0.5).add_(0.5 * x.mean(0))
        return x - self.center


def _centered():
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), RunningCenter(16), nn.ReLU(), nn.Linear(16, 3))


def _compare(factory, **kw):
    opts = dict(input_shape=(1, 2, 4), num_classes=3, targets="cpu,ddp:cpu:2", batch_size=8, steps=3, envelope=1,
                optimizer="sgd", lr=0.05)
    opts.update(kw)
    return convcheck.compare(factory, **opts)


def test_buffers_not_broadcast_are_a_setup_verdict_naming_the_buffer():
    r = _compare(_centered, ddp_no_broadcast_buffers=True)
    v = r.verdict
    assert (v.category, v.sub_cause, v.layer) == ("setup", "ddp", "2")
    assert "buffers '2.center' differ across the ranks of ddp:cpu:2 when the forward starts" in v.headline
    # steps as the curves number them: step 0 starts from equal buffers, its forward sets them per rank
    assert any(e.startswith("buffer '2.center' on ddp:cpu:2: ranks differ by up to") and
               e.endswith("(first when step 1's forward starts; step 0's forward set it from each rank's own "
                          "slice)") for e in v.evidence)
    assert "'2.center' is set in the forward from each rank's own slice" in v.headline
    # broadcasting would not fix it (the forward uses the rank's own slice): the remedy is the all_reduce
    assert v.remedies[0].startswith("compute '2.center' over all ranks in the forward: all_reduce")
    assert not any(rem.startswith("broadcast the buffers") for rem in v.remedies)
    # the same model with DDP's default broadcast: the ranks start every forward from rank 0's buffers, but
    # each rank's forward still centres its slice with its own mean: the step-0 averaged gradient is apart
    default = _compare(_centered, steps=2)
    assert buffers_not_broadcast(default.training, "ddp:cpu:2") is None
    v = default.verdict
    assert (v.category, v.sub_cause, v.layer) == ("setup", "ddp", "2")
    assert v.headline.startswith("data-parallel setup: the averaged gradient on ddp:cpu:2 differs from one "
                                 "device's at step 0")
    assert "'2' sets '2.center' from each of the 2 ranks' own slice in its forward" in v.headline
    assert v.remedies == [v.remedies[0]] and "all_reduce" in v.remedies[0]


def _repeated_per_rank():
    """A global batch put together from two per-rank loaders without a DistributedSampler: each rank's
    loader yields the same 4 samples, so rank 1's slice is rank 0's."""
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        x, y = torch.randn(4, 1, 2, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
        yield torch.cat([x, x]), torch.cat([y, y])


def test_ranks_that_see_the_same_samples_are_a_setup_verdict():
    r = _compare(lambda: nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), data=_repeated_per_rank,
                 input_shape=None, num_classes=None)
    v = r.verdict
    assert (v.category, v.sub_cause) == ("setup", "ddp")
    assert v.headline.startswith("data-parallel setup: the ranks of ddp:cpu:2 see the same samples: in 3 of 3 steps")
    assert v.evidence[0].startswith("per-rank batch hashes equal at step 1: ranks 0, 1")
    assert "DistributedSampler" in v.remedies[0]


class FunctionalDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.3, self.training)


def test_random_draws_the_shared_masks_miss_are_a_setup_verdict_naming_the_layer():
    def net():
        return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), FunctionalDropout(), nn.Linear(16, 3), nn.Dropout(0.2))
    r = _compare(net, steps=2)
    v = r.verdict
    assert (v.category, v.sub_cause, v.layer) == ("setup", "ddp", "3")  # not the nn.Dropout: its masks are shared
    assert "'3' draws random numbers inside the forward (F.dropout" in v.headline
    assert "every rank drew the same random numbers for its own slice" in v.evidence[0]
    assert any("torch.manual_seed(seed + rank)" in rem for rem in v.remedies)
    found = dropout_per_rank(r.training, "ddp:cpu:2")
    assert found.layers == ("3",) and same_data(r.training, "ddp:cpu:2") is None


class BNNet(nn.Module):
    """A user's small conv net with plain BatchNorm (or SyncBatchNorm), as in a new user's trial."""

    def __init__(self, sync=False):
        super().__init__()
        bn = nn.SyncBatchNorm if sync else nn.BatchNorm2d
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), bn(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return self.head(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("sync", [False, True])
def test_per_rank_batchnorm_is_setup_from_the_step_0_gradient_before_any_drift(sync):
    """2 samples per rank, 3 SGD steps: the final loss stays within the outcome rule's margin, which used
    to leave a plain BatchNorm an ``ok`` with a note; the averaged gradient at step 0 is already far outside
    its bound (the parity rows), so it is ``setup`` naming the BatchNorm. SyncBatchNorm stays ``ok``."""
    r = _compare(lambda: BNNet(sync), input_shape=(3, 4, 4), num_classes=4, batch_size=4)
    v = r.verdict
    if sync:
        assert v.category == "ok", v.headline
        return
    assert (v.category, v.sub_cause, v.layer) == ("setup", "ddp", "bn1")
    assert v.headline.startswith("data-parallel setup: the averaged gradient on ddp:cpu:2 differs from one "
                                 "device's at step 0")
    assert "BatchNorm layers 'bn1' normalise each of the 2 ranks' slice with its own batch statistics" in v.headline
    assert v.evidence[0].startswith("step 0, before any update: the averaged gradient of '")
    assert "SyncBatchNorm.convert_sync_batchnorm" in v.remedies[0] and len(v.remedies) == 1
    assert "batchnorm_per_rank" in v.symptoms  # --verify's SyncBatchNorm re-run reads it


class _ShiftedLogits(nn.Module):
    """A user's MLP with a learned shift added to every logit: cross-entropy ignores it, so its true
    gradient is zero (one device's float32 gradient is exactly 0, the all-reduced one ~1e-8)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.net(x) + self.shift


def test_a_parameter_whose_true_gradient_is_zero_does_not_fail_a_healthy_ddp_run():
    """Review: its relative error against the judge's rounding-noise gradient was 1.3e8x its bound, and the run
    was 'setup: the averaged gradient ... differs from one device's at step 0'."""
    r = _compare(_ShiftedLogits, seed=4, steps=2, envelope=0)  # seed 4: one device's float32 gradient is exactly 0
    rows = r.parity.layers[(r.parity.layers["target"] == "ddp:cpu:2") & (r.parity.layers["param"] == "shift")]
    assert len(rows) == 1 and rows["bound"].iloc[0] == 10.0  # 10x an error of 1 (0 against the judge's noise)
    assert rows["propagated"].iloc[0] > 1e6 * rows["bound"].iloc[0]
    assert r.verdict.category == "ok", r.verdict.headline
