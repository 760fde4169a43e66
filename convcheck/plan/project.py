"""A project's convcheck setup, written once: ``[tool.convcheck]`` in ``pyproject.toml`` (or ``--config FILE.toml``).

The table holds the same keys as ``convcheck compare``'s options (``model``,
``loss``, ``data``, ``optimizer``, ``schedule``, ``targets``, ``judge``,
``steps``, ``bound-factor``, ...; dashes or underscores), so a project records
its setup once and ``convcheck compare`` with no arguments runs it. Options on
the command line override the file; the pytest plugin reads the same table.
Paths in the file (``model``, ``loss``, ``data``... ``FILE.py:name``) are
relative to the file's folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from convcheck.errors import UsageError
from convcheck.plan.options import OPTION_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

EXTRA_KEYS = ("model", "input-shape", "classes")
KNOWN_KEYS = tuple(OPTION_NAMES) + EXTRA_KEYS
MAX_BYTES = 1 << 20  # a pyproject.toml is a few kB; refuse to parse a huge one
_PATH_KEYS = ("model", "loss", "data", "optimizer", "schedule")


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` from ``start`` (the working folder) upwards that has [tool.convcheck]."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():  # the nearest project file decides, with the table or without
            return candidate if "convcheck" in _read(candidate).get("tool", {}) else None
    return None


def load_project(path: str | Path | None = None, *, start: Path | None = None) -> tuple[dict, Path | None]:
    """``({option dest: value}, file)`` from ``path`` (a TOML file) or the nearest pyproject.toml."""
    if path is None:
        found = find_pyproject(start)
        if found is None:
            return {}, None
        file, table = found, _read(found)["tool"]["convcheck"]
    else:
        file = Path(path).expanduser()
        data = _read(file)
        table = data.get("tool", {}).get("convcheck", data) if "tool" in data else data
    if not isinstance(table, dict):
        raise UsageError(f"{file}: [tool.convcheck] must be a table of options")
    return _normalise(table, file), file


def _read(file: Path) -> dict:
    if not file.is_file():
        raise UsageError(f"config file {str(file)!r} not found (or not a regular file)")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise UsageError(f"config file {str(file)!r}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_BYTES:
        raise UsageError(f"config file {str(file)!r} is larger than {MAX_BYTES >> 10} kB")
    try:
        return tomllib.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"config file {str(file)!r} is not valid TOML ({str(exc).splitlines()[0]})") from None


def _normalise(table: dict, file: Path) -> dict:
    out, keys = {}, {}
    for key, value in table.items():
        name = str(key).replace("_", "-")
        if name not in KNOWN_KEYS:
            raise UsageError(f"{file}: unknown key {key!r} in [tool.convcheck] (known keys: "
                             f"{', '.join(KNOWN_KEYS)})")
        if name in keys:  # batch-size and batch_size: one option written twice; which one wins is a guess
            raise UsageError(f"{file}: [tool.convcheck] sets {keys[name]!r} and {key!r}, the same option "
                             f"twice; keep one")
        keys[name] = key
        out[name.replace("-", "_")] = _value(name, value, file)
    return out


def _value(name: str, value, file: Path):
    if isinstance(value, dict):
        raise UsageError(f"{file}: [tool.convcheck] {name} must be a value, not a table")
    if name in ("targets", "input-shape") and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if name == "betas" and isinstance(value, list):
        return tuple(value)
    if name in _PATH_KEYS and isinstance(value, str) and ".py:" in value and not Path(value).is_absolute():
        return str(file.parent / value)  # relative to the file, not to where convcheck runs
    return value
