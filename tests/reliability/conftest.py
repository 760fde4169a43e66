"""Helpers for the reliability corpus: run the CLI in this process, snapshot a folder tree."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from convcheck.cli.main import main

HERE = Path(__file__).parent
BAD_MODELS = HERE / "bad_models.py"
DATA = HERE.parent / "data" / "env"
# the smallest run that still goes through every stage
TINY = ["--input-shape", "1,4,4", "--classes", "3", "--steps", "1", "--batch-size", "2", "--envelope", "0",
        "--targets", "cpu,cpu:bf16", "--judge", "cpu:float64"]


def bad(name: str) -> str:
    return f"{BAD_MODELS}:{name}"


@dataclass
class Case:
    """One bad input: the argv (built in the test's folder), the exit code, a text the one error line holds,
    and what to put in the folder first (those paths must be left exactly as they were)."""

    id: str
    argv: Callable[[Path], list[str]]
    code: int
    text: str
    setup: Callable[[Path], None] | None = None
    new_files: tuple[str, ...] = ()  # paths (globs) the run may add; everything else stays as it was
    patch: Callable | None = None  # (monkeypatch) -> None, for faults that cannot be made from outside
    extra: dict = field(default_factory=dict)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVCHECK_NO_PROGRESS", "1")
    monkeypatch.setenv("NO_COLOR", "1")


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (not following links): its kind, and its content or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(root))] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            else:
                out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode),)
    return out


def assert_one_error_line(code: int, expected_code: int, err: str, text: str) -> str:
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(("convcheck: error: ", "convcheck compare: error: ", "convcheck env: error: ")), err
    assert text in lines[0], err
    return lines[0]
