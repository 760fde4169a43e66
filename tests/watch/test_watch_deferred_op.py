"""Issue 43, item 3: ``sync="step"`` (one read per step) keeps the producer's op, its line and the magnitude going
into it - before, a deferred step said only "non-finite at step N" with neither op nor line."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped


class Scorer(nn.Module):
    """A hand-written softmax in float16: exp overflows past 11.09, and inf / inf is NaN."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        s = self.proj(x)
        e = torch.exp(s)
        p = e / e.sum(-1, keepdim=True)
        return self.out(p)


def _run(out, sync: str) -> None:
    torch.manual_seed(0)
    model = Scorer().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    with convcheck.watch(model, opt, out=out, sync=sync) as w:
        for step in range(4):
            x = (torch.randn(16, 8, generator=g) * 4.0 ** step).half()  # the scores grow 4x a step
            loss = model(x).float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_sync_step_names_the_op_its_line_and_what_went_in(tmp_path, capsys):
    _run(tmp_path / "step", "step")
    _run(tmp_path / "layer", "layer")
    live = json.loads((tmp_path / "layer" / "manifest.json").read_text())["first_nonfinite"]
    p = json.loads((tmp_path / "step" / "manifest.json").read_text())["first_nonfinite"]
    assert (p["layer"], p["kind"], p["direction"], p["step"]) == (live["layer"], live["kind"], "forward", live["step"])
    assert p["op"] == live["op"] == "exp"
    assert p["source"]["code"] == live["source"]["code"] == "e = torch.exp(s)"
    assert "its inputs reach" in p["detail"] and "sync=\"step\"" in p["detail"]
    capsys.readouterr()
    code = main(["diff", str(tmp_path / "step"), "--judge", "cpu:float64", "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("first non-finite:"))
    assert line.startswith(f"first non-finite: Scorer (own code: exp, forward) at step {p['step']}: its inputs reach ")
    assert line.endswith("e = torch.exp(s)]")
