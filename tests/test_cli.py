"""convcheck.cli.main: ``convcheck compare`` and ``convcheck models`` end to end, and bad input."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convcheck.cli.main import main

FAST = ["--steps", "3", "--envelope", "0", "--batch-size", "8"]
ZOO = ("lenet", "cifar_cnn", "resnet18", "resnet34", "resnet50", "unet", "mlp_regression")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Default reports/ lands in a temporary folder; no progress bar."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVCHECK_NO_PROGRESS", "1")


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# --- a run -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """`convcheck compare --model lenet --steps 5 --envelope 0`, run once for the module."""
    import contextlib
    import io
    import os

    folder = tmp_path_factory.mktemp("textrun")
    here = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["compare", "--model", "lenet", "--steps", "5", "--envelope", "0", "--batch-size", "8"])
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue(), folder


def test_compare_prints_a_readable_report(text_run):
    code, out, err, _ = text_run
    assert code in (0, 1)
    assert "lenet" in out
    # the targets, with the judge
    assert "Targets" in out and "cpu:float64" in out and "float32" in out
    # the per-layer table and the first flagged layer
    assert "One-step parity" in out
    assert "conv1" in out or "fc1" in out or "relu1" in out
    assert "First flagged layer" in out and "cpu: none" in out
    # loss curves side by side, one row per step
    assert "Loss per step" in out
    steps = [int(m.group(1)) for m in re.finditer(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)", out, re.M)]
    assert steps == [0, 1, 2, 3, 4]
    assert "converge" in out
    assert "Traceback" not in out + err
    if "Verdict:" in out:
        assert (code == 0) == ("Verdict: ok" in out)
    if torch.cuda.is_available() is False:
        assert "no GPU" in out  # the note on the default targets


def test_compare_writes_reports_by_default(text_run):
    _, _, err, folder = text_run
    runs = list((folder / "reports").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-lenet")
    assert {p.name for p in runs[0].iterdir()} >= {"summary.json", "layers.csv", "curves.csv"}
    assert "wrote reports/" in err


def test_json_on_stdout(capsys):
    code, out, err = _run(capsys, "compare", "--model", "lenet", "--targets", "cpu,cpu:emulate-tf32",
                          "--json", "--no-save", *FAST)
    assert code in (0, 1)
    s = json.loads(out)  # stdout is the JSON and nothing else
    assert s["schema"] == "convcheck.summary/2"
    assert s["model"]["name"] == "lenet"
    assert s["targets"] == ["cpu", "cpu:emulate-tf32"]
    assert s["judge"] == "cpu:float64"
    assert s["seed"] == 0
    assert isinstance(s["parity"]["layers"], list) and s["parity"]["layers"]
    assert s["parity"]["first_flagged_layer"] == {"cpu": None, "cpu:emulate-tf32": None}
    for t in ("cpu", "cpu:emulate-tf32", "cpu:float64"):
        assert isinstance(s["training"]["per_target"][t]["converged"], bool)
        assert s["training"]["per_target"][t]["first_nonfinite_step"] is None
    assert s["config"]["steps"] == 3 and s["config"]["batch_size"] == 8
    assert not Path("reports").exists()  # --no-save


def test_out_dir_files(capsys, tmp_path):
    out_dir = tmp_path / "run1"
    code, out, err = _run(capsys, "compare", "--model", "lenet", "--targets", "cpu,cpu:float64",
                          "--out", str(out_dir), "--seed", "3", *FAST)
    assert code in (0, 1)
    names = sorted(p.name for p in out_dir.iterdir())
    assert {"curves.csv", "env.json", "layers.csv", "summary.json"} <= set(names)
    assert not [n for n in names if n.startswith(".") or n.endswith(".tmp")]  # no stray temp files
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["schema"] == "convcheck.summary/2" and summary["seed"] == 3
    assert summary["targets"] == ["cpu", "cpu:float64"]
    with open(out_dir / "layers.csv", newline="") as f:
        layers = list(csv.DictReader(f))
    assert {"target", "kind", "layer", "param", "K", "bound", "propagated", "local", "nan", "inf",
            "flagged"} <= set(layers[0])
    assert {r["target"] for r in layers} == {"cpu"}  # the judge is the reference, not a row
    assert len(layers) == len(summary["parity"]["layers"])
    with open(out_dir / "curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    assert {"arm", "role", "target", "step", "loss", "grad_norm", "dist_judge", "nonfinite_loss",
            "nonfinite_grad", "loss_scale", "skipped"} <= set(curves[0])
    assert len(curves) == 3 * 2  # cpu and the judge
    assert {r["arm"] for r in curves} == {"cpu", "cpu:float64"}
    assert [int(r["step"]) for r in curves if r["arm"] == "cpu"] == [0, 1, 2]
    assert str(out_dir) in err
    json.loads((out_dir / "env.json").read_text())
    assert not Path("reports").exists()


def test_out_dir_that_is_a_file_is_refused_before_the_run(capsys, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    code, out, err = _run(capsys, "compare", "--out", str(f), *FAST)
    assert code == 2
    assert "not a directory" in err and "Traceback" not in err


def test_models_lists_the_zoo(capsys):
    code, out, err = _run(capsys, "models")
    assert code == 0
    listed = [line.split()[0] for line in out.strip().splitlines()]
    assert listed == sorted(ZOO)
    assert "1x28x28" in out and "3x224x224" in out and "1000" in out


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, err = _run(capsys)
    assert code == 2
    assert out == "" and "compare" in err and "models" in err  # a usage error: its help goes to stderr


# --- bad input: exit 2, one line on stderr, no traceback ------------------------------------------

def _bad_file(tmp_path):
    (tmp_path / "broken_model.py").write_text(
        "def factory():\n    raise RuntimeError('weights file is missing')\n")
    return f"{tmp_path / 'broken_model.py'}:factory"


def _linear_file(tmp_path):
    (tmp_path / "linear_model.py").write_text(
        "import torch.nn as nn\n\n"
        "def factory():\n    return nn.Sequential(nn.Flatten(), nn.Linear(25, 3))\n")
    return f"{tmp_path / 'linear_model.py'}:factory"


BAD = [
    ("unknown model", lambda p: ["--model", "lenet6"], ["lenet6", *ZOO]),
    ("malformed target", lambda p: ["--targets", "cpu,cpu:fp8"], ["'fp8'", "unknown mode"]),
    ("bad device", lambda p: ["--targets", "gpu,cpu"], ["'gpu'", "unknown device"]),
    ("one target", lambda p: ["--targets", "cpu"], ["exactly two"]),
    ("missing mnist dir", lambda p: ["--data", f"mnist:{p / 'nope'}"], ["nope"]),
    ("missing npz file", lambda p: ["--data", f"npz:{p / 'nope.npz'}"], ["nope.npz"]),
    ("unknown data source", lambda p: ["--data", "imagenet:/data"], ["imagenet"]),
    ("short input shape", lambda p: ["--input-shape", "1,28"], ["'1,28'", "C,H,W"]),
    ("non-numeric input shape", lambda p: ["--input-shape", "a,b,c"], ["'a,b,c'"]),
    ("factory raises", lambda p: ["--model", _bad_file(p)], ["weights file is missing"]),
    ("missing model file", lambda p: ["--model", f"{p / 'nope.py'}:factory"], ["nope.py", "not found"]),
    ("zoo model rejects shape", lambda p: ["--model", "lenet", "--input-shape", "3,32,32"],
     ["rejects input shape 3x32x32"]),
    ("own model rejects shape", lambda p: ["--model", _linear_file(p), "--input-shape", "1,6,6"],
     ["rejects input shape 1x6x6"]),
    ("wrong class count", lambda p: ["--model", _linear_file(p), "--input-shape", "1,5,5", "--classes", "4"],
     ["outputs 3 classes but --classes says 4", "pass --classes 3"]),
    ("zero steps", lambda p: ["--steps", "0"], ["steps"]),
    ("negative lr", lambda p: ["--lr", "-1"], ["learning rate"]),
]


@pytest.mark.parametrize("argv, expected", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, expected):
    code, out, err = _run(capsys, "compare", *FAST, "--no-save", *argv(tmp_path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("convcheck: error: ")
    for text in expected:
        assert text in lines[0]
    assert "Traceback" not in err + out
    assert out == ""
    assert not Path("reports").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_cuda_target_on_this_machine(capsys):
    code, out, err = _run(capsys, "compare", "--targets", "cpu,cuda", *FAST)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cuda" in lines[0] and "cannot run here" in lines[0]
    assert "cpu:emulate-tf32" in lines[0]  # lists what can run
    assert "Traceback" not in err
    assert not Path("reports").exists()


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--steps", "many"])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_python_dash_m_convcheck_help():
    done = subprocess.run([sys.executable, "-m", "convcheck", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "compare" in done.stdout and "models" in done.stdout
    done = subprocess.run([sys.executable, "-m", "convcheck", "compare", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    for flag in ("--model", "--targets", "--steps", "--json", "--out", "--input-shape", "--classes", "--data"):
        assert flag in done.stdout


# --- exit codes, --version, --help, --debug (issue 11) -----------------------------------------

def test_version(capsys):
    from convcheck import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"convcheck {__version__}"


def test_help_lists_the_exit_codes_and_every_target_kind(capsys):
    from convcheck.targets.runners import known_modes, runner_classes

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for code in ("0  ok", "1  a discrepancy", "2  usage or input error", "3  out of memory", "4  internal error"):
        assert code in top
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert "exit codes:" in text and "--force" in text and "--debug" in text
    for cls in runner_classes():
        for mode in cls.modes:
            for device in cls.devices:
                assert f"{device}:{mode}" in text


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--steps", "many"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and "--steps" in err


def test_debug_adds_the_traceback_and_keeps_the_exit_code(capsys, tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch.nn as nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(25, 3)\n\n"
        "    def forward(self, x):\n        if self.training:\n            raise ValueError('my bug')\n"
        "        return self.fc(x.flatten(1))\n")
    argv = ["compare", "--model", f"{tmp_path / 'm.py'}:M", "--input-shape", "1,5,5", "--classes", "3", "--no-save",
            *FAST]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "ValueError: my bug" in err and "m.py:10" in err and "M.forward" in err and "--debug" in err
    code, out, err = _run(capsys, *argv, "--debug")
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("convcheck: error:")
    code, out, err = _run(capsys, "--debug", *argv)  # before the command too
    assert code == 2 and "Traceback" in err


def test_a_reader_that_stops_early_is_not_a_crash():
    """`convcheck env --json | head -1`: the pipe closes before the output is written."""
    data = Path(__file__).parent / "data" / "env" / "h100_healthy.json"
    proc = subprocess.Popen([sys.executable, "-m", "convcheck", "env", "--from", str(data), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the process has written anything
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 3
    assert err.strip().splitlines() == ["convcheck: error: interrupted: the output was closed before it was all "
                                        "written (broken pipe)"]
