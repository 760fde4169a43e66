"""Repeat runs separate chance from bias (issue 36): a target run twice from the same state differs only if a
kernel is nondeterministic, and then the first layer and op that differ are named; a pair that never differs
from itself is never called `nondeterminism`."""

from __future__ import annotations

import json

import pytest

from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrap_prose

FAST = ["--steps", "6", "--envelope", "0", "--no-save", "--no-verify"]
SCATTER = ["--model", "tests/scenarios/nondeterministic_models.py:scatter_net", "--input-shape", "1,28,28"]


def test_a_kernel_that_sums_in_another_order_each_call_is_named_with_its_layer_and_op(capsys):
    code = main(["compare", *SCATTER, *FAST])
    out = "\n".join(unwrap_prose(capsys.readouterr().out.splitlines()))  # the verdict's lines whole
    assert code == 1
    assert "Verdict: nondeterminism - cpu gives different results for the same input and seed" in out
    assert ("the first bitwise difference between two runs of cpu from the same state: layer 'pool' (forward, op "
            "shuffled_index_add)") in out


def test_a_deterministic_pair_repeated_is_never_nondeterminism_and_says_why(capsys):
    code = main(["compare", "--model", "lenet", "--targets", "cpu,cpu:bf16", "--repeat", "2", *FAST, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["verdict"]["category"] == "ok"
    lines = summary["verdict"]["evidence"]
    assert any(line.startswith("cpu ran twice from the same state at the first step: bitwise identical, so the "
                               "differences between the targets are not chance") for line in lines)
    assert any(line.startswith("cpu:bf16 ran twice from the same state") for line in lines)


def test_repeat_takes_1_or_2(capsys):
    assert main(["compare", "--model", "lenet", "--repeat", "5", *FAST]) == 2
    assert "repeat must be at most 2, got 5" in capsys.readouterr().err


@pytest.mark.slow  # ~4 s: a compare and its remedy's re-run
def test_deterministic_algorithms_are_not_called_a_fix_for_a_kernel_they_do_not_reach(capsys):
    """The remedy re-run measures the difference again (it said "verified" from the loss curve alone)."""
    code = main(["compare", *SCATTER, "--steps", "6", "--envelope", "0", "--no-save"])
    out = "\n".join(unwrap_prose(capsys.readouterr().out.splitlines()))  # the verdict's lines whole
    assert code == 1
    assert ("not verified: with deterministic algorithms, cpu still differs from itself run to run: layer 'pool' "
            "(forward, op shuffled_index_add)") in out
    assert "torch's deterministic algorithms do not cover that op" in out
