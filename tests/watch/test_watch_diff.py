"""``convcheck diff`` on two watched runs: where they part, different data, env, and hostile bundles."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from convcheck.cli.main import main

from .loops import attention_run, offset_run, unhashed


def diff(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("watched")
    offset_run(tmp / "fp32")
    offset_run(tmp / "fp32_again")
    offset_run(tmp / "bf16", bf16=True)
    offset_run(tmp / "shuffled", shuffle=True)
    return tmp


def test_two_identical_runs_agree(runs, capsys):
    code, out, _ = diff(capsys, runs / "fp32", runs / "fp32_again")
    assert code == 0
    assert "verdict: ok: the two watched runs agree within rounding" in out
    assert "data: the same batches at every aligned step" in out


def test_fp32_against_bf16_names_where_they_part(runs, capsys):
    code, out, _ = diff(capsys, runs / "fp32", runs / "bf16")
    assert code == 1
    assert "verdict: numerics: the runs part at step 0 in fc2: they compute at different precisions" in out
    assert "its input (made by the own code that runs before it) differs by" in out
    assert "A's layers output float32, B's bfloat16" in out


def test_a_shuffled_loader_is_named_as_different_data(runs, capsys):
    code, out, _ = diff(capsys, runs / "fp32", runs / "shuffled")
    assert code == 1
    assert "verdict: setup: the runs did not see the same data: different data from step 0" in out
    assert "seeded generator" in out
    # where they part: the first layer's input is the batch itself, not something own code made
    assert "its input (the batch: the runs were given different data) differs by" in out
    assert "made by the own code" not in out


def test_a_planted_fp16_overflow_is_named_with_its_module_and_step(tmp_path, capsys):
    attention_run(tmp_path / "fp32", half=False)
    attention_run(tmp_path / "fp16", half=True)
    code, out, _ = diff(capsys, tmp_path / "fp32", tmp_path / "fp16", "--json")
    assert code == 1
    v = json.loads(out)["verdict"]
    assert v["category"] == "numerics" and v["layer"] == "att" and v["target"] == "B"
    # A's own loss explodes too (the inputs grow 4x a step): said in the pair's verdict, never "A stays finite"
    assert v["headline"].startswith("B turns non-finite at step 4 in att (own code: matmul, forward); A stays "
                                    "finite, but its own loss explodes too (")
    assert "A on its own: the loss explodes" in "\n".join(v["evidence"])
    assert any(r.startswith("lower the learning rate") for r in v["remedies"])
    assert "exploding gradients / learning rate too high" in [s["label"] for s in json.loads(out)["own_findings"][0]]


def test_json_and_out_folder_never_overwrite(runs, tmp_path, capsys):
    args = ["diff", str(runs / "fp32"), str(runs / "fp32_again"), "--out", str(tmp_path / "rep")]
    assert main(args) == 0
    saved = json.loads((tmp_path / "rep" / "watch_diff.json").read_text())
    assert saved["verdict"]["category"] == "ok"
    capsys.readouterr()
    assert main(args) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0


def _copy(runs, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(runs / "fp32", dst)
    return dst


def _one_line_refusal(capsys, a, b, match):
    code, out, err = diff(capsys, a, b)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert match in err
    return err


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(complete=False), "is incomplete"),
    (lambda m: m.update(steps="4"), "manifest.steps is str, expected an integer"),
    (lambda m: m.update(steps=3), "steps.jsonl holds 4 steps, the manifest says 3"),
    (lambda m: m["model"].update(parameters=[{"name": 1}]), "model.parameters[0].name is int"),
    (lambda m: m.update(first_nonfinite={"layer": "x", "step": 0, "direction": "up", "kind": "module"}),
     "first_nonfinite.direction"),
    (lambda m: m["snapshots"][0].update(file="../../etc/passwd"), "is not a plain relative path"),
    (lambda m: m.update(fingerprint={"torch": 5}), "fingerprint"),
])
def test_tampered_manifests_give_one_line_errors(runs, tmp_path, capsys, edit, match):
    run = _copy(runs, tmp_path)
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))
    _one_line_refusal(capsys, runs / "fp32", run, match)


@pytest.mark.parametrize("edit, match", [
    (lambda lines: lines[:1] + lines[2:] + lines[1:2], "is step 2, expected step 1"),
    (lambda lines: [lines[0].replace('"loss": ', '"loss": "x", "l": ')] + lines[1:], ".loss is str"),
    (lambda lines: ["{not json"] + lines[1:], "steps.jsonl line 1 is not JSON"),
    (lambda lines: [lines[0].replace('"dtype": "float32"', '"dtype": "int8"')] + lines[1:], "not a floating dtype"),
])
def test_tampered_steps_give_one_line_errors(runs, tmp_path, capsys, edit, match):
    run = _copy(runs, tmp_path)
    lines = (run / "steps.jsonl").read_text().splitlines()
    (run / "steps.jsonl").write_text("\n".join(edit(lines)) + "\n")
    _one_line_refusal(capsys, runs / "fp32", run, "steps.jsonl is not the file the watch wrote (its SHA-256 differs")
    unhashed(run)  # a run recorded before the hashes: each field is still checked
    _one_line_refusal(capsys, runs / "fp32", run, match)


def test_a_symlinked_member_and_a_tampered_snapshot_are_refused(runs, tmp_path, capsys):
    run = _copy(runs, tmp_path)
    (run / "steps.jsonl").unlink()
    (run / "steps.jsonl").symlink_to(runs / "fp32" / "steps.jsonl")
    _one_line_refusal(capsys, runs / "fp32", run, "symbolic link")
    from convcheck.errors import UsageError
    from convcheck.runformat.reader import open_watched

    run = _copy(runs, tmp_path, "snap")
    m = json.loads((run / "manifest.json").read_text())
    m["snapshots"][0]["arrays"][0]["shape"] = [99]
    (run / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UsageError, match="the index says"):
        open_watched(run).snapshot(0)
    # a snapshot's bytes changed after the run (its values edited, the file rewritten): refused by its SHA-256,
    # never diagnosed (issue 35)
    import numpy as np

    run = _copy(runs, tmp_path, "values")
    snap = run / json.loads((run / "manifest.json").read_text())["snapshots"][0]["file"]
    with np.load(snap) as z:
        arrays = {k: z[k] * 2 for k in z.files}
    np.savez(snap, **arrays)
    with pytest.raises(UsageError, match="is not the file the watch wrote \\(its SHA-256 differs"):
        open_watched(run).snapshot(0)
    _one_line_refusal(capsys, runs / "fp32", run, "is not the file the watch wrote")


def test_a_zipped_run_reads_and_a_mixed_pair_is_refused(runs, tmp_path, capsys):
    z = tmp_path / "run.zip"
    with zipfile.ZipFile(z, "w") as f:
        for p in sorted((runs / "fp32").rglob("*")):
            if p.is_file():
                f.write(p, p.relative_to(runs / "fp32").as_posix())
    code, out, _ = diff(capsys, runs / "fp32_again", z)
    assert code == 0 and "verdict: ok" in out
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "manifest.json").write_text(json.dumps({"schema": "convcheck.bundle/1"}))
    _one_line_refusal(capsys, runs / "fp32", tmp_path / "rec", "one run is watched")


def test_the_example_script_run_twice_and_diffed(tmp_path, monkeypatch, capsys):
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "watch_loop.py"))
    for precision in ("fp32", "fp16"):
        monkeypatch.setenv("CONVCHECK_PRECISION", precision)
        example["main"](str(tmp_path / precision))
    code, out, _ = diff(capsys, tmp_path / "fp32", tmp_path / "fp16")
    assert code == 1 and "first non-finite in B: att (own code: matmul, forward) at step 4" in out
