"""Precision bisection for training: the smallest set of modules that must stay in float32 for the
lower-precision arm to track the judge (delta debugging, Zeller's ddmin, over the model's modules).

``passes(names)`` is one probe: a short re-run of the arm with ``names`` kept in float32
(``float32.keep_in_float32``). ``ddmin`` returns a 1-minimal set (dropping any one module of it fails),
or None when even every module in float32 does not pass (the cause is not one of precision per module).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def candidates(model: nn.Module) -> list[str]:
    """Every module that computes (leaves, and modules with children that are not bare containers), by
    qualified name, in the model's order; the root is not one (all of it in float32 is no bisection)."""
    return [n for n, m in model.named_modules() if n and not isinstance(m, _CONTAINERS)]


def ddmin(items: Sequence[str], passes: Callable[[tuple[str, ...]], bool]) -> tuple[str, ...] | None:
    """A 1-minimal subset of ``items`` that passes; None when ``items`` itself does not. Each set is probed
    once (ddmin asks some again)."""
    seen: dict[frozenset, bool] = {}
    probe = passes

    def passes(names: tuple[str, ...]) -> bool:
        key = frozenset(names)
        if key not in seen:
            seen[key] = probe(names)
        return seen[key]

    c = tuple(items)
    if not passes(c):
        return None
    n = 2
    while len(c) >= 2:
        chunks = _split(c, n)
        reduced = False
        for chunk in chunks:
            if passes(chunk):
                c, n, reduced = chunk, 2, True
                break
        if not reduced:
            for chunk in chunks:
                rest = tuple(x for x in c if x not in chunk)
                if rest and passes(rest):
                    c, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(c):
                break
            n = min(2 * n, len(c))
    return c


def _split(c: tuple[str, ...], n: int) -> list[tuple[str, ...]]:
    k, out, start = len(c), [], 0
    for i in range(n):
        end = start + (k - start) // (n - i)
        out.append(c[start:end])
        start = end
    return [x for x in out if x]
