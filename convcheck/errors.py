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
