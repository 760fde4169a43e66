"""One results schema for live and rebuilt runs: ``compare`` and ``diff`` of two bundles of the same run
give results of the same types, tables with the same columns, facts keyed the same way."""

from __future__ import annotations

import dataclasses

import pytest

from convcheck.bundle.diff import diff_bundles
from convcheck.measure.parity import COLUMNS
from convcheck.measure.table_schema import ActivationRow, CurveRow, LayerGradRow, columns
from convcheck.targets.spec import Target
from convcheck.measure.train import Arm

from conftest import CFG


@pytest.fixture(scope="module")
def live_and_rebuilt(bundles):
    import convcheck

    return convcheck.compare("lenet", "cpu,cpu:bf16", **CFG), diff_bundles(*bundles)[0]


def test_live_and_rebuilt_results_share_one_schema(live_and_rebuilt):
    for r in live_and_rebuilt:
        assert tuple(r.parity.layers.columns) == COLUMNS
        assert tuple(r.training.curves.columns) == columns(CurveRow)
        assert tuple(r.training.layer_grads.columns) == columns(LayerGradRow)
        assert tuple(r.training.activations.columns) == columns(ActivationRow)
        assert len(r.parity.layers) and len(r.training.curves) and len(r.training.layer_grads)
    live, rebuilt = live_and_rebuilt
    assert type(live.parity) is type(rebuilt.parity) and type(live.training) is type(rebuilt.training)
    for r in live_and_rebuilt:
        assert [str(t) for t in r.parity.first_flagged] == ["cpu", "cpu:bf16"]
        for mapping in (r.parity.first_flagged, r.parity.losses, r.parity.self_difference, r.training.outcomes):
            assert all(isinstance(k, Target) for k in mapping)
        for mapping in (r.training.nonfinite_producer, r.training.nonfinite_weights):
            assert list(mapping) == list(r.training.arms) and all(isinstance(a, Arm) for a in mapping)
        assert r.training.lower_precision == Target.parse("cpu:bf16")
        assert set(r.training.outcomes) == {Target.parse(s) for s in ("cpu", "cpu:bf16", "cpu:float64")}
    # the per-target facts read the same from both (the judge re-run here is the one recorded)
    assert {str(t): o.final_loss for t, o in live.training.outcomes.items()} == \
        {str(t): o.final_loss for t, o in rebuilt.training.outcomes.items()}


def test_results_cannot_be_changed_after_construction(live_and_rebuilt):
    for r in live_and_rebuilt:
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.training.outcomes = {}
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.training.envelope = None
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.training.lower_precision = None
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.parity.first_flagged = {}
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.parity.layers = r.parity.layers.head(0)
