"""Fingerprint files: ``load`` a saved fingerprint JSON or a collect_env text, ``save`` a JSON.

This module sits above both formats (``fingerprint`` for the JSON record,
``collect_env`` for the text parser), so neither needs to import the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from convcheck.env.collect_env import looks_like_collect_env, parse_collect_env
from convcheck.env.fingerprint import Fingerprint
from convcheck.errors import UsageError
from convcheck.files import atomic_write_text


def load(path: str | os.PathLike) -> Fingerprint:
    """A saved fingerprint JSON or a collect_env text, told apart by content."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {p}: {exc.strerror or exc}") from None
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{p}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        fp = Fingerprint.from_dict(data)
        return dataclasses.replace(fp, source=f"{fp.source} (from {p.name})")
    if looks_like_collect_env(text):
        return parse_collect_env(text, source=f"collect_env text {p.name}")
    raise UsageError(
        f"{p}: neither a convcheck fingerprint JSON nor `python -m torch.utils.collect_env` output"
    )


def save(fp: Fingerprint, path: str | os.PathLike) -> Path:
    """Write the fingerprint JSON atomically (``convcheck.files``), creating its folder."""
    p = Path(path)
    directory = p.parent if str(p.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps(fp.to_dict(), indent=2) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write {p}: {exc.strerror or exc}") from None
    return p
