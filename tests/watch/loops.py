"""Small training loops written as a user would, each with a real problem planted (or none)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import convcheck


class Attention(nn.Module):
    """Hand-written attention with no 1/sqrt(d): its scores overflow float16 once the inputs grow."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        return torch.softmax(s, -1) @ self.v(x)


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.att, self.head = nn.Linear(8, 16), Attention(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.att(self.embed(x)).mean(1))


def attention_run(out, half: bool, steps: int = 6) -> None:
    """Inputs grow 4x a step: float16 autocast overflows in the attention scores at a later step."""
    convcheck.seed_everything(0)
    growing_inputs_run(out, AttentionNet(), (4, 5, 8), half, steps)


def growing_inputs_run(out, model: nn.Module, shape: tuple, half: bool, steps: int) -> None:
    """A watched SGD loop whose inputs grow 4x a step, under float16 autocast with ``half``, 3 classes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            x = torch.randn(*shape, generator=g) * (4.0 ** step)
            y = torch.randint(0, 3, (shape[0],), generator=g)
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


class OffsetNet(nn.Module):
    """Adds and removes a large offset in its own code: bfloat16 (8 bits) keeps none of the features."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 2)

    def forward(self, x):
        h = self.fc1(x)
        h = (h + 300.0) - 300.0
        return self.fc3(torch.relu(self.fc2(h)))


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g))


def offset_run(out, bf16: bool = False, shuffle: bool = False, steps: int = 4) -> list[float]:
    """A plain loop over a DataLoader; ``shuffle`` without a seeded generator (the planted data difference)."""
    convcheck.seed_everything(0)
    model = OffsetNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(), batch_size=8, shuffle=shuffle,
                        generator=None if shuffle else torch.Generator().manual_seed(0))
    if shuffle:
        torch.manual_seed(torch.seed())  # a run seeded nowhere: the order changes from run to run
    losses = []
    with convcheck.watch(model, opt, out=out) as w:
        for step, (x, y) in zip(range(steps), loader):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            losses.append(loss.item())
    return losses


def unhashed(run) -> None:
    """The watched run at ``run`` as one recorded before the watch kept its files' SHA-256 (no ``steps_sha256``,
    no snapshot ``sha256``): a test that edits a file to check what the reader says of its fields."""
    import json
    from pathlib import Path

    path = Path(run) / "manifest.json"
    m = json.loads(path.read_text())
    m.pop("steps_sha256", None)
    for e in m.get("snapshots", []):
        e.pop("sha256", None)
    path.write_text(json.dumps(m))
