"""A watched run under torchrun/DDP: each rank writes its own part, ``out/rank<k>/``.

When ``torch.distributed`` is initialised as the watch is made, ``convcheck.watch(..., out=OUT)`` writes
``OUT/rank<k>/`` (``k = torch.distributed.get_rank()``) and its manifest's ``distributed`` field says
``{"rank": k, "world_size": N, "backend": ...}``. ``rank_folders`` reads such a run back: a folder
holding exactly ``rank0/`` .. ``rank<N-1>/`` and nothing else (``rankdiff.py`` diffs them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from convcheck.runformat.schema import MANIFEST
from convcheck.errors import UsageError
from convcheck.files import path_kind

RANK_DIR = re.compile(r"rank(0|[1-9][0-9]{0,5})")


def current() -> dict | None:
    """``{"rank", "world_size", "backend"}`` of this process's initialised process group, or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return {"rank": int(dist.get_rank()), "world_size": int(dist.get_world_size()), "backend": str(dist.get_backend())}


def rank_out(out: Path) -> tuple[Path, dict | None]:
    """Where this process's watch writes: ``out/rank<k>`` under DDP, else ``out``; and the rank's fields."""
    d = current()
    return (out if d is None else out / f"rank{d['rank']}"), d


def rank_folders(path) -> list[Path] | None:
    """``[rank0, .., rank<N-1>]`` when ``path`` is a DDP run's folder (no manifest of its own, rank folders
    only), None when it is not one; a folder of rank folders with a gap or anything else is a ``UsageError``."""
    path = Path(path)
    if path_kind(path) != "directory" or path_kind(path / MANIFEST) is not None:
        return None
    entries = sorted(os.listdir(path))
    ranks = [e for e in entries if RANK_DIR.fullmatch(e)]
    if not ranks:
        return None
    other = [e for e in entries if e not in ranks]
    if other:
        raise UsageError(f"watched run {path}: holds rank folders and {other[0]!r}; a DDP run's folder holds "
                         "rank0/ .. rank<N-1>/ only")
    numbers = sorted(int(e[4:]) for e in ranks)
    if numbers != list(range(len(numbers))):
        missing = next(i for i in range(len(numbers) + 1) if i not in numbers)
        raise UsageError(f"watched run {path}: rank{missing}/ is missing (it holds {', '.join(ranks[:4])}"
                         f"{', ...' if len(ranks) > 4 else ''}); every rank writes its part")
    for n in numbers:
        if path_kind(path / f"rank{n}") != "directory":
            raise UsageError(f"watched run {path}: rank{n} is not a folder")
    return [path / f"rank{n}" for n in numbers]
