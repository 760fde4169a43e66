"""User code that calls sys.exit(...) is the user's code failing: exit 2, one line naming where (issue 27)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.conftest import TINY, assert_one_error_line, run_cli

EXITS = Path(__file__).parent / "user" / "exits.py"


def _user(name: str) -> str:
    return f"{EXITS}:{name}"


@pytest.mark.parametrize("code", ["0", "3"])
@pytest.mark.parametrize("where, argv, names", [
    ("model factory", ["--model", _user("factory_exits")], "factory_exits"),
    ("forward", ["--model", _user("forward_exits")], "_ExitsInForward.forward"),
    ("loss", ["--model", _user("good"), "--loss", _user("loss_exits")], "loss_exits"),
    ("data factory", ["--model", _user("good"), "--data", _user("data_exits")], "data_exits"),
    ("Dataset.__getitem__", ["--model", _user("good"), "--data", _user("dataset_exits")],
     "_ExitingDataset.__getitem__"),
])
def test_sys_exit_in_user_code_is_exit_2_naming_where(capsys, monkeypatch, tmp_path, where, argv, names, code):
    monkeypatch.setenv("CC_EXIT", code)
    got, out, err = run_cli(capsys, ["compare", *argv, *TINY, "--out", str(tmp_path / "run")])
    line = assert_one_error_line(got, 2, err, f"sys.exit({code})")
    assert names in line and "exits.py:" in line, line
    assert not (tmp_path / "run").exists()  # nothing half-written, the folder it made removed


def test_sys_exit_at_a_modules_top_level(capsys, monkeypatch):
    import sys

    monkeypatch.setenv("CC_EXIT", "0")
    monkeypatch.setenv("CC_EXIT_AT", "import")
    for name in [m for m in sys.modules if m.startswith("_convcheck_user_exits")]:
        monkeypatch.delitem(sys.modules, name)
    got, _, err = run_cli(capsys, ["compare", "--model", _user("good"), *TINY, "--no-save"])
    line = assert_one_error_line(got, 2, err, "sys.exit(0)")
    assert "<module>" in line and "exits.py:" in line, line


def test_the_python_api_raises_a_user_code_error(monkeypatch):
    import convcheck
    from convcheck.errors import UserCodeError

    monkeypatch.setenv("CC_EXIT", "0")
    with pytest.raises(UserCodeError, match=r"sys.exit\(0\).*loss_exits"):
        convcheck.compare(_user("good"), targets=["cpu", "cpu:bf16"], judge="cpu:float64", steps=1,
                          batch_size=2, envelope=0, input_shape=(1, 4, 4), num_classes=3, loss=_user("loss_exits"))


def test_no_command_prints_help_on_stderr_and_exits_2(capsys):
    got, out, err = run_cli(capsys, [])
    assert got == 2 and out == "" and "usage: convcheck" in err


def test_an_empty_out_is_refused(capsys, tmp_path):
    got, _, err = run_cli(capsys, ["compare", "--model", _user("good"), *TINY, "--out", ""])
    assert_one_error_line(got, 2, err, "--out is empty")
    assert list(tmp_path.iterdir()) == []  # not the default reports/ folder either


def test_no_save_with_an_out_is_refused_before_any_work(capsys, tmp_path):
    got, _, err = run_cli(capsys, ["compare", "--model", _user("good"), *TINY, "--no-save", "--out", "zz"])
    assert_one_error_line(got, 2, err, "--no-save writes no files, --out zz writes them there")
    assert list(tmp_path.iterdir()) == []


def test_json_says_complete(capsys):
    got, out, err = run_cli(capsys, ["compare", "--model", _user("good"), *TINY, "--no-save", "--json"])
    assert got in (0, 1), err
    assert json.loads(out)["complete"] is True
