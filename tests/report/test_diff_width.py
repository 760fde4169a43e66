"""Issue 44: ``convcheck diff`` of watched runs prints its prose wrapped to the terminal (``COLUMNS``, else the
terminal, else 100), as ``compare`` does, and so is the ``wrote ...`` line on stderr; ``--json`` keeps every line
whole, and joining the wrapped lines back (``unwrap_prose``) gives the diff's own lines."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import PROSE_INDENT, fit_prose, prose_columns, unwrapped, wrote_line


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_rather_long_first_layer_name, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.a_rather_long_first_layer_name(x)))


def _record(out, lr: float) -> None:
    convcheck.seed_everything(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("width")
    _record(tmp / "a", 0.05)
    _record(tmp / "b", 3.0)  # another learning rate: a setup verdict with long evidence and a remedy
    return tmp


@pytest.mark.parametrize("columns", ["100", "60"])
def test_a_watched_diff_fits_columns(runs, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    code = main(["diff", str(runs / "a"), str(runs / "b")])
    out = capsys.readouterr().out
    lines = out.rstrip("\n").splitlines()
    too_wide = [x for x in lines if len(x) > int(columns) and " " in x.strip()]
    assert not too_wide, too_wide  # a line wider than COLUMNS is one word (a path) alone
    assert any(x.startswith(" " * PROSE_INDENT) for x in lines), out  # something was long enough to wrap
    assert main(["diff", str(runs / "a"), str(runs / "b"), "--json"]) == code
    whole = json.loads(capsys.readouterr().out)
    assert any(len(e) > int(columns) for e in whole["verdict"]["evidence"] + [whole["verdict"]["headline"]])
    from convcheck.analysis.diff import diff_watched

    assert unwrapped(out).splitlines() == diff_watched(runs / "a", runs / "b").lines()


def test_without_columns_a_pipe_gets_100(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    import sys

    assert prose_columns(sys.stdout) == 100  # capsys's capture is not a terminal
    assert prose_columns(sys.stdout, {"COLUMNS": "132"}) == 132
    assert prose_columns(sys.stdout, {"COLUMNS": "12"}) == 100  # too narrow to be meant


def test_the_wrote_line_wraps_at_the_width_and_reads_back_whole():
    names = ["summary.json", "report.html", "loss.png", "layers.png", "layers.csv", "curves.csv", "env.json"]
    line = wrote_line("reports/2026-12-05T00-00-00.000Z-lenet", names)  # the default folder
    assert len(line) > 100
    text = fit_prose([line], None, {"COLUMNS": "100"})
    assert all(len(x) <= 100 for x in text.splitlines()) and len(text.splitlines()) > 1
    assert unwrapped(text) == line
