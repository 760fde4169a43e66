"""The declared row schemas (``table_schema``): every row the live run makes holds exactly its
table's columns, the bundle reader's checks come from the same classes, and the tables are built
with those columns even when empty."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from convcheck.bundle import reader
from convcheck.measure.parity import COLUMNS, ParityResult, run_parity
from convcheck.measure.table_schema import (
    ActivationRow, CurveRow, LayerGradRow, ParityRow, columns, frame, json_kinds, named,
)
from convcheck.targets.spec import CPU_JUDGE, Target
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES
from convcheck.measure.train import TrainConfig, TrainResult, make_arms, run_training

T = Target.parse


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _build(template):
    import copy

    return lambda t: t.place(copy.deepcopy(template))


def test_columns_are_the_row_fields_in_order():
    assert COLUMNS == columns(ParityRow) and COLUMNS[:3] == ("target", "order", "kind") and COLUMNS[-1] == "flagged"
    assert columns(LayerGradRow) == ("arm", "step", "layer", "grad_norm", "zero_frac")
    assert tuple(frame(ActivationRow, []).columns) == columns(ActivationRow)  # an empty table keeps its columns


def test_the_bundle_reader_checks_the_declared_columns():
    kinds = json_kinds(ParityRow)
    assert kinds["target"] is str and kinds["flagged"] is bool and kinds["order"] is int
    assert kinds["floor"] == (int, float) and kinds["param"] == (str, type(None)) and kinds["K"] == (int, type(None))
    assert reader.PARITY_COLUMNS == kinds and list(reader.CURVE_COLUMNS) == list(columns(CurveRow))
    assert reader.LAYER_GRAD_COLUMNS == json_kinds(LayerGradRow)
    assert reader.ACTIVATION_COLUMNS == json_kinds(ActivationRow)


def test_live_rows_hold_exactly_the_schema(monkeypatch):
    """No column made by hand outside the schema, none missing (``frame`` would fill it with NaN)."""
    made = []
    real = ParityResult.from_rows.__func__
    monkeypatch.setattr(ParityResult, "from_rows", classmethod(lambda cls, rows, *a, **k: made.append(rows) or
                                                                real(cls, rows, *a, **k)))
    template = _mlp()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    p = run_parity(_build(template), (x, y), [T("cpu"), T("cpu:bf16")])
    assert made and made[0] and all(set(r) == set(COLUMNS) for r in made[0])
    assert [str(t) for t in p.targets] == ["cpu", "cpu:bf16"] and set(named(p.losses)) == {"cpu", "cpu:bf16"}

    kept = {}
    arms = make_arms([T("cpu"), T("cpu:bf16")], envelope=1, seed=0, judge=CPU_JUDGE)
    run_training(_build(template), [(x, y)] * 2, arms, TrainConfig(steps=2), keep=lambda curves: kept.update(
        curves=curves))
    assert all(set(row) == set(columns(CurveRow)) for row in kept["curves"]) and len(kept["curves"]) == 2 * 4


def test_train_result_is_built_complete_and_frozen():
    """``from_rows`` makes the outcomes, the envelope and the lower-precision target; nothing is set later."""
    arms = make_arms([T("cpu"), T("cpu:bf16")], envelope=1, seed=0, judge=CPU_JUDGE)
    rows = [dict(arm=a.name, role=a.role, target=str(a.target), step=s, loss=2.0 - s, grad_norm=1.0, dist_judge=0.0,
                 dist_ref=0.0, dist_other=0.0, nonfinite_loss=False, nonfinite_grad=False, loss_scale=1.0,
                 skipped=False, update_ratio=1e-3, lr=1e-3, clipped=False) for s in range(2) for a in arms]
    r = TrainResult.from_rows(rows, [], [], arms, TrainConfig(steps=2), DEFAULT_TOLERANCES,
                              nonfinite_producer={a: None for a in arms}, nonfinite_weights={a: False for a in arms})
    assert list(r.outcomes) == [T("cpu"), T("cpu:bf16"), CPU_JUDGE]  # envelope runs are no targets
    assert r.outcomes[T("cpu")].final_loss == 1.0 and r.envelope.runs == 1 and r.envelope.reference == "cpu:bf16"
    assert r.lower_precision == T("cpu:bf16") and r.judge == "cpu:float64"
    assert r.arm_of(T("cpu:bf16")).role == "target" and r.arm_of(CPU_JUDGE).role == "judge"
    assert len(r.arm_curve(r.arm_of(T("cpu")))) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.outcomes = {}
    p = ParityResult.from_rows([], [T("cpu")], DEFAULT_TOLERANCES, 1.0, losses={T("cpu"): 1.0},
                               self_difference={}, judge="cpu:float64")
    assert tuple(p.layers.columns) == COLUMNS and p.first_flagged == {T("cpu"): None} and bool(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.losses = {}
