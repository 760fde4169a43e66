"""The float64 judge on watched runs: ``convcheck diff A B`` replays the snapshot steps, ``convcheck diff
RUN --judge cpu:float64`` diagnoses one run, and the op inside own code that made the first NaN/Inf."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped

from .judge_loops import LargerOffsetNormNet, norm_run
from .loops import attention_run, offset_run, unhashed


def diff(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    out, err = capsys.readouterr()
    return code, unwrapped(out), err  # the prose wrapped at 100 columns read whole


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judged")
    attention_run(tmp / "att32", half=False)
    attention_run(tmp / "att16", half=True)
    norm_run(tmp / "norm")
    offset_run(tmp / "off")
    offset_run(tmp / "off_again")
    return tmp


def test_a_planted_fp16_overflow_in_attention_is_named_module_op_and_step(runs, capsys):
    code, out, _ = diff(capsys, runs / "att32", runs / "att16")
    assert code == 1
    assert "verdict: numerics: B turns non-finite at step 4 in att (own code: matmul, forward); A stays finite" in out
    line = next(x for x in out.splitlines() if x.startswith("first non-finite in B:"))
    assert "att (own code: matmul, forward) at step 4: values reach" in line
    assert line.endswith("> 65504 (float16's largest) [tests/watch/loops.py:20: s = self.q(x) @ self.k(x).transpose(1, 2)]")
    magnitude = float(line.split("values reach ")[1].split(" >")[0])
    assert magnitude > 65504
    # both runs' step 0 replayed through the judge; B's overflow step has no parameters: said so
    assert "float64 judge (cpu:float64) on A: 5 layer calls at step 0 replayed: all within their floors" in out
    assert "not replayed: step 4: its snapshot holds no parameters" in out


def test_one_run_against_the_judge_names_the_layer_above_its_floor(runs, capsys):
    code, out, _ = diff(capsys, runs / "norm", "--judge", "cpu:float64")
    assert code == 1
    assert "verdict: layer: norm computes beyond its floor at step 0: local error" in out
    assert "above its floor: step 0, norm: local error" in out
    code, out, _ = diff(capsys, runs / "norm", "--judge", "cpu:float64", "--json")
    v = json.loads(out)["verdict"]
    assert code == 1 and v["category"] == "layer" and v["layer"] == "norm"
    rows = {r["layer"]: r for r in json.loads(out)["judge_replay"]["rows"]}
    assert rows["norm"]["flagged"] and rows["norm"]["local"] > 1e3 * rows["norm"]["floor"]
    assert not rows["fc1"]["flagged"] and not rows["fc2"]["flagged"]


def test_one_run_against_the_judge_names_the_overflow_with_the_judges_magnitude(runs, capsys):
    code, out, _ = diff(capsys, runs / "att16", "--judge", "cpu:float64")
    assert code == 1
    assert "verdict: numerics: the run turns non-finite at step 4 in att (own code: matmul, forward)" in out
    assert "> 65504 (float16's largest)" in out
    # float32 stays finite, but its inputs grow 4x a step and its loss with them (1.07 -> 43 at step 4): not ok
    code, out, _ = diff(capsys, runs / "att32", "--judge", "cpu:float64")
    assert code == 1
    assert "verdict: setup: the loss explodes: 43.05 at step 4, 40.3x its first value 1.068 (step 0)" in out
    code, out, _ = diff(capsys, runs / "off", "--judge", "cpu:float64")
    assert code == 0
    assert "verdict: ok: every replayed layer is within its floor and the run stays finite" in out


def test_the_same_flagged_layer_in_both_runs_is_the_layers_code(runs, tmp_path, capsys):
    shutil.copytree(runs / "norm", tmp_path / "norm2")
    code, out, _ = diff(capsys, runs / "norm", tmp_path / "norm2")
    assert code == 1
    assert "verdict: layer: in both runs, norm computes beyond its floor at step 0" in out


def test_a_layer_above_its_floor_in_both_runs_is_quoted_where_it_is_worst(runs, tmp_path, capsys):
    """The same one-pass norm on inputs with a larger mean in B: both runs flag it, B far worse. The
    headline quotes B's error (not A's smaller one, which alone would read as a note), the evidence both."""
    norm_run(tmp_path / "big", net=LargerOffsetNormNet)
    code, out, _ = diff(capsys, runs / "norm", tmp_path / "big")
    assert code == 1
    head = next(x for x in out.splitlines() if x.startswith("verdict: "))
    assert head.startswith("verdict: layer: in both runs, norm computes beyond its floor at step 0: local error ")
    assert head.endswith("(worst in B)")
    errors = {side: float(x.split("local error ")[1].split()[0]) for x in out.splitlines()
              for side in "AB" if x.startswith(f"  - float64 judge on {side}: step 0, norm:")}
    assert errors["B"] > 10 * errors["A"]
    assert f"local error {errors['B']:.3g}," in head


def test_a_healthy_pair_is_ok_with_every_layer_within_its_floor(runs, capsys):
    code, out, _ = diff(capsys, runs / "off", runs / "off_again", "--judge", "cpu:float64")
    assert code == 0
    assert "float64 judge (cpu:float64) on B: 3 layer calls at step 0 replayed: all within their floors" in out
    assert "verdict: ok: the two watched runs agree within rounding" in out


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def _tiny_run(out, cls) -> None:
    torch.manual_seed(0)
    model = cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(2):
            loss = model(torch.randn(3, 4, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_a_model_defined_in_a_function_has_its_torch_layers_rebuilt_from_safe_data(tmp_path, capsys):
    """The class is not importable (defined in a function) and does not pickle: its Linear is torch's own layer,
    rebuilt from the arguments the watch recorded, so the judge still checks every layer (issue 43)."""
    class Net(_Tiny):  # not importable: defined here
        pass

    _tiny_run(tmp_path / "a", Net)
    _tiny_run(tmp_path / "b", Net)
    code, out, _ = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and "verdict: ok" in out
    assert "float64 judge (cpu:float64) on A: 1 layer calls at step 0 replayed: all within their floors" in out
    code, out, _ = diff(capsys, tmp_path / "a", "--judge", "cpu:float64")
    assert code == 0 and "verdict: ok: every replayed layer is within its floor and the run stays finite" in out
    assert "the judge checked 1 of 1 layers (snapshot step 0)" in out


@pytest.mark.parametrize("model, note", [
    ({"module": "no_such_module_xyz", "qualname": "Net"}, "is not importable here (ModuleNotFoundError"),
    ({"module": "os", "qualname": "system"}, "names a module of Python's standard library"),
    ({"module": "torch.nn", "qualname": "functional"}, "is not a torch.nn.Module class"),
    ({"module": "torch.nn", "qualname": "Linear"}, "cannot be built without arguments here (TypeError"),
    ({"module": None, "qualname": None}, "the run did not record its model's module"),
])
def test_a_class_that_cannot_be_used_here_is_one_line(tmp_path, capsys, model, note):
    _tiny_run(tmp_path / "a", _Tiny)
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    m["model"].update(model)
    m["code"], m["model"]["leaf_specs"] = None, None  # as a run recorded before the model by value (issue 43)
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    code, out, err = diff(capsys, tmp_path / "a", "--judge", "cpu:float64")
    assert code == 5 and err == ""  # inconclusive: the judge checked nothing, never ok
    line = next(x for x in out.splitlines() if x.startswith("float64 judge"))
    assert note in line and line.endswith("; diffed without the replay")
    assert "verdict: inconclusive: the run stays finite, but the judge replayed no layer" in out


def test_an_importable_model_is_replayed(tmp_path, capsys):
    _tiny_run(tmp_path / "a", _Tiny)
    code, out, _ = diff(capsys, tmp_path / "a", "--judge", "cpu:float64")
    assert code == 0 and "1 layer calls at step 0 replayed: all within their floors" in out


def test_bad_judges_and_single_recorded_runs_are_usage_errors(runs, tmp_path, capsys):
    for judge, match in (("cpu:float32", "is not a float64 target"), ("some/bundle", "with watched runs, name a "
                                                                                     "float64 target")):
        code, out, err = diff(capsys, runs / "att32", "--judge", judge)
        assert code == 2 and out == "" and match in err and len(err.strip().splitlines()) == 1
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "manifest.json").write_text(json.dumps({"schema": "convcheck.bundle/1"}))
    code, out, err = diff(capsys, tmp_path / "rec", "--judge", "cpu:float64")
    assert code == 2 and "is not a watched run" in err and "Traceback" not in err


class _DropAttention(nn.Module):
    """The attention overflow, then a dropout: the random draws after the first NaN/Inf must be the
    ones an unwatched run makes (naming the op re-runs the module; it must draw nothing)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        return self.drop(torch.softmax(s.float(), -1)).mean()


def _drop_run(out=None) -> torch.Tensor:
    torch.manual_seed(0)
    model = _DropAttention().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)

    def loop(w):
        for step in range(3):
            x = (torch.randn(2, 4, 8, generator=g) * (30.0 ** step)).half()
            loss = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if w is not None:
                w.step(loss)

    if out is None:
        loop(None)
    else:
        with convcheck.watch(model, opt, out=out) as w:
            loop(w)
    return torch.get_rng_state()


def test_naming_the_op_draws_no_random_number(tmp_path):
    assert torch.equal(_drop_run(), _drop_run(tmp_path / "run"))
    p = json.loads((tmp_path / "run" / "manifest.json").read_text())["first_nonfinite"]
    assert (p["layer"], p["kind"], p["op"], p["dtype"]) == ("_DropAttention", "own code", "matmul", "float16")
    assert p["magnitude"] > 65504


def test_a_snapshot_whose_parameter_is_not_the_models_shape_is_skipped(tmp_path, capsys):
    import numpy as np

    _tiny_run(tmp_path / "a", _Tiny)
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    entry = m["snapshots"][0]
    path = tmp_path / "a" / entry["file"]
    with np.load(path) as z:
        arrays = dict(z)
    i = next(i for i, a in enumerate(entry["arrays"]) if a["key"] == "param/fc.weight")
    arrays[f"a{i:05d}"] = np.zeros((3, 3), dtype=np.float32)
    entry["arrays"][i]["shape"] = [3, 3]
    np.savez(path, **arrays)
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    unhashed(tmp_path / "a")  # as a run recorded before the files' SHA-256: its fields are what is checked
    code, out, err = diff(capsys, tmp_path / "a", "--judge", "cpu:float64")
    assert code == 5 and err == "" and "Traceback" not in out  # inconclusive: nothing was replayed
    assert "not replayed: step 0: its snapshot's fc.weight is not the shape of the model's" in out
    assert "not checked: fc (its snapshot's fc.weight is not the shape of the model's)" in out


def test_a_cnn_with_batchnorm_inplace_relu_and_dropout_replays_within_its_floors(tmp_path, capsys):
    from .test_watch import _train

    _train(tmp_path / "cnn", steps=2)
    code, out, _ = diff(capsys, tmp_path / "cnn", "--judge", "cpu:float64")
    assert code == 0, out
    assert "float64 judge (cpu:float64): 3 layer calls at step 0 replayed: all within their floors" in out
    assert "not replayed: step 0, relu: works in place (its input was not kept)" in out
    assert "not replayed: step 0, drop: a random layer (its draw is not recorded)" in out


@pytest.mark.parametrize("kw, why", [
    ({"snapshot_steps": ()}, "the run kept no snapshot (snapshot_steps=() or CONVCHECK_SNAPSHOT_STEPS=none"),
    ({"snapshot_steps": (10,)}, "or none of its snapshot steps was reached"),
    ({"max_bytes": 3000}, "no snapshot was kept: snapshot of step 0"),
])
def test_a_run_with_no_snapshot_says_why_it_is_not_replayed(tmp_path, capsys, kw, why):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run", **kw) as w:
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    capsys.readouterr()
    code, out, _ = diff(capsys, tmp_path / "run", "--judge", "cpu:float64")
    assert code == 5  # inconclusive (issue 43): a judge that replayed nothing never says ok
    assert "float64 judge (cpu:float64): not replayed: " in out and why in out
    assert "verdict: inconclusive: the run stays finite, but the judge replayed no layer" in out
    assert "remedy: keep a snapshot for the judge to replay" in out
