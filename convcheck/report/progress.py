"""Progress on long runs: a rich progress bar on stderr when it is a terminal, else nothing."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def progress_reporter(stream=None):
    """Yields ``progress(stage, done, total)`` (or None when there is no terminal to draw on)."""
    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()) or os.environ.get("CONVCHECK_NO_PROGRESS"):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream, no_color="NO_COLOR" in os.environ)
    with Progress(TextColumn("{task.description:<8}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield progress
