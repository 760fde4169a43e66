"""Training loops as users write them, each with one of issue 34's problems: a gradient-accumulation loop
that forgets to divide the loss, label smoothing and class weights on one side only, weights kept in
bfloat16 under plain SGD, a fixed loss scale of 2**24 under float16 autocast, a sharp float16 attention
whose query/key gradients underflow to exactly zero."""

from __future__ import annotations

import torch
import torch.nn as nn

import convcheck


class MLP(nn.Module):
    def __init__(self, d: int = 20, h: int = 64, c: int = 5):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, c)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batches(n: int, b: int = 16, d: int = 20, c: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` learnable batches (a random linear teacher), the same on every call."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(d, c, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(b, d, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def accumulation_run(out, divide: bool = True, bf16: bool = False, steps: int = 6, micro: int = 4) -> None:
    """SGD with momentum, ``micro`` micro-batches a step; the loss divided by ``micro`` when ``divide``."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(steps * micro)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            for i in range(micro):
                x, y = data[step * micro + i]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = nn.functional.cross_entropy(model(x), y)
                if divide:
                    loss = loss / micro
                loss.backward()
                total += loss.item()
            opt.step()
            w.step(total)


def smoothing_run(out, smooth: bool = False, bf16: bool = False, steps: int = 8) -> None:
    """Adam; ``smooth``: label smoothing 0.3 and class weights (a recipe one side was given)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    weight = torch.tensor([1.0, 4.0, 1.0, 0.25, 1.0]) if smooth else None
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x * 4)  # features in [-12, 12]: the first logits are far from uniform
            loss = nn.functional.cross_entropy(logits.float(), y, weight=weight,
                                               label_smoothing=0.3 if smooth else 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def bf16_weights_run(out, bf16: bool = True, steps: int = 30) -> None:
    """Plain SGD at lr 1e-3; ``bf16``: the model cast with ``model.to(torch.bfloat16)`` (no master weights)."""
    torch.manual_seed(0)
    model = MLP()
    if bf16:
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            logits = model(x.to(torch.bfloat16) if bf16 else x)
            loss = nn.functional.cross_entropy(logits.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def loss_scale_run(out, fp16: bool = True, scale: float = 2.0**24, steps: int = 3) -> None:
    """A hand-written static loss scale: (loss * scale).backward(), the gradients divided back before the step."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            (loss * scale).backward()
            for p in model.parameters():
                p.grad /= scale
            opt.step()
            w.step(loss)


class SharpAttention(nn.Module):
    """Attention with a learned-looking sharpness of 8 on its scores: its softmax saturates."""

    def __init__(self, d: int = 16, sharpness: float = 8.0):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.sharpness = sharpness

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2) * self.sharpness
        return torch.softmax(s, -1) @ self.v(x)


class SharpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.att, self.head = nn.Linear(8, 16), SharpAttention(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.att(self.embed(x)).mean(1))


def sharp_attention_run(out, fp16: bool, steps: int = 4) -> None:
    """Inputs of std 6 under float16 autocast: the saturated softmax's gradients flush to zero in float16."""
    torch.manual_seed(0)
    model = SharpNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(4, 6, 8, generator=g) * 6
            y = torch.randint(0, 3, (4,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def weight_decay_run(out, weight_decay: float = 0.5, bf16: bool = False, steps: int = 30) -> None:
    """SGD at lr 0.1 with a weight decay typed as 5e-1 where 5e-4 was meant: the weights shrink 5% a step."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=weight_decay)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def clip_run(out, max_norm: float | None = None, steps: int = 16) -> None:
    """SGD on inputs of std 3; ``max_norm``: the loop clips its gradients (clip_grad_norm_) before the step."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            loss = nn.functional.cross_entropy(model(x * 3), y)
            opt.zero_grad()
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            w.step(loss)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(20, 64), nn.BatchNorm1d(64), nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def eval_run(out, forget_train: bool = False, steps: int = 12) -> None:
    """A validation pass after step 4 (model.eval() under no_grad); ``forget_train``: model.train() is not called
    again, so the rest of training runs in eval mode."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    val_x, val_y = batches(1, b=32)[0]
    with convcheck.watch(model, opt, out=out) as w:
        for step, (x, y) in enumerate(batches(steps)):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step == 4:
                model.eval()
                with torch.no_grad():
                    nn.functional.cross_entropy(model(val_x), val_y)
                if not forget_train:
                    model.train()


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 5))

    def forward(self, x):
        return self.net(x)


def dropout_run(out, seed: int, steps: int = 6) -> None:
    """The same initial weights (seed 0) and batches; the generator reseeded with ``seed`` before training, as a
    script that seeds once per run with a run number would."""
    torch.manual_seed(0)
    model = DropoutMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(seed)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in batches(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def embedding_run(out, steps: int = 2) -> None:
    """Token ids through an embedding, as a text model's first layer."""
    torch.manual_seed(0)
    model = EmbeddingNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            ids, y = torch.randint(0, 50, (4, 7), generator=g), torch.randint(0, 3, (4,), generator=g)
            loss = nn.functional.cross_entropy(model(ids), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
