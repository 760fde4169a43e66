"""Training code written as a user would, with a NaN made in the user's own code (issue 24): a loss
function, a hand-written attention. Each has its healthy counterpart (the stable formula)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


def focal_loss(logits, target, gamma: float = 2.0):
    """Focal loss with a naive softmax: exp(logits) / sum overflows float16 once a logit passes ~11."""
    e = torch.exp(logits)
    p = e / e.sum(dim=1, keepdim=True)
    pt = p.gather(1, target[:, None]).squeeze(1)
    return (-(1 - pt) ** gamma * torch.log(pt + 1e-4)).mean()


def stable_focal_loss(logits, target, gamma: float = 2.0):
    """The same loss from log_softmax: no exp of the raw logits."""
    logp = F.log_softmax(logits.float(), dim=1).gather(1, target[:, None]).squeeze(1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


def hand_bce(logits, target):
    """YOLO-style multi-label BCE written by hand: log(1 - sigmoid(z)) is log(0) = -inf in bfloat16 once
    sigmoid rounds to 1 (z past ~6)."""
    y = F.one_hot(target, logits.shape[1]).to(logits.dtype)
    p = torch.sigmoid(logits)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def stable_bce(logits, target):
    y = F.one_hot(target, logits.shape[1]).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, y)


class HandAttention(nn.Module):
    """Self-attention over the pixels of a feature map written by hand: softmax as exp(q.k) / sum,
    energies neither scaled by 1/sqrt(d) nor shifted by their maximum."""

    def __init__(self, channels: int, stable: bool = False):
        super().__init__()
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.stable = stable

    def forward(self, x):
        n, c, h, w = x.shape
        q = self.q(x).flatten(2).transpose(1, 2)
        k = self.k(x).flatten(2)
        energy = torch.bmm(q, k)
        if self.stable:
            att = torch.softmax(energy / c ** 0.5, dim=-1)
        else:
            e = torch.exp(energy)
            att = e / e.sum(dim=-1, keepdim=True)
        return x + torch.bmm(x.flatten(2), att.transpose(1, 2)).view(n, c, h, w)


def attention_net(stable: bool = False, channels: int = 16) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         HandAttention(channels, stable), nn.Flatten(), nn.Linear(channels * 7 * 7, 10))


def stable_attention_net() -> nn.Module:
    return attention_net(stable=True)


def groupnorm_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


def adamw(params):
    """The user's own optimizer factory: AdamW with its default eps 1e-8 (0 in float16)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-8, weight_decay=1e-2)



def linear_warmup(optimizer, steps):
    """Linear warm-up over 1% of the run, written with numpy: a run under 100 steps has a warm-up of 0
    steps, and 0/0 is NaN (numpy warns, it does not raise)."""
    warmup = steps // 100
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(np.float64(s) / warmup, 1.0))


class Sharpened(nn.Module):
    """Logits divided by a small temperature (a user's "sharper" classifier): they start near 20."""

    def __init__(self, body: nn.Module, temperature: float = 0.02):
        super().__init__()
        self.body, self.temperature = body, temperature

    def forward(self, x):
        return self.body(x) / self.temperature


def sharpened_mlp() -> nn.Module:
    return Sharpened(mlp())


class OnePassLayerNorm(nn.Module):
    """A channel LayerNorm written by hand with the one-pass variance E[x^2] - E[x]^2: a leaf of the user's
    own code (no children). On activations with a large mean the two terms cancel; in bfloat16 the
    difference comes out negative and sqrt makes NaN."""

    def __init__(self, c: int, eps: float = 1e-5, two_pass: bool = False):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.eps, self.two_pass = eps, two_pass

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        if self.two_pass:
            var = ((x - mean) ** 2).mean(dim=1, keepdim=True)
        else:
            var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        x = (x - mean) / torch.sqrt(var + self.eps)
        return x * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class OffsetNormNet(nn.Module):
    def __init__(self, two_pass: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.norm = OnePassLayerNorm(16, two_pass=two_pass)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.head = nn.Linear(32 * 14 * 14, 10)

    def forward(self, x):
        x = F.gelu(self.norm(self.conv1(x) + 40.0))  # activations with a large mean, as after a bias drift
        return self.head(F.gelu(self.conv2(x)).flatten(1))


def one_pass_norm_net() -> nn.Module:
    return OffsetNormNet()


def two_pass_norm_net() -> nn.Module:
    return OffsetNormNet(two_pass=True)


class TemperatureNet(nn.Module):
    """A classifier whose logits are sharpened by a temperature of 8: confident early, so a wrong label's
    softmax probability gets tiny."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
        self.temperature = 8.0

    def forward(self, x):
        return self.body(x) * self.temperature


def temperature_net() -> nn.Module:
    return TemperatureNet()


def noisy_prototypes():
    """Ten class prototypes plus noise, 10% of the labels flipped at random (label noise, as real data has)."""
    g = torch.Generator().manual_seed(0)
    n = 2048
    y = torch.randint(0, 10, (n,), generator=g)
    protos = torch.randn(10, 1, 16, 16, generator=g)
    x = protos[y] + 0.5 * torch.randn(n, 1, 16, 16, generator=g)
    flip = torch.rand(n, generator=g) < 0.1
    y = torch.where(flip, torch.randint(0, 10, (n,), generator=g), y)
    return torch.utils.data.TensorDataset(x, y)


def log_of_softmax_loss(logits, target):
    """Cross-entropy as -log(softmax(x)[y]): finite forward while p >= float16's smallest subnormal, but the
    backward of log is 1/p, which passes 65504 once p < 1.5e-5 (a confidently wrong, noisy label)."""
    p = torch.softmax(logits, dim=1)
    return -torch.log(p.gather(1, target[:, None])).mean()


class NegativeBiasMLP(nn.Module):
    """Biases 'initialised' to a large negative value by mistake: every ReLU is dead from the start."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 10))
        for m in self.net:
            if isinstance(m, nn.Linear) and m.out_features == 128:
                nn.init.constant_(m.bias, -20.0)

    def forward(self, x):
        return self.net(x)


def negative_bias_mlp() -> nn.Module:
    return NegativeBiasMLP()


class HandL2Norm(nn.Module):
    """Features normalised by hand: the sum of squares overflows float16 once the features grow (in
    training), giving Inf, and h / sqrt(Inf) then zeroes those rows: no NaN/Inf leaves the module."""

    def forward(self, h):
        return h / torch.sqrt((h * h).sum(-1, keepdim=True) + 1e-6)


class CosineHeadNet(nn.Module):
    """A cosine-classifier-like head on unnormalised inputs (pixels scaled by 12)."""

    def __init__(self):
        super().__init__()
        self.flat, self.fc1, self.l2, self.fc2 = nn.Flatten(), nn.Linear(256, 64), HandL2Norm(), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(self.l2(self.fc1(self.flat(x) * 12.0)) * 10.0)


def cosine_head_net() -> nn.Module:
    return CosineHeadNet()


class GramNorm(nn.Module):
    """The one-pass variance with its sum of squares written as an einsum (``bmm`` underneath: TF32 on a
    GPU): a leaf of the user's own code whose matmul reads its operands at the target's matmul precision."""

    def forward(self, x):
        n = x.shape[-1]
        m = x.mean(-1, keepdim=True)
        sq = torch.einsum("bi,bi->b", x, x).unsqueeze(-1) / n
        return (x - m) / torch.sqrt((sq - m * m).clamp_min(0) + 1e-5)


class PixelGramNet(nn.Module):
    """Raw 0..255 pixels (not normalised) through a Linear, then the einsum variance."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3 * 8 * 8, 64)
        self.norm = GramNorm()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = x.flatten(1) * 255.0 + 128.0
        return self.fc2(F.relu(self.norm(self.fc1(x))))


class SensorGramNet(nn.Module):
    """Sensor readings around 100, normalised in the model by the einsum variance."""

    def __init__(self):
        super().__init__()
        self.norm = GramNorm()
        self.fc1 = nn.Linear(192, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = x.flatten(1) + 100.0
        return self.fc2(F.relu(self.fc1(self.norm(x))))


def pixel_gram_net() -> nn.Module:
    return PixelGramNet()


def sensor_gram_net() -> nn.Module:
    return SensorGramNet()


class EinsumLinear(nn.Module):
    """A linear layer written by hand with einsum (a leaf with a parameter: its gradient is a matmul too)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)

    def forward(self, x):
        return torch.einsum("bi,oi->bo", x, self.weight)


class EinsumMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = EinsumLinear(3 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def einsum_mlp() -> nn.Module:
    return EinsumMLP()
