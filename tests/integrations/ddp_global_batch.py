"""One training loop, run two ways with the same global batch: under DDP (each rank trains on its share of every
global batch, DDP averaging the gradients) or in one process on the whole batch. ``python ddp_global_batch.py
OUT[:FAULT] ...``: under torchrun (``WORLD_SIZE`` > 1) it is a DDP rank, writing ``OUT/rank<k>/``; alone, one process
writing ``OUT/``. ``OUT:FAULT`` plants a fault: ``lr`` (0.2, not 0.1), ``unaveraged`` (no DDP wrapper: each rank
steps on its own share's gradients) or ``half`` (one process on one share's batch, not the global batch); several
``OUT:FAULT`` run one after the other.

The averaged gradient of the ranks' mean losses is the whole batch's mean loss's gradient, so the parameters and
gradients of rank 0 are the single process's within rounding; its loss is its share's and is not."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import convcheck

GLOBAL_BATCH, STEPS = 16, 4


def train(out: str, fault: str = "none") -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    if world > 1 and fault != "unaveraged":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2 if fault == "lr" else 0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    share = GLOBAL_BATCH // (2 if fault == "half" else world)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(0, STEPS - 1)) as w:
        for _ in range(STEPS):
            x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


if __name__ == "__main__":
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    try:
        for arg in sys.argv[1:]:
            train(*arg.split(":", 1))
    finally:
        if distributed:
            dist.barrier()  # neither rank tears gloo down while the other still talks to it
            dist.destroy_process_group()
