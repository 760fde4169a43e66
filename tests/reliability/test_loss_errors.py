"""A user's loss that raises: one line naming the loss, its file and line, and the stage or step (issue 26)."""

from __future__ import annotations

import re
from pathlib import Path

from convcheck.cli.main import main

LOSS = Path(__file__).parent / "user" / "late_loss.py"


def _run(capsys, fn: str, steps: int) -> tuple[int, str]:
    code = main(["compare", "--model", "lenet", "--loss", f"{LOSS}:{fn}", "--steps", str(steps), "--envelope", "0",
                 "--threads", "1",  # no thread-choice probe: its bare steps call the loss a varying number of times
                 "--batch-size", "4", "--no-save"])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_loss_failing_mid_training_names_its_line_and_the_step(capsys):
    code, line = _run(capsys, "loss", 6)
    assert code == 2
    assert line.startswith("convcheck: error: loss 'late_loss.loss' raised ValueError: label smoothing table is empty")
    assert re.search(r"in loss \(\S*late_loss\.py:11\) during training step \d+", line), line


def test_a_loss_failing_at_once_names_its_line(capsys):
    code, line = _run(capsys, "always", 2)
    assert code == 2
    assert "loss 'late_loss.always' raised KeyError: 'class_weights' in always (" in line and "late_loss.py:16)" in line
    assert "Traceback" not in line
