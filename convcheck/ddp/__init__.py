"""Data-parallel targets (``ddp:cpu:N``, ``ddp:cuda:N``): rank processes, their proxy, parity, diagnostics.

- ``worker``: one rank (process group, DDP-wrapped copy, its slice of the batch, BatchNorm probe)
- ``pool``: the parent's side (start, command, watch, one-line errors, shutdown)
- ``arm``: ``DDPArmState``, a data-parallel arm in ``run_training``'s lockstep loop
- ``parity``: the DDP-averaged gradient of one step against the judge's
- ``syncbn``: ``GlooSyncBatchNorm``, SyncBatchNorm for gloo on the CPU
- ``launch``: started by ``torchrun`` (``RANK``/``WORLD_SIZE``...)? and do the targets fit its world?
- ``launched``: the torchrun world serving the DDP arm (a relay as rank 0, the other ranks serving)
- ``probes``: what each rank measures for the diagnostics
- ``diagnostics``: per-rank BatchNorm statistics, a loss off by the world size -> verdict ``setup`` / ``ddp``
"""

from __future__ import annotations

import torch.nn as nn


class ddp_builder:  # noqa: N801 - used as a function: build = ddp_builder(build, sync_bn=True)
    """``build`` with the user's data-parallel settings that convcheck mirrors: ``sync_bn`` converts every
    BatchNorm of the data-parallel copies to SyncBatchNorm (``--ddp-sync-bn``; single-device copies, the
    judge's included, are left alone); ``broadcast_buffers`` is DistributedDataParallel's
    (``--ddp-no-broadcast-buffers``: False), read by the ranks. A class so that it pickles (spawned
    ranks) whenever ``build`` does."""

    def __init__(self, build, sync_bn: bool = False, broadcast_buffers: bool = True):
        self.build, self.sync_bn, self.broadcast_buffers = build, sync_bn, broadcast_buffers

    def __call__(self, target) -> nn.Module:
        model = self.build(target)
        if self.sync_bn and getattr(target, "world", None) is not None:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model


def sync_batchnorm_builder(build) -> ddp_builder:
    """``build`` whose data-parallel copies have every BatchNorm converted to SyncBatchNorm."""
    return ddp_builder(build, sync_bn=True)
