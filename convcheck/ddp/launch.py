"""How convcheck was launched: by ``torchrun`` (or another torch.distributed launcher) or on its own.

``torchrun`` starts one process per rank and gives each ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Launched so, convcheck uses
that world for its data-parallel target instead of starting its own ranks
(``convcheck.ddp.torchrun``): rank 0 runs the whole comparison and reports;
its DDP rank runs in a relay process it starts, so the comparison's own
process (the single-device arms, the judge) never joins the process group and
a ``SyncBatchNorm`` or a collective in the model cannot reach across ranks
there; every other rank serves its share of the DDP arm and exits 0.
The launcher's variables are read by ``convcheck.targets.runners.launcher``.
``check_launch`` refuses, in one line (exit 2), what cannot work: a world of
several without a ``ddp:`` target of that size, targets on two backends,
launcher variables missing.
"""

from __future__ import annotations

from convcheck.errors import UsageError
from convcheck.targets.runners.launcher import TORCHRUN_VARIABLES, LaunchedWorld, launched_world

__all__ = ["TORCHRUN_VARIABLES", "LaunchedWorld", "check_launch", "launched_world"]


def check_launch(targets, environ=None) -> LaunchedWorld | None:
    """The launcher's world when this process is one rank of it and the targets fit it; a one-line
    ``UsageError`` when they do not; None when not launched."""
    world = launched_world(environ)
    if world is None:
        return None
    ddp = [t for t in targets if getattr(t, "world", None)]
    if (world.world or 1) <= 1 and not ddp:
        return None  # a world of one running single-device targets: the same as running it alone
    where = f"convcheck was started by torchrun (rank {_text(world.rank)} of {_text(world.world)})"
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in world.variables]
    if missing or world.rank is None or world.world is None or not 0 <= world.rank < world.world:
        raise UsageError(f"{where} with {', '.join(missing) or 'RANK or WORLD_SIZE'} "
                         f"{'unset' if missing else 'not a rank of the world'}: start it with torchrun, which sets "
                         "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    if not ddp:
        raise UsageError(f"{where} but no target is data-parallel: the world's ranks serve a ddp: target "
                         f"(--targets cpu,ddp:cpu:{world.world} or cuda,ddp:cuda:{world.world}); to compare "
                         "single devices run convcheck once, without torchrun")
    wrong = [t for t in ddp if t.world != world.world]
    if wrong:
        t = wrong[0]
        raise UsageError(f"{where}: target {t} asks for {t.world} ranks, the world has {world.world} "
                         f"(torchrun's --nnodes x --nproc-per-node); use ddp:{t.device}:{world.world}"
                         f"{'' if t.mode == 'float32' else ':' + t.mode}")
    if len({t.device for t in ddp}) > 1:
        raise UsageError(f"{where}: the data-parallel targets use two backends ({', '.join(map(str, ddp))}); "
                         "one world runs one: keep ddp:cpu or ddp:cuda")
    return world


def _text(value) -> str:
    return "?" if value is None else str(value)
