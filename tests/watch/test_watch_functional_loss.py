"""A loss written as a function (``F.cross_entropy(model(x), y)``) is seen as a loss module is: its settings in the
recipe and its targets hashed, so a label bug or a loss setting in a script that never builds a loss module is
named; a script that switches between the module and the function is the same recipe; and the watch stays
invisible (the function pickles as torch's, and is torch's again after the block)."""

from __future__ import annotations

import pickle

import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.analysis.diff import diff_watched


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _loop(out, loss_of, steps: int = 6) -> None:
    """A classifier trained with SGD on a fixed stream; ``loss_of(logits, y)`` is how the script writes its loss."""
    convcheck.seed_everything(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(16, 12, generator=g)
            y = torch.randint(0, 4, (16,), generator=g)
            loss = loss_of(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_labels_shifted_before_a_functional_loss_are_named(tmp_path):
    _loop(tmp_path / "a", lambda out, y: F.cross_entropy(out, y))
    _loop(tmp_path / "b", lambda out, y: F.cross_entropy(out, (y + 1) % 4))  # an off-by-one label mapping
    v = diff_watched(tmp_path / "a", tmp_path / "b").verdict
    assert v.category == "setup"
    assert "other targets (labels)" in v.headline, v.headline


def test_a_setting_given_to_the_loss_function_is_named(tmp_path):
    _loop(tmp_path / "a", lambda out, y: F.cross_entropy(out, y))
    _loop(tmp_path / "b", lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1))
    v = diff_watched(tmp_path / "a", tmp_path / "b").verdict
    assert v.category == "setup"
    assert "CrossEntropyLoss's label_smoothing is 0.1 in B, 0.0 in A" in v.headline, v.headline


def test_the_loss_module_and_its_function_are_one_recipe(tmp_path):
    _loop(tmp_path / "a", nn.CrossEntropyLoss())
    _loop(tmp_path / "b", lambda out, y: F.cross_entropy(out, y))
    d = diff_watched(tmp_path / "a", tmp_path / "b")
    assert d.verdict.category == "ok", d.verdict.headline


def test_the_function_pickles_as_torchs_and_is_torchs_again_after_the_block(tmp_path):
    original = F.cross_entropy
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        assert F.cross_entropy is not original  # seen while the block runs
        assert pickle.loads(pickle.dumps(F.cross_entropy)) is F.cross_entropy  # a reference to torch's name
        assert F.cross_entropy.__name__ == "cross_entropy" and F.cross_entropy.__module__ == original.__module__
        loss = F.cross_entropy(model(torch.randn(4, 12)), torch.tensor([0, 1, 2, 3]))
        loss.backward()
        opt.step()
        w.step(loss)
    assert F.cross_entropy is original
    assert pickle.loads(pickle.dumps(F.cross_entropy)) is original


def test_a_loss_the_model_computes_inside_its_forward_is_the_models(tmp_path):
    """A model that returns its own loss (labels among its inputs, as Hugging Face models do): the labels are hashed
    with the batch; the function called inside the model's forward is not a loss of the script's."""

    class WithLoss(Net):
        def forward(self, x, labels):
            return F.cross_entropy(super().forward(x), labels)

    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        for _ in range(2):
            loss = model(torch.randn(4, 12), torch.tensor([0, 1, 2, 3]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    from convcheck.runformat.reader import open_watched

    run = open_watched(tmp_path / "run")
    assert not (run.manifest.get("recipe") or {}).get("criteria")
    assert all("target_sha256" not in s for s in run.steps)
