"""An error in convcheck's own code inside the user's loop stops the *recording*, never the loop (issue 45: the
watch invisible): the losses are those of the loop without the watch, the manifest and the diff say where the
recording stopped, and the user's own exceptions still come out as they were raised."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.analysis.diff import diff_watched
from convcheck.runformat.reader import open_watched


class Net(nn.Module):
    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise ValueError("the user's own error")
        return self.fc2(self.relu(self.fc1(x)))


def _train(out=None, steps=5, fail_at=None, scaler=False, explicit=True, **kw) -> list[float]:
    torch.manual_seed(0)
    model = Net(fail_at)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    g = torch.Generator().manual_seed(1)
    losses = []
    with (convcheck.watch(model, opt, out=out, scaler=sc, **kw) if out else contextlib.nullcontext()) as w:
        for _ in range(steps):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if sc is not None:
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
            else:
                loss.backward()
                opt.step()
            losses.append(loss.item())
            if w is not None and explicit:
                w.step(loss)
    return losses


def _plant(monkeypatch, owner, name: str, after: int) -> None:
    """``owner.name`` raises from its ``after``-th call on: a bug in convcheck's own code."""
    original, calls = getattr(owner, name), [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("a planted bug")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)


def _planted():
    from convcheck.watch import producers, recorder, scaler_use, snapshots

    return {"batch hash (the model's forward hook)": (recorder, "batch_hash", 2, {}),
            "gradient norms (the optimizer's hook)": (recorder, "grad_norms", 2, {}),
            "w.step": (recorder, "loss_dtype", 2, {}),
            "a layer's snapshot (a layer's forward hook)": (snapshots.SnapshotTaker, "take_call", 4,
                                                             {"snapshot_steps": [0, 1, 2]}),
            "a gradient hook": (producers, "wide_finite", 4, {}),
            "a gradient hook, read once a step": (producers.ProducerHooks, "_grad_into", 4, {"sync": "step"}),
            "the GradScaler's spy": (scaler_use.ScalerSpy, "clip", 2, {"scaler": True})}


@pytest.mark.parametrize("where", list(_planted()))
def test_a_bug_in_the_watch_stops_the_recording_not_the_loop(tmp_path, monkeypatch, capsys, where):
    owner, name, after, kw = _planted()[where]
    scaler = kw.pop("scaler", False)
    bare = _train(scaler=scaler)
    _train(tmp_path / "clean", scaler=scaler, **kw)
    _plant(monkeypatch, owner, name, after)
    assert _train(tmp_path / "run", scaler=scaler, **kw) == bare  # bitwise: the loop ran on as without the watch
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("convcheck.watch:")]
    assert len(err) == 1 and "convcheck's fault, please report it" in err[0] and "a planted bug" in err[0]
    run = open_watched(tmp_path / "run")
    failed = run["watch_error"]
    assert failed["exception"] == "RuntimeError" and failed["message"] == "a planted bug"
    assert run["truncated"] and len(run.steps) == failed["step"] < 5  # what it wrote before stays
    monkeypatch.undo()
    d = diff_watched(tmp_path / "clean", tmp_path / "run")
    stopped = f"recording stopped at step {failed['step']}: convcheck.watch failed in {failed['where']}"
    assert any(line.startswith(f"truncated: B's {stopped}") for line in d.lines()), d.lines()
    assert any(f"B's record was cut: {stopped}" in e for e in d.verdict.evidence), d.verdict.evidence


def test_the_users_own_exception_still_comes_out_as_raised(tmp_path, monkeypatch):
    from convcheck.watch import recorder

    with pytest.raises(ValueError, match="the user's own error"):
        _train(tmp_path / "own", fail_at=3)
    run = open_watched(tmp_path / "own")
    assert run["stopped"]["exception"] == "ValueError" and run["watch_error"] is None
    # the watch broken first, the user's error later: still theirs, unchanged
    _plant(monkeypatch, recorder, "grad_norms", 1)
    with pytest.raises(ValueError, match="the user's own error"):
        _train(tmp_path / "both", fail_at=3)
    run = open_watched(tmp_path / "both")
    assert run["watch_error"]["step"] == 1 and run["stopped"]["exception"] == "ValueError"


def test_a_bug_at_the_first_step_is_said_when_the_run_is_diffed(tmp_path, monkeypatch):
    from convcheck.errors import UsageError
    from convcheck.watch import recorder

    _train(tmp_path / "clean")
    _plant(monkeypatch, recorder, "batch_hash", 0)
    assert _train(tmp_path / "run", explicit=False) == _train()
    monkeypatch.undo()
    with pytest.raises(UsageError, match="recorded no step: recording stopped at step 0: convcheck.watch failed"):
        diff_watched(tmp_path / "clean", tmp_path / "run")
