"""Issue 48: a snapshot step over its budget keeps each layer's first, last, worst and first non-finite calls (and the
earliest others that fit), says what it dropped, and the judge replays what was kept; the diff's JSON stays small
whatever the number of calls."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped
from convcheck.runformat.reader import open_watched
from convcheck.watch.snapshots import SnapshotTaker


def forecaster_run(out, steps: int = 2, length: int = 1000, nan_at: int | None = None, hidden: int = 16,
                   batch: int = 4, **watch):
    """An LSTMCell forecaster unrolled over ``length`` time steps of a sine, trained with Adam, as a user writes it;
    ``nan_at``: the series holds a NaN there (every later time step's state turns NaN)."""
    torch.manual_seed(0)

    class Forecaster(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.head = nn.LSTMCell(1, hidden), nn.Linear(hidden, 1)

        def forward(self, x):
            h = c = torch.zeros(x.shape[1], hidden)
            outs = []
            for t in range(x.shape[0]):
                h, c = self.cell(x[t], (h, c))
                outs.append(self.head(h))
            return torch.stack(outs)

    model = Forecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    t = torch.linspace(0, 60, length + 1)
    series = torch.sin(t).reshape(-1, 1, 1).repeat(1, batch, 1)
    if nan_at is not None:
        series[nan_at] = float("nan")
    with convcheck.watch(model, opt, out=out, **watch) as w:
        for _ in range(steps):
            loss = F.mse_loss(model(series[:-1]), series[1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def diff(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["diff", *map(str, args)])
    return code, unwrapped(capsys.readouterr().out)


def test_a_step_over_its_budget_keeps_the_first_last_worst_and_first_nonfinite_calls():
    """The taker alone: 1,000 calls of one layer, a budget for a few dozen; call 600 the largest, 700 the first NaN."""
    budget = 60_000
    taker = SnapshotTaker({}, budget=budget)
    weight = torch.ones(4, 4)
    taker.take_params([("cell.weight", weight)])
    for k in range(1000):
        x = torch.full((4, 16), 1.0 + k / 1000)
        y = x * (50.0 if k == 600 else 1.0)
        if k == 700:
            y = y.clone()
            y[0, 0] = float("nan")
        taker.take_call("cell", [x], [y])
    kept = sorted({int(k.split("/")[2]) for k in taker.arrays if k.startswith("out/cell/")})
    assert {0, 600, 700, 999} <= set(kept) and 10 < len(kept) < 100
    assert kept[:5] == [0, 1, 2, 3, 4]  # the others that fit: the earliest calls
    summary = taker.keeper.summary(budget)["layers"]["cell"]
    assert summary["calls"] == 1000 and summary["kept"] == len(kept)
    assert (summary["first"], summary["last"], summary["worst"], summary["nonfinite"]) == (0, 999, 600, 700)
    assert taker.nbytes() <= budget


@pytest.mark.slow  # ~3 s: the slow pass (the README's command stays under 3 minutes)
def test_a_recurrent_cell_unrolled_over_1000_steps_is_kept_within_its_budget_and_judged(tmp_path, capsys,
                                                                                        monkeypatch):
    """The snapshot at most its budget (CONVCHECK_SNAPSHOT_BYTES, as a user sets it without touching the script), the
    report saying what was kept of each layer; the judge replays the kept calls (the cell's (h, c) tuple included)
    and both layers are checked; the diff's JSON stays far below 1 MB."""
    monkeypatch.setenv("CONVCHECK_SNAPSHOT_BYTES", "300K")
    forecaster_run(tmp_path / "a")
    forecaster_run(tmp_path / "b")
    run = open_watched(tmp_path / "a")
    (entry,) = run["snapshots"]
    assert entry["bytes"] <= 300_000 and run["snapshot_bytes"] == 300_000
    cell = entry["kept"]["layers"]["cell"]
    assert cell["calls"] == 1000 and 3 < cell["kept"] < 1000 and cell["first"] == 0 and cell["last"] == 999
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0, out
    assert "kept: snapshot step 0: 1,000 calls of cell, kept " in out
    assert "(first, last, worst, and the earliest others that fit)" in out and "dropped over the 293 KiB budget" in out
    assert "the judge checked 2 of 2 layers (snapshot step 0)" in out
    assert "calls dropped over the snapshot budget, not replayed (a layer is checked when every call kept of it was)" \
        in out
    code, text = diff(capsys, tmp_path / "a", tmp_path / "b", "--json")
    assert len(text.encode()) < 100_000
    judged = json.loads(text)["judge_replay"][0]
    assert judged["complete"] and judged["calls_dropped"] > 0
    assert judged["layers_replayed"]["cell"]["calls"] == cell["kept"] and judged["rows_total"] > 2 * 3
    assert len(judged["rows"]) <= 2 * 3  # the worst three of each layer, never one line per call


def test_the_first_nonfinite_call_of_a_long_sequence_is_kept_and_said(tmp_path, capsys, monkeypatch):
    """A NaN in the series at time step 700: the cell's first NaN call is kept beside its first, last and worst."""
    monkeypatch.setenv("CONVCHECK_SNAPSHOT_BYTES", "300K")
    forecaster_run(tmp_path / "nan", steps=1, nan_at=700)
    (entry,) = [e for e in open_watched(tmp_path / "nan")["snapshots"] if e["step"] == 0]
    cell = entry["kept"]["layers"]["cell"]
    assert cell["nonfinite"] == 700 and cell["worst"] is not None and cell["worst"] < 700
    code, out = diff(capsys, tmp_path / "nan", "--judge", "cpu:float64")
    assert "1,000 calls of cell, kept" in out and "(first, last, worst, first non-finite" in out


@pytest.mark.slow  # ~400 MB of calls over 1,000 time steps: the default budget measured at scale (~20 s)
def test_the_default_budget_bounds_a_long_unroll(tmp_path, capsys):
    """An LSTMCell over 1,000 time steps whose step-0 calls hold ~400 MB, watched with the default budget (256 MiB):
    the snapshot within it, the diff's JSON at most 1 MB."""
    from convcheck.runformat.layout import DEFAULT_SNAPSHOT_BYTES

    forecaster_run(tmp_path / "run", steps=1, hidden=128, batch=384)
    (entry,) = open_watched(tmp_path / "run")["snapshots"]
    assert entry["bytes"] <= DEFAULT_SNAPSHOT_BYTES
    assert entry["kept"]["layers"]["cell"]["calls"] == 1000
    code, text = diff(capsys, tmp_path / "run", "--judge", "cpu:float64", "--json")
    assert len(text.encode()) <= 1_000_000


def sam_run(out, steps: int = 3, **watch):
    """SAM's two passes as a user writes them: a first backward, the weights moved uphill by rho along the gradient, a
    second forward and backward there, the weights moved back, then the base optimizer's step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    with convcheck.watch(model, opt, out=out, **watch) as w:
        for _ in range(steps):
            x = torch.randn(2, 64, generator=g)
            F.mse_loss(model(x), x).backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                moves = [p.grad * (0.05 / norm) for p in model.parameters()]
                for p, e in zip(model.parameters(), moves):
                    p.add_(e)
            opt.zero_grad()
            loss = F.mse_loss(model(x), x)
            loss.backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), moves):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
            w.step(loss)


def test_sams_second_pass_is_replayed_with_its_own_weights_or_inconclusive_when_not_kept(tmp_path, capsys):
    """Each pass replayed with the weights it ran with; with a budget that holds the step's first weights and gradients
    but not the moved ones, the second pass's calls are not replayed: inconclusive (exit 5), never flagged."""
    sam_run(tmp_path / "sam")
    code, text = diff(capsys, tmp_path / "sam", "--judge", "cpu:float64", "--json")
    judged = json.loads(text)["judge_replay"]
    assert judged["closure_evaluations"] == {"0": {"evaluations": 2, "replayed": 2}} and judged["complete"]
    assert judged["layers_replayed"]["0"] == {"calls": 2, "flagged": 0, "overflowed": 0}
    sam_run(tmp_path / "tight", snapshot_bytes=90_000)
    (entry,) = open_watched(tmp_path / "tight")["snapshots"]
    assert [e.get("kept") for e in entry["evaluations"]] == [None, False] and entry["bytes"] <= 90_000
    code, out = diff(capsys, tmp_path / "tight", "--judge", "cpu:float64")
    assert code == 5, out
    assert "1 of step 0's 2 closure evaluations replayed (the others' parameters were not kept)" in out
    assert "its parameters at closure evaluation 1 were not kept (over the snapshot budget; their hash was)" in out
    assert "above its floor" not in out
