"""One training loop, written as a user writes it, with every knob a planted fault or a healthy variation turns.

``train(family, Run(...), out=DIR)`` runs it under ``convcheck.watch``; ``out=None`` runs the same loop in plain
torch (no convcheck imported by this path) and returns a ``Trace``: what the fault checks read (the losses, each
step's learning rates, whether a step's gradients were already non-zero before its backward, non-finite gradients
and weights, the parameters before and after).
"""

from __future__ import annotations

import os
import contextlib
import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .families import Family

STEPS = int(os.environ.get("CONVCHECK_MATRIX_STEPS") or 32)  # verdict_matrix.py --steps: a short matrix
WARMUP = 8  # the LambdaLR warm-up every family's recipe uses: lr x min(1, (k+1)/WARMUP)
AUX = 0.01  # the auxiliary logit penalty (a z-loss) of the classifiers and LMs


@dataclass(frozen=True)
class Run:
    zero_grad: bool = True
    loss_scale: float = 1.0  # the whole loss times k
    term_sign: float = 1.0  # the sign of the auxiliary term (the VAE's KL, the others' logit penalty)
    lr_mult: float = 1.0
    lr: float | None = None  # replaces the family's lr (both runs of a case)
    groups: str = "split"  # "split": no weight decay on norms/biases (two groups); "one": weight decay on all
    freeze: bool = False  # backbone requires_grad False, never unfrozen
    drop_head: bool = False  # the head's parameters left out of the optimizer
    head_lr_mult: float = 1.0  # the head in its own param group with this lr factor
    eval_mode: bool = False  # model.eval() before training: dropout off, BatchNorm on running statistics
    label_smoothing: float = 0.0
    sched_extra: bool = False  # scheduler.step() once before the first optimizer.step()
    shuffle_seed: int = 0
    autocast: str | None = None  # "bfloat16" / "float16": torch.autocast("cpu", dtype)
    scaler: bool = False  # torch.amp.GradScaler("cpu")
    static_scale: float | None = None  # a hand-written loss scale (loss * S).backward(), grads / S
    weights_dtype: str | None = None  # "bfloat16": model.to(torch.bfloat16), no float32 master weights
    log_softmax: str | None = None  # "float32" / "float16": nll(torch.log(torch.softmax(logits.to(dt) / T)))
    temperature: float | None = None  # the log-softmax's temperature (None: the family's)
    threads: int = 1
    compile: bool = False  # torch.compile(model, backend="aot_eager")
    steps: int = STEPS


@dataclass
class Trace:
    losses: list = field(default_factory=list)
    lrs: list = field(default_factory=list)  # each step's lr of every group
    accumulated: list = field(default_factory=list)  # a step's grads non-zero before its backward
    grads_finite: list = field(default_factory=list)
    params_finite: list = field(default_factory=list)
    batch_hashes: list = field(default_factory=list)
    grad_seen: set = field(default_factory=set)  # parameter names that ever got a gradient
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    trainable: set = field(default_factory=set)  # names with requires_grad
    in_optimizer: set = field(default_factory=set)
    group_of: dict = field(default_factory=dict)  # name -> (lr at step 0, weight decay)
    train_mode: bool = True
    extra_losses: list = field(default_factory=list)  # the GAN's generator loss


def _dtype(name):
    return None if name is None else getattr(torch, name)


def no_decay(name: str, module_of: dict) -> bool:
    """Biases and normalisation layers' parameters: the group without weight decay."""
    mod = module_of.get(name.rsplit(".", 1)[0])
    return name.endswith("bias") or isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm))


def param_groups(model: nn.Module, fam: Family, cfg: Run, lr: float, prefix: str = "") -> list:
    modules = dict(model.named_modules())
    named = [(prefix + n, p) for n, p in model.named_parameters()]
    if cfg.drop_head:
        named = [(n, p) for n, p in named if not n.startswith(fam.head + ".")]
    head = []
    if cfg.head_lr_mult != 1.0:
        head = [(n, p) for n, p in named if n.startswith(fam.head + ".")]
        named = [(n, p) for n, p in named if not n.startswith(fam.head + ".")]
    wd = fam.weight_decay
    if cfg.groups == "one":
        groups = [{"params": [p for _, p in named], "weight_decay": wd, "names": [n for n, _ in named]}]
    else:
        dec = [(n, p) for n, p in named if not no_decay(n[len(prefix):], modules)]
        nod = [(n, p) for n, p in named if no_decay(n[len(prefix):], modules)]
        groups = [{"params": [p for _, p in dec], "weight_decay": wd, "names": [n for n, _ in dec]},
                  {"params": [p for _, p in nod], "weight_decay": 0.0, "names": [n for n, _ in nod]}]
    if head:
        groups.append({"params": [p for _, p in head], "weight_decay": wd, "lr": lr * cfg.head_lr_mult,
                       "names": [n for n, _ in head]})
    return [g for g in groups if g["params"]]


def make_optimizer(kind: str, groups: list, lr: float):
    clean = [{k: v for k, v in g.items() if k != "names"} for g in groups]
    if kind == "sgd":
        return torch.optim.SGD(clean, lr=lr, momentum=0.9)
    return torch.optim.AdamW(clean, lr=lr, betas=(0.9, 0.99) if kind == "adamw" else (0.5, 0.999))


def warmup(k: int) -> float:
    return min(1.0, (k + 1) / WARMUP)


def classifier_loss(logits, y, cfg: Run, criterion, temperature: float = 1.0):
    """``criterion``: the loop's ``nn.CrossEntropyLoss(label_smoothing=...)``, or its ``nn.NLLLoss()`` on a hand-written
    log of a softmax (``cfg.log_softmax``)."""
    flat, target = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    if cfg.log_softmax is not None:
        p = torch.softmax(flat.to(_dtype(cfg.log_softmax)) / temperature, -1)
        main = criterion(torch.log(p).float(), target)
    else:
        main = criterion(flat.float(), target)
    return main + cfg.term_sign * AUX * flat.float().pow(2).mean()


def vae_loss(out, x, cfg: Run):
    recon, mu, logvar = out
    n = x.shape[0]
    rec = F.binary_cross_entropy_with_logits(recon.float(), x, reduction="sum") / n
    kl = -0.5 * torch.sum(1 + logvar.float() - mu.float().pow(2) - logvar.float().exp()) / n
    return rec + cfg.term_sign * kl


def batch_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def train(fam: Family, cfg: Run, out=None) -> Trace:
    """One run of ``fam`` set up by ``cfg``; watched into ``out`` (plain torch, traced, when ``out`` is None)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)  # the initial weights: the same in both runs of a case
    model = fam.build()
    data = fam.batches()
    if fam.kind == "lm":  # windows in their order (the hidden state runs on); another seed: a shuffled order
        order = list(range(len(data))) if cfg.shuffle_seed == 0 else torch.randperm(
            len(data), generator=torch.Generator().manual_seed(cfg.shuffle_seed)).tolist()
        loader = [data[i] for i in order]
    else:  # a DataLoader shuffling with a seeded generator, as a user writes it
        ds = TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
        loader = DataLoader(ds, batch_size=len(data[0][0]), shuffle=True,
                            generator=torch.Generator().manual_seed(cfg.shuffle_seed))
    if cfg.log_softmax is not None:
        criterion = nn.NLLLoss()
    else:
        criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    wdt = _dtype(cfg.weights_dtype)
    if wdt is not None:
        model = model.to(wdt)
    gan = fam.kind == "gan"
    net = model.d if gan else model  # the watched model
    if cfg.freeze:
        for n, p in net.named_parameters():
            if n.startswith(fam.backbone):
                p.requires_grad_(False)
    lr = (cfg.lr if cfg.lr is not None else fam.lr) * cfg.lr_mult
    groups = param_groups(net, fam, cfg, lr)
    opt = make_optimizer(fam.optimizer, groups, lr)
    opt_g = make_optimizer("adam_gan", [{"params": list(model.g.parameters())}], lr) if gan else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    if cfg.sched_extra:
        sched.step()  # the off-by-one: a schedule step before the first optimizer step
    scaler = torch.amp.GradScaler("cpu") if cfg.scaler else None
    fwd = torch.compile(net, backend="aot_eager") if cfg.compile else net
    model.train()
    net.train(not cfg.eval_mode)
    trace = Trace(train_mode=not cfg.eval_mode)
    named = dict(net.named_parameters())
    trace.before = {n: p.detach().clone().float() for n, p in named.items()}
    trace.trainable = {n for n, p in named.items() if p.requires_grad}
    ids = {id(p): n for n, p in named.items()}
    for g, grp in zip(groups, opt.param_groups):
        for p in grp["params"]:
            trace.in_optimizer.add(ids[id(p)])
            trace.group_of[ids[id(p)]] = (grp["lr"], grp["weight_decay"])
    ac = _dtype(cfg.autocast)
    temp = cfg.temperature if cfg.temperature is not None else fam.temperature
    if out is not None:
        import convcheck

        ctx = convcheck.watch(fwd, opt, out=out, scaler=scaler)
    else:
        ctx = contextlib.nullcontext()
    torch.manual_seed(1)  # the run's own randomness (dropout, the VAE's noise, the GAN's z): alike in both runs
    hidden = None
    with ctx as w:
        for step, (x, y) in zip(range(cfg.steps), loader):
            if wdt is not None and x.is_floating_point():
                x = x.to(wdt)
            if cfg.zero_grad:
                opt.zero_grad()
            if out is None:  # what the backward will add to: zero unless the loop forgot zero_grad
                trace.batch_hashes.append(batch_hash(x))
                trace.accumulated.append(any(p.grad is not None and bool(p.grad.abs().sum() > 0)
                                             for p in named.values()))
            with torch.autocast("cpu", dtype=ac, enabled=ac is not None):
                if gan:
                    z = torch.randn(x.shape[0], 8, dtype=wdt or torch.float32)
                    fake = model.g(z)
                    ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
                    loss = (F.binary_cross_entropy_with_logits(fwd(x).float(), ones)
                            + F.binary_cross_entropy_with_logits(fwd(fake.detach()).float(), zeros))
                elif fam.kind == "lm":
                    logits, hidden = fwd(x, hidden)
                    hidden = hidden.detach()  # truncated BPTT: the state carried, its graph cut
                    loss = classifier_loss(logits, y, cfg, criterion, temp)
                elif fam.kind == "vae":
                    loss = vae_loss(fwd(x), x.float(), cfg)
                else:
                    loss = classifier_loss(fwd(x), y, cfg, criterion, temp)
                loss = loss * cfg.loss_scale
            _backward_step(loss, opt, scaler, cfg, named)
            if gan:
                if cfg.zero_grad:
                    opt_g.zero_grad()
                with torch.autocast("cpu", dtype=ac, enabled=ac is not None):
                    loss_g = F.binary_cross_entropy_with_logits(fwd(fake).float(), ones) * cfg.loss_scale
                _backward_step(loss_g, opt_g, scaler, cfg, dict(model.g.named_parameters()))
                trace.extra_losses.append(float(loss_g.detach()))
            if scaler is not None:
                scaler.update()
            sched.step()
            if w is not None:
                w.step(loss)
            trace.losses.append(float(loss.detach()))
            if out is None:
                trace.lrs.append([g["lr"] for g in opt.param_groups])
                for n, p in named.items():
                    if p.grad is not None:
                        trace.grad_seen.add(n)
                trace.grads_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in named.values()
                                              if p.grad is not None))
                trace.params_finite.append(all(bool(torch.isfinite(p).all()) for p in named.values()))
    trace.after = {n: p.detach().clone().float() for n, p in named.items()}
    return trace


def _backward_step(loss, opt, scaler, cfg: Run, named: dict) -> None:
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
    elif cfg.static_scale is not None:
        (loss * cfg.static_scale).backward()
        for p in named.values():
            if p.grad is not None:
                p.grad /= cfg.static_scale
        opt.step()
    else:
        loss.backward()
        opt.step()
