"""The one atomic file writer: a temporary file beside the target, then a rename.

A reader never sees a half-written file, and a failed write leaves no temporary
file behind. Imports nothing from convcheck, so ``convcheck.env`` and
``convcheck.report`` can both use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place.

    The file gets the mode a plain ``open(path, "w")`` would (0o666 less the
    umask), not the 0o600 of a temporary file. Errors (``OSError``) propagate.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))
