"""The first NaN/Inf named where it is made, with the user's line (issue 35).

A parent module's own code whose backward overflows was blamed on a child Linear (the layer after the one
whose output received the Inf gradient): "attn.v (module, backward): gradient into attn.k's output"."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.runformat.reader import open_watched
from convcheck.report.verdict_lines import unwrapped

from .loops import attention_run
from .producer_loops import rowsum_run


@pytest.mark.parametrize("sync", ["layer", "step"])
def test_a_parents_own_division_that_overflows_in_backward_is_named_with_its_line(tmp_path, sync, capsys):
    rowsum_run(tmp_path / "run", sync=sync)
    p = open_watched(tmp_path / "run")["first_nonfinite"]
    assert (p["layer"], p["kind"], p["direction"], p["step"], p.get("op")) == ("attn", "own code", "backward", 0, "div")
    assert p["source"]["file"].endswith("producer_loops.py")
    assert p["source"]["code"] == "w = e / e.sum(-1, keepdim=True)"
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64"]) == 1
    out = unwrapped(capsys.readouterr().out)
    assert "first non-finite: attn (own code: div, backward) at step 0: gradient into attn.k's output [" in out
    assert "producer_loops.py:22: w = e / e.sum(-1, keepdim=True)]" in out
    assert "attn.v (module" not in out


def test_an_own_code_forward_overflow_names_its_line(tmp_path):
    attention_run(tmp_path / "fp16", half=True)
    p = open_watched(tmp_path / "fp16")["first_nonfinite"]
    assert (p["layer"], p["op"]) == ("att", "matmul")
    assert p["source"]["file"].endswith("loops.py")
    assert p["source"]["code"] == "s = self.q(x) @ self.k(x).transpose(1, 2)"


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h)


def _wide_run(out, scale: float) -> dict:
    torch.manual_seed(0)
    model = Wide()
    with torch.no_grad():
        model.fc2.weight.mul_(scale)
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(3):
            x = (torch.randn(4, 8) * 10.0).half()
            loss = model(x).float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    return open_watched(out)["first_nonfinite"]


def test_a_layer_that_overflows_is_named_with_the_line_that_called_it(tmp_path):
    p = _wide_run(tmp_path / "run", 1e5)  # fc2's float16 outputs pass 65504 (float16's largest)
    assert (p["layer"], p["kind"], p["direction"]) == ("fc2", "module", "forward")
    assert p["source"]["code"] == "return self.fc2(h)"
    assert p["source"]["file"] == __file__


def test_a_layers_backward_overflow_handed_on_by_a_relu_is_the_layers(tmp_path):
    """fc2's outputs stay finite (3.2e4), its input gradient (x 1e4 weights) does not: the Inf reaches fc1's
    output through the ReLU of the parent's own code, which makes none."""
    p = _wide_run(tmp_path / "run", 1e4)
    assert (p["layer"], p["kind"], p["direction"], p["detail"]) == ("fc2", "module", "backward",
                                                                     "gradient into fc1's output")
    assert p["source"]["code"] == "return self.fc2(h)"


class L2Norm(nn.Module):
    """x / (sqrt(sum x^2) + eps), written by hand: at float16 the squares of small activations are 0."""

    def __init__(self):
        super().__init__()
        self.act = nn.Linear(8, 8)

    def forward(self, x):
        h = self.act(x)
        n = torch.sqrt((h * h).sum(-1, keepdim=True))
        return h / (n + 1e-7)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = L2Norm(), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.embed(x))


def test_own_code_with_two_ops_that_can_overflow_in_backward_is_the_parents_code_not_the_next_layer(tmp_path):
    torch.manual_seed(0)
    model = NormNet()
    with torch.no_grad():
        model.embed.act.weight.mul_(1e-4)
        model.embed.act.bias.zero_()
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        for _ in range(2):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 8).half()).float(), torch.tensor([0, 1, 2, 0]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    p = open_watched(tmp_path / "run")["first_nonfinite"]
    assert (p["layer"], p["kind"], p["direction"], p["op"]) == ("embed", "own code", "backward", "div or sqrt")
    assert p["source"]["code"] == "def forward(self, x):"
