"""The model zoo: a name for each reference model, with its input spec.

``list_models()`` names them, ``get_spec(name)`` describes one, and
``get_model(name)`` builds it; each model's module declares its ``SPECS`` (``discover``). This package stands alone: it never imports
convcheck.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from torch import nn

from reference_models.spec import TASKS, ModelSpec  # noqa: F401 - re-exported


class UnknownModelError(KeyError, ValueError):
    """A name that is not in the zoo. Both a KeyError (a failed lookup) and a ValueError."""

    def __str__(self) -> str:
        # KeyError would quote the message; show it as written.
        return str(self.args[0]) if self.args else ""


@functools.lru_cache(maxsize=None)
def discover() -> dict[str, ModelSpec]:
    """Every model the package's modules declare in their ``SPECS``, by name: a new zoo model is one
    module with its factory and its ``SPECS`` (plus its test), nothing else to edit."""
    import reference_models

    found: dict[str, ModelSpec] = {}
    for info in sorted(pkgutil.iter_modules(reference_models.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"reference_models.{info.name}")
        for spec in getattr(module, "SPECS", ()):
            if spec.name in found:
                raise ValueError(f"zoo model {spec.name!r} is declared twice")
            found[spec.name] = spec
    return found


def list_models() -> list[str]:
    """The zoo's model names, sorted."""
    return sorted(discover())


def get_spec(name: str) -> ModelSpec:
    """The spec of one zoo model; an unknown name raises ``UnknownModelError`` naming the known ones."""
    try:
        return discover()[name]
    except KeyError:
        known = ", ".join(list_models())
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


def get_model(name: str, **kwargs) -> nn.Module:
    """Build a fresh zoo model; ``kwargs`` go to its factory (e.g. ``num_classes=100``)."""
    return get_spec(name).factory(**kwargs)
