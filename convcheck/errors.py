"""Errors meant for the user: the CLI prints their one-line message, no traceback.

Anything that is not a ``ConvcheckError`` is classified by ``convcheck.exit_codes``:
the machine's limits (exit 3), the user's own code failing (exit 2) or a bug
in convcheck (exit 4, with its traceback).
"""


class ConvcheckError(Exception):
    """A user mistake or a limit of this machine. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class UsageError(ConvcheckError):
    """Bad input: an unknown model, a malformed target spec, an unreadable file."""

    exit_code = 2


class UserCodeError(UsageError):
    """The user's model, loss or data code raised; the message names the file, line and function."""

    exit_code = 2


class TargetUnavailable(ConvcheckError):
    """A target this machine cannot run (no GPU, no MPS)."""

    exit_code = 2


class RunFailed(ConvcheckError):
    """The run itself could not complete (out of memory, disk full, interrupted)."""

    exit_code = 3


def did_you_mean(word: str, choices, cutoff: float = 0.7) -> str | None:
    """The one of ``choices`` nearest ``word`` when it is a near typo of it (``bf17`` -> ``bf16``,
    ``lenett`` -> ``lenet``; difflib's ratio at least ``cutoff``), else None: a usage error offers it
    instead of listing every choice."""
    import difflib

    found = difflib.get_close_matches(str(word).lower(), [str(c) for c in choices], n=1, cutoff=cutoff)
    return found[0] if found else None
