"""Small models that really have the problems the scenario tests are about."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class NaiveNorm(nn.Module):
    """Per-sample normalisation with the variance computed as E[x^2] - E[x]^2.

    Exact in float32 for these inputs, but in bfloat16 (8-bit mantissa) the two
    terms are ~900 apart from a variance of ~1, so every digit cancels away.
    """

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        var = (x * x).mean(dim=(1, 2, 3), keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(1e-5))


class Offset(nn.Module):
    """Adds a large constant: the input of NaiveNorm sits far from zero."""

    def __init__(self, value: float = 30.0):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x + self.value


def cancelling_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), Offset(30.0), NaiveNorm(), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10),
    )


class Gain(nn.Module):
    """Multiplies by a large constant and divides it out in the next layer: harmless in
    float32, an overflow past float16's 65504 in between."""

    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def overflow_net() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), Gain(1e5), Gain(1e-5), nn.Linear(64, 10),
    )


def deep_sigmoid_net(depth: int = 12) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, 32), nn.Sigmoid()]
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    layers.append(nn.Linear(32, 10))
    return nn.Sequential(*layers)


class FunctionalDropout(nn.Module):
    """Dropout drawn with F.dropout inside forward: no module convcheck can share masks for."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


def functional_dropout_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), FunctionalDropout(), nn.Linear(64, 10))


def module_dropout_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


class CancellingPool(nn.Module):
    """Average pooling computed as ``pool(x + offset) - offset``: exact in float64, a rounding of
    ~1e-4 relative in float32, and all zeros in bfloat16 (x + 1000 keeps no digit of x < 2)."""

    def __init__(self, size: int = 4, offset: float = 1000.0):
        super().__init__()
        self.size, self.offset = size, offset

    def forward(self, x):
        return F.adaptive_avg_pool2d(x + self.offset, self.size) - self.offset


def cancelling_pool_net() -> nn.Module:
    """Conv, ReLU, the cancelling pool, then a Linear: in bf16 the Linear sees only zeros, so its
    weight gradient is all zeros (which once read as a gradient underflow there)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), CancellingPool(4), nn.Flatten(),
                         nn.Linear(8 * 16, 10))


class LateGain(nn.Module):
    """Multiplies by 1e5 from its ``start``-th training forward on (a stand-in for activations that
    grow during training): harmless in float32, an overflow past float16's 65504 from then on.
    The next ``Gain(1e-5)`` divides it out."""

    def __init__(self, start: int):
        super().__init__()
        self.start, self.calls = start, 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
        return x * 1e5 if self.calls >= self.start else x * 1.0


def late_overflow_net(start: int = 6) -> nn.Module:
    """Finite at parity (its one step) and for the first ``start - 1`` training steps in float16;
    from training step ``start - 1`` (0-based) on, 'late' overflows."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), LateGain(start), Gain(1e-5),
                         nn.Linear(64, 10))


class Center(nn.Module):
    """Subtracts each sample's mean. Harmless itself, but its input here (features near 1000 that
    vary by ~1) cannot be held in bfloat16, whose spacing at 1000 is 8: rounding the input alone
    loses the result (an ill-conditioned layer at that precision, not a wrong one)."""

    def forward(self, x):
        return x - x.mean(dim=(1, 2, 3), keepdim=True)


def offset_center_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), Offset(1000.0), Center(), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 14 * 14, 10))


# --- code inside modules with children (their own code) ---------------------------------------

class NaiveAttention(nn.Module):
    """Self-attention over the pixels of a feature map, energies not scaled by 1/sqrt(d): with
    features of a few hundred, q.k reaches ~1e5, past float16's 65504; softmax turns the Inf
    into NaN. Its arithmetic is its own code: the 1x1 projections are its only children."""

    def __init__(self, channels: int):
        super().__init__()
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        n, c, h, w = x.shape
        q = self.q(x).flatten(2).transpose(1, 2)
        k = self.k(x).flatten(2)
        energies = torch.bmm(q, k)
        attn = torch.softmax(energies, dim=-1)
        out = torch.bmm(attn, self.v(x).flatten(2).transpose(1, 2))
        return x + out.transpose(1, 2).reshape(n, c, h, w)


class AttentionNet(nn.Module):
    def __init__(self, gain: float = 200.0):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 16, 3, stride=4, padding=1), nn.ReLU(), Gain(gain))
        self.attn = NaiveAttention(16)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 7 * 7, 10))

    def forward(self, x):
        return self.head(self.attn(self.encoder(x)))


def attention_overflow_net() -> nn.Module:
    return AttentionNet(200.0)


def attention_net() -> nn.Module:
    """The same attention at a scale float16 holds (energies of a few units)."""
    return AttentionNet(1.0)


class OffsetResidual(nn.Module):
    """A residual block whose ``out + identity`` is written as ``(out + 64 identity) - 63 identity``
    (a shift trick): exact in float64, but in bfloat16 the sum with 64 identity rounds away ~6
    of ``out``'s 8 bits. Its children (convs, BatchNorms, ReLU) are all healthy."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = (out + identity * 64.0) - identity * 63.0
        return self.relu(out)


def lossy_residual_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(), OffsetResidual(8),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10),
    )


class RacyScatter(nn.Module):
    """``out[:, slot] = x`` with 64 features written into 16 slots (duplicate indices): which write
    wins is up to the kernel - ``index_put`` without accumulation, which PyTorch documents as
    nondeterministic. Here the write order changes on every call anywhere (a class-wide counter),
    as a parallel kernel's order may: the same input gives a different output run to run."""

    calls = 0

    def __init__(self, features: int = 64, slots: int = 16):
        super().__init__()
        self.features = features
        self.register_buffer("slot", torch.arange(features) % slots)
        self.slots = slots

    def forward(self, x):
        RacyScatter.calls += 1
        order = torch.tensor([(k * 37 + RacyScatter.calls * 11) % self.features for k in range(self.features)])
        out = x.new_zeros(x.shape[0], self.slots)
        out[:, self.slot[order]] = x[:, order]
        return out


def racy_scatter_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), RacyScatter(), nn.Linear(16, 10))
