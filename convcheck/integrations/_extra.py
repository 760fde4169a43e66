"""The one place that imports an optional framework: a missing extra is a one-line ``UsageError``."""

from __future__ import annotations

import importlib

from convcheck.errors import UsageError


def require(module: str, extra: str, what: str):
    """``module`` imported, or a ``UsageError`` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"convcheck.integrations.{extra} needs {what} ({module} does not import: {exc}); "
                         f"install it with pip install 'convcheck[{extra}]'") from None


def scalar(value) -> float | None:
    """A loss the framework handed over (a tensor, a number, or None) as a float."""
    if value is None:
        return None
    try:
        return float(value.detach()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
