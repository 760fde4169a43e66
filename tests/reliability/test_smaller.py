"""The smaller items of issue 27: what reaches the terminal is one clean line, and paths convcheck may not
write are the user's to change (exit 2), not a bug in convcheck."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.reliability.conftest import TINY, assert_one_error_line, run_cli

EXITS = Path(__file__).parent / "user" / "exits.py"


def test_ansi_escapes_of_a_user_exception_do_not_reach_the_terminal(capsys):
    code, _, err = run_cli(capsys, ["compare", "--model", f"{EXITS}:good", "--loss", f"{EXITS}:loss_coloured_error",
                                    *TINY, "--no-save"])
    line = assert_one_error_line(code, 2, err, "shape mismatch in my loss")
    assert "\x1b" not in err and "\x07" not in err, repr(err)


def test_an_out_path_with_a_newline_is_named_whole(capsys, tmp_path):
    (tmp_path / "a\nb").write_text("a file, not a folder")
    code, _, err = run_cli(capsys, ["compare", "--model", f"{EXITS}:good", *TINY, "--out", str(tmp_path / "a\nb")])
    line = assert_one_error_line(code, 2, err, "a\\nb")
    assert "is not a directory" in line


def test_record_on_a_read_only_mount_is_exit_2_naming_the_path(capsys, tmp_path, monkeypatch):
    """EROFS cannot be made without mounting (and root ignores permissions): the folder's mkdir fails as
    a read-only mount makes it fail."""
    def read_only(self, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    code, _, err = run_cli(capsys, ["record", "--model", f"{EXITS}:good", "--input-shape", "1,4,4", "--classes", "3",
                                    "--target", "cpu", "--steps", "1", "--batch-size", "2", "--envelope", "0",
                                    "--out", str(tmp_path / "mnt" / "run")])
    line = assert_one_error_line(code, 2, err, "cannot write")
    assert "Read-only file system" in line and "mnt/run" in line


TEN = Path(__file__).parent / "user" / "ten_classes.py"


@pytest.mark.parametrize("shape", [[], ["--input-shape", "1,28,28"]], ids=["inferred-shape", "given-shape"])
def test_classes_1_on_a_10_output_model_says_so(capsys, tmp_path, shape):
    """Once 'cannot tell the input size ... accepts none of 1x28x28, ...' (shape inferred) or 'rejects input
    shape 1x28x28' (shape given): the shape was never the problem."""
    code, _, err = run_cli(capsys, ["compare", "--model", f"{TEN}:net", *shape, "--classes", "1", "--steps", "1",
                                    "--batch-size", "2", "--envelope", "0", "--targets", "cpu,cpu:bf16",
                                    "--out", str(tmp_path / "run")])
    line = assert_one_error_line(code, 2, err, "outputs 10 classes but --classes says 1")
    assert "pass --classes 10" in line and "input" not in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["pyproject", "config"])
def test_one_option_written_twice_in_a_config_is_refused_naming_both_keys_and_the_file(capsys, tmp_path, where):
    """batch-size = 4 and batch_size = 64 in one table: once the last one won, silently."""
    table = '[tool.convcheck]\nmodel = "lenet"\nbatch-size = 4\nbatch_size = 64\n'
    file = tmp_path / ("pyproject.toml" if where == "pyproject" else "cc.toml")
    file.write_text(table)
    argv = ["compare", "--steps", "1", "--envelope", "0", "--targets", "cpu,cpu:bf16", "--out", str(tmp_path / "r")]
    if where == "config":
        argv += ["--config", str(file)]
    code, _, err = run_cli(capsys, argv)
    line = assert_one_error_line(code, 2, err, "'batch-size' and 'batch_size'")
    assert str(file) in line and "twice" in line, line
    assert not (tmp_path / "r").exists()


def test_classes_1_under_cross_entropy_is_refused_not_an_ok_that_means_nothing(capsys, tmp_path):
    """Cross-entropy over one class is 0 for every input: every arm 'agrees' at loss 0 and the run used to
    end `ok`. A user's own --loss with one output stays allowed."""
    code, _, err = run_cli(capsys, ["compare", "--model", "lenet", "--classes", "1", "--steps", "3",
                                    "--envelope", "0", "--out", str(tmp_path / "run")])
    line = assert_one_error_line(code, 2, err, "cross-entropy over a single class is 0")
    assert "--classes 2" in line
    assert not (tmp_path / "run").exists()
