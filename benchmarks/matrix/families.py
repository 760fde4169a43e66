"""The verdict matrix's model families (issue 42): small models a user would write, each on learnable synthetic
data drawn from a seeded generator, so that two runs of a family see the same data and the same initial weights by
construction. One run of ~32 steps takes well under a second on one CPU thread.

A family says how to build its model, its dataset (a list of equally sized batches; the loop picks their order),
how to compute its loss from a batch, which parameters are its ``backbone`` (frozen by the frozen-parameters fault),
which module is its ``head`` (left out of the optimizer by the wrong-param-group fault), and what it supports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Family:
    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[], list]  # the dataset as batches, in their natural order
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    lr: float
    backbone: tuple  # parameter-name prefixes of the backbone
    head: str  # the head module's name (a prefix of its parameters' names)
    kind: str = "classify"  # "classify" (logits, integer labels), "lm" (carried hidden state), "vae", "gan"
    weight_decay: float = 0.05
    temperature: float = 0.2  # the log-softmax fault's temperature: float32 stays finite, float16's softmax hits 0
    supports: set = field(default_factory=set)  # optional features: "fp16" (autocast float16 runs)
    about: str = ""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- MLP: a 4-class teacher problem ------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 48, c: int = 4):
        super().__init__()
        self.fc1, self.fc2, self.drop, self.head = nn.Linear(d, h), nn.Linear(h, h), nn.Dropout(0.1), nn.Linear(h, c)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


def mlp_batches(n: int = 40, b: int = 32, d: int = 16, c: int = 4) -> list:
    g = _gen(11)
    teacher = torch.randn(d, c, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(b, d, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


# --- CNN with BatchNorm: noisy class templates on 12x12 images -------------------------------------------------------
class CNN(nn.Module):
    def __init__(self, c: int = 4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * 3 * 3, c)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def image_batches(n: int = 40, b: int = 16, ch: int = 1, size: int = 12, c: int = 4, seed: int = 12) -> list:
    g = _gen(seed)
    templates = torch.randn(c, ch, size, size, generator=g)
    out = []
    for _ in range(n):
        y = torch.randint(0, c, (b,), generator=g)
        x = templates[y] + 1.5 * torch.randn(b, ch, size, size, generator=g)
        out.append((x, y))
    return out


# --- a small ResNet: residual blocks with BatchNorm ------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + idt)


class ResNet(nn.Module):
    def __init__(self, c: int = 4):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.layer1, self.layer2 = Block(8, 8, 1), Block(8, 16, 2)
        self.head = nn.Linear(16, c)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        return self.head(x.mean((2, 3)))


# --- a character-level GRU language model, its hidden state carried across batches (word_language_model) ----------
VOCAB = 12


def token_stream(n: int, seed: int = 14) -> torch.Tensor:
    """A seeded Markov chain over VOCAB symbols with a sharp transition table: learnable next-token structure."""
    g = _gen(seed)
    table = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=g), 1)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    u = torch.rand(n, generator=g)
    cdf = table.cumsum(1)
    for i in range(1, n):
        out[i] = int(torch.searchsorted(cdf[out[i - 1]], u[i].clamp(max=cdf[out[i - 1]][-1] - 1e-6)))
    return out


class CharGRU(nn.Module):
    def __init__(self, v: int = VOCAB, d: int = 16, h: int = 32):
        super().__init__()
        self.embed, self.drop = nn.Embedding(v, d), nn.Dropout(0.2)
        self.rnn = nn.GRU(d, h, batch_first=True)
        self.head = nn.Linear(h, v)

    def forward(self, x, hidden=None):
        out, hidden = self.rnn(self.drop(self.embed(x)), hidden)
        return self.head(self.drop(out)), hidden


def lm_batches(n: int = 40, b: int = 8, t: int = 12, seed: int = 14) -> list:
    """batchify as word_language_model does: b streams side by side, consecutive windows of t tokens."""
    stream = token_stream(b * (n * t + 1), seed).view(b, -1)
    return [(stream[:, i * t:(i + 1) * t], stream[:, i * t + 1:(i + 1) * t + 1]) for i in range(n)]


# --- a small causal Transformer: token ids, learned positions, TransformerEncoderLayer with a causal mask ----------
class TinyTransformer(nn.Module):
    def __init__(self, v: int = VOCAB, d: int = 32, t: int = 12):
        super().__init__()
        self.embed, self.pos = nn.Embedding(v, d), nn.Embedding(t, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1, batch_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, v)

    def forward(self, x):
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.block(self.embed(x) + self.pos(pos), src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


# --- a VAE: reparameterisation and a KL term ----------------------------------------------------------------------
class VAE(nn.Module):
    def __init__(self, d: int = 32, h: int = 48, z: int = 4):
        super().__init__()
        self.enc, self.drop = nn.Linear(d, h), nn.Dropout(0.1)
        self.mu, self.logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.dec1, self.head = nn.Linear(z, h), nn.Linear(h, d)

    def forward(self, x):
        h = self.drop(torch.relu(self.enc(x)))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.head(torch.relu(self.dec1(z))), mu, logvar


def vae_batches(n: int = 40, b: int = 32, d: int = 32) -> list:
    """Binary vectors: noisy copies of 6 prototypes."""
    g = _gen(15)
    protos = (torch.rand(6, d, generator=g) < 0.5).float()
    out = []
    for _ in range(n):
        k = torch.randint(0, 6, (b,), generator=g)
        flip = (torch.rand(b, d, generator=g) < 0.05).float()
        out.append(((protos[k] - flip).abs(), k))
    return out


# --- a GAN on 2-d points (a ring of 8 Gaussians); the watched model is the discriminator ---------------------------
class Generator(nn.Module):
    def __init__(self, z: int = 8, h: int = 32):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(z, h), nn.BatchNorm1d(h), nn.Linear(h, 2)

    def forward(self, z):
        return self.fc2(torch.relu(self.bn(self.fc1(z))))


class Discriminator(nn.Module):
    def __init__(self, h: int = 32):
        super().__init__()
        self.fc1, self.drop, self.fc2, self.head = nn.Linear(2, h), nn.Dropout(0.2), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        h = F.leaky_relu(self.fc1(x), 0.2)
        return self.head(F.leaky_relu(self.fc2(self.drop(h)), 0.2))


class GAN(nn.Module):
    """Holds G and D so that one build makes both from the same seed; the loop trains them with two optimizers."""

    def __init__(self):
        super().__init__()
        self.g, self.d = Generator(), Discriminator()


def ring_batches(n: int = 40, b: int = 32) -> list:
    g = _gen(16)
    out = []
    for _ in range(n):
        k = torch.randint(0, 8, (b,), generator=g)
        ang = k.float() * (2 * math.pi / 8)
        pts = torch.stack([torch.cos(ang), torch.sin(ang)], 1) * 2 + 0.05 * torch.randn(b, 2, generator=g)
        out.append((pts, k))
    return out


FAMILIES = {
    "mlp": Family("mlp", MLP, mlp_batches, "sgd", 0.2, ("fc1.",), "head", supports={"fp16"},
                  about="MLP, 4-class teacher, dropout, SGD momentum"),
    "cnn": Family("cnn", CNN, image_batches, "sgd", 0.05, ("conv1.", "bn1."), "head", supports={"fp16"},
                  about="2 conv + BatchNorm, 12x12 templates, SGD momentum"),
    "resnet": Family("resnet", ResNet, lambda: image_batches(ch=3, size=8, seed=13), "sgd", 0.05,
                     ("stem.", "bn.", "layer1."), "head", temperature=0.15, supports={"fp16"},
                     about="stem + 2 residual BN blocks, 3x8x8 templates, SGD momentum"),
    "gru": Family("gru", CharGRU, lm_batches, "sgd", 0.5, ("embed.", "rnn."), "head", kind="lm", temperature=0.35, supports={"fp16"},
                  about="char GRU LM, Markov text, hidden state carried across batches (.detach())"),
    "transformer": Family("transformer", TinyTransformer, lm_batches, "adamw", 3e-3, ("embed.", "pos."), "head",
                          weight_decay=0.1, temperature=0.1, supports={"fp16"},
                          about="1 TransformerEncoderLayer, learned positions, causal mask, AdamW"),
    "vae": Family("vae", VAE, vae_batches, "adamw", 3e-3, ("enc.",), "head", kind="vae", weight_decay=0.1,
                  supports={"fp16"}, about="VAE, reparameterisation + KL, binary prototypes, AdamW"),
    "gan": Family("gan", GAN, ring_batches, "adamw", 2e-3, ("fc1.",), "head", kind="gan", weight_decay=0.0,
                  supports={"fp16"}, about="GAN on a ring of 8 Gaussians, G and D, two Adam optimizers; D watched"),
}
