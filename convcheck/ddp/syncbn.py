"""SyncBatchNorm for gloo on the CPU.

``torch.nn.SyncBatchNorm`` refuses CPU tensors ("expected input tensor to be on
GPU"), so on ``ddp:cpu:N`` each rank swaps it for ``GlooSyncBatchNorm``: the same
parameters and buffers, batch statistics over the whole global batch, reduced
with ``torch.distributed.nn.functional.all_reduce`` (differentiable: the
backward all-reduces the gradient of the statistics, as SyncBatchNorm's does).
Two passes (the global mean, then the global sum of squared deviations) so the
variance does not cancel. Outside a process group or in eval mode it is BatchNorm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().forward(x)
        import warnings

        with warnings.catch_warnings():  # deprecated for _functional_collectives, which has no CPU autograd yet
            warnings.simplefilter("ignore", FutureWarning)
            return self._synced(x)

    def _synced(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = x.numel() // x.shape[1]
        total = all_reduce(torch.cat([x.sum(dims), x.new_tensor([float(count)])]))
        n = total[-1]
        mean = total[:-1] / n
        centered = x - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims)) / n
        if self.track_running_stats and self.running_mean is not None:
            self._update_running(mean.detach(), var.detach(), float(n.detach()))
        y = centered / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running(self, mean, var, n: float) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def swap_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.SyncBatchNorm`` (CUDA only) by ``GlooSyncBatchNorm`` with its state; in place."""
    if isinstance(module, nn.SyncBatchNorm):
        new = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats)
        ref = next((t for t in module.state_dict().values() if t.is_floating_point()), None)
        if ref is not None:
            new.to(device=ref.device, dtype=ref.dtype)
        new.load_state_dict(module.state_dict())
        return new.train(module.training)
    for name, child in module.named_children():
        setattr(module, name, swap_sync_batchnorm(child))
    return module
