"""A training script whose model sums its heads' outputs over a *set* of names: the order a set of strings is
iterated in follows the process's hash seed, and a float32 sum in another order rounds otherwise. Run as
``PYTHONHASHSEED=N python set_order_loop.py OUT``."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck

HEADS = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.heads = nn.ModuleDict({name: nn.Linear(32, 4) for name in sorted(HEADS)})

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = 0
        for name in HEADS:  # a set: its order is the hash seed's
            out = out + self.heads[name](h)
        return out


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(16, 4, generator=g)
    data = [torch.randn(128, 16, generator=g) for _ in range(8)]
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(150):  # eight batches in turn: a rounding difference grows from step to step
            x = data[step % 8]
            loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


if __name__ == "__main__":
    main(sys.argv[1])
