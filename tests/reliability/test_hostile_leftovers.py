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


def test_a_loss_that_is_0_at_every_step_trains_nothing_and_says_so(tmp_path, capsys):
    """It was `ok`: `(out * 0).sum()` gives 0 and zero gradients at every step, and nothing trained."""
    (tmp_path / "losses.py").write_text("def zero(out, target):\n    return (out * 0).sum()\n")
    code, err = _run(capsys, "--model", "lenet", "--loss", f"{tmp_path / 'losses.py'}:zero")
    assert code == 2
    assert err.endswith("is 0 at every step on every target: it does not depend on the model's output, so nothing "
                        "trains; check the loss function")


def test_data_whose_values_square_to_inf_in_float32_is_refused(tmp_path, capsys):
    """Values of 1e30 passed silently (every arm's loss ~1e28, `ok`)."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "huge.npz", x=(rng.standard_normal((64, 1, 28, 28)) * 1e30).astype("float32"),
             y=rng.integers(0, 10, 64))
    code, err = _run(capsys, "--model", "lenet", "--data", f"npz:{tmp_path / 'huge.npz'}")
    assert code == 2 and "its inputs reach 4.49e+30, past 1.84e+19 (the square root of float32's largest)" in err


def test_ordinary_raw_pixels_are_not_refused(tmp_path, capsys):
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "raw.npz", x=rng.integers(0, 256, (64, 1, 28, 28)).astype("float32"),
             y=rng.integers(0, 10, 64))
    code, err = _run(capsys, "--model", "lenet", "--data", f"npz:{tmp_path / 'raw.npz'}")
    assert code in (0, 1) and "reach" not in err
