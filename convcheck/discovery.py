"""Extension points: a package whose modules register themselves imports every one of them.

A target kind (``targets/runners/``), a verdict rule (``diagnose/rules/``) and an env audit
family (``env/rules/``) are each one module dropped into its package; the package calls
``import_modules`` once, so no list of modules has to be edited (docs/ARCHITECTURE.md,
"Extending convcheck").
"""

from __future__ import annotations

import importlib
import pkgutil


def import_modules(package: str, path) -> list[str]:
    """Import every module of ``package`` found on ``path`` (its ``__path__``), by name; returns the names."""
    names = sorted(info.name for info in pkgutil.iter_modules(path))
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names
