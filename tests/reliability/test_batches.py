"""The user's data checked at the edge: each of these once ended in exit 4 "a bug in convcheck" (or "out
of memory"); each is now exit 2 and one line naming the batch and the field, or the layer (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.conftest import assert_one_error_line, run_cli

USER = Path(__file__).parent / "user"
DATA = USER / "bad_data.py"
RUN = ["--steps", "1", "--batch-size", "2", "--envelope", "0", "--targets", "cpu,cpu:bf16", "--judge", "cpu:float64"]


def _run(capsys, tmp_path, data: str, model: str = "conv1", *extra: str):
    return run_cli(capsys, ["compare", "--model", f"{USER / 'exits.py'}:{model}", "--data", f"{DATA}:{data}",
                            *RUN, *extra, "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("data, texts, extra", [
    ("ragged_samples", ["batch 0 of data factory 'bad_data.ragged_samples' could not be made",
                        "stack expects each tensor to be equal size"], ["--batch-size", "8"]),
    ("float_labels", ["batch 0 of data factory 'bad_data.float_labels'", "the target is a float32 tensor"], []),
    ("string_labels", ["batch 0 of", "the target is a tuple of str, not a tensor of class indices"], []),
    ("two_d_labels", ["batch 0 of", "the target is a int64 tensor of shape (2, 2), not one class index"], []),
    ("sizes_differ", ["batch 0 of", "the inputs hold 4 samples but the target 3"], []),
    ("bare_tensors", ["batch 0 of", "is a bare tensor (no labels)"], []),
    ("empty_batch", ["batch 0 of", "is empty: its inputs hold 0 samples"], []),
    ("negative_length", ["data factory 'bad_data.negative_length'", "__len__() should return >= 0"], []),
    ("huge", ["1,000,000,000,000 samples", "too many to shuffle"], []),
    ("three_channels", ["your model failed on the data in layer '0' (Conv2d)", "3 channels"], []),
])
def test_bad_batches_are_exit_2_naming_the_batch_and_field(capsys, tmp_path, data, texts, extra):
    code, _, err = _run(capsys, tmp_path, data, "conv1", *extra)
    line = assert_one_error_line(code, 2, err, texts[0])
    assert all(t in line for t in texts), line
    assert "out of memory" not in line and "bug in convcheck" not in line
    assert not (tmp_path / "run").exists()


def test_a_linear_model_fed_other_samples_names_the_layer(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path, "three_channels", "good")
    line = assert_one_error_line(code, 2, err, "your model failed on the data in layer '1' (Linear)")
    assert "mat1 and mat2 shapes cannot be multiplied" in line


def test_a_dataloader_worker_that_dies_is_the_datas_failure(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path, "worker_dies", "good", "--workers", "1")
    line = assert_one_error_line(code, 2, err, "batch 0 of data factory 'bad_data.worker_dies' could not be made")
    assert "DataLoader worker" in line


def test_good_data_and_probabilities_still_run(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path, "good")
    assert code in (0, 1), err


def test_check_batch_accepts_what_cross_entropy_takes():
    import torch

    from convcheck.batch import check_batch

    x = torch.zeros(4, 1, 4, 4)
    check_batch(x, torch.tensor([0, 1, 2, -100]), "d", class_labels=True, num_classes=3)  # -100: ignored
    check_batch(x, torch.softmax(torch.randn(4, 3), 1), "d", class_labels=True, num_classes=3)  # probabilities
    check_batch(x, torch.randn(4), "d")  # a user's loss takes what it takes
    check_batch({"a": x, "b": x}, x, "d", input_shape=(1, 4, 4))
