"""Fingerprint files: ``load`` a saved fingerprint JSON or a collect_env text, ``save`` a JSON.

This module sits above both formats (``fingerprint`` for the JSON record,
``collect_env`` for the text parser), so neither needs to import the other.
Reading is bounded (``MAX_BYTES``, checked while reading, so ``/dev/zero``
ends in a one-line error) and tolerant of how people save pasted text:
UTF-8 with or without a byte-order mark, UTF-16 (PowerShell's ``>``), UTF-32.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
from pathlib import Path

from convcheck.env.collect_env import fields_read, looks_like_collect_env, parse_collect_env
from convcheck.env.fingerprint import Fingerprint
from convcheck.errors import UsageError
from convcheck.files import atomic_write_text, check_writable_file, read_limited, write_error

# A fingerprint JSON is a few KB and a collect_env text about 10 KB; nothing real comes near this.
MAX_BYTES = 4 * 1024 * 1024
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_text(data: bytes) -> str:
    """Text from bytes as saved by editors, terminals and PowerShell; undecodable bytes become U+FFFD."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data[len(bom):].decode(encoding, errors="replace")
    head = data[:400]
    if len(head) >= 4 and head.count(0) >= len(head) // 3:  # UTF-16 without a byte-order mark
        odd_zeros = head[1::2].count(0)
        even_zeros = head[0::2].count(0)
        encoding = "utf-16-le" if odd_zeros >= even_zeros else "utf-16-be"
        return data[: len(data) // 2 * 2].decode(encoding, errors="replace")
    return data.decode("utf-8", errors="replace")


def load(path: str | os.PathLike) -> Fingerprint:
    """A saved fingerprint JSON or a collect_env text, told apart by content."""
    p = Path(path)
    return loads(read_limited(p, MAX_BYTES, "fingerprint file"), name=p.name, label=str(p))


def loads(data: bytes | str, name: str = "text", label: str | None = None) -> Fingerprint:
    """``load`` of bytes (or text) already in memory; ``name`` goes into the record's source."""
    label = label or name
    if isinstance(data, bytes) and len(data) > MAX_BYTES:
        raise UsageError(f"{label}: larger than {MAX_BYTES // 1024} KiB; not a fingerprint or collect_env text")
    text = decode_text(data) if isinstance(data, bytes) else data
    text = text.replace("\x00", "")
    stripped = text.lstrip("\ufeff \t\r\n")
    if not stripped:
        raise UsageError(f"{label}: empty; expected a convcheck fingerprint JSON or collect_env text")
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{label}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting too deep
            raise UsageError(f"{label}: unreadable JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
        fp = Fingerprint.from_dict(data)
        return dataclasses.replace(fp, source=f"{fp.source} (from {name})")
    if looks_like_collect_env(text):
        return parse_collect_env(text, source=f"collect_env text {name}")
    read = fields_read(text)
    said = (f" (collect_env fields read: {', '.join(read)}; it needs 'PyTorch version' or 'CUDA used to build "
            f"PyTorch' and one more)") if read else ""
    raise UsageError(
        f"{label}: neither a convcheck fingerprint JSON nor `python -m torch.utils.collect_env` output{said}"
    )


def save(fp: Fingerprint, path: str | os.PathLike, *, force: bool = True) -> Path:
    """Write the fingerprint JSON atomically (``convcheck.files``), creating its folder.

    Only a regular file is ever replaced, and only with ``force``; a link, a
    device or a FIFO at ``path`` is refused (``UsageError``). A full disk is a
    ``RunFailed``.
    """
    p = check_writable_file(path, force=force, what="--save")
    directory = p.parent if str(p.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps(fp.to_dict(), indent=2) + "\n")
    except OSError as exc:
        raise write_error(exc, p) from None
    return p
