"""Issue 48: a module called many times in one step (a recurrent cell unrolled over time) is one row per step,
its statistics accumulated over its calls, with the call count, the worst call and the first non-finite call.

Written as a user writes the loop: a character-level GRU language model whose ``nn.GRUCell`` runs once per
character, watched with the watch's lines only."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.runformat.reader import open_watched
from convcheck.watch import stats

TEXT = "the quick brown fox jumps over the lazy dog; " * 8
VOCAB = sorted(set(TEXT))
SEQ = 12  # characters per sequence: the cell's calls per step


class CharGRU(nn.Module):
    def __init__(self, poison_at: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), 16)
        self.cell = nn.GRUCell(16, 32)
        self.head = nn.Linear(32, len(VOCAB))
        self.poison_at = poison_at  # B: a NaN in the cell's input at this time step

    def forward(self, chars):
        h = torch.zeros(chars.shape[0], 32)
        logits = []
        for t in range(chars.shape[1]):
            x = self.embed(chars[:, t])
            if t == self.poison_at:
                x = x * float("nan")
            h = self.cell(x, h)
            logits.append(self.head(h))
        return torch.stack(logits, 1)


def batches(steps: int):
    ids = torch.tensor([VOCAB.index(c) for c in TEXT])
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - SEQ - 1, (4,), generator=g)
        seq = torch.stack([ids[s:s + SEQ + 1] for s in starts.tolist()])
        yield seq[:, :-1], seq[:, 1:]


def train(out, poison_at=None, steps: int = 3, sync: str = "auto") -> None:
    torch.manual_seed(0)
    model = CharGRU(poison_at)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(), sync=sync) as w:
        for x, y in batches(steps):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, len(VOCAB)), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def diff_rows(a, b, out, capsys) -> dict:
    main(["diff", str(a), str(b), "--out", str(out)])
    capsys.readouterr()
    with open(out / "watch_layers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by = {}
    for r in rows:
        assert (r["step"], r["layer"]) not in by  # one row per layer and step, however many calls
        by[(r["step"], r["layer"])] = r
    return by


def test_a_cell_unrolled_over_time_is_one_row_with_its_calls(tmp_path, capsys):
    train(tmp_path / "a")
    train(tmp_path / "b")
    run = open_watched(tmp_path / "a")
    row = run.steps[0]["layers"]["cell"]
    assert row["calls"] == SEQ and 0 <= row["worst_call"] < SEQ and row["nonfinite_call"] is None
    assert row["n"] == SEQ * 4 * 32  # every call's elements
    assert "worst_call" not in run.steps[0]["layers"]["embed"] or run.steps[0]["layers"]["embed"]["calls"] > 1
    rows = diff_rows(tmp_path / "a", tmp_path / "b", tmp_path / "rep", capsys)
    cell = rows[("0", "cell")]
    assert cell["calls_a"] == cell["calls_b"] == str(SEQ)
    assert cell["worst_call_a"] == cell["worst_call_b"] == str(row["worst_call"])
    assert cell["nonfinite_call_a"] == cell["nonfinite_call_b"] == ""
    assert float(cell["worst_rel"]) == 0.0  # the same run twice
    assert len([k for k in rows if k[1] == "cell"]) == 3  # three steps, one row each
    page = (tmp_path / "rep" / "watch_report.html").read_text()
    assert "calls_a" in page and "worst_call_a" in page


def test_a_nan_at_one_time_step_names_that_call(tmp_path, capsys):
    train(tmp_path / "a", steps=1)
    train(tmp_path / "b", poison_at=5, steps=1)
    row = open_watched(tmp_path / "b").steps[0]["layers"]["cell"]
    assert row["calls"] == SEQ and row["nonfinite_call"] == 5
    rows = diff_rows(tmp_path / "a", tmp_path / "b", tmp_path / "rep", capsys)
    cell = rows[("0", "cell")]
    assert cell["nonfinite_call_a"] == "" and cell["nonfinite_call_b"] == "5"
    assert cell["worst_rel"] == "inf"
    report = json.loads((tmp_path / "rep" / "watch_diff.json").read_text())
    assert report["verdict"]["category"] != "ok"


class Gate(nn.Module):
    """A leaf called once per time step: ``exp`` of its input (overflows to Inf past 88 in float32)."""

    def forward(self, x):
        return x.exp()


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.cell, self.head = Gate(), nn.GRUCell(4, 8), nn.Linear(8, 1)

    def forward(self, seq):
        h = torch.zeros(seq.shape[0], 8)
        for t in range(seq.shape[1]):
            h = self.cell(self.gate(seq[:, t]), h)
        return self.head(h)


@pytest.mark.parametrize("sync", ["layer", "step"])
def test_the_first_nonfinite_producer_names_its_call(tmp_path, sync):
    torch.manual_seed(0)
    model = Forecaster()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seq = torch.randn(2, 9, 4)
    seq[:, 6] = 100.0  # exp(100) is Inf in float32: the gate's seventh call makes it from a finite input
    with convcheck.watch(model, opt, out=tmp_path / "run", snapshot_steps=(), sync=sync) as w:
        loss = model(seq).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
    run = open_watched(tmp_path / "run")
    p = run["first_nonfinite"]
    assert (p["layer"], p["direction"], p["call"]) == ("gate", "forward", 6)
    assert run.steps[0]["layers"]["gate"]["nonfinite_call"] == 6
    from convcheck.diagnose.watched_evidence import producer_text

    assert "call 6 of the step" in producer_text(p)


def test_calls_merge_into_one_row():
    """The accumulators of several calls: counts and sums added, the mean and std those of all the elements, the
    worst call the one with the largest max |x| (the first of equals), the first non-finite call."""
    xs = [torch.tensor([1.0, -2.0]), torch.tensor([5.0, 0.0]), torch.tensor([float("nan"), 1.0]),
          torch.tensor([-5.0, 3.0])]
    acc = None
    for x in xs:
        acc = stats.merge(acc, stats.measure(x))
    row = stats.finish(acc)
    finite = torch.tensor([1.0, -2.0, 5.0, 0.0, 1.0, -5.0, 3.0], dtype=torch.float64)
    assert row["calls"] == 4 and row["worst_call"] == 1 and row["nonfinite_call"] == 2
    assert math.isclose(row["mean"], float(finite.mean()), rel_tol=1e-12)
    assert math.isclose(row["std"], float(finite.std(correction=0)), rel_tol=1e-6)  # a float32 2-norm
    assert (row["nan"], row["max_abs"], row["min_nonzero"]) == (1, 5.0, 1.0)
    one = stats.finish(stats.measure(xs[0]))
    assert "worst_call" not in one and "nonfinite_call" not in one  # a row of one call stays as before


class PowerNormGRU(nn.Module):
    """Signed square-root ("power normalisation") features of a GRU's state at each character: the ReLU's zeros
    make the root's backward 1/(2 sqrt(0)) = Inf into the ReLU's output, at every time step, its forward finite."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), 16)
        self.cell = nn.GRUCell(16, 32)
        self.proj = nn.Linear(32, 32)
        self.relu = nn.ReLU()
        self.root = Root()
        self.head = nn.Linear(32, len(VOCAB))

    def forward(self, chars):
        h = torch.zeros(chars.shape[0], 32)
        logits = []
        for t in range(chars.shape[1]):
            h = self.cell(self.embed(chars[:, t]), h)
            logits.append(self.head(self.root(self.relu(self.proj(h)))))
        return torch.stack(logits, 1)


class Root(nn.Module):
    def forward(self, x):
        return x.sqrt()


def _train_power_norm(out, **kwargs) -> dict:
    torch.manual_seed(0)
    model = PowerNormGRU()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(), **kwargs) as w:
        for x, y in batches(1):
            loss = nn.functional.cross_entropy(model(x).reshape(-1, len(VOCAB)), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    return json.loads((out / "manifest.json").read_text())


def test_a_nonfinite_gradient_at_repeated_calls_is_named_and_says_what_was_not_checked(tmp_path):
    # the default checks a layer's repeated calls' gradients with its first call's: the root that made the Inf is
    # named, and the producer says that the repeated calls were not checked one by one
    p = _train_power_norm(tmp_path / "together")["first_nonfinite"]
    assert (p["layer"], p["direction"], p["step"]) == ("root", "backward", 0)
    assert "66 later calls of cell, embed, head and 3 more at this step were not checked one by one" in p["detail"]
    assert "repeated_grads=\"each\" checks each" in p["detail"] and len(p["detail"]) <= 200  # as diff shows it whole
    assert p["calls_unchecked"] == {n: SEQ - 1 for n in ("embed", "cell", "proj", "relu", "root", "head")}
    # each call hooked: the same layer, named at the last character (the first that backward reaches), no caveat
    manifest = _train_power_norm(tmp_path / "each", repeated_grads="each")
    q = manifest["first_nonfinite"]
    assert (q["layer"], q["direction"], q["step"]) == ("root", "backward", 0)
    assert "not checked" not in q["detail"] and "calls_unchecked" not in q
    assert manifest["selection"]["repeated_grads"] == "each"


def test_repeated_grads_is_checked_at_the_edge(tmp_path, monkeypatch):
    with pytest.raises(convcheck.UsageError, match="repeated_grads='every' is not one of together, each"):
        convcheck.watch(CharGRU(), out=tmp_path / "w", repeated_grads="every")
    monkeypatch.setenv("CONVCHECK_WATCH_REPEATED_GRADS", "each")
    model = CharGRU()
    with convcheck.watch(model, out=tmp_path / "env") as w:
        for x, y in batches(1):
            nn.functional.cross_entropy(model(x).reshape(-1, len(VOCAB)), y.reshape(-1)).backward()
            w.step()
    manifest = json.loads((tmp_path / "env" / "manifest.json").read_text())
    assert manifest["selection"]["repeated_grads"] == "each"
    assert manifest["settings_from_env"]["CONVCHECK_WATCH_REPEATED_GRADS"] == "each"
