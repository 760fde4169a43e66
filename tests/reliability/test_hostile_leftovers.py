"""Issue 36's leftovers of the hostile corpus: each is one line and the right exit code, never a hang, a
traceback or a silent exit 0."""

from __future__ import annotations

import os

import pytest

from convcheck.cli.main import main

FAST = ["--steps", "2", "--envelope", "0", "--no-save"]


def _run(capsys, *args) -> tuple[int, str]:
    code = main(["compare", *args, *FAST])
    return code, capsys.readouterr().err.strip()


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_npz_data_on_a_device_is_refused_before_it_is_read(capsys):
    """It was read without limit (killed after 129 s): the input-shape sniffing opened it as a zip first."""
    code, err = _run(capsys, "--model", "lenet", "--data", "npz:/dev/zero")
    assert code == 2 and err == "convcheck: error: npz file /dev/zero is a device, not a regular file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_npz_data_on_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "data.npz"
    os.mkfifo(fifo)
    code, err = _run(capsys, "--model", "lenet", "--data", f"npz:{fifo}")
    assert code == 2 and err.endswith("is a FIFO, not a regular file")


def test_targets_of_another_kind_in_the_project_file_are_a_usage_error(tmp_path, monkeypatch, capsys):
    """It was exit 4 (TypeError in executors.before_threads, before the config was validated)."""
    (tmp_path / "pyproject.toml").write_text("[tool.convcheck]\ntargets = 5\n")
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "--model", "lenet")
    assert code == 2 and "targets must be 'A,B' or two specs, not int (targets = 5 from" in err
    assert "internal error" not in err


def test_a_model_factory_that_is_sys_exit_is_not_a_silent_success(capsys):
    """`--model sys:exit` exited 0: the factory's SystemExit was taken for argparse's."""
    code, err = _run(capsys, "--model", "sys:exit")
    assert code == 2 and "SystemExit (sys.exit(None))" in err and "internal error" not in err
