"""A held-out verdict matrix: families and kinds the watched diff's method was never tuned on.

``benchmarks/verdict_matrix.py --set heldout`` runs it (results in ``benchmarks/results/verdict_matrix-heldout.md``).
The matrix of ``families.py``/``cases.py`` was looked at while the diff's method was tuned; this one was written
afterwards, by someone who did not tune it, to measure how the method generalises. It shares nothing with the
tuned matrix but the scoring (``cases.named``, ``CaseInvalid``): its own model families (an MSE regression, a 1-D
conv net on audio-like sequences, a small U-Net with per-pixel cross-entropy, a packed-sequence LSTM classifier, a
tiny ViT, a siamese net with a contrastive loss), its own loop (``train`` below, a loop as a user writes it, with
every knob a planted fault or a healthy variation turns) and its own faults (gradient clipping, dropout p, batch
size, momentum/betas, loss reduction, BatchNorm momentum, one layer's init seed, a missing warm-up, accumulation
without dividing, a double backward, requires_grad turned off mid-run, a noise augmentation, a label shift, fp16
``model.half()`` gradient underflow, bf16 weights under Adam with a tiny lr, an ``exp`` overflow in a hand-written
activation under fp16 autocast) and healthy variations.

Each case states its truth (category, and words one of which the verdict must hold for the cause to count as named)
and a plain-torch check (no convcheck imported) that the fault does what it claims; a fault that does not show is
``INVALID`` (a bug of this matrix, never scored).
"""

from __future__ import annotations

import os
import contextlib
import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

from .cases import CaseInvalid, named  # noqa: F401  (named: the scoring, shared with the tuned matrix)

STEPS = int(os.environ.get("CONVCHECK_MATRIX_STEPS") or 30)  # verdict_matrix.py --steps: a short matrix
WARMUP = 8


# --- the knobs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HRun:
    clip: float | None = None  # torch.nn.utils.clip_grad_norm_(params, clip) before optimizer.step()
    dropout: float | None = None  # the dropout p (None: the family's)
    batch: int | None = None  # the DataLoader's batch size (None: the family's)
    momentum: float | None = None  # SGD momentum / Adam beta1 (None: 0.9)
    reduction: str = "mean"  # the loss's reduction
    bn_momentum: float = 0.1
    init_seed: int | None = None  # the family's ``init_layer`` re-initialised from this seed
    warmup: bool = True  # LambdaLR linear warm-up over WARMUP steps
    accum: int = 1  # micro-batches per optimizer step (each batch split in ``accum``)
    accum_divide: bool = True  # the loss / accum
    double_backward: bool = False  # loss.backward(retain_graph=True); loss.backward()
    freeze_at: int | None = None  # at this step the family's ``freeze`` layer gets requires_grad_(False)
    noise: float = 0.0  # an augmentation: x + noise * randn (seeded) in this run only
    label_shift: int = 0  # y -> (y + k) % classes
    half: bool = False  # model.half(), inputs .half(), no GradScaler
    weights_dtype: str | None = None  # "bfloat16": model.to(torch.bfloat16)
    autocast: str | None = None
    scaler: bool = False
    act: str = "relu"  # "softplus8": a hand-written log1p(exp(8 x)) / 8
    lr: float | None = None  # replaces the family's lr
    loss_weight: float = 1.0  # the loss times w (a down-weighted task)
    weight_decay: bool = True
    threads: int = 1
    shuffle_seed: int = 0
    channels_last: bool = False
    float64: bool = False
    steps: int = STEPS


def act(x, kind: str):
    if kind == "softplus8":  # a sharp softplus written by hand: exp(8x) overflows float16 above x = 1.39
        return torch.log1p(torch.exp(8.0 * x)) / 8.0
    return torch.relu(x)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- families -----------------------------------------------------------------------------------------------------
class RegMLP(nn.Module):
    """MSE regression of a 3-d smooth teacher; BatchNorm1d and dropout."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.cfg = cfg.act
        self.inp, self.bn = nn.Linear(12, 64), nn.BatchNorm1d(64, momentum=cfg.bn_momentum)
        self.hidden, self.drop, self.out = nn.Linear(64, 64), nn.Dropout(p), nn.Linear(64, 3)

    def forward(self, x):
        h = act(self.bn(self.inp(x)), self.cfg)
        return self.out(self.drop(act(self.hidden(h), self.cfg)))


def reg_data(n: int = 1280):
    g = _gen(21)
    w1, w2 = torch.randn(12, 16, generator=g) / 3, torch.randn(16, 3, generator=g) / 4
    x = torch.randn(n, 12, generator=g)
    return x, torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 3, generator=g)


class Audio1D(nn.Module):
    """1-D convs over a waveform: which of 4 frequencies a noisy sinusoid has."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.a = cfg.act
        self.conv1, self.bn1 = nn.Conv1d(1, 8, 7, padding=3), nn.BatchNorm1d(8, momentum=cfg.bn_momentum)
        self.conv2, self.bn2 = nn.Conv1d(8, 16, 5, padding=2), nn.BatchNorm1d(16, momentum=cfg.bn_momentum)
        self.drop, self.classifier = nn.Dropout(p), nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool1d(act(self.bn1(self.conv1(x)), self.a), 2)
        x = act(self.bn2(self.conv2(x)), self.a).mean(-1)
        return self.classifier(self.drop(x))


def audio_data(n: int = 1280, t: int = 64):
    g = _gen(22)
    y = torch.randint(0, 4, (n,), generator=g)
    freq = (y.float() + 1.0) * 0.35
    phase = torch.rand(n, 1, generator=g) * 6.28
    ts = torch.arange(t).float()
    x = torch.sin(freq[:, None] * ts[None] + phase) + 0.6 * torch.randn(n, t, generator=g)
    return x[:, None], y


class TinyUNet(nn.Module):
    """Encoder, bottleneck with Dropout2d, transposed-conv decoder with a skip; per-pixel 3-class logits."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.a = cfg.act
        self.enc, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=cfg.bn_momentum)
        self.mid, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=cfg.bn_momentum)
        self.drop = nn.Dropout2d(p)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec, self.seg = nn.Conv2d(16, 8, 3, padding=1), nn.Conv2d(8, 3, 1)

    def forward(self, x):
        e = act(self.bn1(self.enc(x)), self.a)
        m = self.drop(act(self.bn2(self.mid(F.max_pool2d(e, 2))), self.a))
        d = act(self.dec(torch.cat([self.up(m), e], 1)), self.a)
        return self.seg(d)


def seg_data(n: int = 640, s: int = 16):
    """Noisy images with one bright square (class 1) and one dark square (class 2) on background (class 0)."""
    g = _gen(23)
    x = 0.5 * torch.randn(n, 1, s, s, generator=g)
    y = torch.zeros(n, s, s, dtype=torch.long)
    for i in range(n):
        for cls, val in ((1, 1.5), (2, -1.5)):
            r, c = torch.randint(0, s - 5, (2,), generator=g).tolist()
            x[i, 0, r:r + 5, c:c + 5] += val
            y[i, r:r + 5, c:c + 5] = cls
    return x, y


class PackedLSTM(nn.Module):
    """Padded token sequences of varied length, packed (pack_padded_sequence) into an LSTM; the last state classifies."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.a = cfg.act
        self.embed, self.drop = nn.Embedding(13, 16, padding_idx=0), nn.Dropout(p)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.fc, self.classifier = nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.drop(self.embed(x)), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.classifier(act(self.fc(h[-1]), self.a))


def seq_data(n: int = 1280, t: int = 10):
    """Class: the group (1-4, 5-8, 9-12) of the last token before the padding; lengths 4..10, 0-padded."""
    g = _gen(24)
    y = torch.randint(0, 3, (n,), generator=g)
    lengths = torch.randint(4, t + 1, (n,), generator=g)
    x = torch.randint(1, 13, (n, t), generator=g)
    x[torch.arange(n), lengths - 1] = 1 + 4 * y + torch.randint(0, 4, (n,), generator=g)
    x[torch.arange(t)[None] >= lengths[:, None]] = 0
    return (x, lengths), y


class TinyViT(nn.Module):
    """Patch embedding (a stride-4 conv), a class token, learned positions, one pre-norm encoder layer, LayerNorm."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.a = cfg.act
        self.patch = nn.Conv2d(3, 32, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 32))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 17, 32))
        self.norm1, self.attn = nn.LayerNorm(32), nn.MultiheadAttention(32, 2, batch_first=True)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.drop, self.norm, self.classifier = nn.Dropout(p), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        q = self.norm1(h)
        h = h + self.attn(q, q, q, need_weights=False)[0]
        h = h + self.fc2(self.drop(act(self.fc1(self.norm2(h)), self.a)))
        return self.classifier(self.norm(h[:, 0]))


def vit_data(n: int = 1280, s: int = 16):
    g = _gen(25)
    templates = torch.randn(4, 3, s, s, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return templates[y] + 1.5 * torch.randn(n, 3, s, s, generator=g), y


class Siamese(nn.Module):
    """One embedding net applied to both sides of a pair; forward(x1, x2) returns the two embeddings."""

    def __init__(self, cfg: HRun, p: float):
        super().__init__()
        self.a = cfg.act
        self.fc1, self.bn = nn.Linear(16, 48), nn.BatchNorm1d(48, momentum=cfg.bn_momentum)
        self.drop, self.embed = nn.Dropout(p), nn.Linear(48, 8)

    def one(self, x):
        return self.embed(self.drop(act(self.bn(self.fc1(x)), self.a)))

    def forward(self, x1, x2):
        return self.one(x1), self.one(x2)


def pair_data(n: int = 1280):
    """Pairs of points from 6 clusters; the label: 1 for a pair from one cluster, 0 otherwise (half each)."""
    g = _gen(26)
    centres = 1.2 * torch.randn(6, 16, generator=g)
    c1 = torch.randint(0, 6, (n,), generator=g)
    same = torch.rand(n, generator=g) < 0.5
    c2 = torch.where(same, c1, (c1 + torch.randint(1, 6, (n,), generator=g)) % 6)
    x1 = centres[c1] + 0.8 * torch.randn(n, 16, generator=g)
    x2 = centres[c2] + 0.8 * torch.randn(n, 16, generator=g)
    return (x1, x2), same.float()


def contrastive(out, y, reduction: str, margin: float = 2.0):
    e1, e2 = out
    d = (e1.float() - e2.float()).pow(2).sum(1).add(1e-9).sqrt()
    per = y * d.pow(2) + (1 - y) * torch.relu(margin - d).pow(2)
    return per.sum() if reduction == "sum" else per.mean()


def mse(out, y, reduction):
    return F.mse_loss(out.float(), y, reduction=reduction)


def xent(out, y, reduction):
    return F.cross_entropy(out.float(), y, reduction=reduction)


@dataclass
class HFamily:
    name: str
    build: Callable  # build(cfg, p) -> nn.Module
    data: Callable  # () -> (inputs: a tensor or a tuple of tensors, targets)
    loss: Callable  # loss(output, y, reduction)
    optimizer: str  # "sgd" (momentum) / "adam" (AdamW)
    lr: float
    batch: int
    dropout: float
    init_layer: str  # re-initialised from another seed by the init fault
    freeze: str  # requires_grad_(False) mid-run by the freeze fault
    classes: int = 0  # 0: not a classifier
    float_input: bool = True
    bn: bool = True
    conv2d: bool = False
    fp16: bool = True  # runs under float16 autocast on this CPU
    about: str = ""


FAMILIES = {
    "regress": HFamily("regress", RegMLP, reg_data, mse, "sgd", 0.05, 32, 0.1, "hidden", "inp",
                       about="MLP regression (MSE, 3 outputs), BatchNorm1d, dropout, SGD momentum"),
    "audio1d": HFamily("audio1d", Audio1D, audio_data, xent, "sgd", 0.05, 32, 0.2, "conv2", "conv1", classes=4,
                       about="1-D conv net on 64-sample noisy sinusoids (4 frequencies), BatchNorm1d, SGD momentum"),
    "unet": HFamily("unet", TinyUNet, seg_data, xent, "adam", 3e-3, 16, 0.1, "dec", "enc", classes=3, conv2d=True,
                    about="small U-Net (skip, ConvTranspose2d, Dropout2d), per-pixel 3-class cross-entropy, AdamW"),
    "lstm": HFamily("lstm", PackedLSTM, seq_data, xent, "adam", 1e-2, 32, 0.1, "fc", "embed", classes=3,
                    float_input=False, bn=False, fp16=False,
                    about="LSTM classifier on padded, packed (pack_padded_sequence) sequences of lengths 4-10, AdamW"),
    "vit": HFamily("vit", TinyViT, vit_data, xent, "adam", 2e-3, 32, 0.1, "fc1", "patch", classes=4, bn=False,
                   conv2d=True, about="tiny ViT: stride-4 patch conv, class token, learned positions, pre-norm "
                                      "attention + MLP, LayerNorm, AdamW"),
    "siamese": HFamily("siamese", Siamese, pair_data, contrastive, "sgd", 0.03, 32, 0.1, "embed", "fc1",
                       about="siamese MLP (BatchNorm1d, dropout), contrastive loss with margin on pairs, SGD momentum"),
}


# --- the loop -----------------------------------------------------------------------------------------------------
@dataclass
class Trace:
    losses: list = field(default_factory=list)
    lrs: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)  # the global gradient norm each step, after any clipping
    zero_grad_share: list = field(default_factory=list)  # share of weight-gradient elements exactly 0
    grads_finite: list = field(default_factory=list)
    params_finite: list = field(default_factory=list)
    batch_hashes: list = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    grad_seen: dict = field(default_factory=dict)  # name -> the last step it got a gradient


def _hash(t) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    h = hashlib.sha256()
    for x in ts:
        h.update(x.detach().double().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _cast(x, dtype, fmt=None):
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype, fmt) for v in x)
    if x.is_floating_point():
        x = x.to(dtype) if dtype is not None else x
        if fmt is not None and x.dim() == 4:
            x = x.contiguous(memory_format=fmt)
    return x


def train(fam: HFamily, cfg: HRun, out=None) -> Trace:
    """One run; watched into ``out`` (plain torch, traced, when ``out`` is None)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    model = fam.build(cfg, fam.dropout if cfg.dropout is None else cfg.dropout)
    if cfg.init_seed is not None:  # one layer's weights from another seed (a stray manual_seed before it, say)
        torch.manual_seed(cfg.init_seed)
        getattr(model, fam.init_layer).reset_parameters()
    dtype = (torch.float64 if cfg.float64 else torch.float16 if cfg.half
             else getattr(torch, cfg.weights_dtype) if cfg.weights_dtype else None)
    fmt = torch.channels_last if cfg.channels_last else None
    if dtype is not None:
        model = model.to(dtype)
    if fmt is not None:
        model = model.to(memory_format=fmt)
    xs, ys = fam.data()
    xs = xs if isinstance(xs, tuple) else (xs,)
    if cfg.label_shift:
        ys = (ys + cfg.label_shift) % fam.classes
    loader = DataLoader(TensorDataset(*xs, ys), batch_size=cfg.batch or fam.batch, shuffle=True,
                        generator=_gen(cfg.shuffle_seed), drop_last=True)
    lr = cfg.lr if cfg.lr is not None else fam.lr
    mom = 0.9 if cfg.momentum is None else cfg.momentum
    if fam.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mom, weight_decay=1e-4 * cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(mom, 0.999), weight_decay=0.01 * cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / WARMUP)) if cfg.warmup else None
    scaler = torch.amp.GradScaler("cpu") if cfg.scaler else None
    ac = getattr(torch, cfg.autocast) if cfg.autocast else None
    named_p = dict(model.named_parameters())
    tr = Trace(before={n: p.detach().clone().double() for n, p in named_p.items()})
    ctx = contextlib.nullcontext()
    if out is not None:
        import convcheck

        ctx = convcheck.watch(model, opt, out=out, scaler=scaler)
    torch.manual_seed(1)  # dropout masks: alike in both runs of a case
    aug = _gen(7)
    model.train()
    with ctx as w:
        for step, batch in zip(range(cfg.steps), loader):
            *x, y = batch
            x = tuple(x)
            if cfg.freeze_at is not None and step == cfg.freeze_at:
                for p in getattr(model, fam.freeze).parameters():
                    p.requires_grad_(False)
            if cfg.noise:
                x = tuple(v + cfg.noise * torch.randn(v.shape, generator=aug) if v.is_floating_point() else v
                          for v in x)
            x = _cast(x, dtype, fmt)
            if fam.name == "lstm":
                x = (x[0], x[1].cpu())
            if out is None:
                tr.batch_hashes.append(_hash(x))
            opt.zero_grad()
            total = 0.0
            for xm, ym in _micro(x, y, cfg.accum):
                with torch.autocast("cpu", dtype=ac, enabled=ac is not None):
                    loss = fam.loss(model(*xm), ym.to(dtype) if (dtype is not None and ym.is_floating_point())
                                    else ym, cfg.reduction) * cfg.loss_weight
                if cfg.accum > 1 and cfg.accum_divide:
                    loss = loss / cfg.accum
                if scaler is not None:
                    scaler.scale(loss).backward()
                elif cfg.double_backward:
                    loss.backward(retain_graph=True)
                    loss.backward()  # the stray second backward: gradients doubled
                else:
                    loss.backward()
                total += float(loss.detach())
            if cfg.clip is not None:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            if out is None:
                gs = [p.grad for p in named_p.values() if p.grad is not None]
                tr.grad_norms.append(float(torch.sqrt(sum(g.double().pow(2).sum() for g in gs))))
                wg = [p.grad for n, p in named_p.items() if p.grad is not None and p.dim() >= 2]
                tr.zero_grad_share.append(sum(int((g == 0).sum()) for g in wg) / max(1, sum(g.numel() for g in wg)))
                tr.grads_finite.append(all(bool(torch.isfinite(g).all()) for g in gs))
                for n, p in named_p.items():
                    if p.grad is not None:
                        tr.grad_seen[n] = step
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if sched is not None:
                sched.step()
            if w is not None:
                w.step(loss)  # the loop's own loss variable (divided by accum where the loop divides)
            tr.losses.append(total)
            if out is None:
                tr.lrs.append([g["lr"] for g in opt.param_groups])
                tr.params_finite.append(all(bool(torch.isfinite(p).all()) for p in named_p.values()))
    tr.after = {n: p.detach().clone().double() for n, p in named_p.items()}
    tr.buffers = {n: b.detach().clone().double() for n, b in model.named_buffers() if b.is_floating_point()}
    return tr


def _micro(x: tuple, y, k: int):
    if k == 1:
        yield x, y
        return
    n = y.shape[0] // k
    for i in range(k):
        yield tuple(v[i * n:(i + 1) * n] for v in x), y[i * n:(i + 1) * n]


# --- checks -------------------------------------------------------------------------------------------------------
def need(cond, why):
    if not cond:
        raise CaseInvalid(why)


def _finite(t: Trace) -> bool:
    return all(math.isfinite(v) for v in t.losses) and all(t.params_finite)


def _tail(t: Trace, k: int = 8) -> float:
    return sum(t.losses[-k:]) / k


def _params_differ(a: Trace, b: Trace) -> bool:
    return any(not torch.equal(a.after[n], b.after[n]) for n in a.after)


def _outcome_differs(a, b):
    need(_params_differ(a, b), "B's parameters end exactly as A's")


def _loss0_differs(a, b):
    need(abs(a.losses[0] - b.losses[0]) > 1e-5 * max(abs(a.losses[0]), 1e-12),
         f"the step-0 losses are alike ({a.losses[0]} / {b.losses[0]})")


def _moved(t, names):
    tot = ch = 0
    for n in names:
        tot += t.before[n].numel()
        ch += int((t.before[n] != t.after[n]).sum())
    return ch / max(tot, 1)


def check_clip(fam, a, b):
    need(max(b.grad_norms) <= 0.01 * 1.001 + 1e-9, "B's gradient norm was not clipped")
    need(a.grad_norms[0] > 0.05, f"A's step-0 gradient norm ({a.grad_norms[0]:.3g}) is within the clip")
    need(abs(_tail(a) - _tail(b)) > 0.01 * abs(_tail(a)), f"B ends like A ({_tail(a):.4f} / {_tail(b):.4f})")


def check_steps_differ(fam, a, b):
    _outcome_differs(a, b)
    need(any(x != y for x, y in zip(a.losses, b.losses)), "every loss is the same")


def check_batch(fam, a, b):
    need(a.batch_hashes[0] != b.batch_hashes[0], "the first batches are the same")
    _outcome_differs(a, b)


def check_loss0(fam, a, b):
    _loss0_differs(a, b)
    _outcome_differs(a, b)


def check_bn_buffers(fam, a, b):
    rm = [n for n in a.buffers if n.endswith("running_mean")]
    need(bool(rm), "no running statistics")
    need(any(not torch.equal(a.buffers[n], b.buffers[n]) for n in rm), "the running statistics end alike")


def check_init(fam, a, b):
    pre = fam.init_layer + "."
    need(all(not torch.equal(a.before[n], b.before[n]) for n in a.before if n.startswith(pre)),
         "the layer starts alike")
    need(all(torch.equal(a.before[n], b.before[n]) for n in a.before if not n.startswith(pre)),
         "other layers start differently")
    _outcome_differs(a, b)


def check_warmup(fam, a, b):
    need(a.lrs[0] != b.lrs[0], "the step-0 lrs are the same")
    _outcome_differs(a, b)


def check_double_backward(fam, a, b):
    need(a.losses[0] == b.losses[0] or abs(a.losses[0] - b.losses[0]) < 1e-6 * abs(a.losses[0]),
         f"the step-0 losses differ ({a.losses[0]} / {b.losses[0]}): not a gradient-only fault")
    check_grad_scaled(fam, a, b)


def check_grad_scaled(fam, a, b):
    r = b.grad_norms[0] / a.grad_norms[0]
    need(abs(r - 2.0) < 0.01, f"B's step-0 gradient norm is {r:.3f}x A's, not 2x")
    need(abs(_tail(a) - _tail(b)) > 0.01 * abs(_tail(a)), f"B ends like A ({_tail(a):.4f} / {_tail(b):.4f})")


def check_freeze(fam, a, b):
    fz = [n for n in a.before if n.startswith(fam.freeze + ".")]
    need(all(b.grad_seen.get(n, -1) < 12 for n in fz), "B's frozen layer still got a gradient")
    need(all(a.grad_seen.get(n, -1) == STEPS - 1 for n in fz), "A's layer stopped getting a gradient")
    _outcome_differs(a, b)


def check_data(fam, a, b):
    need(a.batch_hashes[0] != b.batch_hashes[0], "the first batches are the same")
    _outcome_differs(a, b)


def check_labels(fam, a, b):
    need(a.batch_hashes[0] == b.batch_hashes[0], "the inputs differ (the fault is in the labels only)")
    _loss0_differs(a, b)  # a consistent shift is a relabelling: B learns it as well, and is wrong on true labels
    _outcome_differs(a, b)


def check_underflow(fam, a, b):
    za, zb = a.zero_grad_share[0], b.zero_grad_share[0]
    need(za < 0.2, f"A's weight gradients are {za:.2f} zeros at step 0")
    need(zb > za + 0.4, f"B's float16 weight gradients are only {zb:.2f} zeros (A {za:.2f})")
    w = [n for n in a.before if a.before[n].dim() >= 2]
    need(_moved(b, w) < 0.5 * _moved(a, w), f"B's weights moved as A's ({_moved(b, w):.2f} / {_moved(a, w):.2f})")


def check_lost_updates(fam, a, b):
    w = [n for n in a.before if a.before[n].dim() >= 2]
    ma, mb = _moved(a, w), _moved(b, w)
    need(ma > 0.9, f"A's weights did not move ({ma:.2f})")
    need(mb < 0.5 * ma, f"B's bfloat16 weights kept most updates ({mb:.2f}, A {ma:.2f})")


def check_nonfinite(fam, a, b):
    need(_finite(a) and all(a.grads_finite), "A is not finite")
    need(not _finite(b) or not all(b.grads_finite), "B never produced Inf/NaN")


def seed_spread(fam, base: HRun, seeds=(1, 2, 3)) -> float:
    tails = [_tail(train(fam, replace(base, shuffle_seed=s))) for s in (0, *seeds)]
    return max(tails) - min(tails)


def check_healthy(fam, a, b, base: HRun = HRun()):
    need(_finite(a) and _finite(b), "a healthy run produced Inf/NaN")
    ta, tb = _tail(a), _tail(b)
    need(b.losses[-1] < b.losses[0], "B did not learn")
    if ta == tb:
        return
    spread = seed_spread(fam, base)
    need(abs(ta - tb) <= max(spread, 0.02 * abs(ta)),
         f"the healthy pair does not end alike: {ta:.4f} / {tb:.4f}, beyond the seeds' spread {spread:.4f}")


# --- kinds --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    name: str
    truth: str
    a: HRun
    b: HRun
    words: tuple
    check: Callable
    families: Callable = lambda f: True  # noqa: E731
    about: str = ""


BASE = HRun()
SGD = lambda f: f.optimizer == "sgd"  # noqa: E731
LR_UNDERFLOW = 1e-6  # the down-weighted loss of the fp16 underflow case; its lr is the family's / this

KINDS_LIST = [
    Kind("grad_clip", "setup", BASE, HRun(clip=0.01), ("clip", "max_norm", "gradient norm"), check_clip,
         about="clip_grad_norm_(model.parameters(), 0.01) in B only"),
    Kind("dropout_p", "setup", BASE, HRun(dropout=0.5), ("dropout",), check_steps_differ,
         about="B's dropout p 0.5 (A: the family's, 0.1-0.2)"),
    Kind("batch_size", "setup", BASE, HRun(batch=8), ("batch",), check_batch,
         about="same data and shuffle seed, B's DataLoader batch size 8 (A: 16-32)"),
    Kind("momentum", "setup", BASE, HRun(momentum=0.5), ("momentum", "beta"), check_steps_differ,
         about="B's SGD momentum / Adam beta1 0.5 (A: 0.9)"),
    Kind("reduction_sum", "setup", BASE, HRun(reduction="sum"), ("reduction", "sum", "loss"), check_loss0,
         about="B's loss reduction='sum' (A: mean)"),
    Kind("bn_momentum", "setup", BASE, HRun(bn_momentum=0.5), ("momentum", "running", "batchnorm", "buffer", "bn"),
         check_bn_buffers, families=lambda f: f.bn,
         about="B's BatchNorm momentum 0.5 (A: 0.1): the training steps are alike, the running statistics (eval) not"),
    Kind("init_one_layer", "setup", BASE, HRun(init_seed=123), ("initial", "init", "start"), check_init,
         about="one layer (the family's init_layer) re-initialised from another seed in B"),
    Kind("no_warmup", "setup", BASE, HRun(warmup=False), ("learning rate", " lr", "schedul", "warm"), check_warmup,
         about="A: linear lr warm-up over 8 steps (LambdaLR); B: none"),
    Kind("accum_no_divide", "setup", HRun(accum=2), HRun(accum=2, accum_divide=False),
         ("accumulat", "twice", "2x", "x2", "×2", "double", "micro", "divid", "gradient"), check_grad_scaled,
         families=SGD, about="both accumulate 2 micro-batches per step; B does not divide the loss by 2 "
                             "(SGD families: Adam is invariant to the gradient's scale)"),
    Kind("double_backward", "setup", BASE, HRun(double_backward=True),
         ("backward", "twice", "2x", "x2", "×2", "double", "accumulat", "gradient"), check_double_backward,
         families=SGD, about="B calls loss.backward(retain_graph=True) and loss.backward(): gradients doubled "
                             "(SGD families)"),
    Kind("freeze_mid", "setup", BASE, HRun(freeze_at=12),
         ("requires_grad", "frozen", "freez", "no gradient", "trainable", "never", "stopped"), check_freeze,
         about="at step 12, B sets requires_grad_(False) on one layer (the family's freeze layer)"),
    Kind("noise_aug", "setup", BASE, HRun(noise=0.3), ("data", "input", "batch", "augment"), check_data,
         families=lambda f: f.float_input, about="B adds 0.3 * randn noise to the inputs (an augmentation)"),
    Kind("label_shift", "setup", BASE, HRun(label_shift=1), ("label", "target", "data"), check_labels,
         families=lambda f: f.classes > 0, about="B's labels (y + 1) % classes: an off-by-one label bug"),
    Kind("reshuffle", "setup", BASE, HRun(shuffle_seed=5), ("data", "order", "shuffle", "batch"), check_data,
         about="B's DataLoader shuffle from another seed: the same dataset, other batches. Truth setup: a user "
               "comparing two runs wants to hear their batches differ (the diff's 'data'), not 'ok'"),
    Kind("fp16_half_underflow", "numerics", HRun(loss_weight=LR_UNDERFLOW, weight_decay=False),
         HRun(loss_weight=LR_UNDERFLOW, weight_decay=False, half=True), ("underflow", "float16", "fp16", "half", "zero", "lost"),
         check_underflow, families=lambda f: f.fp16 and f.optimizer == "sgd",
         about=f"both: the loss weighted {LR_UNDERFLOW} (a down-weighted task; SGD: lr / {LR_UNDERFLOW}), no weight "
               "decay; B: "
               "model.half() and .half() inputs, no GradScaler: its gradients underflow to zero (SGD families: AdamW "
               "normalises the gradient's scale away)"),
    Kind("bf16_adam_tiny_lr", "numerics", HRun(lr=2e-5), HRun(lr=2e-5, weights_dtype="bfloat16"),
         ("bfloat16", "bf16", "lost", "round", "update"), check_lost_updates, families=lambda f: f.optimizer == "adam",
         about="both AdamW lr 2e-5; B's model.to(torch.bfloat16): updates below bf16's spacing are lost"),
    Kind("exp_overflow_fp16", "numerics", HRun(act="softplus8"), HRun(act="softplus8", autocast="float16"),
         ("inf", "nan", "non-finite", "overflow", "exp"), check_nonfinite, families=lambda f: f.fp16,
         about="both use a hand-written sharp softplus log1p(exp(8x))/8; B under float16 autocast: exp overflows"),
    # healthy
    Kind("identical", "ok", BASE, BASE, (), check_healthy, about="the same run twice"),
    Kind("bf16_autocast", "ok", BASE, HRun(autocast="bfloat16"), (), check_healthy,
         about="B under torch.autocast('cpu', dtype=torch.bfloat16)"),
    Kind("fp16_scaler", "ok", BASE, HRun(autocast="float16", scaler=True), (), check_healthy,
         families=lambda f: f.fp16, about="B under float16 autocast with torch.amp.GradScaler('cpu')"),
    Kind("threads", "ok", BASE, HRun(threads=2), (), check_healthy, about="torch.set_num_threads 1 vs 2"),
    Kind("channels_last", "ok", BASE, HRun(channels_last=True), (), check_healthy, families=lambda f: f.conv2d,
         about="B's model and inputs in torch.channels_last"),
    Kind("float64", "ok", BASE, HRun(float64=True), (), check_healthy,
         about="B: model.double() and float64 inputs (issue 48: a precision pair, ok)"),
]

KINDS = {k.name: k for k in KINDS_LIST}


def _fix_lr(fam: HFamily, cfg: HRun) -> HRun:
    """The underflow case's lr: the family's divided by the loss weight (the step a user tuned for the weighted loss)."""
    if cfg.loss_weight != 1.0 and cfg.lr is None:
        lr = fam.lr / cfg.loss_weight if fam.optimizer == "sgd" else fam.lr
        return replace(cfg, lr=lr)
    return cfg


@dataclass(frozen=True)
class Case:
    family: str
    kind: str

    @property
    def name(self) -> str:
        return f"{self.family}/{self.kind}"


def all_cases(families=None, kinds=None) -> list:
    return [Case(f, k.name) for k in KINDS_LIST if not kinds or k.name in kinds
            for f, fam in FAMILIES.items() if (not families or f in families) and k.families(fam)]


def run_case(family: str, kind: str, check: bool = True) -> dict:
    """One case in this process: the plain-torch check, two watched runs, their diff. Never raises."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    k, fam = KINDS[kind], FAMILIES[family]
    a_cfg, b_cfg = _fix_lr(fam, k.a), _fix_lr(fam, k.b)
    res = {"family": family, "kind": kind, "truth": k.truth, "words": list(k.words), "category": None,
           "headline": None, "sub_cause": None, "evidence": [], "named": False, "right": False, "status": "ok",
           "error": None}
    t0 = time.perf_counter()
    try:
        if check:
            a, b = train(fam, a_cfg), train(fam, b_cfg)
            if k.check is check_healthy:
                check_healthy(fam, a, b, a_cfg)
            else:
                k.check(fam, a, b)
        from convcheck.analysis.diff import diff_watched

        with tempfile.TemporaryDirectory(prefix="verdict-heldout-") as tmp:
            train(fam, a_cfg, out=Path(tmp) / "A")
            train(fam, b_cfg, out=Path(tmp) / "B")
            v = diff_watched(Path(tmp) / "A", Path(tmp) / "B").verdict.to_dict()
        res.update(category=v["category"], headline=v["headline"], sub_cause=v.get("sub_cause"),
                   evidence=list(v.get("evidence") or []))
        res["named"] = named(k.words, v)
        res["right"] = v["category"] == k.truth and res["named"]
    except CaseInvalid as e:
        res.update(status="invalid", error=f"the fault did not manifest: {e}")
    except BaseException as e:  # noqa: BLE001
        tb = traceback.format_exc(limit=4).strip().splitlines()
        res.update(status="crash", category="crash", error=f"{type(e).__name__}: {e}"[:400], traceback=tb[-6:])
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res
