"""Issue 26: an option set in [tool.convcheck] can be switched off on the command line; an error about a
value from the file says so; ``record`` reads the file as ``compare`` does."""

from __future__ import annotations

import json

import pytest

from convcheck.cli.main import build_parser, main

NETS = '''
import torch, torch.nn as nn
def net():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(20)]
'''

TABLE = '''
[tool.convcheck]
model = "nets.py:net"
data = "nets.py:data"
targets = ["cpu", "cpu:float64"]
steps = 3
batch_size = 8
optimizer = "sgd"
momentum = 0.5
nesterov = true
clip-grad-norm = 1.0
warmup = 3
envelope = 0
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "nets.py").write_text(NETS)
    (tmp_path / "pyproject.toml").write_text(TABLE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, field, value", [
    (["--clip-grad-norm", "0"], "clip_grad_norm", None),
    (["--clip-grad-norm", "off"], "clip_grad_norm", None),
    (["--no-nesterov"], "nesterov", False),
    (["--momentum", "default"], "momentum", None),
    (["--betas", "default"], "betas", None),
    (["--eps", "none"], "eps", None),
    (["--loss", "default"], "loss", None),
    (["--no-ddp-sync-bn"], "ddp_sync_bn", False),
    (["--no-ddp-no-broadcast-buffers"], "ddp_no_broadcast_buffers", False),
])
def test_every_option_has_an_off_value(argv, field, value):
    args = build_parser().parse_args(["compare", *argv])
    assert getattr(args, field) == value


def test_the_file_is_switched_off_from_the_command_line(project, capsys):
    code = main(["compare", "--no-save", "--json", "--warmup", "0", "--clip-grad-norm", "off", "--no-nesterov"])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    config = json.loads(captured.out)["config"]
    assert config["clip_grad_norm"] is None and config["nesterov"] is False and config["warmup"] == 0
    assert config["momentum"] == 0.5  # the rest still from the file


def test_an_error_about_a_value_from_the_file_says_so(project, capsys):
    assert main(["compare", "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convcheck: error: --warmup 3 is not shorter than the run (3 steps)")
    assert "warmup = 3" in err and f"from {project / 'pyproject.toml'}" in err
    assert err.count("\n") == 0


def test_record_reads_the_project_file(project, capsys):
    out = project / "run"
    assert main(["record", "--target", "cpu", "--out", str(out)]) == 2  # the file's warmup 3 of 3 steps
    assert "warmup = 3" in capsys.readouterr().err
    assert main(["record", "--target", "cpu", "--out", str(out), "--warmup", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["steps"] == 3 and manifest["config"]["nesterov"] is True


@pytest.mark.parametrize("given, recorded, same", [
    ("nets.py:net", "nets.py:net", True),
    ("/home/u/proj/nets.py:net", "nets.py:net", True),  # [tool.convcheck] made it absolute
    ("/home/u/proj/models/nets.py:net", "./models/nets.py:net", True),
    ("/home/u/proj/nets.py:net", "nets.py:other", False),
    ("/home/u/proj/a/nets.py:net", "b/nets.py:net", False),
    ("lenet", "cifar_cnn", False),
])
def test_against_matches_a_project_model_with_the_recorded_relative_one(given, recorded, same):
    from convcheck.cli.diff import same_model

    assert same_model(given, recorded) is same


def test_compare_against_in_the_project_folder(project, capsys):
    """The bundle recorded 'nets.py:net'; [tool.convcheck] gives the same file as an absolute path."""
    out = project / "run"
    assert main(["record", "--model", "nets.py:net", "--target", "cpu", "--out", str(out), "--warmup", "0"]) == 0
    capsys.readouterr()
    code = main(["compare", "--against", str(out), "--targets", "cpu:bf16", "--no-save", "--warmup", "0"])
    err = capsys.readouterr().err
    assert code in (0, 1), err
    assert "recorded" not in err


@pytest.mark.parametrize("line, said", [("lr = -1", "lr = -1"), ('targets = "cpu,gpu"', "targets = 'cpu,gpu'")])
def test_an_lr_or_targets_from_the_file_is_named_with_it(project, capsys, line, said):
    """New-user trial 5: 'learning rate must be a positive number, got -1' did not say it came from the file."""
    table = TABLE.replace("warmup = 3\n", "").replace('targets = ["cpu", "cpu:float64"]\n', "")
    (project / "pyproject.toml").write_text(table + line + "\n")
    assert main(["compare", "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"({said} from {project / 'pyproject.toml'})" in err, err


def test_a_message_about_the_datas_label_targets_is_not_blamed_on_the_files_targets():
    from types import SimpleNamespace

    from convcheck.cli.main import from_project
    from convcheck.errors import UsageError

    args = SimpleNamespace(project_values={"targets": "cpu,cpu:bf16"}, project_file="/p/pyproject.toml")
    message = "data npz:d.npz: the target's labels span 0..9, outside 0..6 for a 7-class model"
    assert str(from_project(UsageError(message), args)) == message  # review: it got "(targets = ... from ...)"
