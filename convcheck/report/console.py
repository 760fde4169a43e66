"""The one place that decides how to write to a terminal: colour or plain, progress bar or not.

A leaf: it imports no other ``convcheck.report`` module (and not ``rich``).
"""

from __future__ import annotations

import os


def is_tty(stream) -> bool:
    """True when ``stream`` is an interactive terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


def is_plain(stream) -> bool:
    """No colour or terminal styling: ``stream`` is not a terminal, or ``NO_COLOR`` is set."""
    return not is_tty(stream) or "NO_COLOR" in os.environ


def use_color(stream) -> bool:
    """The opposite of ``is_plain``."""
    return not is_plain(stream)


def show_progress(stream) -> bool:
    """A progress bar only on a terminal, and not when ``CONVCHECK_NO_PROGRESS`` is set (non-empty).

    ``NO_COLOR`` does not hide the bar; it only takes the colour out (``is_plain``).
    """
    return is_tty(stream) and not os.environ.get("CONVCHECK_NO_PROGRESS")
