"""The per-layer statistics of a watched run, each declared once (issue 46).

A ``Statistic`` says everything the code does with one column of a layer's row in ``steps.jsonl``:

- what the row holds (``name``, its ``kind`` for ``reader.py``'s check, whether older runs may lack it);
- how the watch computes it (``reduce``): ``None`` for the core statistics, which ``watch/stats.py``'s one-pass
  reduction produces (``aminmax``, ``sum`` and the sum of squares read back in one ``tolist``, the zero and
  NaN/Inf counts where the tensor holds any); for any other statistic a function of the tensor's finite values
  (and the dtype to accumulate in: float32 for half types) returning a 0-d tensor on the tensor's device,
  stacked into that same read; ``merge`` (how two calls' values combine: a layer called several times in a step)
  and ``finish`` (the accumulated value and the finite element count to the recorded value);
- how two runs' values are compared (``family``, the tolerance family below);
- how it is shown (``title``, the column's meaning on the page and in the diff's evidence; ``digits``, the
  significant digits of the HTML report; ``table``: its per-side columns ``<name>_a``/``<name>_b``, its relative
  error ``<name>_rel``, or both).

Tolerance families:

- ``scale``: a magnitude of the values (max |x|, std): compared relative to itself, ``|b - a| / max(|a|, |b|)``;
  in the layer table's ``worst_rel`` and in the diff's layer distance;
- ``location``: a value that may sit near 0 (the mean): compared relative to the layer's spread (its std, else
  its max |x|) in the diff's layer distance; tabled, never in ``worst_rel``;
- ``fine``: read at the resolution of single elements (the share of zeros, the smallest nonzero |x|): one
  rounding moves it by 100%, so tabled only;
- ``count``: exact counts per side (NaN, Inf): any difference is a difference (``worst_rel`` inf);
- ``call``: which call of a layer called several times in a step (the call count, the worst call, the first
  non-finite call): per side, never compared.

``declare(statistic)`` adds one (a name already declared is refused); everything else - the watch's row, the
reader's check, ``analysis/tables.py``'s columns, the CSV and HTML of ``convcheck diff --out``, the diff's layer
distance - reads ``STATISTICS`` when it runs. Nothing here imports torch: the ``reduce`` functions are called by
the watch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

FAMILIES = ("scale", "location", "fine", "count", "call")
MERGES = ("sum", "max", "min")
TABLES = ("relative", "sides", "both")
NUMBER = (int, float)


@dataclass(frozen=True)
class Statistic:
    """One per-layer statistic (see the module's docstring for each field's meaning)."""

    name: str
    title: str
    family: str
    kind: type | tuple = NUMBER
    table: str = "relative"
    digits: int = 3
    optional: bool = False  # runs recorded before it was declared have none: read, shown empty
    nullable: bool = False  # None is a value (no nonzero element, no non-finite call)
    reduce: Callable | None = None  # None: the core one-pass reduction's (``watch/stats.py``)
    merge: str = "sum"
    finish: Callable | None = None  # (accumulated value, finite element count) -> the recorded value

    def __post_init__(self):
        if self.family not in FAMILIES or self.merge not in MERGES or self.table not in TABLES:
            raise ValueError(f"statistic {self.name!r}: family, merge or table not one of {FAMILIES}, {MERGES}, "
                             f"{TABLES}")

    @property
    def compared(self) -> bool:
        """Whether its relative error is tabled (and can be diffed)."""
        return self.table in ("relative", "both")

    @property
    def sides(self) -> bool:
        """Whether each run's own value is tabled (``<name>_a``, ``<name>_b``)."""
        return self.table in ("sides", "both")


# The core statistics, in the order of the layer table's columns. ``n``, ``dtype`` and ``calls`` are the row's
# own bookkeeping (checked by the reader, not tabled as statistics).
STATISTICS: tuple[Statistic, ...] = (
    Statistic("max_abs", "max |x|", "scale", table="both"),
    Statistic("mean", "mean", "location"),
    Statistic("std", "std", "scale"),
    Statistic("zeros", "share of zeros", "fine"),
    Statistic("min_nonzero", "smallest nonzero |x|", "fine", kind=(*NUMBER, type(None)), nullable=True),
    Statistic("nan", "NaN count", "count", kind=int, table="sides"),
    Statistic("inf", "Inf count", "count", kind=int, table="sides"),
    # issue 48: a layer called several times in one step (a recurrent cell unrolled over time, a shared block)
    # is one row accumulated over its calls; these say how many and which one to look at (indices from 0, in
    # the order the calls ran). Runs recorded before them have none: a row of one call.
    Statistic("calls", "calls in the step", "call", kind=int, table="sides"),
    Statistic("worst_call", "the call with the largest max |x|", "call", kind=int, table="sides", optional=True),
    Statistic("nonfinite_call", "the first call with a NaN/Inf output", "call", kind=(int, type(None)),
              table="sides", optional=True, nullable=True),
)
ROW_FIELDS = {"n": int, "dtype": str}  # a row's bookkeeping beside its statistics


def declare(statistic: Statistic) -> Statistic:
    """Add ``statistic`` to ``STATISTICS`` (after the others): recorded by every watch started from now on,
    read, tabled, shown and diffed. An extension must say how it is computed (``reduce``) and is optional in the
    run format (runs recorded before it lack it)."""
    global STATISTICS
    if statistic.name in {s.name for s in STATISTICS} or statistic.name in ROW_FIELDS:
        raise ValueError(f"statistic {statistic.name!r} is declared already")
    if statistic.reduce is None or not statistic.optional:
        raise ValueError(f"statistic {statistic.name!r}: a declared statistic needs its reduce and optional=True")
    STATISTICS = (*STATISTICS, statistic)
    return statistic


def declared() -> tuple[Statistic, ...]:
    """The statistics declared now (the core ones first)."""
    return STATISTICS


_extensions: list = [None, ()]  # ``STATISTICS`` (by identity) and its extensions: read at every layer call


def extensions() -> tuple[Statistic, ...]:
    """The declared statistics the watch computes with their own ``reduce``."""
    if _extensions[0] is not STATISTICS:
        _extensions[:] = [STATISTICS, tuple(s for s in STATISTICS if s.reduce is not None)]
    return _extensions[1]


def by_name(name: str) -> Statistic:
    return next(s for s in STATISTICS if s.name == name)


def row_fields() -> dict:
    """``{key: (kind, optional, nullable)}`` of a layer's row as ``reader.py`` checks it."""
    out = {k: (kind, False, False) for k, kind in ROW_FIELDS.items()}
    out.update({s.name: (s.kind, s.optional, s.nullable) for s in STATISTICS})
    return out
