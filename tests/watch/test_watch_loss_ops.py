"""Issue 43, item 4: the loss is the user's code too - its op named like a layer's, with the remedy for the
pattern (log of a softmax -> F.log_softmax / F.cross_entropy; exp of a large value; division by a norm)."""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped


def _run(out, loss_fn, steps: int = 5) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            x = torch.randn(32, 8, generator=g) * 4.0 ** step  # the model grows confident
            y = torch.randint(0, 4, (32,), generator=g)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def log_of_softmax(logits, y):
    # the loss in float16: softmax underflows to 0 once the model is confident, and log(0) = -inf
    return F.nll_loss(torch.log(torch.softmax(logits.half(), -1)), y)


def cosine_to_zero(logits, y):
    """A cosine loss whose normaliser reaches 0 (a row of exact zeros): 0 / 0 is NaN."""
    z = logits.half() * (y[:, None] > 4)  # every row zero: the norm is 0
    return (z / z.norm(dim=-1, keepdim=True)).sum()


def test_log_of_softmax_in_the_loss_is_named_with_its_stable_form(tmp_path, capsys):
    _run(tmp_path / "run", log_of_softmax)
    p = json.loads((tmp_path / "run" / "manifest.json").read_text())["first_nonfinite"]
    assert (p["layer"], p["kind"], p["op"]) == ("the loss", "own code", "log")
    assert "log of a softmax" in p["detail"]
    code = main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64", "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    assert code == 1
    assert "in the loss (own code: log, forward)" in out
    remedies = [x for x in out.splitlines() if x.lstrip().startswith("remedy:")]
    assert "F.log_softmax / F.cross_entropy" in remedies[0]
    assert not any("learning rate" in r for r in remedies)


def test_division_by_a_norm_in_the_loss_is_named(tmp_path):
    _run(tmp_path / "run", cosine_to_zero, steps=1)
    p = json.loads((tmp_path / "run" / "manifest.json").read_text())["first_nonfinite"]
    assert (p["layer"], p["op"]) == ("the loss", "div")
    assert "division by a norm" in p["detail"] and "eps" in p["detail"]
