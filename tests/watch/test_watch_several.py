"""Loops that are not one model and one optimizer (issue 45): a GAN's two models and two optimizers in one watch,
an optimizer made inside the block, none at all (a manual update), an LBFGS closure, and ``w.step`` reached through
``convcheck.watch.current()`` from the user's own functions. Each watched loop trains exactly as bare."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.errors import UsageError


class Gen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)

    def forward(self, z):
        return self.fc2(self.act(self.fc1(z)))


class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _gan(out=None, steps: int = 5, lr_d: float = 1e-2):
    torch.manual_seed(0)
    G, D = Gen(), Disc()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(D.parameters(), lr=lr_d)
    g = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []

    def step():
        real = torch.randn(16, 2, generator=g) * 0.5 + 2.0
        z = torch.randn(16, 4, generator=g)
        fake = G(z)
        d_loss = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = bce(D(fake), torch.ones(16, 1))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        losses.append((d_loss.item(), g_loss.item()))
        w = convcheck.watch.current()
        if w is not None:
            w.step(g_loss)

    if out is None:
        for _ in range(steps):
            step()
    else:
        with convcheck.watch(models={"G": G, "D": D}, optimizers=[opt_g, opt_d], out=out):
            for _ in range(steps):
                step()
    return losses, G, D


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_a_gan_watched_in_one_block_trains_as_bare_and_diffs_ok(tmp_path, capsys):
    bare, _, _ = _gan()
    watched, G, D = _gan(tmp_path / "a")
    assert watched == bare
    _gan(tmp_path / "b")
    steps = _steps(tmp_path / "a")
    assert len(steps) == 5 and all(s["stepped"] for s in steps)
    assert list(steps[0]["layers"]) == ["G.fc1", "G.act", "G.fc2", "D.fc1", "D.act", "D.fc2"]
    assert set(steps[0]["grad_norms"]) == {f"{m}.{n}" for m, net in (("G", G), ("D", D))
                                           for n, _ in net.named_parameters()}
    assert len(steps[0]["batch_sha256"]) == 4  # G(z), D(real), D(fake), D(fake)
    assert len(steps[0]["lr"]) == 2  # both optimizers' groups
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["optimizer"] == "Adam+Adam" and m["model"]["class"] == "Gen+Disc"
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_each_optimizers_norms_are_its_own_backwards(tmp_path):
    """D's gradient norms are read at D's step: g_loss's backward, later, adds to D's gradients as well."""
    _, G, D = _gan(tmp_path / "a", steps=1)
    torch.manual_seed(0)
    G2, D2 = Gen(), Disc()
    g = torch.Generator().manual_seed(1)
    real = torch.randn(16, 2, generator=g) * 0.5 + 2.0
    fake = G2(torch.randn(16, 4, generator=g))
    bce = nn.functional.binary_cross_entropy_with_logits
    (bce(D2(real), torch.ones(16, 1)) + bce(D2(fake.detach()), torch.zeros(16, 1))).backward()
    want = D2.fc2.weight.grad.norm().item()
    got = _steps(tmp_path / "a")[0]["grad_norms"]["D.fc2.weight"]
    assert got == pytest.approx(want, rel=1e-6)


def test_a_gan_with_another_discriminator_lr_is_a_setup_difference(tmp_path, capsys):
    _gan(tmp_path / "a")
    _gan(tmp_path / "b", lr_d=1e-3)
    capsys.readouterr()
    main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert "verdict: setup" in capsys.readouterr().out


def _simple(out=None, make_opt_inside=False, manual=False, lbfgs=False, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]
    losses = []

    def body(opt):
        for x, y in data:
            if lbfgs:
                def closure():
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss
                losses.append(opt.step(closure).item())
                continue
            loss = nn.functional.mse_loss(model(x), y)
            if manual:
                model.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())

    def make():
        if manual:
            return None
        if lbfgs:
            return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        return torch.optim.SGD(model.parameters(), lr=0.1)

    if out is None:
        body(make())
    elif make_opt_inside or manual:
        with convcheck.watch(model, out=out):
            body(make())
    else:
        opt = make()
        with convcheck.watch(model, opt, out=out):
            body(opt)
    return losses


def test_an_optimizer_made_inside_the_block_is_found_at_its_first_step(tmp_path):
    assert _simple(tmp_path / "run", make_opt_inside=True) == _simple()
    steps = _steps(tmp_path / "run")
    assert len(steps) == 4 and all(s["grad_norms"] and s["stepped"] for s in steps)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["optimizer"] == "SGD" and m["optimizer_settings"]
    assert any("found stepping" in n for n in m["notes"])


def test_a_manual_update_without_an_optimizer_records_each_step(tmp_path):
    assert _simple(tmp_path / "run", manual=True) == _simple(manual=True)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 4 and all(len(s["grad_norms"]) == 4 for s in steps)
    _simple(tmp_path / "run2", manual=True)
    assert steps[1]["grad_norms"] == _steps(tmp_path / "run2")[1]["grad_norms"]


def test_an_lbfgs_closure_loop_watched_and_diffed(tmp_path, capsys):
    assert _simple(tmp_path / "a", lbfgs=True) == _simple(lbfgs=True)
    _simple(tmp_path / "b", lbfgs=True)
    steps = _steps(tmp_path / "a")
    assert len(steps) == 4 and all(s["grad_norms"] for s in steps)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_current_is_the_innermost_open_watch(tmp_path):
    assert convcheck.watch.current() is None
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    with convcheck.watch(m1, out=tmp_path / "a") as w1:
        assert convcheck.watch.current() is w1
        with convcheck.watch(m2, out=tmp_path / "b") as w2:
            assert convcheck.watch.current() is w2
        assert convcheck.watch.current() is w1
    assert convcheck.watch.current() is None


def test_models_and_model_together_are_refused(tmp_path):
    with pytest.raises(UsageError, match="not both"):
        convcheck.watch(nn.Linear(2, 2), models=[nn.Linear(2, 2)], out=tmp_path / "a")
    with pytest.raises(UsageError, match="not a name without dots"):
        convcheck.watch(models={"a.b": nn.Linear(2, 2)}, out=tmp_path / "a")


def test_a_manual_update_ends_its_steps_on_the_steps_the_selection_leaves_out(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    with convcheck.watch(model, out=tmp_path / "run", every=2):
        for _ in range(4):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    steps = _steps(tmp_path / "run")
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert [s.get("layers_recorded", True) for s in steps] == [True, False, True, False]
    assert all(len(s["grad_norms"]) == 4 for s in steps)


def test_the_judge_says_why_it_does_not_replay_several_models(tmp_path, capsys):
    _gan(tmp_path / "a", steps=2)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), "--judge", "cpu:float64"]) == 0
    out = capsys.readouterr().out
    assert "several models were watched in one block (Gen+Disc)" in out and "AttributeError" not in out


def test_an_optimizer_not_given_beside_the_one_given_is_said_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    given = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.01)
    with convcheck.watch(model, given, out=tmp_path / "run"):
        for opt in (given, other, given, other):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert sum("another optimizer (SGD) stepped the watched parameters" in n for n in m["notes"]) == 1
    assert m["optimizer"] == "SGD"
