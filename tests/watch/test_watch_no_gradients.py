"""``optimizer.zero_grad()`` written between ``backward()`` and ``step()``: every ``.grad`` is None when the optimizer
steps, so the run never trains. The diff names it as a setup difference (not a run-to-run nondeterminism), and the
run's own findings do not read the missing gradient norms as non-finite ones."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck
from convcheck.analysis.diff import diff_watched


def _run(out, zero_grad_too_late: bool, steps: int = 8) -> None:
    convcheck.seed_everything(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ELU(), nn.Dropout(0.0), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(8)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(32, 10, generator=g)
            y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
            loss = nn.functional.cross_entropy(model(x), y)
            if not zero_grad_too_late:
                opt.zero_grad()
            loss.backward()
            if zero_grad_too_late:
                opt.zero_grad()  # the bug: the gradients are gone before the step
            opt.step()
            w.step(loss)


def test_a_zero_grad_between_backward_and_step_is_named(tmp_path):
    _run(tmp_path / "a", zero_grad_too_late=False)
    _run(tmp_path / "c", zero_grad_too_late=True)
    d = diff_watched(tmp_path / "a", tmp_path / "c")
    assert d.verdict.category == "setup", d.verdict.headline
    assert d.verdict.headline.startswith("no parameter has a gradient when B's optimizer steps, from step 0")
    assert "zero_grad()" in d.verdict.remedies[0]
    assert not [s for s in d.own[1] if "non-finite" in s.evidence], [s.evidence for s in d.own[1]]
