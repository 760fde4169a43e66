"""How convcheck was launched: by ``torchrun`` (or another torch.distributed launcher) or on its own.

``torchrun`` starts one process per rank and gives each ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. convcheck does not run
inside such a world: its comparison runs the single-device arms and the
float64 judge in one process, and a data-parallel target starts its own rank
processes (``convcheck.ddp.pool``) with their own rendezvous. Were rank 0 to be
the comparison and a DDP rank at once, its single-device copies would share
the process with an initialised default process group: an
``nn.SyncBatchNorm`` or any collective in the user's model would then reduce
a single-device arm's statistics with the other ranks (a hang on NCCL, a wrong
result or an error elsewhere), and the comparison would no longer be one
device against DDP. So ``check_not_under_torchrun`` refuses with one line that
says what to run instead (exit 2), on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from convcheck.errors import UsageError

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


def check_not_under_torchrun(targets, environ=None) -> None:
    """A one-line ``UsageError`` when a launcher started this process as one rank of a world of several,
    or as a rank at all with a data-parallel target; nothing otherwise."""
    world = launched_world(environ)
    if world is None:
        return
    ddp = [t for t in targets if getattr(t, "world", None)]
    if (world.world or 1) <= 1 and not ddp:
        return  # a world of one running single-device targets: the same as running it alone
    where = f"rank {world.rank if world.rank is not None else '?'} of {world.world or '?'}"
    instead = (f"convcheck compare ... --targets {','.join(str(t) for t in targets)}" if ddp else
               f"convcheck compare ... --targets cuda,ddp:cuda:{world.world or 'N'} (or ddp:cpu:N)")
    raise UsageError(f"convcheck was started by torchrun ({where}, {', '.join(world.variables)} set): it starts "
                     f"its own data-parallel ranks and would run the whole comparison on every rank; run it "
                     f"once, without torchrun, on one machine: {instead}")
