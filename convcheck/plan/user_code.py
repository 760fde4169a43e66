"""Load the user's code: ``package.module:name`` or ``path/to/file.py:name``.

One loader for everything a user can point convcheck at (a model factory, a
loss, an optimizer or schedule factory, a data factory). Every failure is a
one-line ``UsageError`` naming the spec; the caller's random state is left alone.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from convcheck.errors import UsageError

FORMS = "package.module:name or path/to/file.py:name"


def is_user_spec(text: str) -> bool:
    """``a.b:c`` or ``x/y.py:c``: a reference to the user's code rather than a built-in name."""
    location, sep, attr = text.rpartition(":")
    if not (sep and location and attr and all(p.isidentifier() for p in attr.split("."))):
        return False
    return (location.endswith(".py") or "/" in location or "\\" in location
            or all(p.isidentifier() for p in location.split(".")))


def load_object(spec: str, what: str):
    """``(object, short name)`` for ``spec``; ``what`` names the role in messages ("loss", "model factory")."""
    location, _, attr = spec.rpartition(":")
    if not location or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise UsageError(f"{what} {spec!r} is not {FORMS}")
    with torch.random.fork_rng(devices=[]):  # user code may draw random numbers on import
        if location.endswith(".py") or "/" in location or "\\" in location:
            module, short, where = load_file(location, what), Path(location).stem, f"file {location!r}"
        elif all(p.isidentifier() for p in location.split(".")):
            module, short, where = import_module(location, what), location.rpartition(".")[2], \
                f"module {location!r}"
        else:
            raise UsageError(f"{what} {spec!r} is not {FORMS}")
    return attribute(module, attr, where, what), f"{short}.{attr}"


def attribute(module, attr: str, where: str, what: str):
    """``module.a.b`` for ``attr`` ``"a.b"``; a missing part is a ``UsageError``: ``{where} has no {what} 'a.b'``."""
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{where} has no {what} {attr!r}") from None
    return obj


def load_callable(spec: str, what: str):
    obj, short = load_object(spec, what)
    if not callable(obj):
        raise UsageError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj, short


def import_module(module_name: str, what: str = "code"):
    try:
        with on_sys_path(os.getcwd()):
            return importlib.import_module(module_name)
    except Exception as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = "; is it installed, or on PYTHONPATH?"
        raise UsageError(f"cannot import module {module_name!r}: {one_line(exc)}{hint}") from None


def load_file(location: str, what: str = "code"):
    path = Path(location).expanduser()
    if not path.is_file():
        raise UsageError(f"{what} file {location!r} not found")
    if path.suffix != ".py":
        raise UsageError(f"{what} file {location!r} is not a Python file (.py)")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"_convcheck_user_{_identifier(path.stem)}_{digest}"
    if module_name in sys.modules:  # the same file for the model and the loss: load it once
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(spec)
    # Registered before running, as a normal import would (dataclasses need it);
    # the file's folder is importable while it runs, for its sibling imports.
    sys.modules[module_name] = module
    try:
        with on_sys_path(str(resolved.parent)):
            spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise UsageError(f"cannot load {what} file {location!r}: {one_line(exc)}") from None
    return module


def one_line(exc: BaseException, with_type: bool = True) -> str:
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return f"{type(exc).__name__}: {lines[0]}" if with_type else lines[0]


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text)


@contextmanager
def on_sys_path(folder: str) -> Iterator[None]:
    """Make ``folder`` importable for the duration, without leaving it on sys.path."""
    if folder in sys.path:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
