"""The user's data-parallel settings that convcheck mirrors in the model copies (``--ddp-sync-bn``,
``--ddp-no-broadcast-buffers``): a builder wrapper, applied by the rank-pool executor (``executor``)."""

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
