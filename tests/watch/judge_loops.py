"""A training loop written as a user would, with a hand-written normalisation layer that loses
accuracy its precision does not force (a one-pass variance: E[x^2] - E[x]^2 on inputs with a large
mean), for the float64 judge's replay of watched runs."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck


class OnePassNorm(nn.Module):
    """Layer normalisation with the variance from one pass: cancels catastrophically when the mean
    is large against the spread (a two-pass or Welford variance would not)."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) / torch.sqrt(v.clamp_min(0) + 1e-5)


class OffsetNormNet(nn.Module):
    OFFSET = 1000.0

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(10, 64), OnePassNorm(), nn.Linear(64, 2)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x) + self.OFFSET))


class LargerOffsetNormNet(OffsetNormNet):
    """The same net on inputs with a larger mean: the one-pass variance cancels worse."""

    OFFSET = 30000.0


def norm_run(out, steps: int = 3, bf16: bool = False, net=OffsetNormNet) -> None:
    """``bf16``: the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as a mixed-precision run."""
    convcheck.seed_everything(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x, y = torch.randn(16, 10, generator=g), torch.randint(0, 2, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
