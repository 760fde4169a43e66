"""What each rank measures about its own copy, for the data-parallel diagnostics.

Every probe hooks the rank's inner module (the one DDP wraps) and, where it
compares ranks, does so with a collective that every rank calls at the same
point of the step; rank 0 keeps the numbers and sends them to the parent.

- ``BatchNormProbe``: per BatchNorm layer, how far a rank's batch statistics are from the global batch's.
- ``BufferProbe``: the buffers as the forward starts (after DDP's broadcast, when it broadcasts), compared
  across ranks: a buffer that differs was not broadcast (``broadcast_buffers=False``) or is set per rank;
  and as it ends: a buffer equal when the forward starts that differs after it is set by the forward from
  each rank's own slice (a running statistic of the user's, BatchNorm's running stats), which
  broadcasting cannot fix.
- ``DrawProbe``: modules that draw from torch's global random generators in their forward (``F.dropout``,
  ``torch.rand``...), which convcheck's shared masks (``nn.Dropout*`` modules) do not cover, and whether
  every rank drew the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from convcheck.numerics.thresholds import TINY_NORM
from convcheck.capture import SHARED_DROPOUT, leaf_modules
from convcheck.ddp.syncbn import GlooSyncBatchNorm


class BatchNormProbe:
    """Per-rank batch statistics of every BatchNorm that does not synchronise, against the global ones.

    Per layer, after a step: the largest shift of a rank's channel mean from the global batch's mean, in
    global standard deviations, and the largest relative change of a rank's channel standard deviation
    (all ranks' statistics combined with all_reduce; rank 0 keeps the numbers)."""

    def __init__(self, model: nn.Module):
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers = [(n, m) for n, m in leaf_modules(model)
                       if isinstance(m, nn.modules.batchnorm._BatchNorm)
                       and not isinstance(m, (nn.SyncBatchNorm, GlooSyncBatchNorm))]
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.layers]

    def _hook(self, name):
        def hook(module, inputs, output):
            if not module.training or name in self.stats or not torch.is_grad_enabled():
                return
            x = inputs[0].detach().to(torch.float64)
            dims = [0] + list(range(2, x.dim()))
            self.stats[name] = (x.mean(dims), x.var(dims, unbiased=False))
        return hook

    def deviations(self, world: int) -> dict[str, tuple[float, float]]:
        """``{layer: (mean shift in global std, relative std change)}``; a collective: every rank calls it."""
        out = {}
        for name, m in self.layers:
            if name not in self.stats:
                continue
            mean, var = self.stats[name]
            packed = torch.stack([mean, var + mean * mean])
            dist.all_reduce(packed)
            g_mean = packed[0] / world
            g_var = (packed[1] / world - g_mean * g_mean).clamp_min(0) + m.eps
            shift = float(((mean - g_mean).abs() / g_var.sqrt()).max())
            scale = float(((var + m.eps) / g_var).sqrt().sub(1).abs().max())
            worst = torch.tensor([shift, scale], dtype=torch.float64, device=mean.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out[name] = (float(worst[0]), float(worst[1]))
        self.stats.clear()
        return out


class BufferProbe:
    """The buffers as the inner module's forward starts: DDP broadcasts rank 0's before it
    (``broadcast_buffers=True``), so with a correct setup they are bitwise equal on every rank there;
    and as that forward ends (``after``): what the forward itself made of them on each rank."""

    def __init__(self, module: nn.Module):
        self.names = [n for n, _ in module.named_buffers()]
        self.snap: torch.Tensor | None = None
        self.after: torch.Tensor | None = None
        self.sizes: list[int] = []
        self._handle = module.register_forward_pre_hook(self._pre) if self.names else None
        self._post = module.register_forward_hook(self._end) if self.names else None

    def _flat(self, module):
        bufs = [b.detach().reshape(-1).to(torch.float64) for b in module.buffers()]
        self.sizes = [b.numel() for b in bufs]
        return torch.cat(bufs) if bufs else None

    def _pre(self, module, args):
        if self.snap is not None or not module.training or not torch.is_grad_enabled():
            return
        self.snap = self._flat(module)

    def _end(self, module, args, output):
        if self.after is not None or self.snap is None or not module.training or not torch.is_grad_enabled():
            return
        self.after = self._flat(module)

    def spreads_after(self, device: torch.device) -> dict[str, float]:
        """As ``spreads``, for the buffers as the step's first forward ended; a collective (call it first)."""
        after, self.after = self.after, None
        return self._spreads(after, device)

    def spreads(self, device: torch.device) -> dict[str, float]:
        """``{buffer: (max - min over ranks) / max |value|}`` for buffers that differ; a collective."""
        snap, self.snap = self.snap, None
        return self._spreads(snap, device)

    def _spreads(self, snap, device) -> dict[str, float]:
        if snap is None or snap.numel() == 0:  # the same on every rank: they ran the same forward
            return {}
        hi, neg_lo = snap.to(device), (-snap).to(device)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(neg_lo, op=dist.ReduceOp.MAX)
        spread, size = (hi + neg_lo).cpu(), torch.maximum(hi.abs(), neg_lo.abs()).cpu()
        out, start = {}, 0
        for name, n in zip(self.names, self.sizes):
            s, m = spread[start:start + n], size[start:start + n]
            start += n
            if n and float(s.max()) > 0:
                out[name] = float(s.max()) / max(float(m.max()), TINY_NORM)
        return out


class DrawProbe:
    """Modules whose forward draws from torch's global random generators (``F.dropout``, ``torch.rand``,
    a stochastic op of the user's): the shared masks cover ``nn.Dropout*`` modules only. Those modules'
    own draws are undone around them (their output is replaced by the shared mask's anyway), so a module
    that changes the generators' state is one whose randomness nobody shares. Innermost modules only."""

    def __init__(self, model: nn.Module, cuda: bool):
        self.cuda, self.changed, self._before, self.active = cuda, set(), {}, True
        self._handles = []
        for name, m in model.named_modules():
            if not name:
                continue
            if isinstance(m, SHARED_DROPOUT):  # covered: its draw is undone
                self._handles += [m.register_forward_pre_hook(self._save(name)),
                                  m.register_forward_hook(self._restore(name))]
            else:
                self._handles += [m.register_forward_pre_hook(self._save(name)),
                                  m.register_forward_hook(self._compare(name))]

    def _state(self):
        cpu = torch.random.get_rng_state()
        return (cpu, torch.cuda.get_rng_state()) if self.cuda else (cpu,)

    def _save(self, name):
        def pre(module, args):
            if self.active:
                self._before[name] = self._state()
        return pre

    def _restore(self, name):
        def post(module, args, output):
            if self.active and name in self._before:
                saved = self._before.pop(name)
                torch.random.set_rng_state(saved[0])
                if self.cuda:
                    torch.cuda.set_rng_state(saved[1])
        return post

    def _compare(self, name):
        def post(module, args, output):
            if self.active and name in self._before:
                before = self._before.pop(name)
                if any(not torch.equal(a, b) for a, b in zip(before, self._state())):
                    self.changed.add(name)
        return post

    def finish(self, device: torch.device) -> dict:
        """``{"layers": innermost drawing modules, "same_on_every_rank": bool}``; removes the hooks. A
        collective (the generators' state compared across ranks): every rank calls it once."""
        for h in self._handles:
            h.remove()
        self.active = False
        layers = sorted(n for n in self.changed if not any(c.startswith(n + ".") for c in self.changed))
        state = torch.random.get_rng_state()
        code = float(int.from_bytes(bytes(state[-8:].tolist()), "little") % (1 << 52)) + float(state.sum())
        both = torch.tensor([code, -code], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return {"layers": layers, "same_on_every_rank": bool(float(both[0]) == -float(both[1]))}
