"""Issues 45 and 48: a layer's repeated small calls are measured together at the forward's end (``stacked.py``),
and what is recorded is what one measurement per call would have recorded.

Written as a user writes the loop: a layer called once per time step, its output sometimes changed in place
after the call, a NaN made at one time step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.runformat.reader import open_watched
from convcheck.watch import stacked, stats

EXACT = ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf", "dtype", "calls")


def _same_row(got: dict, want: dict) -> None:
    for k in EXACT:
        assert got[k] == want[k], k
    for k in ("sum", "sumsq"):
        assert math.isclose(got[k], want[k], rel_tol=1e-5, abs_tol=1e-30), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_stacked_rows_are_the_rows_of_one_measurement_per_call(dtype):
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal
    outs = [torch.tensor([[1.0, -2.0], [0.0, 3.0]]), torch.tensor([[-0.0, 0.0], [0.0, 0.0]]),
            torch.tensor([[tiny, 2.0], [5.0, 7.0]]), torch.tensor([[-1.0, -tiny], [-3.0, -0.5]]),
            torch.tensor([[0.25, 0.0], [0.0, 0.125]]), torch.tensor([[float("nan"), 1.0], [0.0, -1.0]]),
            torch.tensor([[float("inf"), 1.0], [2.0, -1.0]])]
    outs = [t.to(dtype) for t in outs]
    names = ["cell"] * len(outs)
    for got, t in zip(stacked.rows(outs, names), outs):
        _same_row(got, stats.measure(t))


def test_a_layer_whose_calls_differ_in_shape_is_stacked_by_shape():
    outs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 4).relu(), torch.randn(5)]
    for got, t in zip(stacked.rows(outs, ["a", "a", "a", "b"]), outs):
        _same_row(got, stats.measure(t))


class Unrolled(nn.Module):
    """A linear layer called once per time step, its output changed in place after each call (a ReLU written as
    ``relu_``), and a gate whose ``exp`` overflows at one time step."""

    def __init__(self):
        super().__init__()
        self.step, self.gate = nn.Linear(8, 8), Gate()

    def forward(self, seq):
        h = torch.zeros(seq.shape[0], 8)
        for t in range(seq.shape[1]):
            h = self.step(self.gate(seq[:, t]) + h)
            h.relu_()  # after the call: the watch must record what the call returned, not this
        return h.sum(1)


class Gate(nn.Module):
    def forward(self, x):
        return x.exp()


def _watched(out, seq, monkeypatch=None, held=None):
    torch.manual_seed(0)
    model = Unrolled()
    seen = []
    model.step.register_forward_hook(lambda m, args, output: seen.append(output.detach().clone()))
    if held is not None:
        monkeypatch.setattr(stacked, "HELD_MAX", held)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(), sync="layer") as w:
        loss = model(seq).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
    return open_watched(out), seen


def test_a_repeated_call_changed_in_place_afterwards_is_recorded_as_it_returned(tmp_path):
    seq = torch.randn(4, 10, 8) * 0.1
    run, seen = _watched(tmp_path / "run", seq)
    row = run.steps[0]["layers"]["step"]
    acc = None
    for t in seen:  # what each call returned, copied by the user's own hook before the in-place ReLU
        acc = stats.merge(acc, stats.measure(t))
    want = stats.finish(acc)
    assert row["calls"] == 10 and want["zeros"] == 0.0  # the calls' outputs hold no zeros; the ReLU's do
    for k in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf", "calls", "worst_call"):
        assert row[k] == want[k], k
    assert math.isclose(row["mean"], want["mean"], rel_tol=1e-5) and math.isclose(row["std"], want["std"], rel_tol=1e-5)


def test_a_flush_forced_by_the_held_bound_changes_nothing_recorded(tmp_path, monkeypatch):
    seq = torch.randn(4, 10, 8) * 0.1
    whole, _ = _watched(tmp_path / "whole", seq)
    bounded, _ = _watched(tmp_path / "bounded", seq, monkeypatch, held=40)  # a flush every call or two
    a, b = whole.steps[0]["layers"], bounded.steps[0]["layers"]
    assert a.keys() == b.keys()
    for name in a:
        for k in ("n", "max_abs", "min_nonzero", "zeros", "calls", "worst_call"):
            assert a[name].get(k) == b[name].get(k), (name, k)
        assert math.isclose(a[name]["std"], b[name]["std"], rel_tol=1e-5)


def test_a_nan_made_by_a_stacked_call_is_named_with_its_call_and_op(tmp_path):
    seq = torch.randn(4, 10, 8) * 0.1
    seq[:, 7] = 100.0  # exp(100) is Inf in float32: the gate's eighth call makes it from a finite input
    run, _ = _watched(tmp_path / "run", seq)
    p = run["first_nonfinite"]
    assert (p["layer"], p["direction"], p.get("call"), p.get("op")) == ("gate", "forward", 7, "exp")
    assert run.steps[0]["layers"]["gate"]["nonfinite_call"] == 7


def test_a_lazily_negated_view_is_measured_as_its_values():
    """``torch._neg_view`` (a negation applied lazily): torch refuses a bit view of it; measured as its values."""
    base = torch.tensor([0.0, 1.0, -2.0, 0.0])
    got = stats.measure(torch._neg_view(base))
    _same_row(got, stats.measure(-base))
    assert got["zeros"] == 2 and got["max_abs"] == 2.0
    _same_row(stacked.rows([torch._neg_view(base)], ["a"])[0], stats.measure(-base))


class LaterInPlace(Unrolled):
    """``Unrolled`` whose ReLU after each call is written in place only from its third forward on (a mode switched
    mid-run): the first two steps' outputs are left as they returned."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, seq):
        self.calls += 1
        h = torch.zeros(seq.shape[0], 8)
        for t in range(seq.shape[1]):
            h = self.step(self.gate(seq[:, t]) + h)
            h = h.relu_() if self.calls >= 3 else h.relu()
        return h.sum(1)


def test_an_output_changed_in_place_only_later_is_said_once_and_copied_from_then_on(tmp_path):
    torch.manual_seed(0)
    model = LaterInPlace()
    seen = []
    model.step.register_forward_hook(lambda m, args, output: seen.append(output.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seqs = [torch.randn(4, 10, 8) * 0.1 for _ in range(4)]
    with convcheck.watch(model, opt, out=tmp_path / "run", snapshot_steps=(), sync="layer") as w:
        for seq in seqs:
            loss = model(seq).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    run = open_watched(tmp_path / "run")
    for k in (0, 1, 3):  # copied (step 0), held as they are (step 1), copied again once found changed (step 3)
        acc = None
        for t in seen[10 * k:10 * k + 10]:
            acc = stats.merge(acc, stats.measure(t))
        want, row = stats.finish(acc), run.steps[k]["layers"]["step"]
        for key in ("n", "max_abs", "min_nonzero", "zeros", "calls", "worst_call"):
            assert row[key] == want[key], (k, key)
    changed = [n for n in run["notes"] if "changed in place" in n]
    assert len(changed) == 1 and "the output of step was changed in place after its call at step 2" in changed[0]
    assert run.steps[2]["layers"]["step"]["zeros"] > 0  # that step read the ReLU's zeros, as the note says


def test_stacked_rows_leave_the_outputs_as_they_are_and_share_a_stack_across_layers_of_one_shape():
    """The stacks are reduced in place (made |x|): the outputs held as they are (``Stacked``) come back unchanged.
    Layers of one shape share a stack; a call of another dtype among them, 0-d calls and empty ones are measured too."""
    torch.manual_seed(0)
    outs = [torch.randn(3, 4), torch.randn(3, 4).relu(), torch.randn(3, 4).double(), -torch.randn(3, 4).abs(),
            torch.tensor(-1.5), torch.tensor(0.0), torch.zeros(2, 0), torch.zeros(2, 0),
            torch.randn(3, 4, requires_grad=True) * 1]
    names = ["a", "b", "b", "c", "s", "s", "e", "e", "a"]
    before = [t.detach().clone() for t in outs]
    for got, t in zip(stacked.rows(outs, names), outs):
        _same_row(got, stats.measure(t))
    for b, t in zip(before, outs):
        assert torch.equal(b, t.detach())
