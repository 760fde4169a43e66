"""A user's own training loop recorded in several precisions (the new-user trial's): its own Dataset and
DataLoader, AdamW with a cosine schedule and clipping, and ``convcheck.watch`` around it."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import convcheck


class SensorDataset(Dataset):
    """Three classes around fixed centres in 6 features; ``offset``: raw readings (kelvin ~ 300)."""

    def __init__(self, offset: float = 0.0, n: int = 1024):
        g = torch.Generator().manual_seed(123)
        centers = torch.tensor([[1, 0, 0, 1, 0, -1], [0, 1, -1, 0, 1, 0], [-1, -1, 1, 0, 0, 1]], dtype=torch.float32)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = centers[self.y] + 0.6 * torch.randn(n, 6, generator=g) + offset

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class TabularNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.act = nn.Linear(6, 64), nn.LayerNorm(64), nn.GELU()
        self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.act(self.ln(self.fc1(x))))))


class Standardize(nn.Module):
    """Per-sample standardisation written as E[x^2] - E[x]^2: cancels catastrophically on ~300 offsets."""

    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mu * mu
        return (x - mu) / torch.sqrt(var.clamp_min(0) + 1e-5)


class RawSensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.fc3 = Standardize(), nn.Linear(6, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(self.norm(x))))))


def sensor_run(out, precision: str = "fp32", raw: bool = False, seed: int = 0, steps: int = 30) -> list[float]:
    """``precision``: fp32, autocast-bf16 (autocast around the forward), bf16 (``model.to(bfloat16)`` and
    the inputs cast to it)."""
    torch.manual_seed(seed)
    model, ds = (RawSensorNet(), SensorDataset(offset=300.0)) if raw else (TabularNet(), SensorDataset())
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    loader = DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    losses = []
    with convcheck.watch(model, opt, out=out) as w:
        while len(losses) < steps:
            for x, y in loader:
                if precision == "bf16":
                    x = x.to(torch.bfloat16)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast-bf16"):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                w.step(loss)
                losses.append(loss.item())
                if len(losses) == steps:
                    break
    return losses


TEMP = 0.05


def my_ce(logits, y):
    """Cross-entropy with a temperature and a naive log-sum-exp: exp(logits / 0.05) overflows float16."""
    z = logits / TEMP
    lse = torch.log(torch.exp(z).sum(dim=1))
    return (lse - z.gather(1, y[:, None]).squeeze(1)).mean()


def lse_run(out, fp16: bool, steps: int = 12) -> list[float]:
    torch.manual_seed(0)
    model = TabularNet()
    loader = DataLoader(SensorDataset(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = my_ce(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            w.step(loss)
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses
