"""``optimizer.step(closure)``: the forward and backward run inside the optimizer's step (Lightning always
steps so; LBFGS needs it). The watch reads that step's gradients after the closure, not the previous
step's before it, and the run stays bitwise the unwatched one."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

import convcheck


def closure_loop(out=None, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(steps)]
    norms = []

    def run(w=None):
        for x, y in batches:
            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            loss = opt.step(closure)
            norms.append({n: float(p.grad.norm()) for n, p in model.named_parameters()})
            if w is not None:
                w.step(loss)

    if out is None:
        run()
    else:
        with convcheck.watch(model, opt, out=out) as w:
            run(w)
    return model, norms


def test_a_closure_step_records_its_own_gradients_and_changes_nothing(tmp_path):
    bare, _ = closure_loop()
    watched, norms = closure_loop(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(), watched.state_dict().values()))
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    for recorded, actual in zip(steps, norms):
        assert recorded["grad_norms"].keys() == actual.keys()
        for name, value in actual.items():
            assert abs(recorded["grad_norms"][name] - value) <= 1e-6 * value
