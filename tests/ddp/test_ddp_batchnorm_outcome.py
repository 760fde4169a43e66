"""Per-rank BatchNorm judged by its outcome (issue 36): plain BatchNorm under DDP is the standard recipe
(torchvision's references; ResNet-50 with plain DDP). `compare --model cifar_cnn --targets cpu,ddp:cpu:2` at
16 samples a rank converges alike and was `setup`; it is `ok` with a note naming the per-rank statistics. At
2 samples a rank the statistics change training: still `setup`, with SyncBatchNorm as the remedy."""

from __future__ import annotations

import pytest

from convcheck.cli.main import main

pytestmark = pytest.mark.slow  # two data-parallel compares, ~20 s each on 2 cores


def test_plain_batchnorm_at_16_a_rank_that_converges_alike_is_ok_with_its_note(capsys):
    code = main(["compare", "--model", "cifar_cnn", "--targets", "cpu,ddp:cpu:2", "--no-save"])
    out = capsys.readouterr().out
    verdict = out[out.index("Verdict:"):]
    assert code == 0 and verdict.startswith("Verdict: ok")
    assert "note (ddp:cpu:2):" in verdict and "normalise each of the 2 ranks' slice with its own batch statistics" \
        in verdict and "it does not change the outcome" in verdict
    assert "ends at" in verdict  # how far it moves the result, in numbers


def test_plain_batchnorm_at_2_a_rank_is_still_setup(capsys):
    code = main(["compare", "--model", "cifar_cnn", "--targets", "cpu,ddp:cpu:2", "--batch-size", "4", "--no-save"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Verdict: setup - data-parallel setup" in out and "SyncBatchNorm.convert_sync_batchnorm" in out
