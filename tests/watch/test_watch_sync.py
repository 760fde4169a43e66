"""One read per step, and recording only what is asked (issue 35).

On a GPU every read of a statistic waits for the device: the watch read one per layer (a ``tolist`` each).
``sync="step"`` (the default on an accelerator) keeps the step's statistics on the device and reads them once;
these tests run it on the CPU (``CONVCHECK_WATCH_SYNC=step``) and count the reads."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.runformat.reader import open_watched
from convcheck.watch import fused

from .loops import attention_run

READS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__")


class Deep(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))))


def _loop(model, out, n: int = 3, reads: list | None = None, **watch_args) -> list[float]:
    """The user's loop; ``reads`` gets the number of tensor reads made inside each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]
    losses = []
    with convcheck.watch(model, opt, out=out, snapshot_steps=(), **watch_args) as w:
        for x, y in batches:
            with _counting() as count:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
            if reads is not None:
                reads.append(count[0])
            losses.append(float(loss))
    return losses


class _counting:
    """Counts every read of a tensor's value into Python (what waits for a GPU) while active."""

    sites: list = []  # where each read was made (the test's message when the count is wrong)

    def __enter__(self):
        self.count, self.depth = [0], [0]
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, self._wrap(fn))
        return self.count

    def _wrap(self, fn):
        count, depth = self.count, self.depth

        def counted(*args, **kwargs):
            if depth[0] == 0:  # a read whose __torch_function__ re-enters the patched method is one read
                count[0] += 1
                _counting.sites.append(" < ".join(f"{f.name}:{f.lineno}"
                                                  for f in traceback.extract_stack(limit=5)[-2::-1]))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)
        return False


def test_sync_step_reads_a_constant_number_of_times_per_step_whatever_the_depth(tmp_path, monkeypatch):
    fused.ready()
    monkeypatch.setattr(fused, "_KERNELS", {})  # each layer's torch reads counted (the one pass reads through numpy)
    counts, sites = {}, {}
    for blocks in (2, 12):
        for sync in ("step", "layer"):
            torch.manual_seed(0)
            reads: list = []
            _counting.sites.clear()
            _loop(Deep(blocks), tmp_path / f"{sync}{blocks}", reads=reads, sync=sync)
            counts[sync, blocks] = max(reads[1:])  # step 0 holds the first call's one-off work
            sites[sync, blocks] = list(_counting.sites)
    # the step's buffer and the loss handed to w.step (the norms travel in the buffer)
    assert counts["step", 2] == counts["step", 12] <= 2, (sites["step", 2], sites["step", 12])
    assert counts["layer", 12] > counts["layer", 2] + 20  # per layer: the counter sees the reads it should


def test_sync_step_records_the_same_numbers_as_reading_each_layer(tmp_path, monkeypatch):
    for sync in ("step", "layer", "torch"):
        torch.manual_seed(0)
        with monkeypatch.context() as m:
            if sync == "torch":  # reading each layer with torch's passes, as without numba
                fused.ready()
                m.setattr(fused, "_KERNELS", {})
            _loop(Deep(3), tmp_path / sync, sync="layer" if sync == "torch" else sync)
    a = (tmp_path / "step" / "steps.jsonl").read_text()
    assert a == (tmp_path / "torch" / "steps.jsonl").read_text()
    # the one pass (``fused.py``) sums in float64: the same counts and extremes, means and stds to float32's rounding
    layer = (tmp_path / "layer" / "steps.jsonl").read_text()
    for x, y in zip(map(json.loads, a.splitlines()), map(json.loads, layer.splitlines())):
        assert x.keys() == y.keys() and x["grad_norms"] == y["grad_norms"] and x["loss"] == y["loss"]
        for name, row in x["layers"].items():
            other = y["layers"][name]
            assert {k: v for k, v in row.items() if k not in ("mean", "std")} == \
                {k: v for k, v in other.items() if k not in ("mean", "std")}, name
            assert row["mean"] == pytest.approx(other["mean"], rel=1e-4, abs=1e-7)
            assert row["std"] == pytest.approx(other["std"], rel=1e-5)


def test_sync_step_finds_the_first_nonfinite_producer_at_the_steps_end(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVCHECK_WATCH_SYNC", "step")
    attention_run(tmp_path / "fp16", half=True)
    run = open_watched(tmp_path / "fp16")
    p = run["first_nonfinite"]
    assert (p["layer"], p["step"], p["direction"], p["kind"]) == ("att", 4, "forward", "own code")
    # issue 43: the op and its line from the graph the step left, the magnitude going in from the one read
    assert p["op"] == "matmul" and p["source"]["code"] == "s = self.q(x) @ self.k(x).transpose(1, 2)"
    assert "its inputs reach" in p["detail"]
    assert any("found at the end of step 4" in n and "its op read from the autograd graph" in n for n in run["notes"])
    assert run["settings_from_env"]["CONVCHECK_WATCH_SYNC"] == "step"


def test_layers_by_pattern_and_steps_by_window_and_stride(tmp_path):
    torch.manual_seed(0)
    losses = _loop(Deep(3), tmp_path / "run", n=6, layers=["blocks.1.*", "head"], steps="0-3", every=2)
    run = open_watched(tmp_path / "run")
    assert [s["loss"] for s in run.steps] == pytest.approx(losses)  # every step keeps its loss
    assert list(run.steps[0]["layers"]) == ["blocks.1.0", "blocks.1.1", "head"]
    assert [bool(s["layers"]) for s in run.steps] == [True, False, True, False, False, False]
    assert [s.get("layers_recorded", True) for s in run.steps] == [True, False, True, False, False, False]
    assert all(s["grad_norms"] for s in run.steps)
    assert run["selection"] == {"layers": ["blocks.1.*", "head"], "steps": [[0, 3]], "every": 2, "sync": "auto",
                                "repeated_grads": "together"}


def test_pause_and_resume_leave_a_phase_out(tmp_path):
    torch.manual_seed(0)
    model = Deep(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with convcheck.watch(model, opt, out=tmp_path / "run", snapshot_steps=()) as w:
        for step in range(4):
            if step == 1:
                w.pause()
            if step == 3:
                w.resume()
            loss = model(torch.randn(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    run = open_watched(tmp_path / "run")
    assert [bool(s["layers"]) for s in run.steps] == [True, False, False, True]


def test_the_environment_chooses_without_touching_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVCHECK_WATCH_LAYERS", "stem")
    monkeypatch.setenv("CONVCHECK_WATCH_EVERY", "2")
    torch.manual_seed(0)
    _loop(Deep(2), tmp_path / "run", n=3)
    run = open_watched(tmp_path / "run")
    assert [list(s["layers"]) for s in run.steps] == [["stem"], [], ["stem"]]
    assert run["settings_from_env"] == {"CONVCHECK_WATCH_LAYERS": "stem", "CONVCHECK_WATCH_EVERY": "2"}


@pytest.mark.parametrize("env, value, words", [
    ("CONVCHECK_WATCH_SYNC", "sometimes", "CONVCHECK_WATCH_SYNC='sometimes' is not one of auto, step, layer"),
    ("CONVCHECK_WATCH_EVERY", "0", "CONVCHECK_WATCH_EVERY='0' is not a whole number of steps in 1..1000000000"),
    ("CONVCHECK_WATCH_STEPS", "5-2", "the window '5-2' is empty"),
    ("CONVCHECK_WATCH_LAYERS", "nosuch*", "layers pattern 'nosuch*' matches no module of the model"),
])
def test_a_bad_choice_is_one_usage_error_naming_it(tmp_path, monkeypatch, env, value, words):
    monkeypatch.setenv(env, value)
    with pytest.raises(UsageError, match=None) as e:
        _loop(Deep(1), tmp_path / "run", n=1)
    assert words in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_selective_run_diffs_against_a_full_one(tmp_path, capsys):
    torch.manual_seed(0)
    _loop(Deep(2), tmp_path / "full", n=4)
    torch.manual_seed(0)
    _loop(Deep(2), tmp_path / "some", n=4, layers=["head"], every=2)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "full"), str(tmp_path / "some")]) == 0
    assert "verdict: ok" in capsys.readouterr().out
    m = json.loads((tmp_path / "some" / "manifest.json").read_text())
    assert m["selection"]["layers"] == ["head"]


def test_a_pattern_naming_a_block_records_every_layer_inside_it(tmp_path):
    """`layers=["blocks.1"]` (ResNet's "layer4") matched a module with children and recorded nothing."""
    torch.manual_seed(0)
    _loop(Deep(3), tmp_path / "run", n=2, layers=["blocks.1"])
    run = open_watched(tmp_path / "run")
    assert list(run.steps[0]["layers"]) == ["blocks.1.0", "blocks.1.1"]
