"""A data-parallel training loop as a user writes it, launched by torchrun in the tests, watched by
``convcheck.watch``: ``python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_loop.py OUT:BUG ...``
(one launch, one watched run per ``OUT:BUG``, one after the other in the same process group).

BUG plants a real DDP mistake: ``no_sync`` (every step inside ``model.no_sync()``: the gradients are never
averaged, the ranks' models part) or ``unsharded`` (no DistributedSampler: every rank trains on the same
batches) or ``no_set_epoch`` (three epochs without ``sampler.set_epoch``: every epoch in one order; ``epochs``
is the same three epochs done right, ``ordered`` three epochs of a sampler that does not shuffle, by choice);
``none`` is a correct run."""

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import convcheck


def train(out: str, bug: str = "none", steps: int = 3) -> None:
    if bug not in ("none", "no_sync", "unsharded", "no_set_epoch", "epochs", "ordered"):
        raise SystemExit(f"ddp_loop.py: unknown bug {bug!r}")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    sampler = None if bug == "unsharded" else DistributedSampler(data, shuffle=bug != "ordered", seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    epochs = 3 if bug in ("no_set_epoch", "epochs", "ordered") else 1
    with convcheck.watch(model, opt, out=out) as w:
        for epoch in range(epochs):
            if bug == "epochs":
                sampler.set_epoch(epoch)
            for _, (x, y) in zip(range(steps if epochs == 1 else len(loader)), loader):
                with model.no_sync() if bug == "no_sync" else contextlib.nullcontext():
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                opt.step()
                w.step(loss)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        for arg in sys.argv[1:]:
            train(*arg.rsplit(":", 1))
    finally:
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
        dist.destroy_process_group()
