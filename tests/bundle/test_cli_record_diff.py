"""convcheck record / diff end to end: diff of two recordings gives compare's verdict and per-layer errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from convcheck.bundle.diff import diff_bundles
from convcheck.bundle.record import parse_snapshot_steps
from convcheck.bundle.reader import open_bundle
from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.report.verdict_lines import unwrapped

from conftest import CFG, record

SMALL = ["--steps", "2", "--batch-size", "4", "--envelope", "0"]


def test_diff_matches_compare(bundles):
    import convcheck

    result, fps, _ = diff_bundles(*bundles)
    ref = convcheck.compare("lenet", "cpu,cpu:bf16", **CFG)
    assert result.verdict.category == ref.verdict.category
    assert result.verdict.headline == ref.verdict.headline
    a, b = result.parity.layers, ref.parity.layers
    assert list(a["layer"]) == list(b["layer"]) and list(a["target"]) == list(b["target"])
    for col in ("propagated", "local", "floor", "over_floor"):
        x, y = a[col].to_numpy(float), b[col].to_numpy(float)
        assert np.array_equal(np.isnan(x), np.isnan(y))
        assert np.nanmax(np.abs(x - y), initial=0.0) <= 1e-12, col
    assert list(a["flagged"]) == list(b["flagged"])
    ca, cb = result.training.curves, ref.training.curves
    assert list(ca["arm"]) == list(cb["arm"])
    for col in ("loss", "dist_judge", "dist_other", "grad_norm"):
        x, y = ca[col].to_numpy(float), cb[col].to_numpy(float)
        assert np.array_equal(np.isnan(x), np.isnan(y)) and np.nanmax(np.abs(x - y), initial=0) <= 1e-12, col
    assert result.ok == ref.ok


def test_cli_record_zip_and_diff_json(tmp_path, bundles, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["record", "--model", "lenet", "--target", "cpu:bf16", "--out", "B.zip", "--zip", *SMALL]) == 0
    assert "recorded lenet on cpu:bf16" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name != "B.zip"]  # the staging folder is gone
    rc = main(["diff", str(bundles[0]), "B.zip", "--json", "--out", "R"])
    out = json.loads(capsys.readouterr().out)
    ref, _, _ = diff_bundles(bundles[0], tmp_path / "B.zip")  # the verdict itself is diagnose's business
    assert rc == (0 if ref.ok else 1)
    assert out["verdict"]["category"] == ref.verdict.category
    assert out["env_diff"] == []
    assert {"summary.json", "layers.csv", "curves.csv", "env_a.json", "env_b.json", "env_diff.json"} <= \
        {p.name for p in (tmp_path / "R").iterdir()}


def test_other_seed_is_one_line_naming_the_option(tmp_path, bundles, capsys):
    """Another --seed is another command: nothing to diagnose, a usage error naming the option."""
    from convcheck.bundle.record import record_run
    from convcheck.plan.config import CompareConfig

    out = tmp_path / "S"
    out.mkdir()
    record_run("lenet", "cpu:bf16", CompareConfig(**{**CFG, "seed": 1}), out)
    rc = main(["diff", str(bundles[0]), str(out), "--no-save"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "options (seed)" in err[0], err


def test_the_same_command_on_other_data_is_a_setup_verdict(tmp_path, capsys):
    """One policy with watched runs (issue 34): two recordings of one command whose data file differs (the same
    path, other contents on the two machines) saw other batches - a finding, ``setup``, exit 1, chosen by the same
    rule (W001) - never a usage error; nothing is paired step by step and no report is written."""
    from convcheck.bundle.record import record_run
    from convcheck.plan.config import CompareConfig

    data = tmp_path / "digits.npz"
    runs = []
    for k, seed in enumerate((0, 1)):  # the "same" file, regenerated differently on the second machine
        g = np.random.default_rng(seed)
        np.savez(data, x=g.standard_normal((16, 1, 28, 28)).astype(np.float32), y=g.integers(0, 10, 16))
        out = tmp_path / f"run{k}"
        out.mkdir()
        record_run("lenet", "cpu", CompareConfig(**{**CFG, "data": f"npz:{data}"}), out)
        runs.append(out)
    rc = main(["diff", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "R")])
    text = unwrapped(capsys.readouterr().out)
    assert rc == 1, text
    assert f"verdict: setup: the runs did not see the same data: the same source (npz:{data}), other batches" in text
    assert "remedy: give both machines the same data file" in text
    assert "no report written" in text and not (tmp_path / "R").exists()
    rc = main(["diff", str(runs[0]), str(runs[1]), "--no-save", "--json"])
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert rc == 1 and v["category"] == "setup" and v["sub_cause"] == "data"


def _copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_regenerated_batches_must_hash_as_recorded(tmp_path, bundles, capsys):
    def edit(m):
        m["batch_sha256"][0] = "0" * 64
    a, b = _copy(bundles[0], tmp_path / "A", edit), _copy(bundles[1], tmp_path / "B", edit)
    rc = main(["diff", str(a), str(b), "--no-save"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "batch 0 regenerated here" in err[0], err


def test_options_that_differ_are_named(tmp_path, bundles, capsys):
    b = _copy(bundles[1], tmp_path / "B", lambda m: m["config"].update(lr=0.5))
    rc = main(["diff", str(bundles[0]), str(b), "--no-save"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "options (lr)" in err[0], err


def test_same_target_on_two_machines_is_labelled(tmp_path, bundles):
    """The same spec on both sides (cuda on two machines): cpu@A and cpu@B, with the envelope of B."""
    from convcheck.bundle.record import record_run
    from convcheck.plan.config import CompareConfig

    sides = []
    for name in ("X", "Y"):
        out = tmp_path / name
        out.mkdir()
        record_run("lenet", "cpu", CompareConfig(**{**CFG, "envelope": 1}), out)
        sides.append(out)
    result, _, _ = diff_bundles(*sides)
    assert [str(t) for t in result.config.targets] == ["cpu@A", "cpu@B"]
    assert set(result.parity.layers["target"]) == {"cpu@A", "cpu@B"}
    assert list(result.training.curves["arm"].unique()) == ["cpu@A", "cpu@B", "cpu:float64", "cpu@B~1"]
    curves = result.training.curves
    assert (curves[curves["arm"] == "cpu@A"]["dist_other"] == 0).all()  # the same run twice
    assert result.training.envelope.runs == 1 and result.verdict is not None


def test_layers_pattern_and_snapshot_steps(tmp_path):
    b = open_bundle(record(tmp_path, "cpu:bf16", "L", layers="conv*", snapshot_steps="0,2"))
    assert {e["key"] for e in b["arrays"]["forward"]} == {"conv1", "conv2"}
    assert {e["param"] for e in b["arrays"]["grads"]} == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}
    assert [e["step"] for e in b["arrays"]["snapshots"]] == [0, 2]
    assert b.snapshot(1) is None and len(b.snapshot(2)) == len(b["arrays"]["parameters"])


def test_diff_with_partial_arrays_still_works(tmp_path, bundles):
    part = record(tmp_path, "cpu:bf16", "L", layers="conv*", snapshot_steps="none")
    result, _, _ = diff_bundles(bundles[0], part)
    curves = result.training.curves
    assert curves[curves["arm"] == "cpu"]["dist_other"].isna().all()  # no snapshots on one side
    assert result.verdict is not None


def test_snapshot_steps_parsing():
    assert parse_snapshot_steps("0,10,30", 30, 10) == [0, 10, 30]
    assert parse_snapshot_steps("none", 30, 10) == []
    assert parse_snapshot_steps(None, 3, 10) == [0, 1, 2, 3]
    assert parse_snapshot_steps(None, 3, 10**9) == [3]
    for bad in ("31", "x", "-1"):
        with pytest.raises(UsageError):
            parse_snapshot_steps(bad, 30, 10)


def test_record_folder_rules(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("x")
    assert main(["record", "--target", "cpu", "--out", "full", *SMALL]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["record", "--target", "cpu", "--out", "afile", *SMALL]) == 2
    assert "not a bundle folder" in capsys.readouterr().err
    assert main(["record", "--target", "cpu", "--targets", "cpu,cuda", "--out", "x", *SMALL]) == 2
    assert "--target SPEC" in capsys.readouterr().err
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()


def test_record_force_replaces_a_bundle_only(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["record", "--target", "cpu", "--out", "R", "--snapshot-steps", "none", *SMALL]
    assert main(args) == 0
    assert main(args) == 2 and "--force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert open_bundle(tmp_path / "R")["arrays"]["snapshots"] == []


def test_a_bad_target_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["record", "--target", "cpu:nonsense", "--out", "R", *SMALL]) == 2
    assert not (tmp_path / "R").exists()


def test_judge_from_a_float64_bundle(tmp_path, bundles):
    j = record(tmp_path, "cpu:float64", "J", snapshot_steps="none")
    here, _, _ = diff_bundles(*bundles)
    recorded, _, _ = diff_bundles(*bundles, judge=str(j))
    x = recorded.parity.layers["propagated"].to_numpy(float)
    y = here.parity.layers["propagated"].to_numpy(float)
    assert np.nanmax(np.abs(x - y)) <= 1e-12
    assert recorded.verdict.category == here.verdict.category
    with pytest.raises(UsageError, match="not a float64 one"):
        diff_bundles(*bundles, judge=str(bundles[1]))


def test_compare_against_a_recorded_run(bundles, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["compare", "--against", str(bundles[1]), "--targets", "cpu", "--json", "--no-save"])
    out = json.loads(capsys.readouterr().out)
    ref, _, _ = diff_bundles(*bundles)
    assert rc == (0 if ref.ok else 1)
    assert out["verdict"]["category"] == ref.verdict.category
    assert list(tmp_path.iterdir()) == []
    assert main(["compare", "--against", str(bundles[1]), "--targets", "cpu,cuda", "--no-save"]) == 2
    assert "--targets SPEC" in capsys.readouterr().err


def test_compare_against_a_watched_run_points_to_diff(tmp_path, capsys):
    import torch
    import torch.nn as nn

    import convcheck

    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        w.step(loss)
    assert main(["compare", "--against", str(tmp_path / "run"), "--no-save"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is a watched run (convcheck.watch)" in err
    assert "`convcheck diff`" in err


NET = """
import torch.nn as nn

def net():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
"""


def test_code_a_bundle_names_runs_only_with_the_recorded_bytes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)
    common = ["--model", "net.py:net", "--input-shape", "1,4,4", "--classes", "3", *SMALL]
    assert main(["record", *common, "--target", "cpu", "--out", "A"]) == 0
    assert main(["record", *common, "--target", "cpu:bf16", "--out", "B"]) == 0
    assert main(["diff", "A", "B", "--no-save", "--json"]) in (0, 1)
    capsys.readouterr()
    (tmp_path / "net.py").write_text(NET + "\nraise SystemExit('must not run')\n")
    assert main(["diff", "A", "B", "--no-save"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the file the bundle recorded" in err[0], err
    m = json.loads((tmp_path / "A" / "manifest.json").read_text())
    m["code_sha256"] = {}
    (tmp_path / "A" / "manifest.json").write_text(json.dumps(m))
    assert main(["diff", "A", "B", "--no-save"]) == 2
    assert "did not run the same model code" in capsys.readouterr().err
    m = json.loads((tmp_path / "B" / "manifest.json").read_text())
    m["code_sha256"] = {}
    (tmp_path / "B" / "manifest.json").write_text(json.dumps(m))
    assert main(["diff", "A", "B", "--no-save"]) == 2
    assert "has no recorded SHA-256" in capsys.readouterr().err


def test_an_optimizer_step_that_makes_fp16_weights_nan_diffs_as_compare_diagnoses_it(tmp_path, bundles):
    """The 'non-finite weights' finding (Adam's eps is 0 in float16) survives the bundle."""
    import convcheck

    b = record(tmp_path, "cpu:fp16", "F")
    result, _, _ = diff_bundles(bundles[0], b)
    ref = convcheck.compare("lenet", "cpu,cpu:fp16", **CFG)
    assert ref.verdict.sub_cause == "non-finite weights", ref.verdict.headline
    assert result.verdict.headline == ref.verdict.headline


CNN16 = '''
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):  # takes 3x16x16: no size convcheck tries (28, 32, 64, 224) fits it
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def build():
    return Net()
'''


def test_compare_against_takes_the_recorded_input_shape(tmp_path, capsys, monkeypatch):
    """New-user trial 4: a run recorded with --input-shape 3,16,16 could not be compared against
    ('cannot tell the input shape ... pass --input-shape'), and a given --input-shape was dropped."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cnn.py").write_text(CNN16)
    assert main(["record", "--model", "cnn.py:build", "--input-shape", "3,16,16", "--target", "cpu",
                 "--out", "base", *SMALL]) == 0
    capsys.readouterr()
    rc = main(["compare", "--against", "base", "--targets", "cpu:bf16", "--json", "--no-save"])
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err
    assert json.loads(captured.out)["verdict"]["category"]
    assert main(["compare", "--against", "base", "--targets", "cpu:bf16", "--input-shape", "3,32,32", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "--input-shape 3x32x32: the run in base was recorded with input 3x16x16" in err


def test_compare_against_with_the_model_file_changed_is_refused_before_it_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cnn.py").write_text(CNN16)
    assert main(["record", "--model", "cnn.py:build", "--input-shape", "3,16,16", "--target", "cpu",
                 "--out", "base", *SMALL]) == 0
    (tmp_path / "cnn.py").write_text(CNN16.replace("nn.Conv2d(8, 16, 3, padding=1)", "nn.Conv2d(8, 16, 3, padding=1, bias=False)"))
    capsys.readouterr()
    assert main(["compare", "--against", "base", "--targets", "cpu:bf16", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "model cnn.py:build: its file here (SHA-256" in err and "is not the one the run in base recorded" in err
    assert "convcheck-against" not in err


def test_compare_against_a_report_folder_says_what_it_is(tmp_path, capsys):
    report = tmp_path / "report"
    assert main(["compare", "--model", "lenet", "--steps", "2", "--envelope", "0", "--batch-size", "4",
                 "--targets", "cpu,cpu:bf16", "--out", str(report)]) in (0, 1)
    capsys.readouterr()
    assert main(["compare", "--against", str(report), "--targets", "cpu", "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--against {report}: a report folder (what compare or diff wrote), not a run" in err
    assert main(["compare", "--against", str(tmp_path / "nothing"), "--targets", "cpu", "--no-save"]) == 2
    assert f"--against {tmp_path / 'nothing'}: no such folder" in capsys.readouterr().err
