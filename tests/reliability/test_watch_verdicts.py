"""Issue 47: verdicts on watched runs a new user gets wrong. ``scaler.scale(loss).backward(); optimizer.step()``
(the GradScaler's step skipped) is that setup, not "lower the learning rate"; a run stopped by Ctrl-C says where it
stopped and judges what it has, with no remedy about steps it never reached."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.runformat.reader import open_watched


def _amp_run(out, through_scaler: bool, steps: int = 5) -> None:
    """A float16-autocast loop with a GradScaler, stepping through it (the AMP recipe) or around it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, scaler=scaler) as w:
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if through_scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()  # the scaler's step skipped: the scaled gradients applied (update() would refuse)
            w.step(loss)


def _diff(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["diff", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_optimizer_step_around_the_scaler_is_named_with_its_remedy(tmp_path, capsys):
    _amp_run(tmp_path / "run", through_scaler=False)
    assert all(s.get("step_without_scaler") for s in open_watched(tmp_path / "run").steps)
    code, out, err = _diff(capsys, tmp_path / "run", "--judge", "cpu:float64")
    assert code == 1 and "Traceback" not in err, err
    assert "verdict: setup: the run applies the GradScaler's scaled gradients unscaled" in out, out
    assert "scaler.step(optimizer)" in out and "lower the learning rate" not in out, out


def test_the_recipe_through_the_scaler_is_not_named(tmp_path, capsys):
    _amp_run(tmp_path / "run", through_scaler=True)
    assert not any(s.get("step_without_scaler") for s in open_watched(tmp_path / "run").steps)
    _, out, _ = _diff(capsys, tmp_path / "run", "--judge", "cpu:float64")
    assert "scaled gradients unscaled" not in out


def test_a_pair_names_the_run_that_steps_around_its_scaler(tmp_path, capsys):
    _amp_run(tmp_path / "right", through_scaler=True)
    _amp_run(tmp_path / "wrong", through_scaler=False)
    code, out, _ = _diff(capsys, tmp_path / "right", tmp_path / "wrong")
    assert code == 1
    assert "verdict: setup: B applies the GradScaler's scaled gradients unscaled" in out, out
    assert "lower the learning rate" not in out


def _stopped_run(out, stop_at: int | None, steps: int = 8) -> None:
    """A healthy float32 loop, interrupted (Ctrl-C) after ``stop_at`` steps when given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        with convcheck.watch(model, opt, out=out) as w:
            for step in range(steps):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
                if step + 1 == stop_at:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass


def test_a_run_stopped_by_ctrl_c_says_where_and_judges_what_it_has(tmp_path, capsys):
    """Issue 47: the verdict was 'setup: stopped ... the watch saw no NaN/Inf' with a remedy about a NaN check in
    steps the run never reached."""
    _stopped_run(tmp_path / "run", stop_at=4)
    assert open_watched(tmp_path / "run").manifest["stopped"]["step"] == 4
    code, out, err = _diff(capsys, tmp_path / "run", "--judge", "cpu:float64")
    assert code == 0 and "Traceback" not in err, out + err
    verdict = out[out.index("verdict:"):]
    assert "interrupted" in verdict and "step 4" in verdict, verdict
    assert "NaN check" not in out and "remedy" not in verdict, verdict


def test_a_pair_with_one_run_stopped_by_ctrl_c_is_judged_on_the_steps_both_have(tmp_path, capsys):
    _stopped_run(tmp_path / "whole", stop_at=None)
    _stopped_run(tmp_path / "stopped", stop_at=4)
    code, out, _ = _diff(capsys, tmp_path / "whole", tmp_path / "stopped")
    verdict = out[out.index("verdict:"):]
    assert code == 0 and "agree within rounding" in verdict, out
    assert "NaN check" not in out and "stopped at step 4" in out, out


def test_a_run_whose_loop_raised_is_still_the_stop_it_is(tmp_path, capsys):
    """What the rules say of a loop that raised (its own NaN check, say) is unchanged: not an interrupt."""
    from convcheck.diagnose.rules.watched_lines import interrupted

    assert interrupted({"exception": "KeyboardInterrupt", "message": "", "step": 1})
    assert not interrupted({"exception": "RuntimeError", "message": "nan loss", "step": 1})
    assert not interrupted(None)


def test_an_optimizer_trained_without_amp_beside_a_scaled_one_is_not_named(tmp_path):
    """A second optimizer stepped directly (its loss not scaled) beside one stepped through the scaler: not the
    misuse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    other = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=tmp_path / "run", scaler=scaler) as w:
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt_other.zero_grad()
            nn.functional.cross_entropy(other(x), y).backward()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt_other.step()  # after the scaled backward, but its own gradients were never scaled
            scaler.step(opt)
            scaler.update()
            w.step(loss)
    assert not any(s.get("step_without_scaler") for s in open_watched(tmp_path / "run").steps)
