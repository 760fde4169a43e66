"""Stop signals on the command line: SIGTERM and SIGHUP are Ctrl-C; a report already written stays written.

- ``stop_signals()``: while a command runs, SIGTERM and SIGHUP (``timeout``, docker, Slurm and Kubernetes send
  TERM; a closed terminal sends HUP) raise ``exit_codes.Interrupted``, a ``KeyboardInterrupt``: the run stops
  as on Ctrl-C (exit 3, a partial ``summary.json`` marked ``complete: false`` once measuring began, the folders
  it created removed while empty). A signal the caller set to be ignored (``nohup``) stays ignored.
- ``held()``: while what is known is being saved (the partial summary, the report files), a further Ctrl-C,
  TERM or HUP is remembered, not raised: three Ctrl-C in a row cannot cut the save short.
- ``finished()``: once the command's outcome is decided and its files are written, stop signals are ignored
  until the process exits with that outcome's code.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from convcheck.exit_codes import Interrupted

_STOP = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)
_ALL = (signal.SIGINT, *_STOP)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals(*, restore: bool = True) -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Interrupted`` inside the block (main thread only; ignored ones stay ignored).
    ``restore=False`` leaves the process ignoring every stop signal afterwards (the command line's own run:
    nothing is left to stop, and the exit code is already decided)."""
    if not _main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in _ALL}
    for s in _STOP:
        if before[s] is not signal.SIG_IGN:
            signal.signal(s, _raise_interrupted)
    try:
        yield
    finally:
        if restore:
            for s, handler in before.items():
                with contextlib.suppress(TypeError, ValueError):
                    signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        else:
            finished()


@contextlib.contextmanager
def held() -> Iterator[list]:
    """Stop signals inside the block are recorded (the yielded list gets their names), never raised."""
    if not _main_thread():
        yield []
        return
    seen: list[str] = []
    before = {s: signal.getsignal(s) for s in _ALL}

    def remember(signum, frame):
        seen.append(signal.Signals(signum).name)

    for s in _ALL:
        if before[s] is not signal.SIG_IGN:
            signal.signal(s, remember)
    try:
        yield seen
    finally:
        for s, handler in before.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def finished() -> None:
    """From now until the process exits, stop signals are ignored: the outcome is decided and written."""
    if _main_thread():
        for s in _ALL:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(s, signal.SIG_IGN)
