"""A recorded file's fields checked one by one (bundles and watched runs): present, of the kind expected, a
shape, a storage dtype, a SHA-256; a row of a table against its columns. A bad field is a ``BadField`` whose
message names where it is; the readers turn it into one ``UsageError`` naming the run."""

from __future__ import annotations

import math

import numpy as np

from convcheck.errors import UsageError
from convcheck.runformat.schema import STORAGE


class BadField(Exception):
    """A field of the manifest is wrong: the message says which (caught and prefixed with the bundle)."""


# --- field checks -------------------------------------------------------------

def get_field(d: dict, key: str, kind, where: str, *, optional: bool = False):
    if key not in d:
        if optional:
            return None
        raise BadField(f"{where}.{key} is missing")
    v = d[key]
    if v is None and optional:
        return None
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool and bool not in kinds_of(kind))
    if not ok:
        raise BadField(f"{where}.{key} is {type(v).__name__}, expected {_kind_name(kind)}")
    return v


def kinds_of(kind):
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
             bool: "true/false"}
    return " or ".join(names.get(k, k.__name__) for k in kinds_of(kind))


def shape_field(v, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8 or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n
                                                        for n in v):
        raise BadField(f"{where} is not a shape (a list of at most 8 non-negative integers)")
    return tuple(v)


def dtype_field(v, where: str) -> str:
    if not isinstance(v, str) or v not in STORAGE:
        raise BadField(f"{where} is {v!r:.40}, not one of {', '.join(STORAGE)}")
    return v


def sha_field(v, where: str) -> str:
    if not isinstance(v, str) or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise BadField(f"{where} is not a SHA-256 hex digest")
    return v


def nbytes_of(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * np.dtype(STORAGE[dtype]).itemsize


def _check_rows(rows, where: str, columns: dict) -> list[dict]:
    if not isinstance(rows, list):
        raise BadField(f"{where} is {type(rows).__name__}, expected a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadField(f"{where}[{i}] is {type(row).__name__}, expected an object")
        for col, kind in columns.items():
            get_field(row, col, kind, f"{where}[{i}]", optional=type(None) in kinds_of(kind))
    return rows


def check_fingerprint(d: dict) -> None:
    from convcheck.env.fingerprint import Fingerprint

    try:
        Fingerprint.from_dict(d)
    except UsageError as exc:
        raise BadField(f"fingerprint: {exc}") from None
