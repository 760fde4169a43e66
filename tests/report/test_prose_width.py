"""The verdict's prose fits the terminal (issue 44): wrapped at spaces to COLUMNS, else the terminal's width,
else 100 columns, each continuation indented so that unwrapping gives the one-line verdict back."""

from __future__ import annotations

import dataclasses
import io

import pytest

import convcheck
from convcheck.report.text import make_console, render_compare
from convcheck.report.verdict_lines import PROSE_INDENT, unwrap_prose, wrap_prose
from convcheck.report.verdict_lines import verdict_lines


@pytest.fixture(scope="module")
def result():
    return convcheck.compare("lenet", "cpu,cpu:bf16", steps=3, envelope=0, batch_size=8, verify=False, threads=1)


def _verdict_region(monkeypatch, result, columns: str | None) -> list[str]:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    out = io.StringIO()
    render_compare(result, make_console(out))
    lines = out.getvalue().splitlines()
    return lines[next(i for i, x in enumerate(lines) if x.startswith("Verdict:")):]


@pytest.mark.parametrize("columns, width", [("100", 100), (None, 100), ("160", 160)])
def test_verdict_lines_fit_and_unwrap_to_the_verdict(monkeypatch, result, columns, width):
    region = _verdict_region(monkeypatch, result, columns)
    whole = verdict_lines(result.verdict, "compare")
    assert max(len(x) for x in whole) > 100  # there was something to wrap
    assert all(len(x) <= width or " " not in x.strip() for x in region), [x for x in region if len(x) > width]
    assert unwrap_prose(region) == whole


def test_every_line_fits_at_columns_100(monkeypatch, result):
    """Tables, header, notes and the verdict: nothing printed wider than COLUMNS=100 (a lone long word aside)."""
    monkeypatch.setenv("COLUMNS", "100")
    noted = dataclasses.replace(result, notes=[*result.notes, "a long note " + "that goes on " * 12 + "to its end"])
    out = io.StringIO()
    render_compare(noted, make_console(out))
    lines = out.getvalue().splitlines()
    assert [x for x in lines if len(x) > 100 and " " in x.strip()] == []
    assert "note: a long note that goes on" in out.getvalue()
    assert any(x.startswith("note: a long note") for x in unwrap_prose(lines)[:20])


def test_wrap_prose_keeps_long_words_whole_and_round_trips():
    line = "  evidence: " + " ".join(["word"] * 40) + " /a/very/long/path/" + "x" * 120 + " end"
    wrapped = wrap_prose(line, 60)
    assert all(len(x) <= 60 for x in wrapped if "/a/very" not in x)
    assert all(x.startswith(" " * PROSE_INDENT) and not x.startswith(" " * (PROSE_INDENT + 1)) for x in wrapped[1:])
    assert unwrap_prose(wrapped) == [line]
    assert wrap_prose("short", 60) == ["short"]
