"""A plain training loop diagnosed with ``convcheck.watch`` (issue 25): run it twice, then diff.

    CONVCHECK_PRECISION=fp32 python examples/watch_loop.py runs/fp32
    CONVCHECK_PRECISION=fp16 python examples/watch_loop.py runs/fp16
    convcheck diff runs/fp32 runs/fp16

The model's hand-written attention has no 1/sqrt(d) and its inputs grow step by step: under float16
autocast its scores overflow at a later step; in float32 nothing happens.
"""

import os
import sys

import torch
import torch.nn as nn

import convcheck


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        return torch.softmax(s, -1) @ self.v(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.att, self.head = nn.Linear(8, 16), Attention(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.att(self.embed(x)).mean(1))


def main(out: str) -> None:
    half = os.environ.get("CONVCHECK_PRECISION", "fp32") == "fp16"
    convcheck.seed_everything(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, force=True) as w:      # line 1
        for step in range(6):
            x = torch.randn(4, 5, 8, generator=g) * (4.0 ** step)
            y = torch.randint(0, 3, (4,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)                                              # line 2 (optional)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/watch")
