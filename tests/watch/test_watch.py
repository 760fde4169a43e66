"""convcheck.watch on real training loops: the numerics untouched, what the bundle holds, its rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.errors import UsageError
from convcheck.runformat.reader import open_watched
from convcheck.report.verdict_lines import unwrapped

from .loops import dataset, offset_run


class SmallCNN(nn.Module):
    """BatchNorm (running stats), in-place ReLU, dropout (draws from the RNG), pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        h = nn.functional.max_pool2d(self.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(h.flatten(1)))


def _train(watch_out=None, steps=5, explicit=True):
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    losses = []

    def loop(w):
        for _ in range(steps):
            x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if w is not None and explicit:
                w.step(loss)
            losses.append(loss.item())

    if watch_out is None:
        loop(None)
    else:
        with convcheck.watch(model, opt, out=watch_out) as w:
            loop(w)
    return model, losses


def test_a_watched_run_is_bitwise_identical_to_an_unwatched_one(tmp_path):
    bare, bare_losses = _train()
    watched, watched_losses = _train(tmp_path / "run")
    assert watched_losses == bare_losses
    for (n, p), (_, q) in zip(bare.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(p, q), n
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in watched.modules())  # removed on exit


def test_the_bundle_of_a_real_training_loop(tmp_path):
    _train(tmp_path / "run", steps=5)
    run = open_watched(tmp_path / "run")
    assert run["complete"] and run["steps"] == 5 and len(run.steps) == 5
    assert [s["lr"] for s in run.steps] == [[0.05], [0.05], [0.025], [0.025], [0.0125]]
    s0 = run.steps[0]
    assert s0["loss"] is not None and len(s0["batch_sha256"]) == 1
    assert set(s0["grad_norms"]) == {n for n, _ in SmallCNN().named_parameters()}
    assert list(s0["layers"]) == ["conv", "bn", "relu", "drop", "fc"]
    relu = s0["layers"]["relu"]
    assert relu["zeros"] > 0.2 and relu["nan"] == relu["inf"] == 0 and relu["min_nonzero"] > 0
    assert run["math_flags"]["deterministic_algorithms"] is False and run["first_nonfinite"] is None
    snap = run.snapshot(0)  # default: the first step
    assert {"in/conv/0/0", "out/fc/0/0", "param/conv.weight", "grad/fc.bias"} <= set(snap)
    assert snap["in/conv/0/0"].shape == (6, 3, 8, 8) and run.snapshot(1) is None


def test_without_step_calls_it_records_at_the_optimizer_step(tmp_path):
    _train(tmp_path / "run", steps=3, explicit=False)
    run = open_watched(tmp_path / "run")
    assert run["steps"] == 3 and all(s["loss"] is None and s["stepped"] for s in run.steps)


def test_a_nonfinite_forward_is_found_live_and_snapshotted(tmp_path):
    from .loops import attention_run

    attention_run(tmp_path / "fp16", half=True)
    run = open_watched(tmp_path / "fp16")
    p = run["first_nonfinite"]
    assert (p["layer"], p["step"], p["direction"], p["kind"]) == ("att", 4, "forward", "own code")
    snap = run.snapshot(4)
    assert snap is not None and "grad/head.weight" in snap


def test_it_never_overwrites_without_force(tmp_path):
    offset_run(tmp_path / "run", steps=1)
    with pytest.raises(UsageError, match="not empty; pass force=True"):
        offset_run(tmp_path / "run", steps=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="is not empty$"):
        with convcheck.watch(nn.Linear(2, 2), out=tmp_path / "other"):
            pass
    with pytest.raises(UsageError, match="holds 'notes.txt', which is not part of a watched run; refusing"):
        with convcheck.watch(nn.Linear(2, 2), out=tmp_path / "other", force=True):
            pass
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    # a run that crashed before its manifest (steps.jsonl and snapshots/ only) is replaced with force=True
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "steps.jsonl").write_text("")
    (tmp_path / "half" / "snapshots").mkdir()
    with pytest.raises(UsageError, match="not empty; pass force=True"):
        convcheck.watch(nn.Linear(2, 2), out=tmp_path / "half").__enter__()
    with convcheck.watch(nn.Linear(2, 2), out=tmp_path / "half", force=True):
        pass


def test_the_size_cap_stops_recording_with_a_clear_message(tmp_path, capsys):
    model = nn.Linear(10, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = dataset().tensors
    with convcheck.watch(model, opt, out=tmp_path / "run", max_bytes=3000) as w:
        for i in range(20):
            loss = nn.functional.cross_entropy(model(x[i:i + 4]), y[i:i + 4])
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    err = capsys.readouterr().err
    assert "would pass max_bytes=3000" in err
    run = open_watched(tmp_path / "run")
    assert run["truncated"] and 0 < run["steps"] < 20
    assert any("max_bytes=3000" in n for n in run["notes"])
    # the diff says it was cut, never "compared the first N" as if nothing were missing (issue 35)
    from convcheck.analysis.diff import diff_watched, judge_watched

    d = diff_watched(tmp_path / "run", tmp_path / "run", judge="cpu:float64")
    assert any(line.startswith("truncated: A's recording stopped at step") for line in d.lines())
    assert any("record was cut by its size cap" in e and "max_bytes=3000" in e for e in d.verdict.evidence)
    j = judge_watched(tmp_path / "run", "cpu:float64")
    assert any("the record was cut by its size cap" in e for e in j.verdict.evidence)


def _stopping_loop(out, stop_at=None):
    """A user's loop that raises on a bad loss (here: at step ``stop_at``, as a NaN check would)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(5):
            loss = nn.functional.cross_entropy(model(torch.randn(3, 10, generator=g)),
                                               torch.randint(0, 2, (3,), generator=g))
            if step == stop_at:
                raise FloatingPointError(f"loss is nan at step {step}")
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_a_run_whose_loop_raised_is_read_and_says_where_it_stopped(tmp_path, capsys):
    """The commonest stop of a run with the problem: the user's loop raises on a NaN loss. Its steps up to
    there are whole and readable; the manifest says which exception, its message and the step; diff
    reads it and says so."""
    from convcheck.cli.main import main

    with pytest.raises(FloatingPointError):
        _stopping_loop(tmp_path / "run", stop_at=3)
    _stopping_loop(tmp_path / "whole")
    code = main(["diff", str(tmp_path / "whole"), str(tmp_path / "run"), "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    assert code == 1, out  # agreeing up to the stop is not ok: the training did not finish
    assert ("verdict: setup: B stopped at step 3 with FloatingPointError (loss is nan at step 3); the watch saw "
            "no NaN/Inf and no layer beyond its floor before it") in out
    assert "pass the loss to w.step(loss) before the loop's own NaN check" in out
    assert "B = " in out and "(3 steps)" in out
    assert "stopped: B stopped at step 3 with FloatingPointError (loss is nan at step 3); its steps up to " \
           "there are diffed" in out
    code = main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64", "--no-save"])
    out = unwrapped(capsys.readouterr().out)
    assert code == 1 and "verdict: setup: the run stopped at step 3 with FloatingPointError" in out
    run = open_watched(tmp_path / "run")
    assert run["complete"] is True and run["steps"] == 3 and len(run.steps) == 3
    assert run["stopped"] == {"exception": "FloatingPointError", "message": "loss is nan at step 3", "step": 3}
    assert "the watched block stopped with FloatingPointError at step 3: loss is nan at step 3" in run["notes"]
