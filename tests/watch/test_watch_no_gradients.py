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


def test_a_plain_step_is_no_closure_step_and_its_gradients_are_read_before_the_update(tmp_path):
    """torch's step hooks hand over the optimizer as the first argument: a step without a closure must not be taken
    for one (two forwards a step - two half batches - are not two closure evaluations), and an optimizer that clears
    the gradients inside its step does not hide them from the record."""
    import json

    class ClearingSGD(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.zero_()  # an optimizer that clears what it used
            return out

    convcheck.seed_everything(0)
    model = nn.Linear(4, 1)
    opt = ClearingSGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        for _ in range(3):
            x = torch.randn(8, 4)
            loss = model(x[:4]).pow(2).mean() + model(x[4:]).pow(2).mean()
            loss.backward()
            opt.step()
            w.step(loss)
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert all("closure_evaluations" not in s for s in steps)
    assert all(s["grad_norms"]["weight"] > 0 for s in steps)


def test_a_run_that_never_hands_its_loss_to_the_watch_has_no_non_finite_loss(tmp_path):
    """No ``w.step(loss)`` (the optimizer's hooks end each step): the loss is not recorded, which is not a NaN loss."""

    def run(out):
        convcheck.seed_everything(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(3)
        with convcheck.watch(model, opt, out=out):
            for _ in range(5):
                x = torch.randn(16, 6, generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
                opt.step()

    run(tmp_path / "a")
    run(tmp_path / "b")
    d = diff_watched(tmp_path / "a", tmp_path / "b")
    assert d.verdict.category == "ok", d.verdict.headline
    assert not any("non-finite loss" in s.evidence for side in d.own for s in side)
