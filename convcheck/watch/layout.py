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
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}

__all__ = ["DEFAULT_MAX_BYTES", "MANIFEST", "MEMBERS", "SNAPSHOTS", "STEPS", "UNIT_ROUNDOFF", "WATCH_SCHEMA",
           "prepare_out"]


def prepare_out(out: Path, force: bool) -> Path:
    """``out`` made if missing, used if empty, or (``force``) an earlier watched run's files removed;
    anything else there is a one-line ``UsageError``. Never overwrites without ``force``."""
    kind = path_kind(out)
    if kind is None:
        out.mkdir(parents=True)
    elif kind != "directory":
        raise UsageError(f"convcheck.watch: out={out} exists and is a {kind}, not a folder")
    entries = sorted(os.listdir(out))
    if entries and (MANIFEST not in entries or not force):
        raise UsageError(f"convcheck.watch: out={out} is not empty"
                         + ("; pass force=True to replace the watched run there" if MANIFEST in entries else ""))
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
