"""``benchmarks/run.py`` rewrites the table of ``results/latest.md`` and keeps the history below it (issue 28)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _run_module():
    spec = importlib.util.spec_from_file_location("bench_run_for_test", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_history_below_the_table_is_kept_and_its_own_profile_sections_are_not(tmp_path):
    run = _run_module()
    latest = tmp_path / "latest.md"
    latest.write_text("# convcheck benchmarks: latest run\n\n| old | table |\n\n## Profile: lenet\n\nold profile\n\n"
                      "## Issue 28, stop 32\n\nnotes\n\n## Issue 14\n\nolder notes\n")
    kept = run._history(latest)
    assert kept == "\n## Issue 28, stop 32\n\nnotes\n\n## Issue 14\n\nolder notes\n"
    assert run._history(tmp_path / "missing.md") == ""
    latest.write_text("# convcheck benchmarks: latest run\n\n| only | a table |\n")
    assert run._history(latest) == ""
