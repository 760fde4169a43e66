"""Training loops written as a user would, set up differently from run to run: the optimizer, its
learning rate or schedule, the seed the model is built from; a run that diverges; and own code whose
``exp`` overflows float16."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck

from .loops import growing_inputs_run


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def cnn_run(out, optimizer: str = "adam", lr: float = 1e-3, model_seed: int = 0, steps: int = 4,
            lr_at: dict | None = None, **settings) -> list[float]:
    """The same batches every time (their own generator); the model built after ``manual_seed(model_seed)``;
    ``lr_at``: {step: lr} set on the optimizer's group before that step (a hand-written schedule);
    ``settings``: the optimizer's other hyperparameters (momentum=, weight_decay=, ...)."""
    torch.manual_seed(model_seed)
    model = SmallCNN()
    opt = (torch.optim.Adam(model.parameters(), lr=lr, **settings) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=lr, **settings))
    g = torch.Generator().manual_seed(1)
    losses = []
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = (lr_at or {}).get(step, group["lr"])
            x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            losses.append(loss.item())
    return losses


class ExpSoftmax(nn.Module):
    """A softmax written by hand, exp of the raw scores (no maximum subtracted): overflows float16."""

    def forward(self, s):
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.soft, self.fc2 = nn.Linear(8, 16), ExpSoftmax(), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.soft(self.fc1(x)))


def exp_run(out, half: bool, steps: int = 4) -> None:
    """Inputs grow 4x a step: under float16 autocast, exp of fc1's output passes 65504 at a later step."""
    torch.manual_seed(0)
    growing_inputs_run(out, ExpNet(), (4, 8), half, steps)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


def regression_run(out, lr: float, steps: int = 5) -> list[float]:
    """Least squares on one fixed batch with plain SGD: past 2 / (the loss's largest curvature) every step
    overshoots further, and the loss grows a little each step (a slow divergence, never 10x)."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(32, generator=g)
    losses = []
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            losses.append(loss.item())
    return losses
