"""How this process was started: by ``torchrun`` (or another torch.distributed launcher) or on its own.

``torchrun`` starts one process per rank and gives each ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. A runner whose ranks may be
the launcher's reads them here (which GPU this node's rank runs on); what such
a world serves and refuses is its executor's (``convcheck.ddp.launch``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedWorld:
    """The rank this process was given by a launcher, and what the launcher set."""

    rank: int | None
    world: int | None
    local_rank: int | None
    endpoint: str  # MASTER_ADDR:MASTER_PORT, "" when unset
    variables: tuple[str, ...]  # the launcher's variables present in the environment


def launched_world(environ=None) -> LaunchedWorld | None:
    """The launcher's world when ``RANK`` or ``WORLD_SIZE`` is set (torchrun sets all five), else None."""
    env = os.environ if environ is None else environ
    present = tuple(v for v in TORCHRUN_VARIABLES if env.get(v, "").strip())
    if "RANK" not in present and "WORLD_SIZE" not in present:
        return None

    def number(name):
        try:
            return int(env.get(name, "").strip())
        except ValueError:
            return None
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    return LaunchedWorld(number("RANK"), number("WORLD_SIZE"), number("LOCAL_RANK"),
                         f"{addr}:{port}" if addr or port else "", present)
