"""A fingerprint JSON checked field by field before it becomes a record.

A file from another machine (or edited by hand, or by a tool) can hold
anything; a wrong type would otherwise surface as a traceback deep inside an
audit rule. Every field is checked against the type its dataclass declares,
and numbers and texts against sane bounds; the first problem is a one-line
``UsageError`` naming the field (``gpus[0].capability``). Unknown keys are
ignored, so newer files still load.
"""

from __future__ import annotations

import math
from dataclasses import fields

from convcheck.env.tables import parse_version
from convcheck.errors import UsageError

MAX_TEXT = 2000  # free text (a CPU model, an OS name, a note)
MAX_VERSION_TEXT = 100  # a version string ('580.159.04', '2.11.0+cu130')
MAX_ITEMS = 1024  # GPUs, notes, arch-list entries
MAX_INT = 2**64 - 1  # NVML counters and bit masks are unsigned 64-bit
MAX_CAPABILITY_PART = 99
MAX_GPU_INDEX = 4095

# Fields that hold a version number: text that must start like one, when given.
VERSION_FIELDS = {"torch.cuda", "torch.hip", "driver.version", "driver.cuda_version", "torch.cublas_version"}


def _fail(where: str, expected: str, value) -> UsageError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return UsageError(f"malformed fingerprint JSON: field {where} must be {expected}, got {shown}")


def _text(value, where: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise _fail(where, "text", value)
    if len(value) > limit:
        raise _fail(where, f"text of at most {limit} characters", value)
    return value


def _int(value, where: str, least: int = 0, most: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise _fail(where, f"an integer from {least} to {most}", value)
    return value


def _float(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) > 1e15:
        raise _fail(where, "a finite number", value)
    return float(value)


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _texts(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise _fail(where, f"a list of at most {MAX_ITEMS} texts", value)
    return tuple(_text(v, f"{where}[{i}]", MAX_VERSION_TEXT if where.endswith("arch_list") else MAX_TEXT)
                 for i, v in enumerate(value))


def _capability(value, where: str) -> tuple[int, int]:
    parts = value.split(".") if isinstance(value, str) else value
    numbers = []
    if isinstance(parts, list) and len(parts) == 2:
        for p in parts:
            if isinstance(p, int) and not isinstance(p, bool):
                numbers.append(p)
            elif isinstance(p, str) and p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 2:
                numbers.append(int(p))
    if len(numbers) != 2 or not all(0 <= n <= MAX_CAPABILITY_PART for n in numbers):
        raise _fail(where, "[major, minor] or 'major.minor' with numbers from 0 to 99", value)
    return numbers[0], numbers[1]


_CHECKS = {
    "str": _text, "str | None": _text,
    "int": lambda v, w: _int(v, w, 0, MAX_GPU_INDEX), "int | None": _int,
    "bool": _bool, "bool | None": _bool,
    "float | None": _float,
    "tuple[str, ...]": _texts, "tuple[str, ...] | None": _texts,
    "tuple[int, int] | None": _capability,
}


def check_section(cls, data, where: str) -> dict:
    """The keyword arguments for ``cls`` from a JSON object, every known field checked."""
    if not isinstance(data, dict):
        raise _fail(where, "an object", data)
    out = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        path = f"{where}.{f.name}" if where else f.name
        nullable = f.type.endswith("| None")
        if value is None:
            if nullable:
                out[f.name] = None
            continue  # null for a field that cannot be None: its default
        check = _CHECKS.get(f.type)
        if check is None:  # a nested record: the caller builds it
            continue
        out[f.name] = check(value, path)
        if path in VERSION_FIELDS and (len(out[f.name]) > MAX_VERSION_TEXT or parse_version(out[f.name]) is None):
            raise _fail(path, "a version number such as '12.4' or '550.54.14'", value)
    return out


def check_list(data, where: str) -> list:
    if data is None:
        return []
    if not isinstance(data, list) or len(data) > MAX_ITEMS:
        raise _fail(where, f"a list of at most {MAX_ITEMS} entries", data)
    return data
