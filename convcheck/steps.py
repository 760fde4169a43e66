"""Steps as a user writes them, parsed once for every edge that takes them: ``convcheck.watch(steps=...,
snapshot_steps=...)``, the ``CONVCHECK_WATCH_STEPS`` / ``CONVCHECK_SNAPSHOT_STEPS`` variables and
``convcheck record --snapshot-steps``. A ground module: the watch and the recorded bundles both read it, neither
from the other."""

from __future__ import annotations

from convcheck.errors import UsageError

MAX_STEP = 10**9


def shown(value, most: int = 60) -> str:
    """``value``'s repr on one line, at most ``most`` characters: what a one-line error echoes of it."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a repr that fails still leaves a line to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= most else text[:most - 3] + "..."


def whole_number(value, what: str, lo: int = 0, hi: int = MAX_STEP, takes: str = "a whole number") -> int:
    """``value`` (an int, or a string of ASCII digits: ``'²'`` is a digit to ``str.isdigit`` but not to ``int``)
    as an int in ``lo..hi``; anything else one ``UsageError`` naming ``what`` and echoing the value as given.
    The one parser of a step count the API, the environment variables and the command line share."""
    number = value
    if isinstance(value, str):
        text = value.strip()
        number = int(text) if text.isascii() and text.isdigit() and len(text) <= 30 else None
    if not (isinstance(number, int) and not isinstance(number, bool) and lo <= number <= hi):
        raise UsageError(f"{what}={shown(value, 60)} is not {takes} in {lo}..{hi}")
    return number


def step_windows(value, what: str) -> tuple[tuple[int, int], ...]:
    """Steps and inclusive windows: ``'0-99,500'``, ``'500-'`` (step 500 on), a ``range`` of consecutive steps, or
    a list of step numbers / such strings; one ``UsageError`` naming ``what`` otherwise (``steps=5`` included: a
    count is not a selection). Shared by ``steps=``, ``CONVCHECK_WATCH_STEPS``, ``CONVCHECK_SNAPSHOT_STEPS`` and
    ``convcheck record --snapshot-steps``."""
    takes = "a list of steps or inclusive windows (e.g. '0-99,500', '500-' for step 500 on, [0, 10], range(100))"
    if isinstance(value, range):
        if value.step != 1 or len(value) == 0 or value.start < 0 or value.stop - 1 > MAX_STEP:
            raise UsageError(f"{what}={value!r} is not a non-empty range of consecutive steps in 0..{MAX_STEP} "
                             "(use every= for a stride)")
        return ((value.start, value.stop - 1),)
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else list(value)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # a count, or one step?
        raise UsageError(f"{what}={value} is a number, not a selection of steps: range({value}) for the first "
                         f"{value} steps, [{value}] for step {value} alone")
    else:  # a float, bytes, a dict...: not a selection of steps
        raise UsageError(f"{what}={shown(value, 60)} (of type {type(value).__name__}) is not {takes}")
    if len(items) > 10_000:
        raise UsageError(f"{what} lists {len(items)} items; use windows ('0-99') for long runs of steps")
    out = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            out.append((whole_number(item, what, takes="a step number"),) * 2)
            continue
        text = item.strip() if isinstance(item, str) else None
        if text is None or not text or len(text) > 40 or text.count("-") > 1 or text.startswith("-"):
            raise UsageError(f"{what}={shown(value, 80)} is not {takes}")
        lo, dash, hi = text.partition("-")
        a = whole_number(lo, what, takes="a step number")
        b = whole_number(hi, what, takes="a step number") if hi.strip() else (MAX_STEP if dash else a)
        if a > b:
            raise UsageError(f"{what}: the window {text!r} is empty (its first step is after its last)")
        out.append((a, b))
    if not out:
        raise UsageError(f"{what}={shown(value, 80)} names no step")
    return tuple(out)
