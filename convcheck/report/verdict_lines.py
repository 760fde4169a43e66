"""A verdict in words, as every command prints it: one renderer for ``compare``'s terminal report (and so the
pytest plugin's and a bundle diff's) and ``convcheck diff`` of watched runs (a pair, one run against the judge,
DDP ranks). One line each here (summary.json and ``--json`` keep them so, for grep); what reaches a terminal is
wrapped to its width (``wrap_prose``, undone by ``unwrap_prose``): ``compare``'s report in ``report.text``, a
watched diff's lines and the ``wrote ...`` line on stderr through ``fit_prose``.

``compare`` heads its report with ``Verdict: CATEGORY - headline`` under the tables; a watched diff's lines read
``verdict: CATEGORY: headline`` after its ``name: value`` lines. The evidence and remedies follow in that order.
"""

from __future__ import annotations

import os
import textwrap

from convcheck.report.console import is_tty

PROSE_WIDTH = 100  # the prose's width when the output is not a terminal and COLUMNS is not set (issue 44)
PROSE_INDENT = 12  # a wrapped prose line's continuation, under the text after "  evidence: "

STYLES = {
    # (headline, evidence prefix, remedy prefix)
    "compare": ("Verdict: {category} - {headline}", "  evidence: ", "  remedy:   "),
    "diff": ("verdict: {category}: {headline}", "  - ", "  remedy: "),
}


def verdict_lines(v, style: str = "diff") -> list[str]:
    """``v``'s headline, evidence and remedies as lines in ``style`` (``STYLES``)."""
    head, evidence, remedy = STYLES[style]
    return ([head.format(category=v.category, headline=v.headline)] + [f"{evidence}{e}" for e in v.evidence]
            + [f"{remedy}{remedy_text(r)}" for r in v.remedies])


def remedy_text(r) -> str:
    """A verdict's remedy as its reader sees it: a catalogue ``Remedy``'s text (``diagnose/catalogue.py``)."""
    return r.text() if hasattr(r, "text") else str(r)


def prose_columns(stream, environ=None) -> int:
    """The width prose is wrapped to on ``stream``: ``COLUMNS`` when it is set (40 or more), else the
    terminal's, else ``PROSE_WIDTH`` (a pipe, a file, a test's capture)."""
    environ = os.environ if environ is None else environ
    columns = environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) >= 40:
        return int(columns)
    if is_tty(stream):
        try:
            return os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            pass
    return PROSE_WIDTH


def wrap_prose(line: str, width: int) -> list[str]:
    """``line`` broken at spaces to ``width``, the continuation lines indented ``PROSE_INDENT`` (under the text
    after ``  evidence: ``); a word longer than the width (a path, a layer name) stays whole. Joining each
    continuation line onto the one before with a space gives ``line`` back (``unwrap_prose``)."""
    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    return textwrap.wrap(line[lead:], width=width, initial_indent=" " * lead, subsequent_indent=" " * PROSE_INDENT,
                         break_long_words=False, break_on_hyphens=False, drop_whitespace=True) or [line]


def unwrap_prose(lines: list[str]) -> list[str]:
    """``wrap_prose`` undone: a line indented exactly ``PROSE_INDENT`` spaces joined onto the one before."""
    out: list[str] = []
    for line in lines:
        if out and line.startswith(" " * PROSE_INDENT) and not line.startswith(" " * (PROSE_INDENT + 1)):
            out[-1] += " " + line.lstrip(" ")
        else:
            out.append(line)
    return out


def fit_prose(lines: list[str], stream, environ=None) -> str:
    """``lines`` as one text for ``stream``: each wrapped to its width (``prose_columns``, ``wrap_prose``)."""
    width = prose_columns(stream, environ)
    return "\n".join(w for line in lines for w in wrap_prose(line, width))


def wrote_line(path, names) -> str:
    """``wrote FOLDER/a, b, c``: the files a command wrote, one line for a script to read (``FOLDER/`` then the
    names, comma-separated; ``fit_prose`` wraps it at the terminal's width)."""
    return f"wrote {path}/{', '.join(names)}"


def unwrapped(text: str) -> str:
    """A printed text with its wrapped prose joined back into whole lines (``unwrap_prose``): what a test or a
    script reading the output line by line compares against."""
    return "\n".join(unwrap_prose(text.splitlines()))
