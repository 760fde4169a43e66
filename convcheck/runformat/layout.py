"""A watched run's files (``convcheck.watch/1``, beside ``convcheck.bundle/1``: ``runformat/schema.py``)::

    manifest.json              written when the watch starts (``complete: false``) and again when it ends:
                               the model's parameters and layers, the env fingerprint and math-mode flags,
                               the determinism notes, the first non-finite producer, the snapshot index
    steps.jsonl                one JSON object per optimizer step, appended as the step ends (streamed)
    snapshots/step_NNNNN.npz   every layer's inputs/outputs, the parameters and gradients of step N

A run killed mid-way leaves ``complete: false``: ``convcheck diff`` refuses it with one line.
"""

from __future__ import annotations

import os
from pathlib import Path

from convcheck.runformat.schema import MANIFEST, WATCH_SCHEMA
from convcheck.errors import UsageError
from convcheck.files import path_kind, refuse_linked_folder

STEPS = "steps.jsonl"
SNAPSHOTS = "snapshots"
MEMBERS = (MANIFEST, STEPS, SNAPSHOTS)
DEFAULT_MAX_BYTES = 2 * 1024**3
# what one snapshot step may hold, in memory and on disk (issue 48): past it, each layer keeps its first, last, worst
# and first non-finite calls and the earliest others that fit (``watch/keep.py``)
DEFAULT_SNAPSHOT_BYTES = 256 * 1024**2
MAX_STEPS_BYTES = 4 * 1024**3  # what a reader accepts of steps.jsonl
MAX_LINE_BYTES = 16 * 1024**2  # one step's record

ENV_SNAPSHOT_STEPS = "CONVCHECK_SNAPSHOT_STEPS"
ENV_MAX_BYTES = "CONVCHECK_WATCH_MAX_BYTES"
ENV_SNAPSHOT_BYTES = "CONVCHECK_SNAPSHOT_BYTES"
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_SNAPSHOT_BYTES", "ENV_MAX_BYTES", "ENV_SNAPSHOT_BYTES", "ENV_SNAPSHOT_STEPS", "from_env", "MANIFEST", "MEMBERS", "SNAPSHOTS", "STEPS", "WATCH_SCHEMA",
           "prepare_out", "claim", "release", "take", "TAKEN"]


TAKEN = ("is taken: it was claimed by another watched run starting at the same time, or one still running there; "
         "give each run its own folder")


def take(out: Path) -> int | None:
    """``out`` made if missing and locked for this watch (``flock`` on the folder, held until ``release``), before
    anything in it is removed or written: of watches started at once on one folder - ``force=True`` over an earlier
    run included - one takes it, every other is refused in one line (``TAKEN``) and touches nothing. A symlinked
    ``out`` is refused (as ``--out`` of every command: one policy, ``files.refuse_linked_folder``). None where the
    system has no ``flock`` (Windows): ``claim``'s exclusive ``steps.jsonl`` is then the only guard."""
    refuse_linked_folder(out, "convcheck.watch: out=")
    if path_kind(out) is None:
        try:
            out.mkdir(parents=True, exist_ok=True)  # two at once: both find it made
        except FileExistsError:
            pass  # something else made there in between: its kind is named below
        except OSError as exc:  # /proc/foo, a read-only disk, no permission: the user's path, one line
            raise UsageError(f"convcheck.watch: out={out}: cannot create the folder ({exc.strerror or exc})") from None
    kind = path_kind(out)
    if kind != "directory":
        raise UsageError(f"convcheck.watch: out={out} exists and is a {kind}, not a folder")
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    try:
        fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UsageError(f"convcheck.watch: out={out}: cannot open the folder ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held by another watch
        os.close(fd)
        raise UsageError(f"convcheck.watch: out={out} {TAKEN}") from None
    except OSError:  # a file system without locks (some network mounts): ``claim`` is the guard there
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    """The folder ``take`` locked let go (closing the descriptor drops the lock); None is nothing to do."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def prepare_out(out: Path, force: bool) -> Path:
    """``out`` made if missing, used if empty, or (``force``) an earlier watched run's files removed;
    anything else there is a one-line ``UsageError``. Never overwrites without ``force``."""
    kind = path_kind(out)
    if kind is None:
        try:
            out.mkdir(parents=True)
        except OSError as exc:  # /proc/foo, a read-only disk, no permission: the user's path, one line
            raise UsageError(f"convcheck.watch: out={out}: cannot create the folder ({exc.strerror or exc})") from None
    elif kind != "directory":
        raise UsageError(f"convcheck.watch: out={out} exists and is a {kind}, not a folder")
    try:
        entries = sorted(os.listdir(out))
    except OSError as exc:
        raise UsageError(f"convcheck.watch: out={out}: cannot read the folder ({exc.strerror or exc})") from None
    if entries and not force:
        ours = set(entries) <= set(MEMBERS)  # a watched run's files (a half-made one: no manifest yet)
        raise UsageError(f"convcheck.watch: out={out} is not empty"
                         + ("; pass force=True to replace the watched run there" if ours else ""))
    unknown = [e for e in entries if e not in MEMBERS]
    if unknown:
        raise UsageError(f"convcheck.watch: out={out} holds {unknown[0]!r}, which is not part of a watched run; "
                         "refusing to replace it")
    for name in entries:
        p = out / name
        if name == SNAPSHOTS and path_kind(p) == "directory":
            for f in os.listdir(p):
                if path_kind(p / f) != "file":
                    raise UsageError(f"convcheck.watch: {p / f} is not a regular file; refusing to replace it")
                (p / f).unlink(missing_ok=True)
        elif path_kind(p) == "file":
            p.unlink(missing_ok=True)
        else:
            raise UsageError(f"convcheck.watch: {p} is not a regular file; refusing to replace it")
    (out / SNAPSHOTS).mkdir(exist_ok=True)
    return out


def claim(out: Path) -> int:
    """The run folder claimed for this watch: ``steps.jsonl`` created exclusively (``O_EXCL``), its descriptor
    returned for the steps to stream into. Two watches started at once on the same empty folder both pass
    ``prepare_out``; only one creates the file, the other is refused in one line and writes nothing."""
    try:
        return os.open(out / STEPS, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        raise UsageError(f"convcheck.watch: out={out} {TAKEN}") from None
    except OSError as exc:
        raise UsageError(f"convcheck.watch: out={out}: cannot create {STEPS} ({exc.strerror or exc})") from None


def from_env(environ=None) -> dict:
    """``snapshot_steps``, ``max_bytes`` and ``snapshot_bytes`` set without touching the script: ``CONVCHECK_SNAPSHOT_STEPS=0,10,20``
    (or ``none``: no chosen step), ``CONVCHECK_WATCH_MAX_BYTES=500M`` and ``CONVCHECK_SNAPSHOT_BYTES=64M`` (bytes;
    K/M/G/T, KiB/MiB/GiB/TiB).
    Only the variables that are set; a bad value is one ``UsageError`` naming the variable."""
    env = os.environ if environ is None else environ
    got: dict = {}
    raw = env.get(ENV_SNAPSHOT_STEPS)
    if raw is not None:
        text = raw.strip()
        if text.lower() in ("", "none"):
            got["snapshot_steps"] = ()
        else:
            from convcheck.steps import whole_number

            parts = [p.strip() for p in text.split(",")]
            if len(parts) > 10_000:
                raise UsageError(f"{ENV_SNAPSHOT_STEPS} lists {len(parts)} steps; at most 10000")
            try:
                got["snapshot_steps"] = tuple(sorted({whole_number(p, ENV_SNAPSHOT_STEPS) for p in parts}))
            except UsageError:
                raise UsageError(f"{ENV_SNAPSHOT_STEPS}={raw!r:.60} is not a comma-separated list of step numbers "
                                 "(e.g. 0,10,20), or none") from None
    for var, key in ((ENV_MAX_BYTES, "max_bytes"), (ENV_SNAPSHOT_BYTES, "snapshot_bytes")):
        raw = env.get(var)
        if raw is not None:
            got[key] = _size(raw, var)
    return got


def _size(raw: str, var: str) -> int:
    """A size in bytes as the variables take it: digits and an optional K/M/G/T or KiB/MiB/GiB/TiB."""
    text = raw.strip().upper().removesuffix("B")
    digits = text.rstrip("KMGTI")
    unit = text[len(digits):]
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 15 and unit in _UNITS and int(digits) > 0):
        raise UsageError(f"{var}={raw!r:.60} is not a positive size in bytes (e.g. 500000000, 500M, 2GiB)")
    return int(digits) * _UNITS[unit]
