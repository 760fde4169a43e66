"""Progress on long runs: a rich progress bar on stderr when it is a terminal, else nothing."""

from __future__ import annotations

import contextlib
import sys

from convcheck.report.console import is_plain, show_progress


@contextlib.contextmanager
def progress_reporter(stream=None):
    """Yields ``progress(stage, done, total)`` (or None when there is no terminal to draw on)."""
    stream = stream or sys.stderr
    if not show_progress(stream):
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = Console(file=stream, no_color=is_plain(stream))
    # parity: the judge, the stochastic probe, each target and its rerun; train: arm-steps
    with Progress(TextColumn("{task.description:<8}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console,
                  transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield progress
