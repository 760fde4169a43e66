"""The watch's quick start (README.md) runs as written: ``examples/watch_quickstart.py`` twice, in float32 and under
bfloat16 autocast, then ``convcheck diff`` of the two runs - the README's own three commands, from the
repository's root, each a new process as a user runs them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    """The commands of the README's watch quick start: the ``$ `` lines of the first block under '## Quick start:
    the watch' (a session block, whose output the slow README check compares)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start: the watch"):]
    block = section[section.index("```") + 3:]
    return [line[2:] for line in block[:block.index("```")].splitlines() if line.startswith("$ ")]


@pytest.mark.slow  # three processes, ~8 s: the slow pass
def test_the_watch_quick_start_runs_as_written(tmp_path):
    commands = _quick_start()
    assert [c.split()[:3] for c in commands] == [["python", "-m", "examples.watch_quickstart"]] * 2 + [
        ["convcheck", "diff", "runs/fp32"]], commands
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "CONVCHECK_NO_PROGRESS": "1",
           "PYTHONPATH": str(ROOT)}
    outputs = []
    for command in commands:
        argv = [a.replace("runs/", f"{tmp_path}/runs/") for a in shlex.split(command)]
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [sys.executable, "-m", "convcheck", *argv[1:]]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    assert re.search(r"final loss \d", outputs[0]) and "bf16" in outputs[1]
    diff = outputs[2]
    assert "verdict: ok" in diff and "precision: autocast: off | bfloat16" in diff, diff
    assert "float64 judge (cpu:float64) on B" in diff  # the replay imported the example's model
    assert all(len(line) <= 100 for line in diff.splitlines()), diff
