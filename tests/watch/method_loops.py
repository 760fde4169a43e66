"""Training loops as people write them, for issue 42's method: each takes ``out`` and one switch that plants a fault
(or a healthy change of precision). The data are made from a seeded generator, so both runs of a pair see the same
batches; nothing here knows how convcheck decides."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def image_batches(n: int, b: int = 32, seed: int = 3):
    """Four classes of 16x16 images: a bright quadrant each, under noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        y = torch.randint(0, 4, (b,), generator=g)
        x = 0.5 * torch.randn(b, 1, 16, 16, generator=g)
        for i, c in enumerate(y.tolist()):
            r, s = divmod(c, 2)
            x[i, 0, r * 8:(r + 1) * 8, s * 8:(s + 1) * 8] += 1.0
        out.append((x, y))
    return out


def cnn_run(out, precision: str = "fp32", zero_grad: bool = True, wd_on_norms: bool = False, steps: int = 40,
            lr: float = 0.05):
    """SGD with momentum; weight decay on the conv/linear weights only (two groups), or on every parameter in
    one group when ``wd_on_norms``."""
    torch.manual_seed(0)
    model = SmallCNN()
    if wd_on_norms:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-3)
    else:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("bn")]
        rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("bn"))]
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-3}, {"params": rest, "weight_decay": 0.0}],
                              lr=lr, momentum=0.9)
    data = image_batches(steps)
    with convcheck.watch(model, opt, out=out) as w:
        for x, y in data:
            if zero_grad:
                opt.zero_grad()
            with _autocast(precision):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            w.step(loss)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(12, 32), nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.l2(torch.relu(self.l1(x))))


class FineTune(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = Backbone(), nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def finetune_run(out, unfreeze_at: int | None = 5, steps: int = 20):
    """Fine-tuning: the backbone frozen at first and unfrozen at step ``unfreeze_at`` (None: never)."""
    torch.manual_seed(0)
    model = FineTune()
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # every parameter, the frozen ones included
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(12, 3, generator=g)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            if step == unfreeze_at:
                for p in model.backbone.parameters():
                    p.requires_grad_(True)
            x = torch.randn(32, 12, generator=g)
            loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


class VAE(nn.Module):
    def __init__(self, d: int = 20, z: int = 4):
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(d, 32), nn.Linear(32, z), nn.Linear(32, z)
        self.dec1, self.dec2 = nn.Linear(z, 32), nn.Linear(32, d)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec2(torch.relu(self.dec1(z))), mu, logvar


def vae_run(out, kl_sign: float = 1.0, precision: str = "fp32", steps: int = 40, d: int = 20):
    """A VAE's ELBO: reconstruction + KL, the KL's sign as given (-1: the classic sign slip). With many features
    (``d``) the KL is a thousandth of the loss at first, as in an MNIST VAE."""
    torch.manual_seed(0)
    model = VAE(d)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(7)
    basis = torch.randn(4, d, generator=g)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.sigmoid(torch.randn(64, 4, generator=g) @ basis)
            with _autocast(precision):
                recon, mu, logvar = model(x)
                rec = F.binary_cross_entropy_with_logits(recon.float(), x, reduction="sum") / len(x)
                kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
                loss = rec + kl_sign * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


class CharLSTM(nn.Module):
    def __init__(self, vocab: int = 12, h: int = 32):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(vocab, 16), nn.LSTM(16, h, batch_first=True), nn.Linear(h, vocab)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.emb(x), hidden)
        return self.out(y), hidden


def lstm_run(out, lr: float = 1.0, precision: str = "fp32", steps: int = 40):
    """A language model trained on one long sequence in chunks, its hidden state carried over (detached) from
    chunk to chunk as word_language_model does."""
    torch.manual_seed(0)
    model = CharLSTM()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(9)
    text = (torch.arange(12).repeat(400) + torch.randint(0, 2, (4800,), generator=g)) % 12
    stream = text[: (len(text) // 8) * 8].view(8, -1)
    hidden = None
    with convcheck.watch(model, opt, out=out) as w:
        for k in range(steps):
            x, y = stream[:, k * 10:(k + 1) * 10], stream[:, k * 10 + 1:(k + 1) * 10 + 1]
            if hidden is not None:
                hidden = tuple(h.detach() for h in hidden)
            with _autocast(precision):
                logits, hidden = model(x, hidden)
                loss = F.cross_entropy(logits.reshape(-1, 12).float(), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            w.step(loss)


class Generator(nn.Module):
    def __init__(self, z: int = 8, d: int = 16):
        super().__init__()
        self.l1, self.l2 = nn.Linear(z, 32), nn.Linear(32, d)

    def forward(self, z):
        return self.l2(torch.relu(self.l1(z)))


class Discriminator(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.l2(F.leaky_relu(self.l1(x), 0.2))


def gan_run(out, steps: int = 80, precision: str = "fp32", both: bool = False):
    """A GAN whose discriminator learns faster than its generator; the watch on the generator and its optimizer,
    the generator's adversarial loss handed to w.step (it rises from 0.62 to 4.2 as the discriminator wins: by
    design, not divergence). ``both``: the generator and the discriminator watched in one block."""
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g, opt_d = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999)), \
        torch.optim.Adam(D.parameters(), lr=1e-2, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(11)
    centre = torch.randn(16, generator=g)
    bce = nn.BCEWithLogitsLoss()
    watched = convcheck.watch(models={"G": G, "D": D}, optimizers=[opt_g, opt_d], out=out) if both else \
        convcheck.watch(G, opt_g, out=out)
    with watched as w:
        for _ in range(steps):
            real = centre + 0.3 * torch.randn(32, 16, generator=g)
            z = torch.randn(32, 8, generator=g)
            with _autocast(precision):
                fake = G(z)
                d_loss = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            with _autocast(precision):
                g_loss = bce(D(fake), torch.ones(32, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            if not both:
                w.step(g_loss)


def fit_run(out, precision: str = "fp32", steps: int = 120):
    """Full-batch least squares with SGD: float32 drives the loss down many orders of magnitude; bfloat16
    autocast stalls at its own rounding, far higher."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.3
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            with _autocast(precision):
                loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def dcgan_run(out, precision: str = "fp32", flip_labels: bool = False, steps: int = 30):
    """pytorch/examples' DCGAN loop: the watch on netD and its optimizer only; netD is fed netG's fakes detached
    for its own step, then netG steps through netD. ``flip_labels``: the real batch labelled fake (a planted
    fault)."""
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g, opt_d = torch.optim.Adam(G.parameters(), lr=2e-4), torch.optim.Adam(D.parameters(), lr=2e-4)
    g = torch.Generator().manual_seed(11)
    centre = torch.randn(16, generator=g)
    bce = nn.BCEWithLogitsLoss()
    real_label = 0.0 if flip_labels else 1.0
    with convcheck.watch(D, opt_d, out=out) as w:
        for _ in range(steps):
            real = centre + 0.3 * torch.randn(32, 16, generator=g)
            z = torch.randn(32, 8, generator=g)
            with _autocast(precision):
                err_real = bce(D(real), torch.full((32, 1), real_label))
                fake = G(z)
                err_fake = bce(D(fake.detach()), torch.zeros(32, 1))
                err_d = err_real + err_fake
            opt_d.zero_grad()
            err_d.backward()
            opt_d.step()
            w.step(err_d)
            with _autocast(precision):
                err_g = bce(D(fake), torch.ones(32, 1))
            opt_g.zero_grad()
            err_g.backward()
            opt_g.step()


def twin_run(out, dtype=torch.float32, steps: int = 40):
    """A regression script and its float64 twin: the model and every batch cast to ``dtype``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(64, 8, generator=g)
            y = torch.sin(x.sum(1, keepdim=True))
            loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def lbfgs_run(out, zero_grad: bool = True, steps: int = 6):
    """A small LSTM-cell forecaster trained with LBFGS, whose closure evaluates the model up to max_iter times
    a step (zero_grad in the closure, as the LBFGS docs show; ``zero_grad=False`` leaves it out)."""
    torch.manual_seed(0)
    cell, head = nn.LSTMCell(1, 16), nn.Linear(16, 1)
    model = nn.ModuleDict({"cell": cell, "head": head})
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    t = torch.linspace(0, 6.28, 41)
    series = torch.sin(t).unsqueeze(-1)

    class Forecaster(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            h = c = torch.zeros(1, 16)
            outs = []
            for i in range(x.shape[0]):
                h, c = self.net["cell"](x[i:i + 1], (h, c))
                outs.append(self.net["head"](h))
            return torch.cat(outs)

    forecaster = Forecaster()
    with convcheck.watch(forecaster, opt, out=out) as w:
        for _ in range(steps):
            def closure():
                if zero_grad:
                    opt.zero_grad()
                loss = F.mse_loss(forecaster(series[:-1]), series[1:])
                loss.backward()
                return loss
            loss = opt.step(closure)
            w.step(loss)


def mlp_run(out, p: float = 0.1, label_offset: int = 0, freeze_at: int | None = None, steps: int = 20):
    """A classifier with dropout and an nn.CrossEntropyLoss criterion; ``p`` its dropout, ``label_offset`` a label
    mapping bug ((y + offset) % classes), ``freeze_at``: the first layer's requires_grad turned off at that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(21)
    teacher = torch.randn(12, 4, generator=g)
    with convcheck.watch(model, opt, out=out) as w:
        for step in range(steps):
            if step == freeze_at:
                for q in model[0].parameters():
                    q.requires_grad_(False)
            x = torch.randn(32, 12, generator=g)
            y = ((x @ teacher).argmax(1) + label_offset) % 4
            torch.manual_seed(100 + step)  # the same dropout masks in both runs
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
