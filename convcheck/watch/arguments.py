"""``convcheck.watch``'s own arguments checked at the edge (issue 47): each of the wrong kind is one ``UsageError``
naming the argument and what it takes, before anything is hooked or written. The selection's arguments
(``layers``, ``steps``, ``every``, ``sync``) are ``selection.py``'s, the optimizer ``settings.check_optimizer``'s."""

from __future__ import annotations

import os

import torch

from convcheck.errors import UsageError
from convcheck.watch.selection import MAX_STEP, shown, whole_number

_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale")
MAX_SNAPSHOT_STEPS = 10_000


def _kind(value) -> str:
    return f"{shown(value)} (of type {type(value).__name__})"


def check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        hint = " (the class; pass an instance: model=Net())" if isinstance(model, type) else ""
        raise UsageError(f"convcheck.watch: model={_kind(model)} is not a torch.nn.Module{hint}")


def check_out(out):
    """``out``: a folder path, a ``str`` or ``os.PathLike`` naming one (not empty, no NUL byte)."""
    if not isinstance(out, (str, os.PathLike)) or isinstance(out, bytes):
        raise UsageError(f"convcheck.watch: out={_kind(out)} is not a folder path (a str or pathlib.Path)")
    text = os.fspath(out)
    if not isinstance(text, str) or not text.strip() or "\0" in text:
        raise UsageError(f"convcheck.watch: out={shown(out, 60)} is not a folder path (empty, or with a NUL byte); "
                         "name the run's own folder, e.g. out='runs/gpu'")
    return out


def check_scaler(scaler) -> None:
    """``scaler``: None or a GradScaler instance (``torch.amp.GradScaler("cuda")``), not the class."""
    if scaler is None:
        return
    if isinstance(scaler, type):
        raise UsageError(f"convcheck.watch: scaler={scaler.__name__} is a class; pass the GradScaler the loop uses "
                         f"(scaler=torch.amp.GradScaler(...), an instance), or none")
    missing = [m for m in _SCALER_METHODS if not callable(getattr(scaler, m, None))]
    if missing:
        raise UsageError(f"convcheck.watch: scaler={_kind(scaler)} is not a GradScaler (it has no {missing[0]}()); "
                         "pass the torch.amp.GradScaler the loop uses, or none")


def check_flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"convcheck.watch: {what}={_kind(value)} is not True or False")
    return value


def check_max_bytes(value, what: str = "max_bytes") -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise UsageError(f"convcheck.watch: {what}={_kind(value)} is not a positive whole number of bytes")
    return value


def snapshot_steps(value) -> tuple[int, ...]:
    """``snapshot_steps``: step numbers (a list, tuple, set or range of them, or ``'0,10,20'``), or None / () for
    none; one ``UsageError`` otherwise."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")] if value.strip().lower() not in ("", "none") else []
    elif isinstance(value, (list, tuple, set, frozenset, range)):
        items = list(value) if len(value) <= MAX_SNAPSHOT_STEPS else None
    else:
        items = None
    try:
        if items is None:
            raise UsageError("")
        return tuple(sorted({whole_number(s, "snapshot_steps") for s in items}))
    except UsageError:
        raise UsageError(f"convcheck.watch: snapshot_steps={shown(value, 60)} is not a list of at most "
                         f"{MAX_SNAPSHOT_STEPS} step numbers in 0..{MAX_STEP} (e.g. [0, 10, 20]), or none") from None
