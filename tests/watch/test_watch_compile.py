"""``convcheck.watch`` around a compiled model (issue 35): ``torch.compile(model)`` passed to the watch
crashed dynamo's trace of the watch's hook; ``model.compile()`` traced the watch's own code and hit the
recompile limit. Now the watch adds no graph, break or recompile to a compiled model, leaves its losses
bit for bit, records what is seen outside the compiled graph and says so; ``diff`` reads it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import convcheck
from convcheck.cli.main import main


class Net(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        if self.training:  # the model reads its own state: dynamo must trace this, and nothing of the watch
            x = x * 1.0
        return self.fc(self.drop(x.flatten(1)))


def _train(call, model, out=None, watched=None, steps: int = 4) -> list[float]:
    """The user's loop: ``call`` is what the loop calls (the compiled module or the model), ``watched`` what it
    hands to ``convcheck.watch`` (None: no watch)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []

    def loop(w=None):
        for _ in range(steps):
            x = torch.randn(4, 3, 8, 8, generator=g)
            y = torch.randint(0, 5, (4,), generator=g)
            loss = nn.functional.cross_entropy(call(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if w is not None:
                w.step(loss)

    if watched is None:
        loop()
    else:
        with convcheck.watch(watched, opt, out=out) as w:
            loop(w)
    return losses


def _compiled(how: str, backend: str, p: float = 0.0):
    """``(call, model, watched)``: as a user compiles, three ways."""
    torch.manual_seed(0)
    model = Net(p)
    if how == "wrapper passed":  # model = torch.compile(model); watch(model, ...)
        call = torch.compile(model, backend=backend)
        return call, model, call
    if how == "method":  # model.compile()
        model.compile(backend=backend)
        return model, model, model
    call = torch.compile(model, backend=backend)  # the original watched, the compiled module called
    return call, model, model


def _graphs() -> dict:
    return {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break", "frames")}


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ["wrapper passed", "method", "original watched"])
def test_a_compiled_model_trains_under_the_watch_unchanged(tmp_path, how, backend):
    torch._dynamo.reset()
    counters.clear()
    call, model, _ = _compiled(how, backend)
    bare = _train(call, model)
    bare_graphs = _graphs()

    torch._dynamo.reset()
    counters.clear()
    call, model, watched = _compiled(how, backend)
    got = _train(call, model, out=tmp_path / "run", watched=watched)
    assert got == bare  # the watch changes no number
    assert _graphs() == bare_graphs  # and adds no graph, graph break or recompile
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["steps"] == 4 and m["compiled"]["layers_hidden"] is True
    assert m["compiled"]["how"] == {"wrapper passed": "torch.compile(model)", "method": "model.compile()",
                                    "original watched": "a compiled call of the model"}[how]
    assert any(n.startswith("compiled (torch.compile): the layer boundaries are inside") for n in m["notes"])
    first = json.loads((tmp_path / "run" / "steps.jsonl").read_text().splitlines()[0])
    assert list(first["layers"]) == ["Net"]  # the model's output, seen outside the graph
    assert set(first["grad_norms"]) == {n for n, _ in model.named_parameters()}
    assert first["loss"] == pytest.approx(bare[0], rel=0, abs=0)


def test_diff_of_a_compiled_run_against_an_eager_one_says_what_it_compared(tmp_path, capsys):
    torch.manual_seed(0)
    eager = Net()
    _train(eager, eager, out=tmp_path / "eager", watched=eager)
    call, model, watched = _compiled("wrapper passed", "eager")
    _train(call, model, out=tmp_path / "compiled", watched=watched)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "eager"), str(tmp_path / "compiled")]) == 0
    out = capsys.readouterr().out
    assert "compiled: B's layers ran inside a compiled graph (torch.compile(model))" in out
    assert "verdict: ok" in out


def test_the_watch_still_sees_every_layer_of_an_eager_model_after_compile_was_used(tmp_path):
    """A process that compiled something before: an eager model's layers are all recorded."""
    torch.manual_seed(0)
    model = Net()
    _train(model, model, out=tmp_path / "run", watched=model)
    first = json.loads((tmp_path / "run" / "steps.jsonl").read_text().splitlines()[0])
    assert list(first["layers"]) == ["conv", "bn", "drop", "fc"]
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["compiled"]["how"] is None and m["compiled"]["layers_hidden"] is False


@pytest.mark.slow
def test_inductor_dropout_masks_are_named_not_called_a_bug(tmp_path, capsys):
    """Inductor draws Dropout's masks from its own generator: a compiled run and an eager one part at step 0
    by chance. The diff names that and its remedy; with ``fallback_random`` the two agree."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    eager = Net(p=0.3)
    _train(eager, eager, out=tmp_path / "eager", watched=eager)
    torch._dynamo.reset()
    call, model, watched = _compiled("wrapper passed", "inductor", p=0.3)
    _train(call, model, out=tmp_path / "inductor", watched=watched)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "eager"), str(tmp_path / "inductor")]) == 1
    out = capsys.readouterr().out
    assert "verdict: nondeterminism" in out and "random layers draw other masks than eager's" in out
    assert "torch._inductor.config.fallback_random = True" in out

    torch._dynamo.reset()
    old = inductor_config.fallback_random
    inductor_config.fallback_random = True
    try:
        call, model, watched = _compiled("wrapper passed", "inductor", p=0.3)
        _train(call, model, out=tmp_path / "fallback", watched=watched)
    finally:
        inductor_config.fallback_random = old
        torch._dynamo.reset()
    assert main(["diff", str(tmp_path / "eager"), str(tmp_path / "fallback")]) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_the_judge_never_replays_a_dropout_whose_p_it_cannot_know(tmp_path, capsys):
    """The judge builds the model from its class's default arguments (here p=0.0): a Dropout the run made with
    p=0.3 was replayed as the identity and called a layer beyond its floor."""
    torch.manual_seed(0)
    model = Net(p=0.3)
    _train(model, model, out=tmp_path / "run", watched=model)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64"]) == 0
    out = capsys.readouterr().out
    assert "drop" not in out.split("verdict:")[1] and "verdict: ok" in out
    assert "step 0, drop: a random layer (its draw is not recorded)" in out
