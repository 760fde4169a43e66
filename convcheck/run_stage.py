"""Where a run is: the stage and step it last reported, and the guard that names them when the user's code
fails.

``RunStage`` is the progress callback every stage reports to (``stages.guarded`` makes one); it remembers
the stage and step for the one-line error (``describe``) and keeps what was measured so far for a stopped
run's partial report (``keep``). ``user_failures`` turns an exception into what the Python API raises
(``exit_codes.as_convcheck_error``), naming the stage.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from convcheck.errors import UserCodeError
from convcheck.exit_codes import as_convcheck_error


class RunStage:
    """A progress callback that remembers the stage and step it last reported (for error lines
    and partial results), passing every call on to ``inner``."""

    def __init__(self, inner: Callable[[str, int, int], None] | None = None, steps: int | None = None):
        self.inner = inner
        self.steps = steps  # training reports arm-steps (steps x arms); this turns them back into steps
        self.stage = "setup"
        self.done = 0
        self.total = 0
        self.started = False  # a measuring stage (parity, train) began
        self.partial: dict = {}  # results measured so far (a stopped run keeps them: ``keep``)

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.stage, self.done, self.total = stage, done, total
        self.started = True
        if self.inner is not None:
            self.inner(stage, done, total)

    def keep(self, **results) -> None:
        """Results measured so far (``parity=``): a run stopped later keeps them in its partial report."""
        self.partial.update(results)
        if isinstance(self.inner, RunStage):
            self.inner.keep(**results)

    def describe(self) -> str:
        if self.stage == "train" and self.total:
            steps = self.steps or self.total
            arms = max(self.total // steps, 1)
            return f"training step {min(self.done // arms + 1, steps)} of {steps}"
        if self.stage == "parity":
            return "the one-step parity check" if self.done < self.total else "training step 1"
        return self.stage


@contextlib.contextmanager
def user_failures(stage: RunStage | None = None):
    """Re-raise the user's code failing as ``UserCodeError`` and the machine's limits as
    ``RunFailed`` (each chained to the original); convcheck's own bugs pass unchanged."""
    try:
        yield
    except UserCodeError as exc:
        if getattr(exc, "stage_unknown", False) and stage is not None:  # a user callable's failure: when
            raise UserCodeError(f"{exc} during {stage.describe()}") from exc
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - classified, never swallowed
        replacement = as_convcheck_error(exc, stage.describe() if stage else "")
        if replacement is None:
            raise
        raise replacement from exc
