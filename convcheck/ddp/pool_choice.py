"""Which ranks serve a data-parallel target: started here, or the world torchrun launched."""

from __future__ import annotations

from convcheck.ddp.launch import launched_world


def open_pool(target, job):
    """The ranks of ``target``: started here (``pool.RankPool``), or, when torchrun launched convcheck,
    the launcher's world (``launched.LaunchedPool``)."""
    if launched_world() is not None:
        from convcheck.ddp.torchrun import LaunchedPool

        return LaunchedPool(target, job)
    from convcheck.ddp.rank_pool import RankPool

    return RankPool(target, job)
