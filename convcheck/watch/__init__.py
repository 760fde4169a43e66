"""``convcheck.watch``: record the user's own training loop, unchanged, into a watched-run bundle
(``convcheck.watch/1``), and ``convcheck diff`` two of them.

``stats`` computes one tensor's statistics, ``recorder`` is the context manager (hooks in, hooks
out), ``layout`` the bundle's files and its folder rules, ``reader`` reads a watched bundle trusting
nothing in it, ``diff`` aligns two watched runs and ends with a ``Verdict``."""

import sys
import types

from convcheck.watch.attach import current
from convcheck.watch.recorder import Watch, seed_everything, watch

__all__ = ["Watch", "current", "seed_everything", "watch"]


class _CallableModule(types.ModuleType):
    """``convcheck.watch`` is this package and the context manager at once: ``convcheck.watch(model, ...)``."""

    def __call__(self, *args, **kwargs) -> Watch:
        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
