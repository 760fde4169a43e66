"""[tool.convcheck] in pyproject.toml (or --config FILE.toml): a project's setup written once."""

from __future__ import annotations

import json
import textwrap

import pytest

from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.plan.project import load_project

NETS = '''
import torch, torch.nn as nn
def net():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(20)]
'''

TABLE = '''
[project]
name = "myproj"

[tool.convcheck]
model = "nets.py:net"
data = "nets.py:data"
targets = ["cpu", "cpu:bf16"]
steps = 4
batch_size = 8
optimizer = "SGD"
lr = 0.05
envelope = 0
bound-factor = 4.0
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "nets.py").write_text(NETS)
    (tmp_path / "pyproject.toml").write_text(TABLE)
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)  # found from a subfolder, paths relative to the file
    return tmp_path


def _summary(capsys, *argv):
    code = main(["compare", "--no-save", "--json", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_compare_with_no_arguments_runs_the_project(project, capsys):
    code, s, err = _summary(capsys)
    assert code in (0, 1)
    assert s["model"]["name"] == "nets.net" and s["targets"] == ["cpu", "cpu:bf16"]
    assert s["config"]["steps"] == 4 and s["config"]["optimizer"] == "sgd" and s["config"]["lr"] == 0.05
    assert s["config"]["tolerances"]["bound_factor"] == 4.0
    assert s["data"]["source"] == "factory:nets.data"
    assert any(f"options from {project / 'pyproject.toml'}" in n for n in s["notes"])
    assert err.count("\n") <= 1  # stderr keeps its one-line contract


def test_mnist_with_a_folder_that_looks_like_a_name_is_not_a_factory():
    from convcheck.plan.data_sources import is_user_data

    assert not is_user_data("mnist:mnistdir") and not is_user_data("npz:data.npz")
    assert is_user_data("nets.py:data") and is_user_data("mypkg.data:make")


def test_the_command_line_overrides_the_file(project, capsys):
    code, s, _ = _summary(capsys, "--steps", "2", "--targets", "cpu,cpu:float64")
    assert s["config"]["steps"] == 2 and s["targets"] == ["cpu", "cpu:float64"]
    assert s["config"]["lr"] == 0.05  # the rest still from the file


def test_an_explicit_config_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "nets.py").write_text(NETS)
    cfg = tmp_path / "convcheck.toml"
    cfg.write_text('model = "nets.py:net"\ndata = "nets.py:data"\nsteps = 3\nenvelope = 0\nbatch-size = 8\n')
    monkeypatch.chdir("/")
    code, s, _ = _summary(capsys, "--config", str(cfg))
    assert s["config"]["steps"] == 3 and s["model"]["name"] == "nets.net"


@pytest.mark.parametrize("text, words", [
    ("[tool.convcheck]\nstepz = 3\n", "unknown key 'stepz' in [tool.convcheck] (known keys: targets"),
    ("[tool.convcheck]\nsteps = \n", "is not valid TOML"),
    ("[tool.convcheck]\nsteps = 0\n", "steps must be an integer of at least 1"),
    ("[tool.convcheck]\nlr = \"fast\"\n", "lr = 'fast' is not a valid float"),
    ("[tool.convcheck]\nlr = -1.0\n", "learning rate must be a positive number"),
    ("[tool.convcheck.inner]\nsteps = 1\n", "unknown key 'inner'"),
])
def test_a_bad_project_table_is_one_line_exit_2(tmp_path, monkeypatch, capsys, text, words):
    (tmp_path / "pyproject.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    code = main(["compare", "--no-save"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.strip().count("\n") <= 1, err


def test_no_table_means_no_project(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert load_project(start=tmp_path) == ({}, None)


def test_a_missing_config_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_project(tmp_path / "nope.toml")


def test_the_pytest_plugin_reads_the_project(pytester):
    pytester.makepyfile(nets=NETS)
    pytester.makefile(".toml", pyproject=textwrap.dedent(TABLE))
    pytester.makepyfile(test_user='''
def test_uses_the_project(convcheck_compare):
    from nets import net
    result = convcheck_compare(net, data=None, input_shape=(1, 4, 4), num_classes=3)
    assert [str(t) for t in result.targets] == ["cpu", "cpu:bf16"]
    assert result.config.steps == 2 and result.config.lr == 0.05   # --convcheck-steps=2 overrides the file
''')
    result = pytester.runpytest("--convcheck-steps=2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
