"""Clipping the scaled gradients (issue 36): `clip_grad_norm_` before `scaler.unscale_(optimizer)` holds the
true gradients to max_norm / scale - found in at least eight repositories."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.runformat.reader import open_watched
from convcheck.report.verdict_lines import unwrapped


def _run(out, unscale_first: bool, steps: int = 4) -> None:
    """A float16-autocast loop with a GradScaler and gradient clipping, as the AMP recipe writes it (or not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, scaler=scaler) as w:
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            w.step(loss)


def test_clipping_before_unscale_is_a_setup_verdict_with_the_remedy(tmp_path, capsys):
    _run(tmp_path / "run", unscale_first=False)
    run = open_watched(tmp_path / "run")
    assert all(s.get("clip_before_unscale") for s in run.steps)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64"]) == 1
    out = unwrapped(capsys.readouterr().out)
    assert ("verdict: setup: the run clips its gradients before unscaling them: clip_grad_norm_ ran on the "
            "GradScaler's scaled gradients from step 0") in out
    assert "remedy: call scaler.unscale_(optimizer) before clip_grad_norm_" in out


def test_the_recipe_done_right_is_not_named(tmp_path, capsys):
    _run(tmp_path / "run", unscale_first=True)
    run = open_watched(tmp_path / "run")
    assert not any(s.get("clip_before_unscale") for s in run.steps)
    capsys.readouterr()
    main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64"])
    assert "before unscaling" not in capsys.readouterr().out


def test_a_pair_names_the_run_that_clips_scaled_gradients(tmp_path, capsys):
    _run(tmp_path / "right", unscale_first=True)
    _run(tmp_path / "wrong", unscale_first=False)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "right"), str(tmp_path / "wrong")]) == 1
    out = unwrapped(capsys.readouterr().out)
    assert "verdict: setup: B clips its gradients before unscaling them" in out


def test_the_watch_leaves_the_scaler_and_torch_as_they_were(tmp_path):
    clip = torch.nn.utils.clip_grad_norm_
    scaler = torch.amp.GradScaler("cpu")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run", scaler=scaler):
        assert torch.nn.utils.clip_grad_norm_ is not clip
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert "unscale_" not in vars(scaler) and "step" not in vars(scaler)


def test_one_scaler_stepping_two_optimizers_is_named(tmp_path):
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 2)
    model = nn.Sequential(body, head)
    opt_body, opt_head = torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.Adam(head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with convcheck.watch(model, opt_body, out=tmp_path / "run", scaler=scaler) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            opt_body.zero_grad()
            opt_head.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt_body)
            scaler.step(opt_head)
            scaler.update()
            w.step(loss)
    notes = open_watched(tmp_path / "run")["notes"]
    assert any(n.startswith("one GradScaler stepped 2 optimizers (SGD, Adam)") for n in notes)


def test_a_scheduler_that_steps_on_skipped_steps_is_named(tmp_path):
    """A GradScaler whose first scale overflows float16 skips the first steps; the loop steps its scheduler
    anyway (the warning PyTorch prints once), so the schedule runs ahead of the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # overflows float16: skipped steps at first
    with convcheck.watch(model, opt, out=tmp_path / "run", scaler=scaler) as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            w.step(loss)
            sched.step()
    run = open_watched(tmp_path / "run")
    skipped = sum(bool(s.get("skipped")) for s in run.steps)
    assert skipped >= 1
    assert any(n.startswith("the learning rate moved on after") for n in run["notes"])


def test_the_diff_says_it_and_a_loop_that_skips_its_scheduler_with_the_step_is_not_named(tmp_path, capsys):
    for name, guard in (("ahead", False), ("guarded", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
        with convcheck.watch(model, opt, out=tmp_path / name, scaler=scaler) as w:
            for _ in range(5):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().square().mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scale = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                w.step(loss)
                if not guard or scaler.get_scale() >= scale:  # the scale dropped: the step was skipped
                    sched.step()
    assert not any(n.startswith("the learning rate moved on") for n in open_watched(tmp_path / "guarded")["notes"])
    capsys.readouterr()
    main(["diff", str(tmp_path / "ahead"), "--judge", "cpu:float64"])
    assert "note: the learning rate moved on after" in capsys.readouterr().out


@pytest.mark.parametrize("sync", ["layer", "step"])
def test_a_grad_scaler_calibrating_its_scale_is_not_a_nonfinite_finding(tmp_path, sync):
    """float16 AMP whose first scale is too large: the GradScaler skips steps while it lowers the scale (its
    design); the watch called that the run's first non-finite value ("numerics ... in the loss")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=tmp_path / "run", scaler=scaler, sync=sync) as w:
        for _ in range(12):
            x, y = torch.randn(8, 16, generator=g) * 30, torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            w.step(loss)
    run = open_watched(tmp_path / "run")
    assert any(s.get("skipped") for s in run.steps)
    assert run["first_nonfinite"] is None
    assert any(n.startswith("the scaled gradients held Inf/NaN at") for n in run["notes"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GradScaler targets (amp-fp16) are CUDA's")
def test_compares_own_training_clips_the_unscaled_gradients(monkeypatch):
    """`compare --clip-grad-norm` with a float16 GradScaler target: convcheck's own step unscales before it clips
    (runners.base.train_backward), so compare cannot make the mistake it finds in a user's loop. The norms the
    clip sees are the true ones, not 4096x them (this run's first scale)."""
    import convcheck.measure.train.arm_state as arm_state

    seen = []
    real = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *args, **kwargs):
        params = list(params)
        seen.append(float(torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params
                                                                 if p.grad is not None]))))
        return real(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(arm_state.torch.nn.utils, "clip_grad_norm_", clip)
    result = convcheck.compare("lenet", "cuda,cuda:amp-fp16", steps=3, envelope=0, clip_grad_norm=0.5, verify=False)
    assert seen and max(seen) < 100  # unscaled: O(1); scaled by the GradScaler they would be ~1e4 and more
    assert result.verdict is not None
