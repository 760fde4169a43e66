"""Issue 26: the README and its docs/ pages stay true: the command-line synopsis (docs/cli.md) names every
command and option the parsers have, and (slow) every output block of README.md and docs/*.md is what the runs
print now (scripts/readme_output.py --check)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from convcheck.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "cli.md").read_text()  # the command-line reference, linked from README.md


def _synopsis() -> str:
    return REFERENCE.split("```text", 1)[1].split("```", 1)[0]


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["compare", "record", "diff", "env", "models", "targets"])
def test_the_synopsis_names_every_command_and_option(command):
    synopsis = _synopsis()
    lines = [line for line in synopsis.splitlines() if line.startswith(f"convcheck {command}")]
    assert lines, f"'convcheck {command}' missing from docs/cli.md's synopsis"
    p = _subcommands()[command]
    for action in p._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings or "-h" in action.option_strings:
            continue
        if command == "record" and action.dest not in ("target", "out", "zip", "force", "layers",
                                                       "snapshot_steps", "config", "debug"):
            continue  # compare's options, named as such in the synopsis
        for flag in action.option_strings:
            assert re.search(rf"{re.escape(flag)}(?![\w-])", synopsis), f"{command} {flag} not in the synopsis"


def test_compare_against_and_env_force_are_in_the_synopsis():
    synopsis = _synopsis()
    assert "convcheck compare --against RUN --targets SPEC" in synopsis
    assert "--save FILE [--force]" in synopsis


def test_record_help_does_not_offer_what_record_refuses(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["record", "--help"])
    assert "--targets" not in capsys.readouterr().out


def test_models_columns_are_aligned(capsys):
    from convcheck.cli.main import main

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # every description starts in the same column, and so does every shape
    starts = {len(re.match(r"^\S+\s+\S+\s+\d+ \w+\s+", line).group(0)) for line in lines}
    shapes = {len(re.match(r"^\S+\s+", line).group(0)) for line in lines}
    assert len(starts) == 1 and len(shapes) == 1, lines


@pytest.mark.slow
def test_the_readme_output_blocks_are_what_the_runs_print():
    done = subprocess.run([sys.executable, "scripts/readme_output.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_output_checker_compares_numbers_to_a_stated_precision():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from readme_output import same
    finally:
        sys.path.pop(0)
    assert same("loss 2.2971 -> 0.13417", "loss 2.2972 -> 0.13418")
    assert not same("loss 2.2971 -> 0.13417", "loss 2.2971 -> 0.2")  # a number that moved
    assert not same("Verdict: ok - both targets", "Verdict: layer - both targets")
    # the envelope's figures are the CPU kernels' (AVX2 against AVX-512): their words are compared, not their values
    assert same("    6    2.1851        2.1851      2.1851..2.186    3.66e-07          3.66e-07   0.007647",
                "    6    2.1851        2.1851     2.1851..2.1851    3.50e-07          3.50e-07   1.01e-06")
    assert same("drift stays within 6.05e-05x the spread of cpu's one-ulp envelope (rounding noise)",
                "drift stays within 0.404x the spread of cpu's one-ulp envelope (rounding noise)")
    assert not same("drift stays within 6.05e-05x the spread of cpu's one-ulp envelope (rounding noise)",
                    "drift stays within 40.4x the spread of cpu's one-ulp envelope (above 4x at times)")
    assert not same("envelope 2.1851..2.186 spread 0.002572\nloss 2.2971 -> 0.13417",
                    "envelope 2.1851..2.1851 spread 7.86e-07\nloss 2.2971 -> 0.2")
