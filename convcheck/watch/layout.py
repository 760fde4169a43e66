"""A watched run's files (``convcheck.watch/1``, beside ``convcheck.bundle/1``: ``bundle/schema.py``)::

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

from convcheck.bundle.schema import MANIFEST, WATCH_SCHEMA
from convcheck.errors import UsageError
from convcheck.files import path_kind

STEPS = "steps.jsonl"
SNAPSHOTS = "snapshots"
MEMBERS = (MANIFEST, STEPS, SNAPSHOTS)
DEFAULT_MAX_BYTES = 2 * 1024**3
MAX_STEPS_BYTES = 4 * 1024**3  # what a reader accepts of steps.jsonl
MAX_LINE_BYTES = 16 * 1024**2  # one step's record

ENV_SNAPSHOT_STEPS = "CONVCHECK_SNAPSHOT_STEPS"
ENV_MAX_BYTES = "CONVCHECK_WATCH_MAX_BYTES"
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}

__all__ = ["DEFAULT_MAX_BYTES", "ENV_MAX_BYTES", "ENV_SNAPSHOT_STEPS", "from_env", "MANIFEST", "MEMBERS", "SNAPSHOTS", "STEPS", "WATCH_SCHEMA",
           "prepare_out", "claim"]


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
                (p / f).unlink()
        elif path_kind(p) == "file":
            p.unlink()
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
        raise UsageError(f"convcheck.watch: out={out} was claimed by another watched run starting at the same "
                         "time; give each run its own folder") from None
    except OSError as exc:
        raise UsageError(f"convcheck.watch: out={out}: cannot create {STEPS} ({exc.strerror or exc})") from None


def from_env(environ=None) -> dict:
    """``snapshot_steps`` and ``max_bytes`` set without touching the script: ``CONVCHECK_SNAPSHOT_STEPS=0,10,20``
    (or ``none``: no chosen step) and ``CONVCHECK_WATCH_MAX_BYTES=500M`` (bytes; K/M/G/T, KiB/MiB/GiB/TiB).
    Only the variables that are set; a bad value is one ``UsageError`` naming the variable."""
    env = os.environ if environ is None else environ
    got: dict = {}
    raw = env.get(ENV_SNAPSHOT_STEPS)
    if raw is not None:
        text = raw.strip()
        if text.lower() in ("", "none"):
            got["snapshot_steps"] = ()
        else:
            parts = [p.strip() for p in text.split(",")]
            if not all(p.isdigit() and len(p) <= 9 for p in parts):
                raise UsageError(f"{ENV_SNAPSHOT_STEPS}={raw!r:.60} is not a comma-separated list of step numbers "
                                 "(e.g. 0,10,20), or none")
            got["snapshot_steps"] = tuple(sorted({int(p) for p in parts}))
    raw = env.get(ENV_MAX_BYTES)
    if raw is not None:
        text = raw.strip().upper().removesuffix("B")
        digits = text.rstrip("KMGTI")
        unit = text[len(digits):]
        if not (digits.isdigit() and len(digits) <= 15 and unit in _UNITS and int(digits) > 0):
            raise UsageError(f"{ENV_MAX_BYTES}={raw!r:.60} is not a positive size in bytes (e.g. 500000000, 500M, 2GiB)")
        got["max_bytes"] = int(digits) * _UNITS[unit]
    return got
