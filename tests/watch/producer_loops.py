"""Loops whose first NaN/Inf is made by a parent module's own code, written as users write them."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck


class RowSumAttention(nn.Module):
    """Attention normalised by hand: exp of the shifted scores over their row sums. In float16 the row sums
    fall to ~1e-7, and the division's backward (1 / s**2) overflows while every forward value is finite."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        e = torch.exp(s - 16.0)
        w = e / e.sum(-1, keepdim=True)
        return w @ self.v(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(8, 16), RowSumAttention(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)).mean(1))


def rowsum_run(out, steps: int = 3, **watch_args) -> None:
    """A float16 model (``model.half()``) trained with SGD: the attention's backward overflows at step 0."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # small weights: scores near 0, so exp(s - 16) ~ 1e-7 in every row
        for m in (model.attn.q, model.attn.k):
            m.weight.mul_(0.01)
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, **watch_args) as w:
        for _ in range(steps):
            x = torch.randn(4, 5, 8, generator=g).half()
            y = torch.randint(0, 3, (4,), generator=g)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
